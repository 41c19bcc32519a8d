"""Per-segment reductions of packed rows: several sequences share one ``[..., T]`` row.

In the packed layout (docs/semantics.md §10) an int ``segment_ids`` array ``[..., T]``
names the sequence of every token: ``1..K`` (``K = num_segments``, a static int)
are the sequences of a row and 0 is padding. A per-sequence value is then
``[..., K]`` (one per (row, segment)) instead of ``[...]`` (one per row).

* :func:`segment_reduce` is :meth:`offpolicy_jax._reduce.Rows.reduce` per segment:
  every column's sum / min / max over the tokens of each segment, ``[..., T] ->
  [..., K]``, all columns in few fused loops. Inside ``shard_map`` with a sharded
  token axis the ``[..., K]`` partial results are ``psum``-ed (``pmin``/``pmax``)
  over the token mesh axes, so a sequence may cross a shard boundary; only
  ``[..., K]``-sized values cross devices, never token data.
* :func:`segment_broadcast` is the way back, ``[..., K] -> [..., T]``: each token
  gets its segment's value (the gather), padding a fill value.
* :class:`Packed` is the layout object behind the seam of ``_reduce.Rows``: the
  correction pipeline, the losses and every rule reduce and broadcast through it,
  so they are all packed-aware without knowing it.

How, on one device (XLA:CPU; measured with ``python -m benchmarks.packing``, jax
0.10.2): a two-level *windowed* reduction. The row is cut into windows of ``W``
tokens (``W ≈ sqrt(T / 8)``, 16-64). Level 1 (:func:`_windowed`) reduces every
column per window with the one-sequence-per-row machinery of
:mod:`~offpolicy_jax._fusion` (the column's expression evaluated once, nothing
written out as ``[..., T]``, as many columns per loop as a row reduction). The few
windows across a boundary, one per sequence that ends inside a window, ``K`` a row at
most, are gathered (XLA computes the gathered columns' expressions at their
``K W`` tokens) and reduced again in two slots: the tokens with an even id and those
with an odd id. Level 2 scatters the window results (those of two ids left out), the
slot results and the ``T mod W`` tokens after the last window into the ``K``
segments. It is exact when no window holds two different even ids or two different
odd ids, and no sequence ends in two windows that hold two ids: true of the layout
of ``pack_sequences``, tunix and MaxText (each sequence one run of tokens, ids 1, 2,
3, ... in order, consecutive sequences of different parity, each longer than a
window but the last of a row), and of any order of such runs. The plan of the
windows (:func:`_plan`: each window's ids, the windows of two ids) is made once per
public call, from the ids alone.

Any other ids (the layout allows any id on any token) take the exact
*compare-and-reduce*: ``Σ_t [id_t = k] x_t`` for ``k = 1..K`` as
:mod:`~offpolicy_jax._fusion`'s fused variadic loop over ``[..., K, T]`` operands
that XLA never writes out, about ``K`` times the work of the unpacked reduction. It
is also the only path on other backends, for rows shorter than two windows, and
when the XLA partitioner may split the token axis. The choice is a ``cond`` on the
ids: :func:`dispatch` puts one around a whole public call (``compute_correction``,
``policy_loss_terms``), whose operands are the caller's inputs, compiling it twice;
a reduction outside such a call checks its own ids (a ``cond`` whose operands, the
columns, XLA then writes out). Under ``vmap`` the check covers the whole mapped
batch (:func:`_all`, a custom batching rule), so the ``cond`` stays a branch.

Under differentiation both branches of :func:`dispatch` are checkpointed with a
policy that keeps only reduction results (:func:`_keep_reductions`): the backward
recomputes the per-token values, as XLA's fusion does without a ``cond``, where the
``cond`` would otherwise write out every per-token residual the backward reads. The
fallback branch reduces in blocks (``_compare_reduce(lean=True)``), since a program
allocates its largest branch's scratch memory on every call.

Measured (``policy_loss`` forward + backward, mis.yaml, ``K = 8``, packed / padded
time per valid token): the compare-and-reduce alone 3.3-4.7; the windowed path 1.3-1.45
(it was 1.6-1.9 when every window was reduced in both slots, which doubled the
columns and so the fused loops, each re-reading the inputs). Alternatives measured
against the compare-and-reduce: a one-hot ``einsum`` 1.7-2.5x (XLA:CPU writes the
``[..., T, K]`` indicator), ``jax.ops.segment_sum`` over flattened (row, segment) ids
3-8x (a serial scatter-add over every token), one fused loop per (column, segment)
0.7-1.5x. The windows of two ids are listed without a cumulative sum or ``top_k``
(a quadratic ``reduce-window`` and a sort on XLA:CPU, 0.5 and 1.5 ms at ``[39,
18432]``). The gather back is a chain of ``K`` selects, fused into whatever
elementwise pass consumes it (``take_along_axis`` per token was 3x slower); on the
windowed path (:meth:`Packed.broadcast` after the check) two lookups per window and
two selects per token.

Gradients: a segment sum is linear, and its JVP is written as ``K`` plain sums of
the tangent (on the windowed path, the two-slot windowed sum), whose transpose is the
chain of selects (the two selects): the backward of a segment sum is the gather, one
elementwise pass, with nothing ``[..., K, T]`` stored.

Ids outside ``1..K`` (0, negative, too large) belong to no segment: they are
padding, whatever the mask says.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax import _fusion, _reduce, _validation
from offpolicy_jax._fusion import INIT as _INIT
from offpolicy_jax._reduce import _COLLECTIVE, Column, ColumnKey, MeshAxes, Rows


def check_segments(segment_ids, num_segments, shape: tuple[int, ...]) -> jax.Array | None:
    """Validates the packed-layout arguments; returns int32 ids, or None when unpacked.

    Args:
      segment_ids: int ``[..., T]`` (the shape of the per-token inputs), or None.
      num_segments: a positive Python int ``K`` (static), or None.
      shape: the per-token inputs' shape ``[..., T]``.

    Raises:
      ValueError / TypeError naming ``segment_ids`` or ``num_segments``.
    """
    if segment_ids is None and num_segments is None:
        return None
    if segment_ids is None:
        raise ValueError(
            "num_segments was given without segment_ids: pass segment_ids (int [..., T], "
            "0 = padding, 1..num_segments = the sequences of a row) or neither"
        )
    if num_segments is None:
        raise ValueError(
            "segment_ids was given without num_segments: pass num_segments, the static "
            "int K = the most sequences a row may hold (segment_ids take values 0..K)"
        )
    if isinstance(num_segments, (bool, np.bool_)) or not isinstance(
        num_segments, (int, np.integer)
    ):
        raise TypeError(
            "num_segments must be a static Python int (the most sequences a row may hold), "
            f"got {type(num_segments).__name__}; pass it as a static argument under jit"
        )
    if num_segments < 1:
        raise ValueError(f"num_segments must be >= 1, got {num_segments}")
    dtype = jnp.result_type(segment_ids)
    if not jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_:
        raise TypeError(
            f"segment_ids must be an integer array (0 = padding, 1..K = sequences), got dtype "
            f"{dtype}"
        )
    if tuple(np.shape(segment_ids)) != tuple(shape):
        raise ValueError(
            f"segment_ids has shape {tuple(np.shape(segment_ids))} but the per-token inputs "
            f"have shape {tuple(shape)}; segment_ids must be [..., T] alike"
        )
    _validation.check_int32_ids("segment_ids", segment_ids)
    _validation.check_segment_ids_at_most(segment_ids, int(num_segments))
    ids = jnp.asarray(segment_ids)
    if ids.dtype.itemsize > 4 or ids.dtype == jnp.uint32:
        # Traced wide ids (x64 on): out-of-range ones to padding before the cast can wrap them.
        ids = jnp.where((ids >= 1) & (ids <= num_segments), ids, 0)
    return ids.astype(jnp.int32)


def in_segment(segment_ids: jax.Array, num_segments: int) -> jax.Array:
    """``[..., T]`` bool: the token belongs to a segment ``1..K`` (not padding)."""
    return (segment_ids >= 1) & (segment_ids <= num_segments)


def _segment_axis(segment_ids: jax.Array, num_segments: int) -> jax.Array:
    """``[..., K, T]`` bool: ``hit[..., k − 1, t] = (id_t == k)``, built inside the loop."""
    segments = jnp.arange(1, num_segments + 1, dtype=segment_ids.dtype)
    return segment_ids[..., None, :] == segments[:, None]


def _plain_segment_sum(value: jax.Array, segment_ids: jax.Array, num_segments: int) -> jax.Array:
    """``K`` plain sums: linear in ``value``, and its transpose is :func:`segment_broadcast`."""
    return jnp.stack(
        [
            jnp.sum(jnp.where(segment_ids == k, value, 0.0), axis=-1)
            for k in range(1, num_segments + 1)
        ],
        axis=-1,
    )


def _compare_reduce(
    ops: tuple[str, ...],
    num_segments: int,
    values: tuple[jax.Array, ...],
    segment_ids,
    lean: bool = False,
) -> tuple[jax.Array, ...]:
    """The exact compare-and-reduce: ``K`` masked copies of every operand, one fused loop.

    ``lean``: the fallback branch of :func:`dispatch` on one CPU device. A program
    allocates its largest branch's scratch memory on every call, taken or not, and
    the fast loops' partial results (``K · T / 4`` per operand, all live at once:
    84 MB at ``[39, 18432]``, K = 8) would make the rarely taken branch set it.
    Reduced in blocks of :data:`_LEAN_BLOCK` tokens, the partial results are
    ``K · T / 64`` and this branch needs less scratch than the windowed one; it runs
    about 2x slower, only for ids the windowed path cannot take.
    """
    hit = _segment_axis(segment_ids, num_segments)
    operands = tuple(
        jnp.where(hit, v[..., None, :], _INIT[op]) for op, v in zip(ops, values, strict=True)
    )
    if not lean:
        return _fusion.reduce_columns(ops, operands)
    length = segment_ids.shape[-1]
    body = length - length % _LEAN_BLOCK
    lead = operands[0].shape[:-1]
    blocks = tuple(o[..., :body].reshape(*lead, body // _LEAN_BLOCK, _LEAN_BLOCK) for o in operands)
    partial = _fusion._variadic_reduce(ops, blocks)
    out = [_fusion.plain_reduce(op, p) for op, p in zip(ops, partial, strict=True)]
    if body < length:
        rest = _fusion._variadic_reduce(ops, tuple(o[..., body:] for o in operands))
        out = [_fusion._combine(op, a, b) for op, a, b in zip(ops, out, rest, strict=True)]
    return tuple(out)


_LEAN_BLOCK = 64


def _window_size(length: int) -> int:
    """The window ``W``: about ``sqrt(T / 8)``, which balances the ``2 T / W`` window
    results of the second level against segments shorter than a window (which send a
    call to the compare-and-reduce); a power of two between 16 and 64 (a multiple of
    ``_fusion._CHUNK``)."""
    best = math.sqrt(length / 8)
    return int(min(64, max(16, 2 ** round(math.log2(max(best, 1.0))))))


def _window_reduce(
    ops: tuple[str, ...], costs: tuple[int, ...], windows: tuple[jax.Array, ...]
) -> tuple[jax.Array, ...]:
    """Every ``[..., n, W]`` operand reduced over its windows, ``[..., n]``.

    :mod:`~offpolicy_jax._fusion`'s variadic loop (grouped by cost like a row
    reduction), each window viewed as ``[_CHUNK, W / _CHUNK]`` and reduced over its
    leading axis (the strided view of ``_fusion._chunked_reduce``), writes ``[..., n,
    W / _CHUNK]``; these are then combined by ``W / _CHUNK − 1`` elementwise ops, one
    fused pass (the library kernel that finishes a row reduction is 3-5x slower on
    so short a last axis).
    """
    chunk = _fusion._CHUNK
    lead = windows[0].shape[:-1]
    width = windows[0].shape[-1]
    out: list[jax.Array] = []
    for group in _fusion._loops(costs):
        group_ops = ops[group]
        strided = tuple(w.reshape(*lead, chunk, width // chunk) for w in windows[group])
        partial = _fusion._variadic_reduce(group_ops, strided, axis=-2)
        out += [_finish_windows(op, part) for op, part in zip(group_ops, partial, strict=True)]
    return tuple(out)


def _finish_windows(op: str, part: jax.Array) -> jax.Array:
    """A window's ``W / _CHUNK`` lane results combined, elementwise (XLA fuses the chain
    into the consumer: the second level's stack)."""
    acc = part[..., 0]
    for j in range(1, part.shape[-1]):
        acc = _fusion._combine(op, acc, part[..., j])
    return acc


