"""Per-segment reductions of packed rows: several sequences share one ``[..., T]`` row.

In the packed layout (docs/semantics.md §10) an int ``segment_ids`` array ``[..., T]``
names the sequence of every token: ``1..K`` (``K = num_segments``, a static int)
are the sequences of a row and 0 is padding. A per-sequence value is then
``[..., K]`` (one per (row, segment)) instead of ``[...]`` (one per row).

* :func:`segment_reduce` is :func:`offpolicy_jax._reduce.seq_reduce` per segment:
  every column's sum / min / max over the tokens of each segment, ``[..., T] ->
  [..., K]``, all columns in few fused loops. Inside ``shard_map`` with a sharded
  token axis the ``[..., K]`` partial results are ``psum``-ed (``pmin``/``pmax``)
  over the token mesh axes, so a sequence may cross a shard boundary; only
  ``[..., K]``-sized values cross devices, never token data.
* :func:`segment_broadcast` is the way back, ``[..., K] -> [..., T]``: each token
  gets its segment's value (the gather), padding a fill value.

How (measured with ``python -m benchmarks.segments``, jax 0.10.2, XLA:CPU, K = 8):
the sum over the tokens of each segment is a compare-and-reduce, ``Σ_t [id_t = k]
x_t`` for ``k = 1..K``, run as :mod:`~offpolicy_jax._reduce`'s fused variadic loop
over ``[..., K, T]`` operands that XLA never writes out (the compare and the select
are fused into the loop). The alternatives were 2-10x slower: a one-hot
``einsum`` (XLA:CPU materialises the ``[..., T, K]`` indicator and runs a poor
batched matrix-vector product), ``jax.ops.segment_sum`` over flattened (row,
segment) ids (a serial scatter-add, and a flattening that the partitioner cannot
keep sharded), a plain ``jnp.sum`` of the ``[..., K, T]`` select (the reduction
kernel cannot fuse its producer, so the select is written to memory) and one
reduction per segment. The gather back is a chain of ``K`` selects, fused into
whatever elementwise pass consumes it (``take_along_axis`` was 3x slower).

Gradients: a segment sum is linear, and its JVP is written as ``K`` plain sums of
the tangent, whose transpose is the chain of selects: the backward of a segment
sum is the gather, one elementwise pass, with nothing ``[..., K, T]`` stored.

Ids outside ``1..K`` (0, negative, too large) belong to no segment: they are
padding, whatever the mask says.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax import _reduce
from offpolicy_jax._reduce import _COLLECTIVE, _INIT, Column, MeshAxes


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
    return jnp.asarray(segment_ids).astype(jnp.int32)


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


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _segment_fused(
    ops: tuple[str, ...], num_segments: int, values: tuple[jax.Array, ...], segment_ids
) -> tuple[jax.Array, ...]:
    """Each ``[..., T]`` operand reduced by its op over each segment: ``[..., K]``."""
    hit = _segment_axis(segment_ids, num_segments)
    operands = tuple(
        jnp.where(hit, v[..., None, :], _INIT[op]) for op, v in zip(ops, values, strict=True)
    )
    return _reduce._fused_reduce(ops, operands)


def _segment_fused_jvp(ops, num_segments, primals, tangents):
    values, segment_ids = primals
    dvalues, _ = tangents
    out = _segment_fused(ops, num_segments, values, segment_ids)
    dout = []
    for op, value, dvalue, primal in zip(ops, values, dvalues, out, strict=True):
        if isinstance(dvalue, jax.custom_derivatives.SymbolicZero):
            dout.append(jnp.zeros_like(primal))
        elif op == "sum":
            dout.append(_plain_segment_sum(dvalue, segment_ids, num_segments))
        else:  # min / max: JAX's own rule (the library never differentiates them)
            hit = _segment_axis(segment_ids, num_segments)

            def plain(v, op=op, hit=hit):
                masked = jnp.where(hit, v[..., None, :], _INIT[op])
                return _reduce._plain_reduce(op, masked)

            dout.append(jax.jvp(plain, (value,), (dvalue,))[1])
    return out, tuple(dout)


_segment_fused.defjvp(_segment_fused_jvp, symbolic_zeros=True)


def segment_reduce(
    columns: Mapping[str, Column], segment_ids: jax.Array, num_segments: int, axes: MeshAxes
) -> dict[str, jax.Array]:
    """Every column's per-segment reduction, ``[..., T] -> [..., K]``, computed together.

    ``out[..., k − 1] = Σ_t [id_t = k] x_t p_t`` (or the min / max over the tokens
    with ``id_t = k`` and ``p_t > 0``; ``±inf`` for an empty segment). Values are
    selected with ``where`` before they are weighted, so NaN/inf outside a
    population or a segment never reaches a result. Sums are differentiable, and
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
    values = tuple(_reduce._operand(columns[n], shape) for n in names)
    ids = jnp.broadcast_to(segment_ids, shape)
    results = dict(zip(names, _segment_fused(ops, num_segments, values, ids), strict=True))
    if axes.token:
        for op, collective in _COLLECTIVE.items():
            same = {n: results[n] for n in names if columns[n].op == op}
            if same:
                results.update(collective(same, axes.token))
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
        {"hits": _reduce.count_where(condition, population)}, segment_ids, num_segments, axes
    )["hits"]
    return hits > 0


__all__ = [
    "check_segments",
    "in_segment",
    "segment_any",
    "segment_broadcast",
    "segment_reduce",
]
