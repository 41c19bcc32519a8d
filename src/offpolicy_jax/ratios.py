"""Log-ratios, their aggregation to a level, and the clamped exponential.

The importance ratio of the rollout correction is ``π_old / π_rollout``; in log
space ``δ_t = o_t − b_t``. Levels (semantics.md §2):

* token:     ``λ_t = δ_t``
* sequence:  ``λ = Σ_s δ_s m_s``          (log of the product of ratios)
* geometric: ``λ = Σ_s δ_s m_s / N̄``      (log of their geometric mean)

and ``ρ = exp(clip(λ, −S, S))`` with ``S = 20``: the clamp comes after the
aggregation, so a long sequence of small ratios is bounded as a whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from offpolicy_jax import _reduce
from offpolicy_jax._reduce import MeshAxes

LOG_RATIO_CLAMP = 20.0
"""``S``: log-space bound applied before every ``exp`` of a ratio."""


def log_ratio(
    numerator_logp: jax.Array, denominator_logp: jax.Array, valid: jax.Array
) -> jax.Array:
    """``δ = numerator − denominator`` on valid tokens and exactly 0 elsewhere.

    Args:
      numerator_logp: ``[..., T]`` log-probs of the target policy (e.g. π_old).
      denominator_logp: ``[..., T]`` log-probs of the sampling policy (π_rollout).
      valid: ``[..., T]`` bool, where the difference is meaningful.

    Returns:
      ``[..., T]`` log-ratio; garbage at invalid positions never leaks.
    """
    return jnp.where(valid, numerator_logp - denominator_logp, 0)


def aggregate_level(
    delta: jax.Array, mask: jax.Array, level: str, axes: MeshAxes = MeshAxes()
) -> jax.Array:
    """Aggregates per-token log-ratios to ``level``.

    Args:
      delta: ``[..., T]`` log-ratios (0 at invalid positions).
      mask: ``[..., T]`` float population weights ``m``.
      level: ``"token"``, ``"sequence"`` or ``"geometric"``.
      axes: mesh axes for the per-sequence sum inside ``shard_map``.

    Returns:
      ``[..., T]`` for the token level; ``[..., 1]`` (one value per sequence, which
      broadcasts against ``[..., T]``) for the sequence and geometric levels.
    """
    if level == "token":
        return delta
    _check_level(level)
    sums = _reduce.seq_reduce(
        {"delta": _reduce.total(delta, mask), "count": _reduce.count(mask)}, axes
    )
    return sequence_log_ratio(sums["delta"], sums["count"], level)[..., None]


def sequence_log_ratio(delta_sum: jax.Array, count: jax.Array, level: str) -> jax.Array:
    """``λ`` of each sequence, ``[...]``, from ``Σ_t δ_t m_t`` and ``N = Σ_t m_t``.

    sequence: ``Σ δ m``; geometric: ``Σ δ m / N̄``. Here ``N̄ = N`` where ``N > 0``:
    identical to ``max(N, 1)`` for 0/1 masks, but it does not under-scale a
    sequence whose fractional mask sums to less than 1.
    """
    _check_level(level)
    if level == "sequence":
        return delta_sum
    if level == "geometric":
        return _reduce.safe_divide(delta_sum, count)
    raise ValueError(f"the token level has no per-sequence log-ratio, got {level!r}")


def _check_level(level: str) -> None:
    if level not in ("token", "sequence", "geometric"):
        raise ValueError(f"level must be one of 'token', 'sequence', 'geometric', got {level!r}")


def clamped_exp(log_value: jax.Array) -> jax.Array:
    """``exp(clip(x, −S, S))``: a ratio that can neither overflow nor underflow to 0."""
    return jnp.exp(jnp.clip(log_value, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