class _Plan(NamedTuple):
    """Where each window's tokens go (ids only).

    Made once per public call (by :func:`dispatch`, outside its ``cond``) and read by
    every reduction and broadcast of the windowed branch, forward and backward.
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
    chunk = _fusion._CHUNK
    *lead, n, width = windows[0].shape
    strided = tuple(w.reshape(*lead, n, chunk, width // chunk) for w in windows)
    partial = _fusion._variadic_reduce(ops, strided, axis=-2)
    return list(_fusion._variadic_reduce(ops, partial, axis=-1))


def _plan(segment_ids: jax.Array, window: int, num_segments: int) -> _Plan:
    lead = segment_ids.shape[:-1]
    n = segment_ids.shape[-1] // window
    ids = segment_ids.astype(jnp.int32)
    inside = in_segment(ids, num_segments)
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
    ok = _all(one_each) & _all(jnp.sum(ends.astype(jnp.int32), axis=-1) <= 1)
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
    return _Plan(slot, even_hi, odd_hi, mixed, second_ids, ok)


def _windows_plan(segment_ids: jax.Array, num_segments: int) -> _Plan:
    return _plan(segment_ids, _window_size(segment_ids.shape[-1]), num_segments)


def _window_broadcast(values: jax.Array, segment_ids: jax.Array, plan: _Plan, fill) -> jax.Array:
    """:func:`segment_broadcast` when ``plan.ok``: two per-window lookups in the
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
    tail = _broadcast(values, segment_ids[..., body:], fill)
    return jnp.concatenate([tokens, tail], axis=-1)


