"""Host-side packing: several ragged sequences per ``[T]`` row, and back.

Pure NumPy, for data preparation on the host before a batch is sent to the
device (packing is a data-dependent, variable-shape operation; it does not belong
inside ``jit``). The packed layout is the one every public function accepts with
``segment_ids=`` and ``num_segments=`` (docs/semantics.md §10):

* ``segment_ids`` ``[R, T]`` int32: ``1..K`` name the sequences of a row in the
  order they were placed, 0 is padding;
* ``segment_positions`` ``[R, T]`` int32: a token's position inside its sequence
  (0 at padding), the ``segment_positions`` of tunix's ``TrainExample`` and the
  ``inputs_position`` of MaxText; a model needs them for its position embeddings.

Example::

    seqs = [dict(logp=..., old_logp=..., rollout_logp=..., advantages=..., mask=...), ...]
    packed = pack_sequences(seqs, length=4096, max_segments=8)
    loss, metrics = opj.policy_loss(
        *(packed.arrays[k] for k in ("logp", "old_logp", "rollout_logp", "advantages", "mask")),
        config, segment_ids=packed.segment_ids, num_segments=packed.num_segments)
    padded = unpack_sequences(packed.arrays, packed.segment_ids, packed.num_segments)
    # padded[name]: [R, K, T]; sequence i is padded[name][packed.rows[i], packed.segments[i] - 1]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["PackedSequences", "pack_sequences", "unpack_sequences", "segment_positions"]


class PackedSequences(NamedTuple):
    """The result of :func:`pack_sequences`.

    Attributes:
      arrays: the packed per-token arrays, ``[R, T]`` each: a dict when the
        sequences were dicts, a tuple when they were tuples / lists.
      segment_ids: ``[R, T]`` int32; 0 = padding, ``1..K`` = the row's sequences.
      segment_positions: ``[R, T]`` int32; position inside the sequence, 0 at padding.
      num_segments: ``K``, the static ``num_segments`` to pass with ``segment_ids``:
        ``max_segments`` when given, else the most sequences any row holds.
      rows: ``[N]`` int: the row each input sequence went to.
      segments: ``[N]`` int: its segment id in that row (1-based).
      starts: ``[N]`` int: the column of its first token.
    """

    arrays: dict[str, np.ndarray] | tuple[np.ndarray, ...]
    segment_ids: np.ndarray
    segment_positions: np.ndarray
    num_segments: int
    rows: np.ndarray
    segments: np.ndarray
    starts: np.ndarray


def _fields(sequence: Any, index: int) -> tuple[list[str] | None, list[np.ndarray]]:
    if isinstance(sequence, Mapping):
        names = list(sequence)
        return names, [np.asarray(sequence[n]) for n in names]
    if isinstance(sequence, (tuple, list)):
        return None, [np.asarray(v) for v in sequence]
    raise TypeError(
        f"sequences[{index}] must be a dict or a tuple of per-token arrays, got "
        f"{type(sequence).__name__}"
    )


def pack_sequences(
    sequences: Sequence[Mapping[str, Any] | Sequence[Any]],
    length: int,
    *,
    max_segments: int | None = None,
    num_rows: int | None = None,
    sort: bool = False,
    pad_value: float | Mapping[str, float] = 0,
) -> PackedSequences:
    """Packs ragged sequences into rows of ``length`` tokens, first fit.

    Each sequence goes, in input order (or longest first with ``sort=True``:
    first-fit decreasing, which wastes less), into the first row with room for
    all its tokens and fewer than ``max_segments`` sequences; a new row is opened
    when none has room. A sequence is never split across rows. Pure NumPy (host
    side, not jittable).

    Args:
      sequences: ``N`` sequences, each a dict ``name -> [L_i]`` array (e.g.
        ``logp``, ``old_logp``, ``rollout_logp``, ``advantages``, ``mask``) or a
        tuple of ``[L_i]`` arrays, all sequences with the same names / arity.
        Prompt tokens are part of a sequence with mask 0.
      length: ``T``, the row length.
      max_segments: the most sequences per row (``K``); None = no limit.
      num_rows: pad the result to exactly this many rows (all-padding rows), so
        that the shapes stay static across steps; a ValueError if more are needed.
      sort: place the longest sequences first (first-fit decreasing).
      pad_value: the value of padding tokens, one for all arrays or per name.

    Returns:
      A :class:`PackedSequences`; ``arrays`` keep each input's dtype.

    Raises:
      ValueError: a sequence longer than ``length``, arrays of unequal length
        inside a sequence, mismatched names, or too many rows for ``num_rows``.
    """
    if not isinstance(length, (int, np.integer)) or length < 1:
        raise ValueError(f"length must be a positive int, got {length!r}")
    if max_segments is not None and (
        not isinstance(max_segments, (int, np.integer)) or max_segments < 1
    ):
        raise ValueError(f"max_segments must be a positive int or None, got {max_segments!r}")
    if len(sequences) == 0:
        raise ValueError("sequences is empty: nothing to pack")
    names, fields, lengths = _checked_fields(sequences, length)
    rows, segments, starts, counts = _first_fit(lengths, length, max_segments, sort)
    n_rows = len(counts)
    if num_rows is not None:
        if n_rows > num_rows:
            raise ValueError(f"the sequences need {n_rows} rows of {length}, num_rows={num_rows}")
        n_rows = num_rows
    first = fields[0]
    keys = names if names is not None else list(range(len(first)))

    def pad_of(key):
        if isinstance(pad_value, Mapping):
            return pad_value.get(key, 0)
        return pad_value

    out = [
        np.full((n_rows, length), pad_of(k), dtype=v.dtype)
        for k, v in zip(keys, first, strict=True)
    ]
    segment_ids = np.zeros((n_rows, length), np.int32)
    positions = np.zeros((n_rows, length), np.int32)
    for i, values in enumerate(fields):
        r, s, n = rows[i], starts[i], lengths[i]
        for array, v in zip(out, values, strict=True):
            array[r, s : s + n] = v
        segment_ids[r, s : s + n] = segments[i]
        positions[r, s : s + n] = np.arange(n)
    arrays = dict(zip(names, out, strict=True)) if names is not None else tuple(out)
    k = max_segments if max_segments is not None else max(counts)
    return PackedSequences(arrays, segment_ids, positions, int(k), rows, segments, starts)


def _checked_fields(sequences, length: int):
    """``(names, per-sequence arrays, lengths)``; every sequence alike, 1-D, fits a row."""
    names, first = _fields(sequences[0], 0)
    fields = []
    lengths = []
    for i, sequence in enumerate(sequences):
        seq_names, values = _fields(sequence, i)
        if seq_names != names or len(values) != len(first):
            raise ValueError(
                f"sequences[{i}] has fields {seq_names or len(values)}, but sequences[0] has "
                f"{names or len(first)}: every sequence must carry the same arrays"
            )
        sizes = {np.shape(v) for v in values}
        if len(sizes) != 1 or len(next(iter(sizes))) != 1:
            raise ValueError(
                f"sequences[{i}] arrays must all be 1-D of one length, got shapes "
                f"{[np.shape(v) for v in values]}"
            )
        n = int(values[0].shape[0])
        if n > length:
            raise ValueError(f"sequences[{i}] has {n} tokens, more than the row length {length}")
        fields.append(values)
        lengths.append(n)
    return names, fields, lengths


def _first_fit(lengths: list[int], length: int, max_segments: int | None, sort: bool):
    """Each sequence's row, segment id (1-based) and start; and the count per row."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i]) if sort else range(len(lengths))
    loads: list[int] = []
    counts: list[int] = []
    rows = np.zeros(len(lengths), np.int64)
    segments = np.zeros(len(lengths), np.int64)
    starts = np.zeros(len(lengths), np.int64)
    for i in order:
        for r, load in enumerate(loads):
            if load + lengths[i] <= length and (max_segments is None or counts[r] < max_segments):
                break
        else:
            loads.append(0)
            counts.append(0)
            r = len(loads) - 1
        rows[i], starts[i] = r, loads[r]
        counts[r] += 1
        segments[i] = counts[r]
        loads[r] += lengths[i]
    return rows, segments, starts, counts


