"""Trace-time checks of array arguments: rank, shape and dtype, with the argument's name.

They run on static shape/dtype information only, so they cost nothing under
``jax.jit`` and fail at trace time instead of producing NaN steps later.
"""

from __future__ import annotations

import functools

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
    """Checks a mask and returns float32 weights (docs/semantics.md §0).

    An entry that is not > 0 (0, negative, NaN) is padding and becomes 0. A bool entry
    is 0/1; an integer mask must be 0/1 (a concrete one holding another value raises,
    :func:`check_mask_values`; a traced entry > 0 is a member with weight exactly 1). A
    float entry > 0 is a member whose value weights its token in every sum (use 0/1
    floats for a plain mask).
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
    check_mask_values(name, mask)
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


# --------------------------------------------------------------- values known eagerly
#
# A value check needs the values: under jax.jit they are tracers, and reading them would
# be a host sync (or impossible). These helpers check what is concrete (NumPy data, a
# list, an eager jax.Array) and let tracers through; each caller documents what a bad
# value means under jit.


def is_concrete(x) -> bool:
    """True when ``x``'s values can be read now without tracing (not a tracer, and every
    shard addressable from this process)."""
    if isinstance(x, jax.core.Tracer):  # pyright: ignore[reportAttributeAccessIssue]
        return False
    if isinstance(x, jax.Array):
        return x.is_fully_addressable
    return True


def read_now(check):
    """Runs a value check eagerly even while a trace is active.

    A concrete array closed over by a jitted function is still concrete, but ``jnp``
    operations on it inside the trace would return tracers (and ``bool`` of one
    raises); ``jax.ensure_compile_time_eval`` evaluates them on the spot instead.
    """

    @functools.wraps(check)
    def eager(*args, **kwargs):
        with jax.ensure_compile_time_eval():
            return check(*args, **kwargs)

    return eager


def _any(condition) -> bool:
    """``any(condition)``, reduced on the array's own device: one scalar comes back."""
    if isinstance(condition, jax.Array):
        return bool(jnp.any(condition))
    return bool(np.any(condition))


def _xp(x):
    return jnp if isinstance(x, jax.Array) else np


INT32_MIN, INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)


@read_now
def check_int32_ids(name: str, x) -> None:
    """Raises ``ValueError`` naming ``name`` if integer ids do not fit in int32.

    The library computes ids in int32 (and JAX, with x64 off, converts int64 data to
    int32 by wrapping: 2**32 + 1 becomes 1, a silently different id). Only concrete
    values of a wider integer dtype are read.
    """
    dtype = np.dtype(jnp.result_type(x)) if not hasattr(x, "dtype") else np.dtype(x.dtype)
    if dtype.kind not in "iu" or dtype.itemsize < 4 or dtype == np.int32 or not is_concrete(x):
        return
    values = x if isinstance(x, (jax.Array, np.ndarray)) else np.asarray(x)
    if _any(
        (values > INT32_MAX) | (values < INT32_MIN) if dtype.kind == "i" else values > INT32_MAX
    ):
        raise ValueError(
            f"{name} holds ids outside int32 [{INT32_MIN}, {INT32_MAX}] (dtype {dtype}); the "
            "library computes ids in int32, where they would wrap to other ids silently"
        )


@read_now
def check_mask_values(name: str, mask) -> None:
    """Raises ``ValueError`` naming ``name`` if a concrete integer mask holds a value other
    than 0 or 1 (docs/semantics.md §0).

    An integer mask is membership only; a 2 or 255 would read as 1, which is the
    silent answer to a caller who meant a weight. Bool masks cannot be wrong and float
    masks are per-token weights (documented); traced masks are not read (under jit an
    integer entry > 0 is a member with weight 1).
    """
    dtype = np.dtype(mask.dtype) if hasattr(mask, "dtype") else np.asarray(mask).dtype
    if dtype.kind not in "iu" or not is_concrete(mask):
        return
    values = mask if isinstance(mask, (jax.Array, np.ndarray)) else np.asarray(mask)
    if _any((values != 0) & (values != 1)):
        xp = _xp(values)
        bad = xp.where((values != 0) & (values != 1), values, 0)
        example = int(xp.max(bad)) if _any(bad > 0) else int(xp.min(bad))
        raise ValueError(
            f"{name} is an integer mask holding {example}: an integer mask must be 0/1 (or "
            "bool). For per-token loss weights pass a float mask (docs/semantics.md §0)."
        )


@read_now
def check_segment_ids_at_most(segment_ids, num_segments: int) -> None:
    """Raises ``ValueError`` if concrete ``segment_ids`` hold an id above ``num_segments``.

    Such an id is padding (docs/semantics.md §10), but a caller who wrote it almost
    always passed too small a ``num_segments``: the tokens of the last sequences would
    silently leave the loss. Traced ids are not read: under jit they stay padding.
    """
    if not is_concrete(segment_ids):
        return
    values = segment_ids if isinstance(segment_ids, (jax.Array, np.ndarray)) else None
    values = np.asarray(segment_ids) if values is None else values
    if values.size and _any(values > num_segments):
        highest = int(_xp(values).max(values))
        raise ValueError(
            f"segment_ids holds id {highest} but num_segments is {num_segments}: ids above "
            "num_segments would be padding, silently leaving the loss. Pass num_segments >= "
            "the largest id (use 0 or a negative id for padding)."
        )


def check_staleness_limit(owner: str, limit) -> None:
    """Raises ``ValueError`` naming ``{owner}.max_weight_staleness`` if the limit is not
    an int in ``[0, 2**31 − 1]``: ages are compared with it as int32 (or int64), and a
    larger limit would fail inside every call with JAX's overflow error instead."""
    whole = isinstance(limit, int | np.integer) and not isinstance(limit, bool)
    if not whole or not 0 <= int(limit) <= INT32_MAX:
        raise ValueError(
            f"{owner}.max_weight_staleness must be an int in [0, {INT32_MAX}] (policy "
            f"versions) or None, got {limit!r}"
        )