def _window_segment_sum(value: jax.Array, plan: _Plan, num_segments: int) -> jax.Array:
    """``K`` per-segment sums when ``plan.ok`` (the tangent of a windowed sum): linear,
    and its transpose is :func:`_window_broadcast`'s two selects per token."""
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
    costs: tuple[int, ...],
    num_segments: int,
    values: tuple[jax.Array, ...],
    plan: _Plan,
) -> tuple[jax.Array, ...]:
    """Two-level per-segment reduction, exact when ``plan.ok``.

    Level 1: every operand reduced over windows of ``W`` tokens by the fast
    one-sequence-per-row loop on ``[..., T / W, W]`` (:func:`_window_reduce`: as
    many columns per loop as a row reduction, each column's expression evaluated
    once, nothing written out as ``[..., T]``). The windows of a row that hold two
    sequences (one per boundary, ``K`` slots) are gathered, ``[..., K, W]``, and
    reduced again in two slots, their tokens with an even id and those with an odd
    id: consecutive sequences have ids of different parity (``plan.ok`` checks it;
    padding, id 0, adds nothing). Level 2: a scatter of the ``T / W`` window
    results (those of two ids dropped), the ``2 K`` slot results and the ``T mod W``
    tokens after the last window into the ``K`` segments.
    """
    lead = plan.even_ids.shape[:-1]
    n = plan.even_ids.shape[-1]
    body = n * plan.window
    shape = (*lead, n, plan.window)
    whole = _window_reduce(ops, costs, tuple(v[..., :body].reshape(shape) for v in values))
    odd = _gather_windows(plan.odd.reshape(shape), plan.mixed)
    slot_ops, slot_costs, slots = [], [], []
    for op, cost, v in zip(ops, costs, values, strict=True):
        mixed = _gather_windows(v[..., :body].reshape(shape), plan.mixed)
        slot_ops += [op, op]
        slot_costs += [cost, 1]
        slots += [jnp.where(odd, _INIT[op], mixed), jnp.where(odd, mixed, _INIT[op])]
    split = _window_reduce(tuple(slot_ops), tuple(slot_costs), tuple(slots))
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
        at = jnp.full((rows * buckets, len(group)), _INIT[op], stacked.dtype).at[index]
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