def segment_positions(segment_ids: np.ndarray) -> np.ndarray:
    """Each token's position inside its segment (0 at padding), from ``segment_ids``.

    Counts the earlier tokens of the same row with the same id, so it is right for
    contiguous and non-contiguous segments alike. Pure NumPy.
    """
    ids = np.asarray(segment_ids)
    positions = np.zeros(ids.shape, np.int32)
    flat_ids = ids.reshape(-1, ids.shape[-1])
    flat_pos = positions.reshape(-1, ids.shape[-1])
    for row, pos in zip(flat_ids, flat_pos, strict=True):
        for k in np.unique(row[row > 0]):
            where = np.flatnonzero(row == k)
            pos[where] = np.arange(where.size)
    return positions


def unpack_sequences(
    arrays: Mapping[str, Any] | Sequence[Any],
    segment_ids: np.ndarray,
    num_segments: int,
    *,
    length: int | None = None,
    fill: float | Mapping[str, float] = 0,
) -> dict[str, np.ndarray] | tuple[np.ndarray, ...]:
    """The inverse of :func:`pack_sequences`: one sequence per row, padded.

    Segment ``k`` of row ``[...]`` goes to ``out[..., k − 1, :]``, its tokens in
    their order in the row, left-aligned; padding tokens (id 0 or outside
    ``1..K``) are dropped. A segment with no tokens gives an all-``fill`` row,
    which every function treats as an empty sequence. Pure NumPy.

    Args:
      arrays: ``[..., T]`` packed arrays, a dict or a tuple.
      segment_ids: int ``[..., T]``.
      num_segments: ``K``.
      length: the unpacked row length ``L`` (default ``T``); a ValueError if a
        segment is longer.
      fill: the value of padding positions, one for all or per name (bool arrays
        are filled with False).

    Returns:
      The arrays as ``[..., K, L]``, a dict or tuple like ``arrays``.
    """
    ids = np.asarray(segment_ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"segment_ids must be an integer array, got dtype {ids.dtype}")
    names: list[str] | None = None  # set iff `arrays` is a dict: the output is one too
    keys: list[str | int]
    if isinstance(arrays, Mapping):
        names = list(arrays)
        keys = list(names)
        values = [np.asarray(arrays[k]) for k in names]
    else:
        keys = list(range(len(arrays)))
        values = [np.asarray(arrays[i]) for i in range(len(arrays))]
    for k, v in zip(keys, values, strict=True):
        if v.shape != ids.shape:
            raise ValueError(f"arrays[{k!r}] has shape {v.shape}, segment_ids {ids.shape}")
    lead, t = ids.shape[:-1], int(ids.shape[-1])
    length = t if length is None else length
    flat_ids = ids.reshape(-1, t)

    def fill_of(key, dtype):
        value = fill.get(key, 0) if isinstance(fill, Mapping) else fill
        return False if dtype == np.bool_ else value

    outs = [
        np.full((flat_ids.shape[0], num_segments, length), fill_of(k, v.dtype), v.dtype)
        for k, v in zip(keys, values, strict=True)
    ]
    flat_values = [v.reshape(-1, t) for v in values]
    for r, row in enumerate(flat_ids):
        for k in range(1, num_segments + 1):
            where = np.flatnonzero(row == k)
            if where.size > length:
                raise ValueError(
                    f"segment {k} of row {r} has {where.size} tokens > length {length}"
                )
            for out, v in zip(outs, flat_values, strict=True):
                out[r, k - 1, : where.size] = v[r, where]
    outs = [o.reshape(*lead, num_segments, length) for o in outs]
    if names is not None:
        return dict(zip(names, outs, strict=True))
    return tuple(outs)
