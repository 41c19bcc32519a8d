"""Trace-time checks of array arguments: rank, shape and dtype, with the argument's name.

They run on static shape/dtype information only, so they cost nothing under
``jax.jit`` and fail at trace time instead of producing NaN steps later.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def as_float_logp(name: str, x) -> jax.Array:
    """Checks a log-prob array and casts it to float32, the library's compute dtype (bf16/fp16 upcast exactly)."""
    if x is None:
        raise ValueError(f"{name} is required but got None")
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array of log-probs, got dtype {dtype}")
    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError(f"{name} must have shape [..., T] (rank >= 1), got a scalar")
    return x.astype(jnp.float32)


def as_float_mask(name: str, mask) -> jax.Array:
    """Checks a mask (bool, integer or float 0/1 weights) and returns float32 weights.

    An entry that is not > 0 (0, negative, NaN) is padding and becomes 0.
    """
    if mask is None:
        raise ValueError(f"{name} is required but got None")
    dtype = jnp.result_type(mask)
    if not (
        jnp.issubdtype(dtype, jnp.floating)
        or jnp.issubdtype(dtype, jnp.integer)
        or dtype == jnp.bool_
    ):
        raise TypeError(f"{name} must be a bool, integer or float array, got dtype {dtype}")
    mask = jnp.asarray(mask)
    if mask.ndim < 1:
        raise ValueError(f"{name} must have shape [..., T] (rank >= 1), got a scalar")
    weights = mask.astype(jnp.float32)
    if dtype == jnp.bool_:
        # Already 0/1. Skipping the `where` is not only one op less: with it, XLA
        # stores the float mask as a [..., T] array read by every pass, instead of
        # converting the 1-byte bool mask inside each pass.
        return weights
    return jnp.where(weights > 0, weights, 0.0)


def check_same_shape(reference_name: str, reference: jax.Array, **others: jax.Array) -> None:
    """Raises ``ValueError`` naming the first argument whose shape differs."""
    for name, value in others.items():
        if value is not None and np.shape(value) != np.shape(reference):
            raise ValueError(
                f"{name} has shape {tuple(np.shape(value))} but {reference_name} has shape "
                f"{tuple(np.shape(reference))}; all per-token inputs must be [..., T] alike"
            )