def _use_windows(value: jax.Array, num_segments: int) -> bool:
    """The windowed path runs on CPU when no device shares the token axis: inside
    ``shard_map`` (local arrays) or on one device. The XLA partitioner would move
    whole token rows to gather the mixed windows of a sharded axis, so a program
    that the partitioner may split keeps the compare-and-reduce."""
    length = value.shape[-1]
    if jax.default_backend() != "cpu" or length < 2 * _window_size(length):
        return False
    split = _fusion._split(value)
    return split.explicit * split.free == 1


@jax.custom_batching.custom_vmap
def _all(flags: jax.Array) -> jax.Array:
    """``all(flags)``; under ``vmap`` also over the mapped axis, so that a ``cond`` on
    it stays a branch (a batched predicate would turn it into a select of both)."""
    return jnp.all(flags)


@_all.def_vmap
def _all_vmap(axis_size, in_batched, flags):
    del axis_size, in_batched
    return jnp.all(flags), False


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3))
def _segment_fused(
    ops: tuple[str, ...],
    costs: tuple[int, ...],
    num_segments: int,
    contiguous: bool | None,
    values: tuple[jax.Array, ...],
    segment_ids,
    plan: _Plan | None,
) -> tuple[jax.Array, ...]:
    """Each ``[..., T]`` operand reduced by its op over each segment: ``[..., K]``.

    ``contiguous``: True when the caller has checked that the ids suit the windowed
    path (:func:`contiguous_rows`; :func:`dispatch` passes its ``plan``, made here when
    None), False to compare, None to check here (a ``cond``: see the module docstring
    for its price).
    """
    if contiguous is False:  # dispatch's fallback branch
        return _compare_reduce(ops, num_segments, values, segment_ids, lean=True)
    if not _use_windows(values[0], num_segments):
        return _compare_reduce(ops, num_segments, values, segment_ids)
    if plan is None:
        plan = _windows_plan(segment_ids, num_segments)
    if contiguous:
        return _windowed(ops, costs, num_segments, values, plan)
    return jax.lax.cond(
        plan.ok,
        lambda v, i: _windowed(ops, costs, num_segments, v, plan),
        lambda v, i: _compare_reduce(ops, num_segments, v, i),
        values,
        segment_ids,
    )


