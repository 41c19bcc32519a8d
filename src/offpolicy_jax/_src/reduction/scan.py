"""Prefix scans per sequence: each token's minimum over the earlier tokens of its sequence.

The one per-token quantity of the library that depends on token *order* (MinPRO's
minimum prefix ratio, docs/semantics.md §2). A layout
(:meth:`~offpolicy_jax._src.reduction.rows.Rows.exclusive_min`) runs it:

* one sequence per row (:func:`exclusive_min_rows`): a running minimum along the token
  axis (an associative scan), shifted by one;
* packed rows (:func:`exclusive_min_segments`): the tokens of a row sorted by
  ``(segment id, position)`` (a stable order, so every segment becomes one run in
  token order, whatever the ids' layout), a segmented scan that restarts at each run,
  and the inverse sort;
* a sharded token axis (:func:`carry_from_earlier_shards`): each shard scans its own
  tokens and takes, per sequence, the minimum of the shards before it (one
  ``all_gather`` of a per-sequence ``[...]`` / ``[..., K]`` value over the token axes).
  A minimum is exact in any order of combination, so a sharded scan equals the
  unsharded one bit for bit. Inside ``shard_map`` the token axes are the call's
  ``MeshAxes.token``; under ``jit`` with an explicitly sharded token axis
  (:func:`explicit_spec`) the scan runs in a ``shard_map`` over the arrays' own
  sharding (:func:`on_shards`), with the same per-sequence communication only.

Tokens outside the population take part as ``+inf`` (the identity of ``min``), so
padding, holes and garbage never reach a result; a token with no earlier token in
its population gets ``+inf``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def _shift_right(x: jax.Array, fill) -> jax.Array:
    """``out[..., t] = x[..., t − 1]``, ``out[..., 0] = fill`` (a pad, which keeps the
    leading axes' sharding, where a concatenated constant would not)."""
    widths = [(0, 0, 0)] * (x.ndim - 1) + [(1, 0, 0)]
    return jax.lax.pad(x[..., :-1], jnp.asarray(fill, x.dtype), widths)


def carry_from_earlier_shards(local: jax.Array, token_axes: tuple[str, ...]) -> jax.Array:
    """Per sequence, the minimum over the shards *before* this one of their ``local`` value.

    Args:
      local: ``[...]`` (or ``[..., K]``) float32: each sequence's minimum over this
        shard's tokens (``+inf`` where it has none).
      token_axes: the mesh axes the token axis is split over, in the order of the
        sharding (``PartitionSpec(..., ("a", "b"))`` is shard ``i_a · n_b + i_b``).

    Returns:
      ``local``-shaped: ``min_{j < i} local_j`` for shard ``i`` (``+inf`` on the first).
    """
    # Gathered on a new *last* axis, [..., shards]: the leading axes keep whatever
    # (explicit) sharding they have.
    gathered = jax.lax.all_gather(local, token_axes, axis=local.ndim)
    earlier = jnp.arange(gathered.shape[-1]) < jax.lax.axis_index(token_axes)
    return jnp.min(jnp.where(earlier, gathered, jnp.inf), axis=-1)


def explicit_spec(x: jax.Array) -> P | None:
    """``x``'s ``PartitionSpec`` when its last (token) axis is sharded in its type (``jit``
    with ``NamedSharding`` on an ``AxisType.Explicit`` mesh), else None: there a
    cumulative op along that axis is refused, so the scan runs per shard instead
    (:func:`on_shards`)."""
    try:
        spec = jax.typeof(x).sharding.spec
    except AttributeError:
        return None
    if len(spec) < x.ndim or spec[x.ndim - 1] is None:
        return None
    return P(*spec[: x.ndim])


def _names(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def token_axes_of(spec: P) -> tuple[str, ...]:
    """The mesh axes the last axis is split over, in the sharding's order."""
    return _names(spec[len(spec) - 1])


def on_shards(fn, arrays: tuple[jax.Array, ...], spec: P) -> jax.Array:
    """``fn(*local_arrays)`` in a ``shard_map`` manual over every mesh axis of ``spec``
    (the arrays' own sharding, so nothing is resharded): each device sees its own
    block, exactly as inside a user's ``shard_map`` with those axes named."""
    axes = {name for entry in spec for name in _names(entry)}
    return jax.shard_map(fn, in_specs=(spec,) * len(arrays), out_specs=spec, axis_names=axes)(
        *arrays
    )


def exclusive_min_rows(values: jax.Array, token_axes: tuple[str, ...] = ()) -> jax.Array:
    """``out[..., t] = min_{s < t} values[..., s]`` along the last axis (one sequence a row).

    Args:
      values: ``[..., T]`` float32, ``+inf`` outside the population.
      token_axes: mesh axes the token axis is split over (inside ``shard_map``).

    Returns:
      ``[..., T]`` float32; ``+inf`` where no earlier token is in the population.
    """
    # An associative scan (log T elementwise passes): the XLA partitioner splits it
    # over a sharded token axis with per-sequence messages, where lax.cummin (a
    # reduce_window over the whole row) would all-gather the tokens.
    inclusive = jax.lax.associative_scan(jnp.minimum, values, axis=values.ndim - 1)
    out = _shift_right(inclusive, jnp.inf)
    if token_axes:
        carry = carry_from_earlier_shards(inclusive[..., -1], token_axes)
        out = jnp.minimum(out, carry[..., None])
    return out


def _segmented_min(starts: jax.Array, values: jax.Array) -> jax.Array:
    """Inclusive running minimum that restarts wherever ``starts`` is True."""

    def combine(a, b):
        (start_a, min_a), (start_b, min_b) = a, b
        return start_a | start_b, jnp.where(start_b, min_b, jnp.minimum(min_a, min_b))

    _, out = jax.lax.associative_scan(combine, (starts, values), axis=values.ndim - 1)
    return out


def exclusive_min_segments(values: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """``out[..., t] = min {values[..., s] : s < t, id_s = id_t}`` (packed rows, one shard).

    Exact for any layout of ids (a segment need not be one run of tokens). A sharded
    token axis takes :func:`carry_from_earlier_shards` of the per-segment minima on top
    (the packed layout does, :meth:`~offpolicy_jax._src.reduction.segments.Packed.exclusive_min`).

    Args:
      values: ``[..., T]`` float32, ``+inf`` outside the population.
      segment_ids: int32 ``[..., T]``.

    Returns:
      ``[..., T]`` float32; ``+inf`` where no earlier token of the segment is in the
      population.
    """
    ids = jnp.broadcast_to(segment_ids, values.shape)
    axis = values.ndim - 1
    position = jax.lax.broadcasted_iota(jnp.int32, values.shape, axis)
    sorted_ids, sorted_position, sorted_values = jax.lax.sort(
        (ids, position, values), dimension=axis, num_keys=2
    )
    starts = (sorted_ids != _shift_right(sorted_ids, 0)) | (position == 0)
    inclusive = _segmented_min(starts, sorted_values)
    exclusive = jnp.where(starts, jnp.inf, _shift_right(inclusive, jnp.inf))
    _, out = jax.lax.sort((sorted_position, exclusive), dimension=axis, num_keys=1)
    return out
