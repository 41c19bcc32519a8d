"""Bounding importance weights: truncate (one-sided), clip (two-sided), mask (reject).

``w`` is the ratio at the TIS level, ``L``/``U`` the resolved bounds (semantics.md §3.2).
The weights are stop-gradient quantities, so the usual min/max JVP conventions do
not matter here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def truncate(weights: jax.Array, upper: float) -> jax.Array:
    """Truncated IS (Ionides, 2008): ``min(w, U)``."""
    return jnp.minimum(weights, upper)


def clip(weights: jax.Array, lower: float, upper: float) -> jax.Array:
    """Two-sided clipped IS: ``clip(w, L, U)``."""
    return jnp.clip(weights, lower, upper)


def within_bounds(weights: jax.Array, lower: float, upper: float) -> jax.Array:
    """Masked IS / rejection: keep iff ``L ≤ w ≤ U`` (inclusive bounds). Returns bool."""
    return (weights >= lower) & (weights <= upper)


def apply_mode(
    weights: jax.Array, mode: str, lower: float, upper: float
) -> tuple[jax.Array, jax.Array | None]:
    """Bounds ``weights`` by ``mode``.

    Args:
      weights: ``[..., T]`` (or ``[..., 1]``) raw ratios ``w``.
      mode: ``"truncate"``, ``"clip"`` or ``"mask"``.
      lower: ``L`` (ignored by truncate).
      upper: ``U``.

    Returns:
      ``(bounded, keep)``: the bounded weights and, for mask mode, the bool keep
      mask (``None`` otherwise). In mask mode rejected weights are 0 (D8).
    """
    if mode == "truncate":
        return truncate(weights, upper), None
    if mode == "clip":
        return clip(weights, lower, upper), None
    if mode == "mask":
        keep = within_bounds(weights, lower, upper)
        return jnp.where(keep, weights, 0), keep
    raise ValueError(f"mode must be one of 'truncate', 'clip', 'mask', got {mode!r}")