def _segment_fused_jvp(ops, costs, num_segments, contiguous, primals, tangents):
    values, segment_ids, plan = primals
    dvalues, _, _ = tangents
    out = _segment_fused(ops, costs, num_segments, contiguous, values, segment_ids, plan)
    if not (contiguous and _use_windows(values[0], num_segments)):
        plan = None
    elif plan is None:
        plan = _windows_plan(segment_ids, num_segments)
    dout = []
    for op, value, dvalue, primal in zip(ops, values, dvalues, out, strict=True):
        if isinstance(dvalue, jax.custom_derivatives.SymbolicZero):
            dout.append(jnp.zeros_like(primal))
        elif op == "sum" and plan is not None:
            dout.append(_window_segment_sum(dvalue, plan, num_segments))
        elif op == "sum":
            dout.append(_plain_segment_sum(dvalue, segment_ids, num_segments))
        else:  # min / max: JAX's own rule (the library never differentiates them)
            hit = _segment_axis(segment_ids, num_segments)

            def plain(v, op=op, hit=hit):
                masked = jnp.where(hit, v[..., None, :], _INIT[op])
                return _fusion.plain_reduce(op, masked)

            dout.append(jax.jvp(plain, (value,), (dvalue,))[1])
    return out, tuple(dout)


_segment_fused.defjvp(_segment_fused_jvp, symbolic_zeros=True)


