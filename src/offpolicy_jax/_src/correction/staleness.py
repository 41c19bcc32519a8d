"""Asynchronous RL: policy versions as pipeline stages (docs/guide/async.md).

In asynchronous RL a rollout comes from a policy one or more updates old, and a partial
rollout resumed under new weights mixes versions within one sequence. With the
per-token ``versions`` (the policy version that sampled each token) and the trainer's
``current_version``, a token's *age* is ``current_version − version``, computed in
integers (int32; int64 with ``jax_enable_x64``) so that versions compare exactly at any
size. A negative version (AReaL writes −1: no policy version generated the token) has
no age: it is never stale, never in an off-policy prefix, and outside the age metrics,
as in AReaL's staleness statistics (``valid_generated_mask``):

* :class:`Staleness` reports the age (``mis_staleness_mean``, and
  ``mis_staleness_max`` as an :class:`~offpolicy_jax._src.correction.stages.Extreme` that pools with
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
import numpy as np

from offpolicy_jax._src import reduction as _reduce
from offpolicy_jax._src.correction import rules
from offpolicy_jax._src.correction.stages import Decision, Mean, Stage
from offpolicy_jax._src.validation import as_array, is_concrete, read_now


def _indicator(x: jax.Array) -> jax.Array:
    return jnp.where(x, 1.0, 0.0)


def sortable(versions: jax.Array) -> jax.Array:
    """An order-preserving float32 key of int32 values: ``a < b`` iff ``key(a) < key(b)``.

    The reduction engine takes minima and maxima of float32 columns; a plain cast makes
    versions above ``2**24`` collide (``2**24 + 1`` reads as ``2**24``). Instead each
    ``v >= 0`` (negatives read as 0: they are never compared) becomes a distinct normal
    float32: with ``w = v − 2**30``, the float whose bit pattern is ``|w| + 2**23``,
    negated for ``w < 0``. Normal floats order like their bit patterns, and none of
    these is inf, NaN or subnormal (which CPUs may flush to 0), so every ``max`` /
    ``min`` / ``pmax`` of keys is exact.
    """
    w = jnp.maximum(versions.astype(jnp.int32), 0) - (1 << 30)
    pattern = (jnp.abs(w) + (1 << 23)).astype(jnp.uint32)
    magnitude = jax.lax.bitcast_convert_type(pattern, jnp.float32)
    return jnp.where(w < 0, -magnitude, magnitude)


@dataclasses.dataclass(frozen=True)
class Staleness(Stage):
    """Age metrics and, with ``limit``, the staleness rule (module docstring).

    Attributes:
      age: ``[..., T]`` integer ``current_version − version`` (exact; the metrics read
        it as float32).
      versioned: ``[..., T]`` bool, ``version >= 0``: a token without a generation
        version (AReaL writes −1, e.g. a prompt or tool-output token) has no age: it is
        never stale and stays out of the age metrics.
      limit: ``max_weight_staleness`` (None: metrics only).
      level: ``"token"`` or ``"sequence"``.
    """

    age: jax.Array
    versioned: jax.Array
    limit: int | None = None
    level: str = "sequence"

    @property
    def stale(self) -> jax.Array:
        assert self.limit is not None
        return self.versioned & (self.age > self.limit)

    def columns(self, t):
        aged = jnp.where(self.versioned, t.population, 0.0)
        age = self.age.astype(jnp.float32)
        columns = {
            "aged": _reduce.count(aged),
            "age": _reduce.total(age, aged),
            "oldest": _reduce.maximum(age, aged),
        }
        if self.limit is not None:
            columns["stale"] = _reduce.count_where(self.stale, t.population)
        return columns

    def decide(self, t, sums):
        aged, p = sums["aged"], "mis_staleness"
        metrics: dict = {
            f"{p}_mean": _reduce.seq_mean(sums["age"], aged, t.reduction),
            f"{p}_max": rules.batch_extreme(t.layout, sums["oldest"], aged, "max"),
        }
        if self.limit is None:
            return Decision(metrics=metrics)
        stale_token = self.stale
        stale_seq = sums["stale"] > 0
        metrics[f"{p}_fraction_high"] = Mean(_indicator(stale_token))
        metrics[f"{p}_seq_fraction"] = Mean(_indicator(stale_seq), per_seq=True)
        if self.level == "token":
            return Decision(keep=~stale_token, metrics=metrics)
        return Decision(keep=~stale_seq, per_seq=True, metrics=metrics)


@dataclasses.dataclass(frozen=True)
class OffPolicyPrefix(Stage):
    """Keeps the tokens sampled by the newest version of their sequence.

    Versions are compared as integers (through :func:`sortable`); a token without a
    version (negative) is neither compared nor rejected.
    ``mis_offpolicy_prefix_fraction``: the share of valid tokens rejected;
    ``mis_offpolicy_prefix_seq_fraction``: the share of sequences that mix versions.
    """

    versions: jax.Array
    order: jax.Array  # int32 >= 0, ordered as the versions within a sequence (prefix_order)

    def columns(self, t):
        versioned = jnp.where(self.versions >= 0, t.population, 0.0)
        key = sortable(self.order)
        return {
            "newest": _reduce.maximum(key, versioned),
            "first": _reduce.minimum(key, versioned),
        }

    def decide(self, t, sums):
        newest = t.layout.broadcast(sums["newest"])
        prefix = (self.versions >= 0) & (sortable(self.order) < newest)
        # An empty (or unversioned) sequence has newest −inf and first +inf.
        mixed = sums["first"] < sums["newest"]
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


def version_dtype():
    """The integer dtype versions are compared in: int32, or int64 when
    ``jax_enable_x64`` is on (JAX has no int64 arrays otherwise)."""
    return jax.dtypes.canonicalize_dtype(jnp.int64)  # int32 unless x64 is on


def check_versions(versions, current_version, shape, *, needed_by: str | None, mask=None):
    """Validated ``(versions, current_version)`` as integer arrays of
    :func:`version_dtype`, or ``(None, None)``.

    Args:
      versions: int ``[..., T]`` or None; negative: no generation version.
      current_version: an int ``>= 0``, or an int array of shape ``[...]`` (one value
        per sequence, or per row with ``segment_ids``), ``[..., 1]`` or ``[..., T]``
        (per token); required with ``versions``. It comes back as ``()``,
        ``[..., 1]`` or ``[..., T]``, ready to broadcast against ``versions``.
      shape: the log-probs' ``[..., T]``.
      needed_by: the config key that reads the versions, if any (for the message).
      mask: the ``[..., T]`` mask (padding already applied), or None: the concrete
        checks read the valid tokens only, as the rules do.

    Concrete values (not traced) are checked: each must fit the dtype (an int64
    ``2**40`` would wrap), ``current_version`` must be ``>= 0`` and no valid token's
    version may be newer than it. Under ``jax.jit`` traced values are not read.
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
    versions = as_array("versions", versions)
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
    current = as_array("current_version", current_version)
    if not jnp.issubdtype(current.dtype, jnp.integer):
        raise TypeError(f"current_version must be an int, got dtype {current.dtype}")
    current = _per_sequence(current, tuple(shape))
    valid = None if mask is None else (lambda: np.asarray(mask) > 0)
    dtype = version_dtype()
    check_version_range("versions", versions, dtype, valid if is_concrete(mask) else None)
    check_version_range("current_version", current, dtype, None)
    if is_concrete(mask) or mask is None:
        check_not_newer(versions, current, valid)
    return _as_int(versions, dtype), _as_int(current, dtype)


