"""The packed layout: several sequences share one ``[..., T]`` row.

In the packed layout (docs/semantics.md §10) an int ``segment_ids`` array ``[..., T]``
names the sequence of every token: ``1..K`` (``K = num_segments``, a static int)
are the sequences of a row and 0 is padding. A per-sequence value is then
``[..., K]`` (one per (row, segment)) instead of ``[...]`` (one per row).

* :func:`segment_reduce` is :meth:`~offpolicy_jax._src.reduction.rows.Rows.reduce` per
  segment: every column's sum / min / max over the tokens of each segment, ``[...,
  T] -> [..., K]``. Inside ``shard_map`` with a sharded token axis the ``[..., K]``
  partial results are ``psum``-ed (``pmin``/``pmax``) over the token mesh axes, so a
  sequence may cross a shard boundary; only ``[..., K]``-sized values cross devices.
* :func:`segment_broadcast` is the way back, ``[..., K] -> [..., T]``: each token
  gets its segment's value (the gather), padding a fill value.
* :class:`Packed` is the layout object behind the seam of ``Rows``: the correction
  pipeline, the losses and every rule reduce and broadcast through it, so they are
  all packed-aware without knowing it.

A pass is reduced by one scatter-add and one scatter-min
(:func:`~offpolicy_jax._src.reduction.packed.reduce_segments`) and broadcast back by
one gather: O(T) work whatever ``K`` and whatever the layout of the ids (a sequence
need not be one run of tokens).

Ids outside ``1..K`` (0, negative, too large) belong to no segment: they are
padding, whatever the mask says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax._src import validation as _validation
from offpolicy_jax._src.reduction import packed, scan
from offpolicy_jax._src.reduction.columns import Column, broadcast_shape, count_where, operand
from offpolicy_jax._src.reduction.mesh import MeshAxes
from offpolicy_jax._src.reduction.packed import gather_broadcast
from offpolicy_jax._src.reduction.rows import ColumnKey, Rows, combine_over


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
    segment_ids = _validation.as_array("segment_ids", segment_ids)  # a list: named errors
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
    population never reaches a result. Populations must be 0 outside the segments
    ``1..K`` (padding): every population of the library is, since the public calls
    restrict their masks with :func:`only_segments`. Sums are differentiable, and
    their backward is :func:`segment_broadcast` of the cotangent.

    Args:
      columns: name -> :class:`~offpolicy_jax._src.reduction.columns.Column` (``[..., T]``
        populations and values).
      segment_ids: int ``[..., T]``: 1..K name the sequences of a row, anything
        else is padding.
      num_segments: ``K``, static.
      axes: mesh axes to combine over inside ``shard_map``.

    Returns:
      name -> ``[..., K]`` per-segment result.
    """
    return Packed(axes, segment_ids, num_segments).reduce_columns(columns)


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
        out = gather_broadcast(values.astype(jnp.int8), segment_ids, int(bool(fill)))
        return out.astype(bool)
    return gather_broadcast(values, segment_ids, fill)


def segment_any(
    condition: jax.Array,
    population: jax.Array,
    segment_ids: jax.Array,
    num_segments: int,
    axes: MeshAxes,
) -> jax.Array:
    """Per-segment ``any(condition)`` over the population, ``[..., T] -> [..., K]`` bool."""
    columns = {"hits": count_where(condition, population)}
    return segment_reduce(columns, segment_ids, num_segments, axes)["hits"] > 0


@dataclasses.dataclass(frozen=True, eq=False)
class Packed(Rows):
    """The packed layout: several sequences per row, named by ``segment_ids``.

    The same seam as :class:`~offpolicy_jax._src.reduction.rows.Rows`, with per-sequence
    arrays ``[..., K]`` (one value per (row, segment)) instead of ``[...]``:
    :meth:`reduce` reduces per segment, :meth:`broadcast` is :func:`segment_broadcast`,
    and ``batch_means`` (inherited) sums the ``[..., K]`` terms like any other axis. A
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

    def reduce_columns(self, columns: Mapping[ColumnKey, Column]) -> dict[ColumnKey, jax.Array]:
        """Every column's per-segment reduction, ``[..., T] -> [..., K]`` (see
        :func:`segment_reduce`)."""
        if not columns:
            return {}
        names = tuple(columns)
        shape = broadcast_shape(columns.values(), self.ids.shape)
        results = packed.reduce_segments(
            tuple(columns[n].op for n in names),
            self.num_segments,
            tuple(operand(columns[n], shape) for n in names),
            jnp.broadcast_to(self.ids, shape),
        )
        return combine_over(dict(zip(names, results, strict=True)), columns, self.axes.token)

    def broadcast(self, per_seq: jax.Array) -> jax.Array:
        """A per-segment value ``[..., K]`` on every token of its segment, ``[..., T]``
        (0 / False on padding)."""
        return segment_broadcast(jnp.asarray(per_seq), self.ids)

    def scan_inputs(self, values: jax.Array) -> tuple[jax.Array, ...]:
        """The segment ids, token-shaped like ``values``."""
        return (jnp.broadcast_to(self.ids, values.shape),)

    def exclusive_min_of(
        self, values: jax.Array, ids: jax.Array | None = None, *, token_axes: tuple[str, ...]
    ) -> jax.Array:
        """The prefix minimum per segment (see ``Rows.exclusive_min``): a segment's
        earlier tokens are those with its id and a smaller position, whatever the layout
        of the ids; a sharded token axis adds the per-segment minimum of earlier shards.
        ``ids``: this device's segment ids (the layout's own when None)."""
        local_ids = jnp.broadcast_to(self.ids, values.shape) if ids is None else ids
        out = scan.exclusive_min_segments(values, local_ids)
        if token_axes:
            (local,) = packed.reduce_segments(("min",), self.num_segments, (values,), local_ids)
            carry = scan.carry_from_earlier_shards(local, token_axes)
            out = jnp.minimum(out, segment_broadcast(carry, local_ids, jnp.inf))
        return out


def layout(axes: MeshAxes, segment_ids, num_segments, shape: tuple[int, ...]) -> Rows:
    """The layout of a public call: :class:`Rows` without ``segment_ids``, else
    :class:`Packed` (the arguments validated, errors naming them)."""
    ids = check_segments(segment_ids, num_segments, shape)
    if ids is None:
        return Rows(axes)
    return Packed(axes, ids, int(num_segments))


def only_segments(layout: Rows, mask: jax.Array) -> jax.Array:
    """The float mask without padding: 0 outside the segments ``1..K`` of a packed
    layout (padding is never trained on, whatever the mask says); unchanged otherwise."""
    if not isinstance(layout, Packed):
        return mask
    return jnp.where(in_segment(layout.ids, layout.num_segments), mask, 0.0)


def segment_arguments(layout: Rows) -> dict:
    """``segment_ids`` / ``num_segments`` keyword arguments for a user correction
    callable, or none for the one-sequence-per-row layout."""
    if not isinstance(layout, Packed):
        return {}
    return {"segment_ids": layout.segment_ids, "num_segments": layout.num_segments}