def segment_reduce(
    columns: Mapping[ColumnKey, Column],
    segment_ids: jax.Array,
    num_segments: int,
    axes: MeshAxes,
    contiguous: bool | None = None,
    plan: _Plan | None = None,
) -> dict[ColumnKey, jax.Array]:
    """Every column's per-segment reduction, ``[..., T] -> [..., K]``, computed together.

    ``out[..., k − 1] = Σ_t [id_t = k] x_t p_t`` (or the min / max over the tokens
    with ``id_t = k`` and ``p_t > 0``; ``±inf`` for an empty segment). Values are
    selected with ``where`` before they are weighted, so NaN/inf outside a
    population never reaches a result. Populations must be 0 outside the segments
    ``1..K`` (padding): every population of the library is, since the public calls
    restrict their masks with :func:`only_segments`. Sums are differentiable, and
    their backward is :func:`segment_broadcast` of the cotangent.

    Inside ``shard_map`` with a sharded token axis the ``[..., K]`` partial results
    are combined over ``axes.token``: a segment may span several shards.

    Args:
      columns: name -> :class:`~offpolicy_jax._reduce.Column` (``[..., T]``
        populations and values).
      segment_ids: int ``[..., T]``: 1..K name the sequences of a row, anything
        else is padding.
      num_segments: ``K``, static.
      axes: mesh axes to combine over inside ``shard_map``.
      contiguous: static; True: the ids are known (by :func:`dispatch`) to suit the
        windowed path (:func:`contiguous_rows`), which runs without a check;
        False: the compare-and-reduce; None: the windowed path, checked by a ``cond``.
      plan: the windows of these ids, when the caller has made them (:func:`dispatch`).

    Returns:
      name -> ``[..., K]`` per-segment result.
    """
    if not columns:
        return {}
    names = list(columns)
    shape = jnp.broadcast_shapes(
        segment_ids.shape,
        *(jnp.shape(c.population) for c in columns.values()),
        *(jnp.shape(c.value) for c in columns.values()),
    )
    ops = tuple(columns[n].op for n in names)
    costs = tuple(columns[n].cost for n in names)
    values = tuple(_reduce._operand(columns[n], shape) for n in names)
    ids = jnp.broadcast_to(segment_ids, shape)
    results = dict(
        zip(
            names,
            _segment_fused(ops, costs, num_segments, contiguous, values, ids, plan),
            strict=True,
        )
    )
    if axes.token:
        for op, collective in _COLLECTIVE.items():
            same = [n for n in names if columns[n].op == op]
            if same:  # a list: column names may be of mixed types (no sorted pytree keys)
                combined = collective([results[n] for n in same], axes.token)
                results.update(zip(same, combined, strict=True))
    return results


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _broadcast(values: jax.Array, segment_ids: jax.Array, fill) -> jax.Array:
    out = jnp.full(segment_ids.shape, fill, values.dtype)
    for k in range(values.shape[-1]):
        out = jnp.where(segment_ids == k + 1, values[..., k : k + 1], out)
    return out


@_broadcast.defjvp
def _broadcast_jvp(fill, primals, tangents):
    values, segment_ids = primals
    return _broadcast(values, segment_ids, fill), _broadcast(tangents[0], segment_ids, 0)


def segment_broadcast(values: jax.Array, segment_ids: jax.Array, fill=0.0) -> jax.Array:
    """Each token's segment value: ``[..., K] -> [..., T]`` (the gather), ``fill`` on padding.

    ``out[..., t] = values[..., id_t − 1]`` for ``1 ≤ id_t ≤ K``, else ``fill``.
    Differentiable in ``values`` (its transpose is a per-segment sum).

    Args:
      values: ``[..., K]`` one value per (row, segment); any dtype.
      segment_ids: int ``[..., T]``.
      fill: the value of padding tokens.
    """
    if values.dtype == jnp.bool_:
        return _broadcast(values.astype(jnp.int8), segment_ids, int(bool(fill))).astype(bool)
    return _broadcast(values, segment_ids, fill)


def segment_any(
    condition: jax.Array,
    population: jax.Array,
    segment_ids: jax.Array,
    num_segments: int,
    axes: MeshAxes,
) -> jax.Array:
    """Per-segment ``any(condition)`` over the population, ``[..., T] -> [..., K]`` bool."""
    hits = segment_reduce(
        {"hits": _reduce.count_where(condition, population)},
        segment_ids,
        num_segments,
        axes,
    )["hits"]
    return hits > 0


