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

How (measured with ``python -m benchmarks.segments``, jax 0.10.2, XLA:CPU, ``[64, 2048]``,
K = 8, 8 columns): the sum over the tokens of each segment is a compare-and-reduce,
``Σ_t [id_t = k] x_t`` for ``k = 1..K``, run as :mod:`~offpolicy_jax._fusion`'s fused
variadic loop over ``[..., K, T]`` operands that XLA never writes out (the compare
and the select are fused into the loop): about 2-3x the time of the
one-sequence-per-row reduction of the same columns. The alternatives, relative to
it: a one-hot ``einsum`` 1.7-2.5x (XLA:CPU writes the ``[..., T, K]`` indicator and
runs small batched matrix products), ``jax.ops.segment_sum`` over flattened (row,
segment) ids 3-8x (a serial scatter-add, and a flattening the partitioner cannot keep
sharded), a plain ``jnp.sum`` of the ``[..., K, T]`` select 15-40x (the reduction
kernel cannot fuse its producer, so the select is written out), one fused loop
per (column, segment) 0.7-1.5x (faster only when a column holds an ``exp`` that the
compare form evaluates K times), materialising the columns first about 1x, and a
windowed two-level sum (at most two segments per window of 64 tokens, with a
``cond`` fallback) no faster. The gather back is a chain of ``K`` selects, fused
into whatever elementwise pass consumes it (``take_along_axis`` was 3x slower).

Gradients: a segment sum is linear, and its JVP is written as ``K`` plain sums of
the tangent, whose transpose is the chain of selects: the backward of a segment
sum is the gather, one elementwise pass, with nothing ``[..., K, T]`` stored.

Ids outside ``1..K`` (0, negative, too large) belong to no segment: they are
padding, whatever the mask says.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax import _fusion, _reduce
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
    return _fusion.reduce_columns(ops, operands)


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
                return _fusion.plain_reduce(op, masked)

            dout.append(jax.jvp(plain, (value,), (dvalue,))[1])
    return out, tuple(dout)


_segment_fused.defjvp(_segment_fused_jvp, symbolic_zeros=True)


def segment_reduce(
    columns: Mapping[ColumnKey, Column],
    segment_ids: jax.Array,
    num_segments: int,
    axes: MeshAxes,
) -> dict[ColumnKey, jax.Array]:
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
    """

    # A default only because the inherited ``axes`` has one; :func:`layout` always
    # passes validated ids (see ``ids``).
    segment_ids: jax.Array | None = None
    num_segments: int = 1

    @property
    def ids(self) -> jax.Array:
        """``segment_ids``, which a packed layout cannot lack."""
        if self.segment_ids is None:
            raise TypeError("Packed layout constructed without segment_ids")
        return self.segment_ids

    def reduce(self, columns: Mapping[ColumnKey, Column]) -> dict[ColumnKey, jax.Array]:
        """Every column's per-segment reduction, ``[..., T] -> [..., K]`` (see
        :func:`segment_reduce`)."""
        return segment_reduce(columns, self.ids, self.num_segments, self.axes)

    def broadcast(self, per_seq: jax.Array) -> jax.Array:
        """A per-segment value ``[..., K]`` on every token of its segment, ``[..., T]``
        (0 / False on padding)."""
        return segment_broadcast(jnp.asarray(per_seq), self.ids)


def layout(axes: MeshAxes, segment_ids, num_segments, shape: tuple[int, ...]) -> Rows:
    """The layout of a public call: :class:`Rows` without ``segment_ids``, else
    :class:`Packed` (the arguments validated, errors naming them)."""
    ids = check_segments(segment_ids, num_segments, shape)
    if ids is None:
        return Rows(axes)
    return Packed(axes, ids, int(num_segments))


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
    "in_segment",
    "layout",
    "only_segments",
    "segment_any",
    "segment_arguments",
    "segment_broadcast",
    "segment_reduce",
]
