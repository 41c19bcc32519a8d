"""Trace-time checks of array arguments: rank, shape and dtype, with the argument's name.

They run on static shape/dtype information only, so they cost nothing under
``jax.jit`` and fail at trace time instead of producing NaN steps later.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def as_array(name: str, x):
    """``x`` if it is already an array, else ``x`` (a nested list or tuple) as a NumPy array.

    JAX arrays, tracers and NumPy arrays pass through untouched. Anything else is
    converted here so that a ragged list or a list of strings fails with an error
    naming ``name``, instead of JAX's ``Cannot determine dtype of [[...]]``.
    """
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return x
    try:
        array = np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        return jnp.asarray(x)  # a list of traced values, inside jit: JAX stacks them
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"{name} must be an array of shape [..., T] (a nested list or tuple of numbers is "
            f"converted), but it could not be converted: {err}"
        ) from None
    if array.dtype == object or array.dtype.kind not in "biuf":
        raise TypeError(
            f"{name} must hold numbers (an array or a nested list of them), got a "
            f"{type(x).__name__} that converts to dtype {array.dtype}"
        )
    return array


def as_float_logp(name: str, x) -> jax.Array:
    """Checks a log-prob array and casts it to float32, the library's compute dtype
    (bf16/fp16 upcast exactly)."""
    if x is None:
        raise ValueError(f"{name} is required but got None")
    x = as_array(name, x)
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array of log-probs, got dtype {dtype}")
    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError(f"{name} must have shape [..., T] (rank >= 1), got a scalar")
    return x.astype(jnp.float32)


def as_float_mask(name: str, mask) -> jax.Array:
    """Checks a mask and returns float32 weights (docs/semantics.md §0, issue 17 #3).

    An entry that is not > 0 (0, negative, NaN) is padding and becomes 0. A bool or
    integer entry > 0 is a member with weight exactly 1 (a mask of 2 or 255 scales
    nothing). A float entry > 0 is a member whose value weights its token in every
    sum (use 0/1 floats for a plain mask).
    """
    if mask is None:
        raise ValueError(f"{name} is required but got None")
    mask = as_array(name, mask)
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
    if not jnp.issubdtype(dtype, jnp.floating):
        return jnp.where(mask > 0, 1.0, 0.0)
    return jnp.where(weights > 0, weights, 0.0)


def check_same_shape(reference_name: str, reference: jax.Array, **others: jax.Array | None) -> None:
    """Raises ``ValueError`` naming the first argument whose shape differs."""
    for name, value in others.items():
        if value is not None and np.shape(value) != np.shape(reference):
            raise ValueError(
                f"{name} has shape {tuple(np.shape(value))} but {reference_name} has shape "
                f"{tuple(np.shape(reference))}; all per-token inputs must be [..., T] alike"
            )


def _varying_axes(x) -> frozenset[str]:
    """The manual mesh axes ``x`` varies over inside ``shard_map`` (empty if unknown)."""
    if not isinstance(x, jax.Array):  # NumPy data or a list: a constant, varies over nothing
        return frozenset()
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax >= 0.10
    varying = getattr(mat, "varying", None) if mat is not None else getattr(aval, "vma", None)
    return frozenset(varying or ())


def check_axes_bound(axis_names: tuple[str, ...]) -> None:
    """Raises ``ValueError`` naming ``axis_names`` if a name is not a bound mesh axis here.

    Outside ``jax.shard_map`` (or a ``vmap`` with that ``axis_name``) the library's
    ``psum`` would fail later with JAX's ``unbound axis name``, which does not say
    which argument is wrong. ``jax.lax.axis_size`` answers at trace time, for free.
    """
    for axis in axis_names:
        try:
            jax.lax.axis_size(axis)
        except NameError:
            raise ValueError(
                f"axis_names names mesh axis {axis!r}, but no axis of that name is bound here: "
                "axis_names is only for calls inside jax.shard_map (or a vmap with that "
                "axis_name) over those axes. Outside shard_map, leave axis_names=None: under "
                "plain jax.jit with sharded inputs the result is already the global one."
            ) from None


def check_split_over(axis_names: tuple[str, ...], **arrays) -> None:
    """Raises if an input is replicated along a mesh axis that ``axis_names`` names.

    Inside ``shard_map`` the library ``psum``-s its sums over the named axes; an
    input that is the same on every device of such an axis would be counted once
    per device, silently. JAX tracks which axes a value varies over (with
    ``check_vma=True``, the default); an input whose tracking is empty (a constant,
    or ``check_vma=False``) cannot be checked and is let through.
    """
    if not axis_names:
        return
    check_axes_bound(axis_names)
    for name, value in arrays.items():
        if value is None:
            continue
        varying = _varying_axes(value)
        missing = [axis for axis in axis_names if axis not in varying]
        if varying and missing:
            raise ValueError(
                f"axis_names names mesh axes {missing} but {name} is not split over them "
                f"(it varies only over {sorted(varying)}): its sums would be counted once per "
                "device of those axes. Name only the axes the batch (or its tokens) is "
                "sharded over in shard_map's in_specs."
            )