@dataclasses.dataclass(frozen=True, eq=False)
class Packed(Rows):
    """The packed layout: several sequences per row, named by ``segment_ids``.

    The same seam as :class:`~offpolicy_jax._reduce.Rows`, with per-sequence arrays
    ``[..., K]`` (one value per (row, segment)) instead of ``[...]``: :meth:`reduce`
    is :func:`segment_reduce`, :meth:`broadcast` is :func:`segment_broadcast`, and
    ``batch_means`` (inherited) sums the ``[..., K]`` terms like any other axis. A
    segment that a row does not use is an empty sequence: every mean leaves it out.

    Attributes:
      axes: mesh axes to combine over inside ``shard_map``.
      segment_ids: int32 ``[..., T]``; 1..K name the sequences of a row.
      num_segments: ``K``, static.
      contiguous: static, see :func:`segment_reduce` (set by :func:`dispatch`).
      plan: the windows of ``segment_ids`` (set by :func:`dispatch` with
        ``contiguous=True``), made once for every reduction and broadcast.
    """

    # A default only because the inherited ``axes`` has one; :func:`layout` always
    # passes validated ids (see ``ids``).
    segment_ids: jax.Array | None = None
    num_segments: int = 1
    contiguous: bool | None = None
    plan: _Plan | None = None

    @property
    def ids(self) -> jax.Array:
        """``segment_ids``, which a packed layout cannot lack."""
        if self.segment_ids is None:
            raise TypeError("Packed layout constructed without segment_ids")
        return self.segment_ids

    def reduce_columns(self, columns: Mapping[ColumnKey, Column]) -> dict[ColumnKey, jax.Array]:
        """Every column's per-segment reduction, ``[..., T] -> [..., K]`` (see
        :func:`segment_reduce`)."""
        return segment_reduce(
            columns,
            self.ids,
            self.num_segments,
            self.axes,
            contiguous=self.contiguous,
            plan=self.plan,
        )

    def broadcast(self, per_seq: jax.Array) -> jax.Array:
        """A per-segment value ``[..., K]`` on every token of its segment, ``[..., T]``
        (0 / False on padding)."""
        values = jnp.asarray(per_seq)
        if not (self.contiguous and _use_windows(self.ids, self.num_segments)):
            return segment_broadcast(values, self.ids)
        plan = self.plan if self.plan is not None else _windows_plan(self.ids, self.num_segments)
        if values.dtype == jnp.bool_:
            return _window_broadcast(values.astype(jnp.int8), self.ids, plan, 0).astype(bool)
        return _window_broadcast(values, self.ids, plan, 0.0)


def layout(axes: MeshAxes, segment_ids, num_segments, shape: tuple[int, ...]) -> Rows:
    """The layout of a public call: :class:`Rows` without ``segment_ids``, else
    :class:`Packed` (the arguments validated, errors naming them)."""
    ids = check_segments(segment_ids, num_segments, shape)
    if ids is None:
        return Rows(axes)
    contiguous, plan = _CONTIGUOUS.get()
    return Packed(axes, ids, int(num_segments), contiguous, plan)


# Set while :func:`dispatch` traces one of its two branches: every packed layout
# built meanwhile (by :func:`layout`) takes that branch's path (and the windowed
# branch, the plan that dispatch made outside its cond).
_CONTIGUOUS: contextvars.ContextVar[tuple[bool | None, _Plan | None]] = contextvars.ContextVar(
    "offpolicy_jax_segments_contiguous", default=(None, None)
)


def contiguous_rows(
    segment_ids: jax.Array, num_segments: int, axes: MeshAxes = MeshAxes()
) -> jax.Array:
    """Bool scalar: the windowed path is exact for these ids (no window holds two
    different even ids or two different odd ids, and no sequence ends in two windows
    that hold two ids, as in the layout of :func:`~offpolicy_jax.pack_sequences`);
    True where the windowed path does not apply. Under ``vmap``, over the whole
    mapped batch; inside ``shard_map``, over every device of ``axes`` (all must take
    the same branch of a :func:`dispatch` whose branches hold collectives)."""
    ids = jnp.asarray(segment_ids)
    ok = _windows_plan(ids, num_segments).ok if _use_windows(ids, num_segments) else True
    return _everywhere(jnp.asarray(ok), axes)


def _everywhere(ok: jax.Array, axes: MeshAxes) -> jax.Array:
    names = axes.batch + axes.token
    if names:
        ok = jax.lax.pmin(ok.astype(jnp.int32), names) > 0
    return ok


