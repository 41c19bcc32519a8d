"""Asynchronous RL: policy versions as pipeline stages (docs/guide/async.md).

In asynchronous RL a rollout comes from a policy one or more updates old, and a partial
rollout resumed under new weights mixes versions within one sequence. With the
per-token ``versions`` (the policy version that sampled each token) and the trainer's
``current_version``, a token's *age* is ``current_version − version``:

* :class:`Staleness` reports the age (``mis_staleness_mean``, and
  ``mis_staleness_max`` as an :class:`~offpolicy_jax.correction.stages.Extreme` that pools with
  ``max``) and, with ``max_weight_staleness = L``, rejects what is older than ``L``:
  each token with age ``> L`` (``staleness_level="token"``), or each sequence whose
  oldest valid token is (``"sequence"``, miles' rule: a sample is stale when
  ``current − oldest > L``);
* :class:`OffPolicyPrefix` rejects the off-policy prefix of a partial rollout, the
  valid tokens whose version is older than the newest version of their sequence
  (miles ``--mask-offpolicy-in-partial-rollout``);
* :class:`NeutralRollout` counts the valid tokens whose ``π_rollout`` was
  non-finite and is read as ``π_old`` (``nonfinite_rollout="neutral"``).

Like the rules of docs/semantics.md §8, each stage tests the valid tokens on its own,
and every per-sequence quantity goes through the layout (packed rows, token-sharded
sequences).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from offpolicy_jax import reduction as _reduce
from offpolicy_jax._validation import as_array
from offpolicy_jax.correction import rules
from offpolicy_jax.correction.stages import Decision, Mean, Stage


def _indicator(x: jax.Array) -> jax.Array:
    return jnp.where(x, 1.0, 0.0)


@dataclasses.dataclass(frozen=True)
class Staleness(Stage):
    """Age metrics and, with ``limit``, the staleness rule (module docstring).

    Attributes:
      age: ``[..., T]`` float32 ``current_version − version``.
      limit: ``max_weight_staleness`` (None: metrics only).
      level: ``"token"`` or ``"sequence"``.
    """

    age: jax.Array
    limit: int | None = None
    level: str = "sequence"

    def columns(self, t):
        columns = {
            "age": _reduce.total(self.age, t.population),
            "oldest": _reduce.maximum(self.age, t.population),
        }
        if self.limit is not None:
            columns["stale"] = _reduce.count_where(self.age > self.limit, t.population)
        return columns

    def decide(self, t, sums):
        count, p = sums["count"], "mis_staleness"
        metrics: dict = {
            f"{p}_mean": _reduce.seq_mean(sums["age"], count, t.reduction),
            f"{p}_max": rules.batch_extreme(t.layout, sums["oldest"], count, "max"),
        }
        if self.limit is None:
            return Decision(metrics=metrics)
        stale_token = self.age > self.limit
        stale_seq = sums["stale"] > 0
        metrics[f"{p}_fraction_high"] = Mean(_indicator(stale_token))
        metrics[f"{p}_seq_fraction"] = Mean(_indicator(stale_seq), per_seq=True)
        if self.level == "token":
            return Decision(keep=~stale_token, metrics=metrics)
        return Decision(keep=~stale_seq, per_seq=True, metrics=metrics)


@dataclasses.dataclass(frozen=True)
class OffPolicyPrefix(Stage):
    """Keeps the tokens sampled by the newest version of their sequence.

    ``mis_offpolicy_prefix_fraction``: the share of valid tokens rejected;
    ``mis_offpolicy_prefix_seq_fraction``: the share of sequences that mix versions.
    """

    versions: jax.Array

    def columns(self, t):
        return {
            "newest": _reduce.maximum(self.versions, t.population),
            "first": _reduce.minimum(self.versions, t.population),
        }

    def decide(self, t, sums):
        newest = t.layout.broadcast(sums["newest"])
        prefix = self.versions < newest
        mixed = (sums["first"] < sums["newest"]) & (sums["count"] > 0)
        return Decision(
            keep=~prefix,
            metrics={
                "mis_offpolicy_prefix_fraction": Mean(_indicator(prefix)),
                "mis_offpolicy_prefix_seq_fraction": Mean(_indicator(mixed), per_seq=True),
            },
        )


@dataclasses.dataclass(frozen=True)
class NeutralRollout(Stage):
    """``mis_nonfinite_rollout_token_fraction``: the share of valid tokens whose
    non-finite ``π_rollout`` was read as ``π_old`` (ratio 1)."""

    filled: jax.Array

    def decide(self, t, sums):
        return Decision(
            metrics={"mis_nonfinite_rollout_token_fraction": Mean(_indicator(self.filled))}
        )


def neutral_rollout(old: jax.Array, rollout: jax.Array, mask: jax.Array):
    """``(rollout', filled)``: ``π_rollout`` with ``π_old`` where it is non-finite at a
    valid token whose ``π_old`` is finite, and where that happened."""
    filled = (mask > 0) & ~jnp.isfinite(rollout) & jnp.isfinite(old)
    return jnp.where(filled, old, rollout), filled


def check_versions(versions, current_version, shape, *, needed_by: str | None):
    """Validated ``(versions, current_version)`` as float32 (exact below 2**24), or
    ``(None, None)``.

    Args:
      versions: int ``[..., T]`` or None.
      current_version: an int or an int array broadcastable to ``[..., T]``; required
        with ``versions``.
      shape: the log-probs' ``[..., T]``.
      needed_by: the config key that reads the versions, if any (for the message).
    """
    if versions is None:
        if needed_by is not None:
            raise ValueError(
                f"versions is required: {needed_by} reads the policy version of each token "
                "(int [..., T])"
            )
        if current_version is not None:
            raise ValueError("current_version was given without versions (int [..., T])")
        return None, None
    versions = jnp.asarray(as_array("versions", versions))
    if not jnp.issubdtype(versions.dtype, jnp.integer):
        raise TypeError(f"versions must be an integer array [..., T], got dtype {versions.dtype}")
    if versions.shape != tuple(shape):
        raise ValueError(
            f"versions has shape {versions.shape} but the log-probs have shape {tuple(shape)}; "
            "all per-token inputs must be [..., T] alike"
        )
    if current_version is None:
        raise ValueError(
            "current_version is required with versions: a token's age is current_version − version"
        )
    if isinstance(current_version, bool):
        raise TypeError("current_version must be an int, got a bool")
    current = jnp.asarray(as_array("current_version", current_version))
    if not jnp.issubdtype(current.dtype, jnp.integer):
        raise TypeError(f"current_version must be an int, got dtype {current.dtype}")
    try:
        jnp.broadcast_shapes(current.shape, tuple(shape))
    except ValueError:
        raise ValueError(
            f"current_version of shape {current.shape} does not broadcast to [..., T] = "
            f"{tuple(shape)}"
        ) from None
    return versions.astype(jnp.float32), current.astype(jnp.float32)


def async_stages(config, versions, current) -> list[Stage]:
    """The stages of the config's asynchronous-RL keys (after the §3 / §8 ones)."""
    chain: list[Stage] = []
    if versions is None:
        return chain
    age = current - versions
    chain.append(Staleness(age, config.max_weight_staleness, config.staleness_level))
    if config.mask_offpolicy_in_partial_rollout:
        chain.append(OffPolicyPrefix(versions))
    return chain
