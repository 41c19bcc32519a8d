"""How the reductions run, the same on every backend.

* One sequence per row (:func:`reduce_columns`): the columns stacked by kind and
  reduced over the token axis, one ``jnp.sum`` for the sums and one ``jnp.min`` for the
  minima and maxima of each shape.
* Packed rows (:func:`reduce_segments`): one scatter per op over the tokens
  (``jax.ops.segment_sum`` / ``segment_min`` / ``segment_max``), O(T) work whatever the
  number of segments ``K``; the way back (:func:`gather_broadcast`) is one gather.

Gradients: a sum is linear, so its JVP is written as the plain sum of the tangents
(:func:`linear_jvp`); reverse mode transposes that into a broadcast, and the whole
backward of a reduction is one elementwise pass over the inputs, with nothing
``[..., T]`` stored from the forward. A per-segment sum is a scatter-add, whose
transpose is the gather of the cotangent. Min/max take JAX's own rule (the library
never differentiates them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from offpolicy_jax._src.reduction.columns import INIT

_FINISH = {"sum": jnp.sum, "min": jnp.min, "max": jnp.max}


def plain_reduce(op: str, value: jax.Array) -> jax.Array:
    """One reduction over the last axis (``initial``: ``T = 0`` is fine too)."""
    return _FINISH[op](value, axis=-1, initial=INIT[op])


def linear_jvp(
    ops: tuple[str, ...],
    values: tuple[jax.Array, ...],
    dvalues: tuple,
    out: tuple[jax.Array, ...],
    sum_tangent: Callable[[jax.Array], jax.Array],
    reduce_one: Callable[[str, jax.Array], jax.Array],
) -> tuple[jax.Array, ...]:
    """The tangents of reductions ``out`` of ``values``: ``sum_tangent(dvalue)`` for a
    sum (linear: its transpose is the backward's one elementwise pass), JAX's own rule
    of ``reduce_one(op, value)`` for min/max, zeros for symbolic-zero tangents."""
    dout = []
    for op, value, dvalue, primal in zip(ops, values, dvalues, out, strict=True):
        if isinstance(dvalue, jax.custom_derivatives.SymbolicZero):
            dout.append(jnp.zeros_like(primal))
        elif op == "sum":
            dout.append(sum_tangent(dvalue))
        else:
            dout.append(jax.jvp(functools.partial(reduce_one, op), (value,), (dvalue,))[1])
    return tuple(dout)


STACK_LIMIT = 8
"""The most operands stacked into one reduction. XLA:CPU fuses a ``concatenate`` of at
most 8 operands into the kernel that makes them; a 9th leaves every operand a kernel of
its own and the stack a copy of all of them, one more pass over every operand."""


def _reduce_together(ops: tuple[str, ...], values: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Operands of one shape and dtype stacked, then reduced over their last axis in one
    reduction per kind: every sum in one ``jnp.sum``, every min and max in one ``jnp.min``
    (``max x = −min(−x)``, exact; the identities ``±inf`` swap with the sign). More than
    :data:`STACK_LIMIT` operands go in near-equal stacks of at most that many."""
    if len(values) > STACK_LIMIT:
        stacks = -(-len(values) // STACK_LIMIT)
        size = -(-len(values) // stacks)
        return tuple(
            r
            for at in range(0, len(values), size)
            for r in _reduce_together(ops[at : at + size], values[at : at + size])
        )
    if len(values) == 1:
        return (plain_reduce(ops[0], values[0]),)
    if all(op == "sum" for op in ops):
        out = plain_reduce("sum", jnp.stack(values))
        return tuple(out[j] for j in range(len(values)))
    signed = [v if op == "min" else -v for op, v in zip(ops, values, strict=True)]
    out = plain_reduce("min", jnp.stack(signed))
    return tuple(out[j] if op == "min" else -out[j] for j, op in enumerate(ops))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def reduce_columns(ops: tuple[str, ...], values: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Each ``[..., T]`` operand reduced over its last axis by its op (sum/min/max).

    Columns are reduced in groups, not one by one: the sums of one shape and dtype
    together, and the minima and maxima together (:func:`_reduce_together`), so that
    a pass over the tokens is a few reductions whatever the number of columns (XLA:CPU
    runs each reduction, and each operand it does not fuse, as a kernel of its own).
    Each result is the reduction of its own operand's row; only the order a float sum
    is taken in may differ from a reduction of that row alone (a rounding).
    """
    groups: dict[tuple, list[int]] = {}
    for i, (op, v) in enumerate(zip(ops, values, strict=True)):
        kind = "sum" if op == "sum" else "extreme"
        groups.setdefault((kind, jnp.shape(v), jnp.result_type(v)), []).append(i)
    results: list = [None] * len(values)
    for at in groups.values():
        together = _reduce_together(tuple(ops[i] for i in at), tuple(values[i] for i in at))
        for i, r in zip(at, together, strict=True):
            results[i] = r
    return tuple(results)


def _reduce_columns_jvp(ops, primals, tangents):
    (values,), (dvalues,) = primals, tangents
    out = reduce_columns(ops, values)
    return out, linear_jvp(ops, values, dvalues, out, lambda d: jnp.sum(d, axis=-1), plain_reduce)


reduce_columns.defjvp(_reduce_columns_jvp, symbolic_zeros=True)


# Per-segment sums are taken in chunks of this many tokens (one scatter-add of every
# token into its (chunk, segment) slot), then the chunks are summed as a tree: the
# sequential accumulation of a scatter stays short, so a segment's sum is as close to
# its exact value as a plain ``jnp.sum`` over a row.
_CHUNK = 256

_SCATTER = {"sum": jax.ops.segment_sum, "min": jax.ops.segment_min, "max": jax.ops.segment_max}


def _over_rows(fn: Callable, batch_dims: int) -> Callable:
    """``fn`` of one row, mapped over ``batch_dims`` leading axes (a batched scatter or
    gather: each row independent, so a sharded batch axis stays local)."""
    for _ in range(batch_dims):
        fn = jax.vmap(fn)
    return fn


def _slots(segment_ids: jax.Array, num_segments: int, chunked: bool) -> jax.Array:
    """Each token's scatter slot: its segment ``1..K`` (0 for padding, any id outside
    ``1..K``), offset by ``(K + 1)`` per chunk of :data:`_CHUNK` tokens when ``chunked``."""
    inside = (segment_ids >= 1) & (segment_ids <= num_segments)
    slots = jnp.where(inside, segment_ids, 0)
    if chunked:
        position = jax.lax.broadcasted_iota(jnp.int32, segment_ids.shape, segment_ids.ndim - 1)
        slots = slots + (position // _CHUNK) * (num_segments + 1)
    return slots


def _scatter_columns(
    op: str, num_segments: int, values: tuple[jax.Array, ...], segment_ids: jax.Array
) -> tuple[jax.Array, ...]:
    """Columns of one op, stacked ``[..., T, n]`` and scattered together by segment:
    ``n`` results ``[..., K]``."""
    length = segment_ids.shape[-1]
    chunks = -(-length // _CHUNK) if op == "sum" else 1
    slots = _slots(segment_ids, num_segments, chunks > 1)
    stacked = jnp.stack(values, axis=-1)

    def one_row(v, s):
        return _SCATTER[op](v, s, num_segments=chunks * (num_segments + 1))

    out = _over_rows(one_row, segment_ids.ndim - 1)(stacked, slots)
    out = out.reshape(*out.shape[:-2], chunks, num_segments + 1, len(values))
    out = plain_reduce(op, jnp.moveaxis(out, -3, -1))  # the chunks, as a tree: [..., K+1, n]
    return tuple(out[..., 1:, i] for i in range(len(values)))


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

    One scatter per op (``jax.ops.segment_sum`` / ``segment_min`` / ``segment_max`` of
    the op's columns stacked), O(T) work whatever ``K``; tokens with an id outside
    ``1..K`` go to a slot that is dropped. Sums are linear (the transpose is a gather);
    an empty segment gives the op's identity (0, ``+inf``, ``−inf``). Arrays sharded in
    their types are reduced on each device's block, and the ``[..., K]`` partial results
    combined over the token axis's mesh axes.
    """
    spec = next(filter(None, map(_explicit_spec, (segment_ids, *values))), None)
    if spec is None:
        return _reduce_segments(ops, num_segments, values, segment_ids)
    token_axes = _mesh_names(spec[-1])

    def local(ids, *vals):
        out = _reduce_segments(ops, num_segments, vals, ids)
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


def _reduce_segments(
    ops: tuple[str, ...], num_segments: int, values: tuple[jax.Array, ...], segment_ids
) -> tuple[jax.Array, ...]:
    """:func:`reduce_segments` of arrays on one device (or sharded by the partitioner)."""
    results: list = [None] * len(values)
    for op in ("sum", "min", "max"):
        at = [i for i, o in enumerate(ops) if o == op]
        if at:
            group = _scatter_columns(op, num_segments, tuple(values[i] for i in at), segment_ids)
            for i, r in zip(at, group, strict=True):
                results[i] = r
    return tuple(results)


def gather_broadcast(values: jax.Array, segment_ids: jax.Array, fill) -> jax.Array:
    """``[..., K] -> [..., T]``: each token its segment's value (a gather), ``fill`` on
    tokens outside ``1..K``. Linear in ``values``: its transpose is a per-segment sum."""
    num_segments = values.shape[-1]
    lead = jnp.broadcast_shapes(values.shape[:-1], segment_ids.shape[:-1])
    values = jnp.broadcast_to(values, (*lead, num_segments))
    segment_ids = jnp.broadcast_to(segment_ids, (*lead, segment_ids.shape[-1]))
    ids_spec, values_spec = _explicit_spec(segment_ids), _explicit_spec(values)
    if ids_spec is None and values_spec is None:
        return _gather(values, segment_ids, fill)
    lead = tuple(ids_spec or values_spec)[:-1]  # type: ignore[arg-type]
    token_spec = PartitionSpec(*lead, None if ids_spec is None else ids_spec[-1])
    per_segment = PartitionSpec(*lead, None)
    return _on_shards(
        lambda v, i: _gather(v, i, fill),
        (values, segment_ids),
        (per_segment, token_spec),
        token_spec,
        token_spec,
    )


def _gather(values: jax.Array, segment_ids: jax.Array, fill) -> jax.Array:
    num_segments = values.shape[-1]
    inside = (segment_ids >= 1) & (segment_ids <= num_segments)
    index = jnp.where(inside, segment_ids - 1, 0)
    out = _over_rows(lambda v, i: v[i], segment_ids.ndim - 1)(values, index)
    return jnp.where(inside, out, jnp.asarray(fill, values.dtype))
