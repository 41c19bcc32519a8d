"""How the packed reductions run, the same on every backend: O(T) per pass, a few ops.

Packed rows hold several sequences, named by ``segment_ids`` (1..K; anything else is
padding). Every token has one slot in its row's table (:func:`token_slots`: its chunk
of :data:`CHUNK` tokens, its segment), computed once from the ids and used by every
scatter of the program, forward and backward. Each row is scattered and gathered on
its own (batched over the leading axes), so that under ``jit`` the XLA partitioner
keeps a sharded batch axis local: a flat table over all rows would be replicated and
all-reduced.

* Reductions (:func:`reduce_segments`): the columns of a pass stacked ``[..., T, n]`` and
  scattered together, one ``segment_sum`` for every sum and one ``segment_min`` for
  every min and max (``max x = −min(−x)``, exact), then reduced over the chunks as a
  tree. A scatter costs about one update per token and column, whatever ``K`` and
  whatever the layout of the ids, so a pass costs about what the padded rows' stacked
  reductions cost; a scatter per column (or per op) would walk the tokens again.
* The way back (:func:`gather_broadcast`), ``[..., K] -> [..., T]``: one gather of the
  tokens' ids, a computation of its own whose result every reader shares.
* Gradients (custom JVPs; forward-mode tangents are exact, reverse mode is what they
  are written for). The transpose of a per-segment sum broadcasts its cotangent to
  the tokens, inside the backward's elementwise pass over them: there ``K`` selects on
  the ids (up to :data:`SELECT_MAX` segments) fuse and stay vectorized, where a gather
  fused into that pass reads one token at a time and slows all of it. So a sum's
  tangent is written as ``K`` masked sums, whose transpose JAX takes to exactly those
  selects. The transpose of a broadcast is a per-segment sum: its tangent is written
  as a gather at the tokens' slots of the (chunk, segment) table, whose transpose is
  the chunked scatter-add (as exact as the forward's sums).
  Nothing ``[..., K, T]``-sized is ever built.

Arrays sharded in their types (``jit`` with ``NamedSharding`` on an
``AxisType.Explicit`` mesh) are reduced and broadcast on each device's block, in a
``shard_map`` over their own sharding; only ``[..., K]`` partial results cross
devices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from offpolicy_jax._src.reduction.plain import linear_jvp, plain_reduce

# Per-segment sums are taken in chunks of this many tokens (one scatter-add of every
# token into its (chunk, segment) slot), then the chunks are summed as a tree: the
# sequential accumulation of a scatter stays short, so a segment's sum is as close to
# its exact value as a plain ``jnp.sum`` over a row.
CHUNK = 256

# Up to this many segments a row, the cotangent of a per-segment sum reaches its tokens
# through K selects (elementwise: they fuse into the backward's pass over the tokens
# and stay vectorized on every backend); past it through one gather, whose cost does
# not grow with K.
SELECT_MAX = 64

_IN_BOUNDS = jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS


def _chunks(length: int) -> int:
    return max(1, -(-length // CHUNK))


def token_slots(segment_ids: jax.Array, num_segments: int) -> jax.Array:
    """Each token's slot in its row's table of ``chunks · (K + 1)`` slots, ``[..., T]``.

    A row's tokens go to the slots of their (chunk of :data:`CHUNK` tokens, segment),
    slot 0 of a chunk for padding (any id outside ``1..K``). The same expression for
    every scatter of a program, so it is computed once.
    """
    inside = (segment_ids >= 1) & (segment_ids <= num_segments)
    chunk = jax.lax.broadcasted_iota(jnp.int32, segment_ids.shape, segment_ids.ndim - 1) // CHUNK
    return jnp.where(inside, segment_ids, 0) + chunk * (num_segments + 1)


def _over_rows(fn: Callable, batch_dims: int) -> Callable:
    """``fn`` of one row, mapped over ``batch_dims`` leading axes (a batched scatter or
    gather: each row independent, so a sharded batch axis stays local)."""
    for _ in range(batch_dims):
        fn = jax.vmap(fn)
    return fn


def _scatter(kind: str, num_segments: int, stacked: jax.Array, segment_ids: jax.Array):
    """``[..., T, n]`` columns scattered into their tokens' slots, then reduced over the
    chunks (a tree): ``[..., K, n]``. ``kind`` is ``"sum"`` or ``"min"``."""
    length = segment_ids.shape[-1]
    size = _chunks(length) * (num_segments + 1)
    scatter = jax.ops.segment_sum if kind == "sum" else jax.ops.segment_min

    def one_row(v, s):
        return scatter(v, s, num_segments=size, mode=_IN_BOUNDS)

    slots = token_slots(segment_ids, num_segments)
    out = _over_rows(one_row, segment_ids.ndim - 1)(stacked, slots)
    out = out.reshape(*out.shape[:-2], _chunks(length), num_segments + 1, stacked.shape[-1])
    return plain_reduce(kind, jnp.moveaxis(out, -3, -1))[..., 1:, :]


def _scatter_columns(
    ops: tuple[str, ...], num_segments: int, values: tuple[jax.Array, ...], segment_ids
) -> tuple[jax.Array, ...]:
    """One scatter-add of every sum and one scatter-min of every min and max (``max x =
    −min(−x)``, exact: the identities ``±inf`` swap with the sign), ``[..., K]`` each."""
    results: list = [None] * len(values)
    sums = [i for i, op in enumerate(ops) if op == "sum"]
    if sums:
        stacked = jnp.stack([values[i] for i in sums], axis=-1)
        out = _scatter("sum", num_segments, stacked, segment_ids)
        for j, i in enumerate(sums):
            results[i] = out[..., j]
    extremes = [i for i, op in enumerate(ops) if op != "sum"]
    if extremes:
        signed = [values[i] if ops[i] == "min" else -values[i] for i in extremes]
        out = _scatter("min", num_segments, jnp.stack(signed, axis=-1), segment_ids)
        for j, i in enumerate(extremes):
            results[i] = out[..., j] if ops[i] == "min" else -out[..., j]
    return tuple(results)


def _masked_sums(value: jax.Array, segment_ids: jax.Array, num_segments: int) -> jax.Array:
    """``[..., T] -> [..., K]`` as ``K`` masked sums: the tangent of a per-segment sum,
    written so that its transpose, the broadcast of the cotangent, is ``K`` selects
    (exact: each token takes its own segment's value, the others add zeros)."""
    if num_segments > SELECT_MAX:
        return _scatter("sum", num_segments, value[..., None], segment_ids)[..., 0]
    return jnp.stack(
        [
            jnp.sum(jnp.where(segment_ids == k, value, 0), axis=-1)
            for k in range(1, num_segments + 1)
        ],
        axis=-1,
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _reduce_local(
    ops: tuple[str, ...], num_segments: int, values: tuple[jax.Array, ...], segment_ids
) -> tuple[jax.Array, ...]:
    """:func:`reduce_segments` of arrays on one device (or sharded by the partitioner)."""
    return _scatter_columns(ops, num_segments, values, segment_ids)


def _reduce_local_jvp(ops, num_segments, primals, tangents):
    (values, segment_ids), (dvalues, _) = primals, tangents
    out = _reduce_local(ops, num_segments, values, segment_ids)

    def reduce_one(op: str, value: jax.Array) -> jax.Array:
        return _scatter_columns((op,), num_segments, (value,), segment_ids)[0]

    def sum_tangent(dvalue: jax.Array) -> jax.Array:
        return _masked_sums(dvalue, segment_ids, num_segments)

    return out, linear_jvp(ops, values, dvalues, out, sum_tangent, reduce_one)


_reduce_local.defjvp(_reduce_local_jvp, symbolic_zeros=True)


def _gather(values: jax.Array, segment_ids: jax.Array, fill) -> jax.Array:
    """``[..., K] -> [..., T]`` as one gather a row from ``K + 1`` values, ``fill`` in
    slot 0."""
    num_segments = values.shape[-1]
    fills = jnp.full((*values.shape[:-1], 1), fill, values.dtype)
    table = jnp.concatenate([fills, values], axis=-1)
    inside = (segment_ids >= 1) & (segment_ids <= num_segments)
    index = jnp.where(inside, segment_ids, 0)

    def one_row(t, i):
        return t.at[i].get(mode="promise_in_bounds")

    return _over_rows(one_row, segment_ids.ndim - 1)(table, index)


def _chunked_gather(values: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """``[..., K] -> [..., T]``, 0 on padding, read at the tokens' :func:`token_slots`:
    the tangent of a broadcast, whose transpose is the chunked scatter-add of
    :func:`_scatter` (a sum as exact as :data:`CHUNK` promises)."""
    num_segments, length = values.shape[-1], segment_ids.shape[-1]
    table = jnp.pad(values, [(0, 0)] * (values.ndim - 1) + [(1, 0)])
    table = jnp.broadcast_to(
        table[..., None, :], (*values.shape[:-1], _chunks(length), num_segments + 1)
    ).reshape(*values.shape[:-1], _chunks(length) * (num_segments + 1))

    def one_row(t, i):
        return t.at[i].get(mode="promise_in_bounds")

    slots = token_slots(segment_ids, num_segments)
    return _over_rows(one_row, segment_ids.ndim - 1)(table, slots)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _broadcast_local(values: jax.Array, segment_ids: jax.Array, fill) -> jax.Array:
    """:func:`gather_broadcast` of arrays on one device, differentiable in ``values``."""
    return _gather(values, segment_ids, fill)


@_broadcast_local.defjvp
def _broadcast_local_jvp(fill, primals, tangents):
    (values, segment_ids), (dvalues, _) = primals, tangents
    out = _broadcast_local(values, segment_ids, fill)
    return out, _chunked_gather(dvalues, segment_ids)


# --- arrays sharded in their types ---------------------------------------------------


def _explicit_spec(x: jax.Array) -> PartitionSpec | None:
    """The ``PartitionSpec`` in ``x``'s type where it shards an axis (``jit`` with
    ``NamedSharding`` on an ``AxisType.Explicit`` mesh), else None."""
    try:
        spec = tuple(jax.typeof(x).sharding.spec)
    except AttributeError:
        return None
    spec = (spec + (None,) * x.ndim)[: x.ndim]
    return PartitionSpec(*spec) if any(e is not None for e in spec) else None


def _mesh_names(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _on_shards(fn: Callable, args: tuple, in_specs: tuple, out_specs, spec: PartitionSpec):
    """``fn(*local_args)`` in a ``shard_map`` manual over the mesh axes of ``spec`` (the
    arrays' own sharding): an explicitly sharded scatter or gather has no unambiguous
    output sharding, while each device's block of rows and tokens is a plain one."""
    axes = {name for entry in spec for name in _mesh_names(entry)}
    mapped = jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=axes)
    return mapped(*args)


_COLLECTIVE = {"sum": jax.lax.psum, "min": jax.lax.pmin, "max": jax.lax.pmax}


def reduce_segments(
    ops: tuple[str, ...], num_segments: int, values: tuple[jax.Array, ...], segment_ids
) -> tuple[jax.Array, ...]:
    """Each ``[..., T]`` operand reduced by its op over each segment ``1..K``: ``[..., K]``.

    One scatter-add of every sum and one scatter-min of every min and max, O(T) work
    whatever ``K``; tokens with an id outside ``1..K`` go to a slot that is dropped.
    Sums are linear (the transpose is the broadcast of the cotangent); an empty
    segment gives the op's identity (0, ``+inf``, ``−inf``). Arrays sharded in their
    types are reduced on each device's block, and the ``[..., K]`` partial results
    combined over the token axis's mesh axes.
    """
    spec = next(filter(None, map(_explicit_spec, (segment_ids, *values))), None)
    if spec is None:
        return _reduce_local(ops, num_segments, values, segment_ids)
    token_axes = _mesh_names(spec[-1])

    def local(ids, *vals):
        out = _reduce_local(ops, num_segments, vals, ids)
        if not token_axes:
            return out
        return tuple(_COLLECTIVE[op](r, token_axes) for op, r in zip(ops, out, strict=True))

    per_segment = PartitionSpec(*spec[:-1], None)
    return _on_shards(
        local,
        (segment_ids, *values),
        (spec,) * (len(values) + 1),
        (per_segment,) * len(values),
        spec,
    )


def _broadcast(values: jax.Array, segment_ids: jax.Array, fill) -> jax.Array:
    if jnp.issubdtype(values.dtype, jnp.inexact):
        return _broadcast_local(values, segment_ids, fill)
    return _gather(values, segment_ids, fill)  # nothing to differentiate


def gather_broadcast(values: jax.Array, segment_ids: jax.Array, fill) -> jax.Array:
    """``[..., K] -> [..., T]``: each token its segment's value, ``fill`` on tokens
    outside ``1..K``. Linear in ``values``: its transpose is a per-segment sum."""
    num_segments = values.shape[-1]
    lead = jnp.broadcast_shapes(values.shape[:-1], segment_ids.shape[:-1])
    values = jnp.broadcast_to(values, (*lead, num_segments))
    segment_ids = jnp.broadcast_to(segment_ids, (*lead, segment_ids.shape[-1]))
    ids_spec, values_spec = _explicit_spec(segment_ids), _explicit_spec(values)
    if ids_spec is None and values_spec is None:
        return _broadcast(values, segment_ids, fill)
    lead = tuple(ids_spec or values_spec)[:-1]  # type: ignore[arg-type]
    token_spec = PartitionSpec(*lead, None if ids_spec is None else ids_spec[-1])
    per_segment = PartitionSpec(*lead, None)
    return _on_shards(
        lambda v, i: _broadcast(v, i, fill),
        (values, segment_ids),
        (per_segment, token_spec),
        token_spec,
        token_spec,
    )
