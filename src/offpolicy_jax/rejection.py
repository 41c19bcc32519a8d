"""Rejection: which tokens or sequences leave the loss (mask only, never the weights).

* ``rejection_keep``: rejection sampling at a level (semantics.md §3.3).
* ``veto``: reject a sequence containing a catastrophic token (§3.4, D1).
* ``finite_sequences``: a non-finite log-prob at a valid position rejects its
  whole sequence (§0) instead of poisoning the batch with NaN.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from offpolicy_jax import _reduce
from offpolicy_jax._reduce import MeshAxes


def rejection_keep(ratio: jax.Array, lower: float, upper: float) -> jax.Array:
    """Rejection sampling: keep iff ``L_rs ≤ ρ_rs ≤ U_rs``.

    Args:
      ratio: ``[..., T]`` token-level or ``[..., 1]`` sequence-level ratios ``ρ_rs``.
      lower: ``L_rs``.
      upper: ``U_rs``.

    Returns:
      bool keep mask with the shape of ``ratio``; a sequence-level ratio keeps or
      rejects its whole sequence.
    """
    return (ratio >= lower) & (ratio <= upper)


def catastrophic_tokens(delta: jax.Array, valid: jax.Array, threshold: float) -> jax.Array:
    """Valid tokens whose raw, unclamped ratio is below ``threshold``: ``δ_t < log(τ)``."""
    return valid & (delta < math.log(threshold))


def veto(
    delta: jax.Array, mask: jax.Array, threshold: float, axes: MeshAxes = MeshAxes()
) -> tuple[jax.Array, jax.Array]:
    """Catastrophic-token veto (semantics.md §3.4; D1: independent of ``use_rs``).

    A sequence is rejected if any valid token has ``δ_t < log(threshold)``
    (strict), i.e. π_old assigns it a far smaller probability than the sampler did.

    Args:
      delta: ``[..., T]`` raw log-ratios ``o − b`` (0 at invalid positions).
      mask: ``[..., T]`` float population weights.
      threshold: the veto ratio ``τ > 0``.
      axes: mesh axes for the per-sequence ``any`` inside ``shard_map``.

    Returns:
      ``(catastrophic, keep_seq)``: ``[..., T]`` bool catastrophic tokens and
      ``[..., 1]`` bool, False for vetoed sequences.
    """
    catastrophic = catastrophic_tokens(delta, mask > 0, threshold)
    vetoed = _reduce.seq_any(catastrophic, mask, axes)
    return catastrophic, ~vetoed[..., None]


def nonfinite_tokens(*logps: jax.Array) -> jax.Array:
    """``[..., T]`` bool: a NaN or ±inf in any of the log-prob arrays."""
    bad = jnp.zeros(jnp.broadcast_shapes(*(jnp.shape(x) for x in logps)), bool)
    for logp in logps:
        bad = bad | ~jnp.isfinite(logp)
    return bad


def finite_sequences(mask: jax.Array, *logps: jax.Array, axes: MeshAxes = MeshAxes()) -> jax.Array:
    """``[..., 1]`` bool: True for sequences whose log-probs are finite at every valid token.

    Args:
      mask: ``[..., T]`` float population weights.
      *logps: ``[..., T]`` log-prob arrays to check.
      axes: mesh axes for the per-sequence ``any`` inside ``shard_map``.
    """
    return ~_reduce.seq_any(nonfinite_tokens(*logps), mask, axes)[..., None]