def dispatch(fn, segment_ids, num_segments, *args, axes: MeshAxes = MeshAxes()):
    """``fn(*args)`` traced twice, under one ``cond`` on :func:`contiguous_rows`:
    with the windowed path unchecked, and with the compare-and-reduce.

    A check inside each reduction (``contiguous=None``) costs a ``cond`` whose
    operands are every column, written out as ``[..., T]`` arrays; here the operands
    are ``args``, the caller's inputs, and both branches fuse as usual. Compiles
    ``fn`` twice. Without ``segment_ids`` (None), or where only the
    compare-and-reduce applies (:func:`_use_windows`), simply ``fn(*args)``.

    Args:
      fn: a function of ``args`` whose packed layouts (:func:`layout`) are built
        while it is traced.
      segment_ids: int ``[..., T]`` or None.
      num_segments: static ``K``.
      args: ``fn``'s arguments (a pytree of arrays).
      axes: the mesh axes of a call inside ``shard_map``.
    """
    if segment_ids is None or not _use_windows(jnp.asarray(segment_ids), num_segments):
        return fn(*args)  # one path only: nothing to choose

    # The windows are made once, outside the cond: both the check and every
    # reduction and broadcast of the windowed branch (forward and backward) read them.
    plan = _windows_plan(jnp.asarray(segment_ids).astype(jnp.int32), num_segments)

    def branch(flag):
        def run(*a):
            token = _CONTIGUOUS.set((flag, plan if flag else None))
            try:
                return fn(*a)
            finally:
                _CONTIGUOUS.reset(token)

        return run

    ok = _everywhere(plan.ok, axes)
    windowed, exact = (
        jax.checkpoint(branch(flag), policy=_keep_reductions) for flag in (True, False)
    )
    return jax.lax.cond(ok, windowed, exact, *args)


_REDUCTION_FACTOR = 16


def _keep_reductions(prim, *avals, **params) -> bool:
    """The checkpoint policy of :func:`dispatch`'s branches: under differentiation
    they keep for the backward pass only the results of reductions (outputs at
    least ``_REDUCTION_FACTOR`` times smaller than their inputs), and the backward
    recomputes every per-token value from the inputs, as XLA's fusion does anyway
    without a ``cond``. Without it every per-token residual the backward reads
    leaves the ``cond`` as an output (26 ``[..., T]`` arrays for ``policy_loss``),
    written out on every call: packed steps were 1.25x (64 x 2048) to 2.3x (256 x
    4096) slower, the latter by page faults on a scratch buffer grown past glibc's
    largest heap allocation (32 MiB).
    """
    name = prim.name
    if name == "custom_jvp_call":  # the fused reductions (_fusion, _segment_fused)
        jaxpr = params["call_jaxpr"]
        return _elements(jaxpr.out_avals) * _REDUCTION_FACTOR <= _elements(jaxpr.in_avals)
    if name in ("reduce_sum", "reduce_max", "reduce_min", "reduce_and", "reduce_or"):
        reduced = math.prod(avals[0].shape[axis] for axis in params["axes"])
        return reduced >= _REDUCTION_FACTOR
    return False


def _elements(avals) -> int:
    return sum(math.prod(getattr(a, "shape", ())) for a in avals)


def only_segments(layout: Rows, mask: jax.Array, raw=None) -> jax.Array:
    """The mask without padding: 0 outside the segments ``1..K`` of a packed layout
    (padding is never trained on, whatever the mask says); unchanged otherwise.

    ``mask`` is the float mask; ``raw``, when given, the user's mask before the
    conversion. A bool ``raw`` is restricted as a bool: ``(raw & inside)`` converted
    stays a 0/1 value that XLA turns ``x * mask`` into a select of and fuses into every
    pass, where a float ``where`` would be stored as its own ``[..., T]`` array and
    multiplied in every column (enough extra work per token to push the first pass's
    fused loop out of vector code: packed steps were 2x slower).
    """
    if not isinstance(layout, Packed):
        return mask
    inside = in_segment(layout.ids, layout.num_segments)
    if raw is not None and jnp.result_type(raw) == jnp.bool_:
        return (jnp.asarray(raw) & inside).astype(jnp.float32)
    return jnp.where(inside, mask, 0.0)


def segment_arguments(layout: Rows) -> dict:
    """``segment_ids`` / ``num_segments`` keyword arguments for a user correction
    callable, or none for the one-sequence-per-row layout."""
    if not isinstance(layout, Packed):
        return {}
    return {"segment_ids": layout.segment_ids, "num_segments": layout.num_segments}


__all__ = [
    "Packed",
    "check_segments",
    "contiguous_rows",
    "dispatch",
    "in_segment",
    "layout",
    "only_segments",
    "segment_any",
    "segment_arguments",
    "segment_broadcast",
    "segment_reduce",
]
