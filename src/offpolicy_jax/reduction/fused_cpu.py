"""The fused XLA:CPU reduction path: several per-sequence reductions in one loop.

Chosen by :mod:`offpolicy_jax.reduction.backend` on CPU (``OFFPOLICY_JAX_REDUCTION``
``auto`` or ``fused``); TPU and GPU run :mod:`~offpolicy_jax.reduction.plain`, whose
results it matches to float32 rounding. Kept because it pays on CPU: measured with
``python -m benchmarks.fused_vs_plain`` (``benchmarks/fused_vs_plain.md``), the plain
path is 2.6-5.3x slower padded and ~10x slower packed on the project's CPU VM.

Why CPU needs it: XLA:CPU hands each reduction to a library kernel (YNNPACK) that
cannot fuse the elementwise code producing its input, so every
``jnp.sum(f(inputs), -1)`` first writes ``f(inputs)`` as a full ``[..., T]``
float32 array and reads it back, and K sums of functions of the same inputs read
those inputs K times. A *variadic* reduce (several operands, one loop) stays in
XLA's own fused loop, which reads the inputs once and evaluates every column's
expression in registers. XLA:CPU vectorises that loop only when LLVM fully unrolls
its inner reduction loop, which bounds the work per loop: so the loop adds only
``_CHUNK`` tokens per result (writing ``[..., T / _CHUNK]`` partial results, then
finished by the library kernel; see :func:`_chunked_reduce` for the two views of the
token axis), and a loop takes at most ``_MAX_COLUMNS`` columns; larger sets run as
several such loops of as even sizes as possible (:func:`_loops`). A length that is not a multiple of ``_CHUNK`` is reduced as
its chunked prefix plus a short remainder loop. The numbers were measured with
``benchmarks/`` on jax 0.10.2.

Which loop runs depends only on how the devices may share the token axis (the
arrays' own sharding, or the mesh axes left to the XLA partitioner): the chunk
reshape must never straddle two devices' shares, and a variadic loop must never
reduce across devices (the partitioner would all-gather each operand's partial
results, one collective per column).

**Packed rows** (several sequences a row, ``segment_ids``): by default the exact
*compare-and-reduce*, ``Σ_t [id_t = k] x_t`` for ``k = 1..K`` as the fused variadic
loop over ``[..., K, T]`` operands that XLA never writes out (about ``K`` times the
work of the unpacked reduction). When the caller promises contiguous segments
(``contiguous_segments=True``, the layout of ``pack_sequences``, checked by
:func:`~offpolicy_jax.reduction.segments.contiguous_rows`), a two-level *windowed*
reduction: the row is cut into windows of ``W`` tokens (``W ≈ sqrt(T / 8)``,
16-64), each column reduced per window by the row loops above; the few windows
across a boundary (one per sequence that ends inside a window) are gathered and
reduced again in two slots (even and odd ids); a scatter adds the window results,
slot results and the ``T mod W`` tokens after the last window into the ``K``
segments. It is exact when no window holds two different even ids or two different
odd ids, and no sequence ends in two windows that hold two ids. Measured
(``policy_loss`` forward + backward, mis.yaml, ``K = 8``, packed / padded time per
valid token): the compare-and-reduce 3.3-4.7, the windowed path 1.3-1.45.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec

from offpolicy_jax.reduction.columns import INIT
from offpolicy_jax.reduction.plain import (
    compare_operands,
    linear_jvp,
    plain_reduce,
    plain_segment_sum,
    select_broadcast,
)

_COMBINE = {"sum": jnp.add, "min": jnp.minimum, "max": jnp.maximum}

_CHUNK = 4
_MAX_COLUMNS = 8
# Below this many values in total (columns x elements, e.g. the per-sequence terms of
# all the metrics), one scalar loop over every column is cheaper than a kernel each.
_SMALL = 1 << 16


def _combine(op: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return _COMBINE[op](a, b)


@functools.cache
def _combiner(ops: tuple[str, ...]):
    """The ``lax.reduce`` computation combining columns by ``ops``, one function per
    ``ops``: ``lax.reduce`` keys its trace and its compiled program on the function
    object, so a fresh lambda per call traced it again under ``jit`` and compiled the
    loop again at every eager call."""

    def combine(acc, x):
        return tuple(_combine(op, a, b) for op, a, b in zip(ops, acc, x, strict=True))

    return combine


class _Split(NamedTuple):
    """How the devices may share the last (token) axis of an array."""

    explicit: int  # devices its explicit sharding splits it over
    free: int  # devices the XLA partitioner may still split it over, in any way
    spec: PartitionSpec | None  # the chunked array's sharding, when the axis is explicit


def _split(value: jax.Array) -> _Split:
    """How the devices may share the last axis of ``value``, from its own sharding.

    Inside ``shard_map`` (Manual mesh axes) arrays are local: nothing splits them.
    An explicitly sharded axis is split over a known number of devices. Mesh axes
    left to the partitioner (Auto axes) may split it over any number of devices
    dividing their total; with no mesh in context, jit may place the program on any
    of the backend's devices, which is the same question for the backend at hand.
    """
    sharding = jax.typeof(value).sharding
    spec = tuple(sharding.spec) + (None,) * (value.ndim - len(sharding.spec))
    token = spec[-1]
    names = () if token is None else (token,) if isinstance(token, str) else tuple(token)
    context = jax.sharding.get_abstract_mesh()
    if context.empty:
        free = len(jax.devices(jax.default_backend()))
    else:
        free = math.prod(
            size
            for size, kind in zip(context.axis_sizes, context.axis_types, strict=True)
            if kind == AxisType.Auto
        )
    return _Split(
        explicit=math.prod(sharding.mesh.shape[name] for name in names),
        free=free,
        spec=PartitionSpec(*spec[:-1], token, None) if names else None,
    )


def _variadic_reduce(
    ops: tuple[str, ...], values: tuple[jax.Array, ...], axis: int = -1
) -> tuple[jax.Array, ...]:
    """One loop reducing every operand over ``axis`` (XLA's own, not a library kernel);
    float or integer operands."""
    inits = tuple(_identity(op, v.dtype) for op, v in zip(ops, values, strict=True))
    return tuple(
        jax.lax.reduce(
            values,
            inits,
            _combiner(ops),
            (axis % values[0].ndim,),
        )
    )


def _identity(op: str, dtype) -> jax.Array:
    """The op's identity in ``dtype`` (the extreme integers stand for ``±inf``)."""
    if op != "sum" and jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return jnp.array(info.max if op == "min" else info.min, dtype)
    return jnp.array(INIT[op], dtype)


def _chunked_reduce(
    ops: tuple[str, ...], values: tuple[jax.Array, ...], spec: PartitionSpec | None, unsplit: bool
) -> list[jax.Array]:
    """One variadic loop adding ``_CHUNK`` tokens at a time, then the partial results.

    ``T`` must be a multiple of ``_CHUNK`` here. When nothing may split the token
    axis (``unsplit``: one device, or local arrays inside ``shard_map``) it is viewed
    as ``[..., _CHUNK, T / _CHUNK]`` and the loop reduces the short *leading* axis:
    each result adds ``_CHUNK`` tokens ``T / _CHUNK`` apart, and LLVM vectorises
    along the contiguous axis of the results (the step 3-8% faster, and a loop 1.2-2.7x
    in isolation, than contiguous chunks). Otherwise it is viewed as ``[..., T /
    _CHUNK, _CHUNK]``: contiguous chunks never straddle two devices' shares, where the
    strided view would make the loop reduce across devices.
    """
    shape = values[0].shape
    if unsplit:
        strided_shape = (*shape[:-1], _CHUNK, shape[-1] // _CHUNK)
        strided = tuple(jax.lax.reshape(v, strided_shape) for v in values)
        partial = _variadic_reduce(ops, strided, axis=len(shape) - 1)
    else:
        chunked_shape = (*shape[:-1], shape[-1] // _CHUNK, _CHUNK)
        chunked = tuple(jax.lax.reshape(v, chunked_shape, out_sharding=spec) for v in values)
        partial = _variadic_reduce(ops, chunked)
    return [plain_reduce(op, p) for op, p in zip(ops, partial, strict=True)]


def _loops(count: int) -> list[slice]:
    """Consecutive groups of ``count`` columns, at most ``_MAX_COLUMNS`` each: as few
    groups as that allows, as even as possible, the smaller ones first (17 columns run
    as 5 + 6 + 6, never as 8 + 8 + 1: a lone column would go back to the
    write-then-reduce path). Order is kept, so that columns that share a subexpression
    (k3 and χ²'s ``exp``) stay in one loop when they are declared side by side.

    Measured (issue 25): on the library's workloads this gives the same loops as the
    per-column cost budgets it replaces (``benchmarks/compare_results.md``).
    """
    groups = max(1, -(-count // _MAX_COLUMNS))
    small, larger = divmod(count, groups)
    sizes = [small] * (groups - larger) + [small + 1] * larger
    cuts = [0, *itertools.accumulate(sizes)]
    return [slice(a, b) for a, b in itertools.pairwise(cuts)]


def _cpu_reduce(ops: tuple[str, ...], values: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    split = _split(values[0])
    length = values[0].shape[-1]
    if values[0].size * len(values) <= _SMALL and split.explicit * split.free == 1:
        return _variadic_reduce(ops, values)
    share = length // split.explicit
    unsplit = split.explicit * split.free == 1
    if length < _CHUNK or (share % (_CHUNK * split.free) and not unsplit):
        return tuple(plain_reduce(op, v) for op, v in zip(ops, values, strict=True))
    # On one device a ragged length is a chunked prefix plus a few remaining tokens:
    # 2 to _CHUNK + 1 of them, since a remainder of one token (a size-1 reduce that
    # XLA rewrites into the consumers) made every pass 2-4x slower at T = 4k + 1.
    body = length - length % _CHUNK if unsplit else length
    if unsplit and length % _CHUNK == 1 and body > _CHUNK:
        body -= _CHUNK
    prefix = tuple(v[..., :body] for v in values) if body < length else values
    out: list[jax.Array] = []
    for group in _loops(len(ops)):
        out += _chunked_reduce(ops[group], prefix[group], split.spec, unsplit)
    if body < length:
        rest = _variadic_reduce(ops, tuple(v[..., body:] for v in values))
        out = [_combine(op, a, b) for op, a, b in zip(ops, out, rest, strict=True)]
    return tuple(out)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def reduce_columns(ops: tuple[str, ...], values: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Reduces each ``[..., T]`` operand over its last axis by its op (sum/min/max), in
    few fused loops (see the module docstring). Differentiable: a sum's tangent is the
    plain sum of the tangents."""
    if len(values) == 1:
        return (plain_reduce(ops[0], values[0]),)
    return _cpu_reduce(ops, values)


def _reduce_columns_jvp(ops, primals, tangents):
    (values,), (dvalues,) = primals, tangents
    out = reduce_columns(ops, values)
    return out, linear_jvp(ops, values, dvalues, out, lambda d: jnp.sum(d, axis=-1), plain_reduce)


reduce_columns.defjvp(_reduce_columns_jvp, symbolic_zeros=True)


def batch_totals(values: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Each operand summed over all its axes (per-sequence terms to batch totals).

    Small local operands of two or more axes (packed rows' ``[..., K]`` terms) are
    summed over every axis in one scalar loop, where an axis at a time took one more
    variadic loop per call (about 0.1 s of compile each on XLA:CPU); anything larger or
    shared by devices goes an axis at a time, as :func:`reduce_columns`."""
    if values[0].ndim > 1 and _one_local_loop(values):
        return _sum_all(values)
    while values[0].ndim:
        values = reduce_columns(("sum",) * len(values), values)
    return values


def _one_local_loop(values: tuple[jax.Array, ...]) -> bool:
    """Few values in all, no axis sharded and no device that may share one."""
    if sum(v.size for v in values) > _SMALL or _split(values[0]).free != 1:
        return False
    return all(all(axis is None for axis in jax.typeof(v).sharding.spec) for v in values)


@jax.custom_jvp
def _sum_all(values: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    dims = tuple(range(values[0].ndim))
    return tuple(
        jax.lax.reduce(
            values,
            tuple(jnp.zeros((), v.dtype) for v in values),
            _combiner(("sum",) * len(values)),
            dims,
        )
    )


@_sum_all.defjvp
def _sum_all_jvp(primals, tangents):
    # Linear: the tangent is the sum of the tangents (its transpose a broadcast).
    (values,), (dvalues,) = primals, tangents
    return _sum_all(values), tuple(jnp.sum(d) for d in dvalues)


# --------------------------------------------------------------------------- packed rows


def _window_size(length: int) -> int:
    """The window ``W``: about ``sqrt(T / 8)``, which balances the ``2 T / W`` window
    results of the second level against segments shorter than a window (which send a
    call to the compare-and-reduce); a power of two between 16 and 64 (a multiple of
    ``_CHUNK``)."""
    best = math.sqrt(length / 8)
    return int(min(64, max(16, 2 ** round(math.log2(max(best, 1.0))))))


def _window_reduce(ops: tuple[str, ...], windows: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Every ``[..., n, W]`` operand reduced over its windows, ``[..., n]``.

    The variadic loop (grouped like a row
    reduction), each window viewed as ``[_CHUNK, W / _CHUNK]`` and reduced over its
    leading axis (the strided view of ``_chunked_reduce``), writes ``[..., n,
    W / _CHUNK]``; these are then combined by ``W / _CHUNK − 1`` elementwise ops, one
    fused pass (the library kernel that finishes a row reduction is 3-5x slower on
    so short a last axis).
    """
    chunk = _CHUNK
    lead = windows[0].shape[:-1]
    width = windows[0].shape[-1]
    out: list[jax.Array] = []
    for group in _loops(len(ops)):
        group_ops = ops[group]
        strided = tuple(w.reshape(*lead, chunk, width // chunk) for w in windows[group])
        partial = _variadic_reduce(group_ops, strided, axis=-2)
        out += [_finish_windows(op, part) for op, part in zip(group_ops, partial, strict=True)]
    return tuple(out)


def _finish_windows(op: str, part: jax.Array) -> jax.Array:
    """A window's ``W / _CHUNK`` lane results combined, elementwise (XLA fuses the chain
    into the consumer: the second level's stack)."""
    acc = part[..., 0]
    for j in range(1, part.shape[-1]):
        acc = _combine(op, acc, part[..., j])
    return acc


class Plan(NamedTuple):
    """Where each window's tokens go (ids only).

    Made once per packed layout (``Packed.plan``) and read by every reduction and
    broadcast of the windowed path, forward and backward.
    """

    slot: jax.Array  # [..., T'] int8: 0 padding, 1 even id, 2 odd id (T' = n · W)
    even_ids: jax.Array  # [..., n] the window's even id (0: none)
    odd_ids: jax.Array  # [..., n] the window's odd id (0: none)
    mixed: jax.Array  # [..., K] the window where sequence k ends with another one (0: none)
    second_ids: jax.Array  # [..., n + 2K + T mod W] the ids of the second level's values
    # bool scalar: no window holds two even or two odd ids, no sequence ends in two
    # windows of two ids
    ok: jax.Array

    @property
    def odd(self) -> jax.Array:
        return self.slot == 2

    @property
    def window(self) -> int:
        return self.slot.shape[-1] // self.even_ids.shape[-1]

    @property
    def tail(self) -> jax.Array:
        """``[..., T mod W]`` the ids of the tokens after the last whole window."""
        return self.second_ids[..., self.even_ids.shape[-1] + 2 * self.mixed.shape[-1] :]


_ID_INIT = {"min": np.iinfo(np.int32).max, "max": 0}


def _window_extremes(windows: tuple[jax.Array, ...], ops: tuple[str, ...]) -> list[jax.Array]:
    """Each int32 ``[..., n, W]`` operand's min or max over its windows, ``[..., n]``:
    one fused loop over the strided ``[..., n, _CHUNK, W / _CHUNK]`` view (as
    :func:`_window_reduce`), then one over the ``W / _CHUNK`` lanes. A plain ``max``
    over ``W`` becomes a select written out and a ``reduce-window`` on XLA:CPU,
    about 5x slower; lanes combined by elementwise ops would be fused into every
    consumer, and run again for each of the ``K`` segments the plan compares with."""
    chunk = _CHUNK
    *lead, n, width = windows[0].shape
    strided = tuple(w.reshape(*lead, n, chunk, width // chunk) for w in windows)
    partial = _variadic_reduce(ops, strided, axis=-2)
    return list(_variadic_reduce(ops, partial, axis=-1))


def _plan(segment_ids: jax.Array, window: int, num_segments: int) -> Plan:
    lead = segment_ids.shape[:-1]
    n = segment_ids.shape[-1] // window
    ids = segment_ids.astype(jnp.int32)
    inside = (ids >= 1) & (ids <= num_segments)
    body, body_inside = ids[..., : n * window], inside[..., : n * window]
    odd = (body % 2) == 1
    slot = jnp.where(body_inside, jnp.where(odd, 2, 1), 0).astype(jnp.int8)
    # Per window and parity, the largest and the smallest id (one id of each parity
    # at most when they agree; 0 / int32 max for a parity the window lacks) and the
    # first position.
    position = jnp.arange(n * window, dtype=jnp.int32)
    parts = []
    for parity in (~odd, odd):
        here = body_inside & parity
        parts += [
            jnp.where(here, body, _ID_INIT["max"]),
            jnp.where(here, body, _ID_INIT["min"]),
            jnp.where(here, position, _ID_INIT["min"]),
        ]
    even_hi, even_lo, even_at, odd_hi, odd_lo, odd_at = _window_extremes(
        tuple(x.reshape(*lead, n, window) for x in parts), ("max", "min", "min") * 2
    )
    one_each = ((even_hi == 0) | (even_hi == even_lo)) & ((odd_hi == 0) | (odd_hi == odd_lo))
    # The windows across a boundary, listed by the sequence that ends there (its id
    # on the left of the boundary): one window each when every sequence of a row is
    # one run of tokens, as packing lays them out; checked.
    two = (even_hi > 0) & (odd_hi > 0)
    left = jnp.where(even_at < odd_at, even_hi, odd_hi)
    ends = two[..., None, :] & (left[..., None, :] == jnp.arange(1, num_segments + 1)[:, None])
    mixed = jnp.sum(jnp.where(ends, jnp.arange(n, dtype=jnp.int32), 0), axis=-1)
    listed = jnp.any(ends, axis=-1)
    ok = jnp.all(one_each) & jnp.all(jnp.sum(ends.astype(jnp.int32), axis=-1) <= 1)
    tail = jnp.where(inside[..., n * window :], ids[..., n * window :], 0)
    second_ids = jnp.concatenate(
        [
            jnp.where(two, 0, jnp.maximum(even_hi, odd_hi)),  # a window of one id
            jnp.where(listed, jnp.take_along_axis(even_hi, mixed, axis=-1), 0),
            jnp.where(listed, jnp.take_along_axis(odd_hi, mixed, axis=-1), 0),
            tail,
        ],
        axis=-1,
    )
    return Plan(slot, even_hi, odd_hi, mixed, second_ids, ok)


def windows_plan(segment_ids: jax.Array, num_segments: int) -> Plan:
    return _plan(segment_ids, _window_size(segment_ids.shape[-1]), num_segments)


def window_broadcast(values: jax.Array, segment_ids: jax.Array, plan: Plan, fill) -> jax.Array:
    """:func:`~offpolicy_jax.reduction.segments.segment_broadcast` when ``plan.ok``: two per-window lookups in the
    ``[..., K]`` table (``[..., n]`` each), then two selects per token, where the
    general gather compares every token with all ``K`` ids. Linear in ``values``:
    its transpose, the backward of a broadcast, is as cheap (a select per token, a
    sum over each window, a scatter of ``2 n`` values)."""
    lead = plan.even_ids.shape[:-1]
    n = plan.even_ids.shape[-1]
    body = n * plan.window
    table = jnp.concatenate([jnp.full((*lead, 1), fill, values.dtype), values], axis=-1)
    even = jnp.take_along_axis(table, plan.even_ids, axis=-1, mode="promise_in_bounds")
    odd = jnp.take_along_axis(table, plan.odd_ids, axis=-1, mode="promise_in_bounds")
    shape = (*lead, n, plan.window)
    tokens = jnp.where(plan.odd.reshape(shape), odd[..., None], even[..., None])
    tokens = jnp.where((plan.slot == 0).reshape(shape), fill, tokens).reshape(*lead, body)
    if body == segment_ids.shape[-1]:
        return tokens
    tail = select_broadcast(values, segment_ids[..., body:], fill)
    return jnp.concatenate([tokens, tail], axis=-1)


def _window_segment_sum(value: jax.Array, plan: Plan, num_segments: int) -> jax.Array:
    """``K`` per-segment sums when ``plan.ok`` (the tangent of a windowed sum): linear,
    and its transpose is :func:`window_broadcast`'s two selects per token."""
    lead = plan.even_ids.shape[:-1]
    n = plan.even_ids.shape[-1]
    body = n * plan.window
    shape = (*lead, n, plan.window)
    odd = plan.odd.reshape(shape)
    windows = value[..., :body].reshape(shape)
    even_sums = jnp.sum(jnp.where(odd, 0.0, windows), axis=-1)
    odd_sums = jnp.sum(jnp.where(odd, windows, 0.0), axis=-1)
    pieces = [(even_sums,), (odd_sums,), (value[..., body:],)]
    ids = jnp.concatenate([plan.even_ids, plan.odd_ids, plan.tail], axis=-1)
    return _scatter(("sum",), num_segments, pieces, ids)[0]


def _windowed(
    ops: tuple[str, ...],
    num_segments: int,
    values: tuple[jax.Array, ...],
    plan: Plan,
) -> tuple[jax.Array, ...]:
    """Two-level per-segment reduction, exact when ``plan.ok``.

    Level 1: every operand reduced over windows of ``W`` tokens by the fast
    one-sequence-per-row loop on ``[..., T / W, W]`` (:func:`_window_reduce`: as
    many columns per loop as a row reduction, each column's expression evaluated
    once, nothing written out as ``[..., T]``). The windows of a row that hold two
    sequences (one per boundary, ``K`` slots) are gathered, ``[..., K, W]``, and
    reduced again in two slots, their tokens with an even id and those with an odd
    id: consecutive sequences have ids of different parity (``plan.ok`` checks it;
    padding, id 0, adds nothing), all ``2 C`` slot columns in one plain variadic loop:
    ``K W`` tokens a row, a few percent of it, where level 1's vectorised loops (one
    per 8 columns) cost 0.1-0.3 s of compile each on XLA:CPU and gained no measurable
    time. Level 2: a scatter of the ``T / W`` window results (those of two ids
    dropped), the ``2 K`` slot results and the ``T mod W`` tokens after the last
    window into the ``K`` segments.
    """
    lead = plan.even_ids.shape[:-1]
    n = plan.even_ids.shape[-1]
    body = n * plan.window
    shape = (*lead, n, plan.window)
    whole = _window_reduce(ops, tuple(v[..., :body].reshape(shape) for v in values))
    odd = _gather_windows(plan.odd.reshape(shape), plan.mixed)
    slot_ops, slots = [], []
    for op, v in zip(ops, values, strict=True):
        mixed = _gather_windows(v[..., :body].reshape(shape), plan.mixed)
        slot_ops += [op, op]
        slots += [jnp.where(odd, INIT[op], mixed), jnp.where(odd, mixed, INIT[op])]
    split = _variadic_reduce(tuple(slot_ops), tuple(slots))
    pieces = [whole, split[0::2], split[1::2], tuple(v[..., body:] for v in values)]
    return _scatter(ops, num_segments, pieces, plan.second_ids)


def _gather_windows(windows: jax.Array, index: jax.Array) -> jax.Array:
    """``windows[..., index, :]``: ``[..., n, W]``, ``[..., K]`` -> ``[..., K, W]``. XLA
    fuses the code computing a column into this gather (``K W`` tokens a row), where
    gathering single tokens would write the column out."""
    return jnp.take_along_axis(windows, index[..., None], axis=-2)


def _scatter(
    ops: tuple[str, ...],
    num_segments: int,
    pieces: Sequence[tuple[jax.Array, ...]],
    segment_ids,
) -> tuple[jax.Array, ...]:
    """Per-segment reduction of a few values per row by scatter: the columns of one op
    stacked on a minor axis, one scatter per op; id 0 lands in a bucket dropped after
    (a select, never a product, so NaN there reaches nothing).

    ``pieces``: each a tuple of every column's ``[..., L_i]`` values; the values of a
    column are its pieces end to end, ``[..., L]``, the length of ``segment_ids``.
    Stacked piece by piece, so that XLA builds each op's stack in one fusion.
    """
    lead = segment_ids.shape[:-1]
    rows = math.prod(lead)
    length = segment_ids.shape[-1]
    buckets = num_segments + 1
    base = (jnp.arange(rows, dtype=jnp.int32) * buckets).reshape(*lead, 1)
    index = (base + segment_ids).reshape(rows * length)
    out: list[jax.Array] = [jnp.zeros(())] * len(ops)
    for op in ("sum", "min", "max"):
        group = [i for i, o in enumerate(ops) if o == op]
        if not group:
            continue
        stacked = jnp.concatenate(
            [jnp.stack([piece[i] for i in group], axis=-1) for piece in pieces], axis=-2
        ).reshape(rows * length, -1)
        at = jnp.full((rows * buckets, len(group)), INIT[op], stacked.dtype).at[index]
        if op == "sum":
            reduced = at.add(stacked, mode="promise_in_bounds")
        elif op == "min":
            reduced = at.min(stacked, mode="promise_in_bounds")
        else:
            reduced = at.max(stacked, mode="promise_in_bounds")
        reduced = reduced.reshape(*lead, buckets, len(group))[..., 1:, :]
        for j, i in enumerate(group):
            out[i] = reduced[..., j]
    return tuple(out)


def use_windows(value: jax.Array, num_segments: int) -> bool:
    """Whether the windowed path applies: rows of at least two windows, and no device
    shares the token axis (inside ``shard_map``, local arrays; or one device). The XLA
    partitioner would move whole token rows to gather the mixed windows of a sharded
    axis, so a program that the partitioner may split keeps the compare-and-reduce."""
    length = value.shape[-1]
    if length < 2 * _window_size(length):
        return False
    split = _split(value)
    return split.explicit * split.free == 1


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def reduce_segments(
    ops: tuple[str, ...],
    num_segments: int,
    values: tuple[jax.Array, ...],
    segment_ids,
    plan: Plan | None,
) -> tuple[jax.Array, ...]:
    """Each ``[..., T]`` operand reduced by its op over each segment: ``[..., K]``.

    ``plan``: the windows of ``segment_ids`` (:func:`windows_plan`) when the caller
    promises contiguous segments and the row is long enough (:func:`use_windows`):
    the windowed path; None: the compare-and-reduce.
    """
    if plan is None:
        operands = compare_operands(ops, num_segments, values, segment_ids)
        return reduce_columns(ops, operands)
    return _windowed(ops, num_segments, values, plan)


def _reduce_segments_jvp(ops, num_segments, primals, tangents):
    values, segment_ids, plan = primals
    out = reduce_segments(ops, num_segments, values, segment_ids, plan)

    def sum_tangent(d):
        if plan is None:
            return plain_segment_sum(d, segment_ids, num_segments)
        return _window_segment_sum(d, plan, num_segments)

    def extreme(op, v):
        return plain_reduce(op, compare_operands((op,), num_segments, (v,), segment_ids)[0])

    return out, linear_jvp(ops, values, tangents[0], out, sum_tangent, extreme)


reduce_segments.defjvp(_reduce_segments_jvp, symbolic_zeros=True)