def _per_sequence(current, shape: tuple[int, ...]):
    """``current_version`` shaped to broadcast against ``[..., T]``: a ``[...]`` array is
    one value per sequence (as ``advantages`` and ``rewards``), even when ``[...]``
    happens to equal ``[T]``."""
    batch = shape[:-1]
    if current.ndim == 0:
        return current
    if current.shape == batch:
        return current[..., None]
    same_rank = current.ndim == len(shape)
    if same_rank and all(c in (1, s) for c, s in zip(current.shape, shape, strict=True)):
        return current
    raise ValueError(
        f"current_version has shape {current.shape}; expected an int, {batch} (one per "
        f"sequence), {(*batch, 1)} or {shape} (one per token) for log-probs of shape {shape}"
    )


def _as_int(x, dtype) -> jax.Array:
    """``x`` in ``dtype``; a traced unsigned value too large for it saturates (a concrete
    one was refused by :func:`check_version_range`)."""
    x = jnp.asarray(x)
    info = jnp.iinfo(dtype)
    if jnp.issubdtype(x.dtype, jnp.unsignedinteger) and jnp.iinfo(x.dtype).max > info.max:
        x = jnp.minimum(x, info.max)
    return x.astype(dtype)


@read_now
def check_version_range(name: str, x, dtype, valid) -> None:
    """Raises ``ValueError`` naming ``name`` if a concrete ``x`` holds a value outside
    ``dtype`` (at a valid token, where ``valid()`` gives them)."""
    source = np.dtype(x.dtype)
    info = np.iinfo(dtype)
    if not is_concrete(x) or (
        np.iinfo(source).min >= info.min and np.iinfo(source).max <= info.max
    ):
        return
    values = np.asarray(x)
    outside = (values > info.max) | (values < info.min) if source.kind == "i" else values > info.max
    if valid is not None:
        outside = outside & valid()
    if outside.any():
        example = values[outside].flat[0]
        raise ValueError(
            f"{name} holds {example} (dtype {source}), outside {np.dtype(dtype)} "
            f"[{info.min}, {info.max}]: policy versions are compared as {np.dtype(dtype)} "
            "(int64 with jax_enable_x64), where it would wrap to another version"
        )


@read_now
def check_not_newer(versions, current, valid) -> None:
    """Raises ``ValueError`` if concrete versions are newer than a concrete
    ``current_version`` at a valid token (a negative age), or ``current_version < 0``."""
    if not (is_concrete(versions) and is_concrete(current)):
        return
    c = np.asarray(current).astype(np.int64)
    if (c < 0).any():
        raise ValueError(
            f"current_version must be >= 0 (the trainer's policy version), got {c.min()}"
        )
    v = np.asarray(versions).astype(np.int64)
    newer = (v >= 0) & (v > c)
    if valid is not None:
        newer = newer & valid()
    if newer.any():
        at = tuple(int(i) for i in np.argwhere(newer)[0])
        raise ValueError(
            f"versions holds {v[at]} at {at}, newer than current_version "
            f"{np.broadcast_to(c, v.shape)[at]}: a token cannot come from a policy version "
            "the trainer has not reached (its age would be negative). Pass the trainer's "
            "current version, or mask the token out."
        )


def async_stages(config, versions, current) -> list[Stage]:
    """The stages of the config's asynchronous-RL keys (after the §3 / §8 ones)."""
    chain: list[Stage] = []
    if versions is None:
        return chain
    age = current - versions  # integers: exact at any version
    chain.append(Staleness(age, versions >= 0, config.max_weight_staleness, config.staleness_level))
    if config.mask_offpolicy_in_partial_rollout:
        chain.append(OffPolicyPrefix(versions, prefix_order(versions, age)))
    return chain


def prefix_order(versions: jax.Array, age: jax.Array) -> jax.Array:
    """int32 values ``>= 0`` ordered as the versions are within a sequence, for the
    float32 reduction engine (:func:`sortable`): the int32 versions themselves, and for
    int64 versions (``jax_enable_x64``) ``2**30 − age``, exact while ``|age| < 2**30``
    and the current version is one per sequence."""
    if versions.dtype == jnp.int32:
        return jnp.maximum(versions, 0)
    lag = jnp.clip(age, 1 - 2**30, 2**30)
    return (2**30 - lag).astype(jnp.int32)
