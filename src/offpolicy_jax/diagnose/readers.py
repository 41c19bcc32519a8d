"""Streaming readers and the dump writer of ``offpolicy-jax diagnose``.

A dump holds, for every sampled token, the trainer's log-prob ``old`` and the
rollout engine's log-prob ``rollout`` of the same token, and a 0/1 ``mask``:

* ``.npz``: arrays ``old_logp``, ``rollout_logp``, ``mask`` of shape ``[..., T]``, optional
  ``advantages`` and ``segment_ids`` (packed rows: each contiguous run of one segment id
  in a row is a sequence of its own), and optionally the engine's top-k per position:
  ``topk_rollout_logp`` (its log-probs of its ``K`` most probable ids) with
  ``topk_old_logp`` (the trainer's log-probs of the same ids), both ``[..., T, K]``, and
  ``topk_ids`` (the ids, ``[..., T, K]`` integers; checked for shape, not needed);
* Parquet / JSONL: one row per sequence with list-valued columns (names configurable).

Every reader yields :class:`Chunk` objects of at most ``rows`` sequences padded to the
chunk's longest one, so that a dump larger than memory streams through; Parquet is read
with ``pyarrow.parquet.ParquetFile.iter_batches``, JSONL line by line. An ``.npz`` array
is loaded whole by NumPy (the format has no partial reads): use Parquet for huge dumps.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INDEX_NAME = "index.json"
_INDEX_MAX_BYTES = 16 << 20
DEFAULT_COLUMNS = {"old": "old_log_probs", "rollout": "rollout_log_probs", "mask": "response_mask"}
NPZ_KEYS = {"old": "old_logp", "rollout": "rollout_logp", "mask": "mask"}
LOGPROB_TOLERANCE = 1e-3
"""The largest log-prob accepted at a valid token. A log-prob is ``<= 0``; a float32
log-softmax of a near-certain token can round a little above 0 (by about one ulp of the
largest logit, 1e-5 at logits of 100), far below this. A value above it is not a
log-prob: a negative log-likelihood (``-log p``) passed as one is positive at nearly
every token, and its "perplexity" and mismatch would be nonsense."""
PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


class DiagnoseError(ValueError):
    """Bad input to ``diagnose``: the message is one line meant for the user."""


@dataclass
class Chunk:
    """Up to ``rows`` sequences, padded: ``old``, ``rollout``, ``mask`` are ``[B, T]`` float32.

    ``file`` and ``row`` (``[B]``) say where each sequence came from (index into the
    list of input files, row in that file); ``start`` is its first position in that row
    (non-zero only for packed rows split by ``segment_ids``). ``topk_old`` and
    ``topk_rollout`` (``[B, T, K]`` float32, or None) are the trainer's and the engine's
    log-probs of the engine's top-k ids, where the dump carries them.
    """

    old: np.ndarray
    rollout: np.ndarray
    mask: np.ndarray
    file: np.ndarray
    row: np.ndarray
    start: np.ndarray
    topk_old: np.ndarray | None = None
    topk_rollout: np.ndarray | None = None


def expand_inputs(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Paths, globs and dump folders -> existing readable files, in the order given.

    Globs are sorted. A folder stands for the files its ``index.json`` lists (the
    demo's ``--dump-logprobs`` folder), else for every dump file in it (sorted); an
    ``index.json`` given as a file stands for the files it lists.
    """
    if not inputs:
        raise DiagnoseError("no input files given")
    groups: list[list[Path]] = []
    for item in inputs:
        text = os.fspath(item)
        if any(c in text for c in "*?["):
            matches = sorted(glob.glob(text, recursive=True))
            if not matches:
                raise DiagnoseError(f"no file matches {text!r}")
            groups.extend(_dump_files(Path(m)) for m in matches)
        else:
            groups.append(_dump_files(Path(text)))
    flat = [p for group in groups for p in group]
    for path in flat:
        if path.is_dir():
            raise DiagnoseError(f"cannot read {str(path)!r}: is a directory")
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            raise DiagnoseError(f"cannot read {str(path)!r}: {e.strerror or e}") from None
    return flat


def _dump_files(path: Path) -> list[Path]:
    """One input -> its files: a folder or an index -> the dump files, else ``[path]``."""
    if path.is_dir():
        index = dump_index(path / INDEX_NAME)
        if index is not None:
            return _listed(path / INDEX_NAME, index)
        files = sorted(
            p for p in path.iterdir() if p.is_file() and _is_dump(p) and dump_index(p) is None
        )
        if not files:
            raise DiagnoseError(
                f"{str(path)!r}: no dump files in this folder (expected .npz, .parquet/.pq "
                "or .jsonl/.json/.ndjson files, or an index.json listing them)"
            )
        return files
    index = dump_index(path)
    return [path] if index is None else _listed(path, index)


def _is_dump(path: Path) -> bool:
    return path.name.lower().endswith((".npz", *PARQUET_SUFFIXES, *JSONL_SUFFIXES))


def _listed(index_path: Path, index: dict) -> list[Path]:
    files = [index_path.parent / name for names in index["files"].values() for name in names]
    if not files:
        raise DiagnoseError(f"{str(index_path)!r}: lists no dump files")
    return files


def dump_index(path: Path) -> dict | None:
    """The dump index at ``path`` (the demo's ``index.json``: a JSON object whose
    ``"files"`` maps each row to file names beside it, and ``"steps"`` lists the
    training steps along the files' first axis), or None if ``path`` is not one."""
    try:
        if path.suffix.lower() != ".json" or path.stat().st_size > _INDEX_MAX_BYTES:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(v, list) and all(isinstance(n, str) for n in v) for v in files.values()
    ):
        return None
    return data


def row_locator(path: Path) -> Callable[[int], dict]:
    """``row -> {"step": ..., "row": ...}``: where a sequence of ``path`` sits in the dump.

    Readers number the sequences of a file by a flat row; an ``.npz`` array ``[K, B, T]``
    (the demo's: K dumped steps of B sequences) is flattened to ``K·B`` rows. This maps
    a flat row back to its training step (from the ``index.json`` beside the file, which
    lists the file and the K steps) and its row within that step, ``{"step": 150,
    "row": 55, "flat_row": 567}``; without such an index, to its index along the
    leading axes, ``{"row": [4, 55], "flat_row": 567}``. A file of ``[B, T]`` arrays,
    Parquet or JSONL keeps its row: ``{"row": 567}``.
    """
    shape: tuple[int, ...] = ()
    if file_format(path) == "npz":
        try:
            with np.load(path) as data:
                shape = tuple(data[NPZ_KEYS["mask"]].shape[:-1])
        except Exception:  # unreadable: check() reports it
            shape = ()
    if len(shape) < 2:
        return lambda row: {"row": int(row)}
    index = dump_index(path.parent / INDEX_NAME)
    steps = index.get("steps") if index is not None else None
    listed = index is not None and any(path.name in v for v in index["files"].values())
    if not (listed and isinstance(steps, list) and len(steps) == shape[0]):
        steps = None

    def locate(row: int) -> dict:
        where = [int(i) for i in np.unravel_index(int(row), shape)]
        if steps is None:  # no index: the position along each leading axis
            return {"row": where, "flat_row": int(row)}
        rest = where[1] if len(where) == 2 else where[1:]
        return {"step": steps[where[0]], "row": rest, "flat_row": int(row)}

    return locate


def file_format(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".npz"):
        return "npz"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    raise DiagnoseError(
        f"{str(path)!r}: unknown format (expected .npz, .parquet/.pq or .jsonl/.json/.ndjson)"
    )


def check(path: Path, columns: dict[str, str] | None = None) -> int | None:
    """Fails early on an unreadable or empty file or a missing column; returns its rows.

    The row count is returned where it is cheap (Parquet metadata, npz shapes) for the
    progress bar, else None (JSONL).
    """
    columns = {**DEFAULT_COLUMNS, **(columns or {})}
    fmt = file_format(path)
    if os.path.getsize(path) == 0:
        raise DiagnoseError(f"{str(path)!r}: empty file")
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            file = pq.ParquetFile(path)
        except Exception as e:  # ArrowInvalid / OSError, with multi-line text
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DiagnoseError(f"cannot read {str(path)!r} as Parquet: {reason}") from None
        _missing(path, columns, file.schema_arrow.names)
        rows = file.metadata.num_rows
    elif fmt == "npz":
        try:
            with np.load(path) as data:
                _missing(path, NPZ_KEYS, data.files)
                shape = data[NPZ_KEYS["mask"]].shape
        except DiagnoseError:
            raise
        except Exception as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DiagnoseError(f"cannot read {str(path)!r} as .npz: {reason}") from None
        # A 1-D [T] array is one sequence (np.prod of () is 1).
        rows = int(np.prod(shape[:-1])) if len(shape) >= 1 and shape[-1] else 0
    else:
        with open(path, "rb") as f:
            first = next((line for line in f if line.strip()), None)
        if first is None:
            raise DiagnoseError(f"{str(path)!r}: empty file (no sequences)")
        try:
            record = json.loads(_utf8(path, first, 1))
        except json.JSONDecodeError as e:
            raise DiagnoseError(f"{str(path)!r}: first line is not JSON ({e.msg})") from None
        if isinstance(record, dict):
            _missing(path, columns, list(record))
        return None
    if rows == 0:
        raise DiagnoseError(f"{str(path)!r}: empty file (no sequences)")
    return rows


def iter_chunks(
    paths: Sequence[Path], *, rows: int = 1024, columns: dict[str, str] | None = None
) -> Iterator[Chunk]:
    """Every sequence of every file, in chunks of at most ``rows`` sequences.

    Args:
      paths: files from :func:`expand_inputs`.
      rows: sequences per chunk.
      columns: Parquet/JSONL column names ``{"old": ..., "rollout": ..., "mask": ...}``.

    Raises:
      DiagnoseError: a missing column, a row whose lists differ in length, an empty or
        unreadable file.
    """
    columns = {**DEFAULT_COLUMNS, **(columns or {})}
    for index, path in enumerate(paths):
        fmt = file_format(path)
        reader = {"npz": _npz_chunks, "parquet": _parquet_chunks, "jsonl": _jsonl_chunks}[fmt]
        n = 0
        names = NPZ_KEYS if fmt == "npz" else columns
        for chunk in _reading(path, reader(path, rows, columns)):
            _check_values(path, names, chunk)
            chunk.file = np.full(chunk.old.shape[0], index, np.int32)
            n += chunk.old.shape[0]
            yield chunk
        if n == 0:
            raise DiagnoseError(f"{str(path)!r}: empty file (no sequences)")


def _check_values(path: Path, names: dict[str, str], chunk: Chunk) -> None:
    """DiagnoseError for values no dump may hold, naming the field and the token.

    A mask entry of +inf (or one too large for float32) would make every sum of its
    sequence inf; a log-prob above :data:`LOGPROB_TOLERANCE` at a valid token is not a
    log-prob. NaN/inf log-probs are counted by the analysis, not refused here; a mask
    entry that is not ``> 0`` (NaN, negative) is padding.
    """
    checks = [
        (
            "mask",
            chunk.mask == np.inf,
            "is +inf (or too large for float32); a mask entry is 0/1 or a finite weight",
        ),
    ]
    valid = chunk.mask > 0
    for key in ("old", "rollout"):
        values = getattr(chunk, key)
        with np.errstate(invalid="ignore"):
            bad = valid & np.isfinite(values) & (values > LOGPROB_TOLERANCE)
        checks.append(
            (
                key,
                bad,
                f"is above 0 (more than {LOGPROB_TOLERANCE:g}), so it is not a "
                "log-prob (log p <= 0); negative log-likelihoods must be negated",
            )
        )
    for key, bad, what in checks:
        if not bad.any():
            continue
        i, pos = (int(v) for v in np.argwhere(bad)[0])
        value = float(getattr(chunk, key)[i, pos])
        count = int(bad.sum())
        more = f" ({count:,} such entries in this chunk)" if count > 1 else ""
        raise DiagnoseError(
            f"{str(path)!r} row {int(chunk.row[i])} position {int(chunk.start[i]) + pos}: "
            f"{names[key]!r} = {value:g} {what}{more}"
        )


def _reading(path: Path, chunks: Iterator[Chunk]) -> Iterator[Chunk]:
    """``chunks``, with any error a reader did not foresee (a value of the wrong kind
    deep in a file) turned into the one-line :class:`DiagnoseError` of the CLI."""
    try:
        yield from chunks
    except DiagnoseError:
        raise
    except (ValueError, TypeError, OverflowError, UnicodeError, KeyError, OSError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DiagnoseError(f"cannot read {str(path)!r}: {reason}") from None


def _utf8(path: Path, raw: bytes, line_no: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DiagnoseError(
            f"{str(path)!r} line {line_no}: not UTF-8 text (byte {e.start}); JSONL must be UTF-8"
        ) from None


def _numbers(path: Path, line_no: int, name: str, values: list) -> list:
    """``values`` if every entry is a number, a bool or null (JSON), else DiagnoseError."""
    for value in values:
        if value is not None and type(value) not in (int, float, bool):
            raise DiagnoseError(
                f"{str(path)!r} line {line_no}: column {name!r} must be a list of numbers "
                f"(or null), got an entry of type {type(value).__name__}"
            )
    return values


# --------------------------------------------------------------------------- padding


LONG_SEQUENCE = 1 << 16
"""A sequence longer than this is analysed in a chunk of its own (when padding is split)."""


def length_groups(length: np.ndarray) -> list[np.ndarray]:
    """Row indices of one batch in groups that are padded separately, so that padding
    costs at most about twice the tokens.

    One chunk padded to its longest sequence is the fast path (one shape, one
    compilation) and is kept while it wastes little. A skewed batch (one 2M-token
    sequence beside 1,023 of 64 tokens) would be 1024 x 2M padded cells, 8 GiB per
    column: there the rows are sorted by length, longest first, and a group grows
    while its padded size stays within twice its tokens.
    """
    b = length.shape[0]
    longest = int(length.max(initial=0))
    if b * longest <= 4 * int(length.sum()) + b * 512:
        return [np.arange(b)]
    order = np.argsort(-length, kind="stable")
    groups, start, tokens = [], 0, 0
    for i, row in enumerate(order):
        top = int(length[order[start]])
        # A very long sequence is a group of its own: every [B, T] temporary of the
        # analysis is then one row wide.
        alone = top > LONG_SEQUENCE
        if i > start and (alone or (i - start + 1) * top > 2 * (tokens + int(length[row])) + 512):
            groups.append(np.sort(order[start:i]))
            start, tokens = i, 0
        tokens += int(length[row])
    groups.append(np.sort(order[start:]))
    return groups


def _pad_lists(
    path: Path, first_row: int, names: Sequence[str], lists: Sequence[tuple[np.ndarray, np.ndarray]]
) -> Iterator[Chunk]:
    """(values, offsets) of three list columns -> padded :class:`Chunk` objects (one,
    or one per :func:`length_groups` group of a skewed batch); checks raggedness."""
    lengths = [np.diff(offsets) for _, offsets in lists]
    for name, length in zip(names[1:], lengths[1:], strict=True):
        bad = np.flatnonzero(length != lengths[0])
        if bad.size:
            i = int(bad[0])
            raise DiagnoseError(
                f"{str(path)!r} row {first_row + i}: {names[0]!r} has {lengths[0][i]} values "
                f"but {name!r} has {length[i]} (the lists of one row must have equal lengths)"
            )
    for group in length_groups(lengths[0]):
        yield _pad_group(group, first_row, lengths[0], lists)


def _pad_group(
    group: np.ndarray,
    first_row: int,
    length: np.ndarray,
    lists: Sequence[tuple[np.ndarray, np.ndarray]],
) -> Chunk:
    """The rows ``group`` (indices into the batch) of three list columns, padded."""
    b = group.shape[0]
    size = length[group]
    t = max(int(size.max(initial=0)), 1)
    row_of = np.repeat(np.arange(b), size)
    padded = []
    for values, offsets in lists:
        # Each row's values, in group order: starts offsets[group], lengths size.
        start_of = np.repeat(offsets[group] - np.concatenate([[0], np.cumsum(size)[:-1]]), size)
        flat_index = np.arange(int(size.sum())) + start_of
        col_of = np.arange(flat_index.shape[0]) - np.repeat(
            np.concatenate([[0], np.cumsum(size)[:-1]]), size
        )
        out = np.zeros((b, t), np.float32)
        out[row_of, col_of] = values[flat_index]
        padded.append(out)
    rows = (first_row + group).astype(np.int64)
    return Chunk(*padded, file=np.zeros(b, np.int32), row=rows, start=np.zeros(b, np.int64))


def _missing(path: Path, wanted: dict[str, str], found: Sequence[str]) -> None:
    flag = {"old": "--old-col", "rollout": "--rollout-col", "mask": "--mask-col"}
    for key, name in wanted.items():
        if name not in found:
            shown = ", ".join(map(repr, found)) or "none"
            raise DiagnoseError(
                f"{str(path)!r}: missing column {name!r} (columns found: {shown}; "
                f"choose another with {flag.get(key, key)})"
            )


# --------------------------------------------------------------------------- Parquet


def _list_parts(path: Path, name: str, array) -> tuple[np.ndarray, np.ndarray]:
    import pyarrow as pa

    if isinstance(array, pa.ChunkedArray):
        array = pa.concat_arrays(array.chunks)
    if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)):
        raise DiagnoseError(
            f"{str(path)!r}: column {name!r} must hold one list per row, got type {array.type}"
        )
    value_type = array.type.value_type
    if not (
        pa.types.is_integer(value_type)
        or pa.types.is_floating(value_type)
        or pa.types.is_boolean(value_type)
        or pa.types.is_null(value_type)
    ):
        raise DiagnoseError(
            f"{str(path)!r}: column {name!r} must hold lists of numbers, got type {array.type}"
        )
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = array.values.to_numpy(zero_copy_only=False)  # nulls come back as NaN
    return values.astype(np.float32, copy=False), offsets


def _parquet_chunks(path: Path, rows: int, columns: dict[str, str]) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    try:
        # pre_buffer=False: with pre-buffering, iter_batches keeps every column chunk it
        # has read in Arrow's memory pool until the file is closed, so memory grew with
        # the dump (2.6 GB peak RSS on a 2 GB file); without it, it stays flat.
        file = pq.ParquetFile(path, pre_buffer=False)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError with multi-line text
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        if os.path.getsize(path) == 0:
            reason = "empty file"
        raise DiagnoseError(f"cannot read {str(path)!r} as Parquet: {reason}") from None
    names = [columns["old"], columns["rollout"], columns["mask"]]
    _missing(path, columns, file.schema_arrow.names)
    first = 0
    for batch in file.iter_batches(batch_size=rows, columns=names):
        parts = [_list_parts(path, n, batch.column(n)) for n in names]
        yield from _pad_lists(path, first, names, parts)
        first += batch.num_rows


# --------------------------------------------------------------------------- JSONL


def _jsonl_chunks(path: Path, rows: int, columns: dict[str, str]) -> Iterator[Chunk]:
    names = [columns["old"], columns["rollout"], columns["mask"]]
    buffers: list[list] = [[], [], []]
    first = 0
    line_no = 0

    def flush():
        parts = []
        for buf in buffers:
            lengths = np.array([len(x) for x in buf], np.int64)
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            flat = [v for x in buf for v in x]
            values = np.array([np.nan if v is None else v for v in flat], np.float64)
            parts.append((values.astype(np.float32), offsets))
        return list(_pad_lists(path, first, names, parts))

    with open(path, "rb") as f:
        for raw in f:
            line_no += 1
            if not raw.strip():
                continue
            line = _utf8(path, raw, line_no)
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DiagnoseError(f"{str(path)!r} line {line_no}: not JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise DiagnoseError(f"{str(path)!r} line {line_no}: expected a JSON object")
            _missing(path, columns, list(record))
            for buf, name in zip(buffers, names, strict=True):
                value = record[name]
                if not isinstance(value, list):
                    raise DiagnoseError(
                        f"{str(path)!r} line {line_no}: column {name!r} must be a list"
                    )
                buf.append(_numbers(path, line_no, name, value))
            if len(buffers[0]) == rows:
                yield from flush()
                first += rows
                buffers = [[], [], []]
    if buffers[0]:
        yield from flush()


# --------------------------------------------------------------------------- npz


def _npz_chunks(path: Path, rows: int, columns: dict[str, str]) -> Iterator[Chunk]:
    try:
        data = np.load(path)
    except Exception as e:
        reason = "empty file" if os.path.getsize(path) == 0 else str(e).splitlines()[0]
        raise DiagnoseError(f"cannot read {str(path)!r} as .npz: {reason}") from None
    with data:
        _missing(path, NPZ_KEYS, data.files)
        keys = [NPZ_KEYS[k] for k in ("old", "rollout", "mask")]
        keys += ["segment_ids"] if "segment_ids" in data.files else []
        loaded = [_npz_array(path, data, key) for key in keys]
        topk = _npz_topk(path, data)
    arrays, segments = loaded[:3], (loaded[3] if len(loaded) > 3 else None)
    if segments is not None and segments.dtype.kind not in "biu":
        raise DiagnoseError(
            f"{str(path)!r}: 'segment_ids' must be integers, got dtype {segments.dtype}"
        )
    shape = arrays[0].shape
    for name, array in zip(("rollout_logp", "mask"), arrays[1:], strict=True):
        if array.shape != shape:
            raise DiagnoseError(
                f"{str(path)!r}: {name!r} has shape {array.shape} but 'old_logp' has {shape}"
            )
    if segments is not None and segments.shape != shape:
        raise DiagnoseError(
            f"{str(path)!r}: 'segment_ids' has shape {segments.shape} but 'old_logp' has {shape}"
        )
    for name, array in topk.items():
        if array.ndim != len(shape) + 1 or array.shape[:-1] != shape or array.shape[-1] < 1:
            raise DiagnoseError(
                f"{str(path)!r}: {name!r} has shape {array.shape}; expected [..., T, K] with "
                f"[..., T] = {shape}, the shape of 'old_logp'"
            )
    if len(shape) == 0 or shape[-1] == 0 or int(np.prod(shape)) == 0:
        return
    t = shape[-1]
    old, rollout, mask = (a.reshape(-1, t) for a in arrays)
    k_arrays = [topk[k].reshape(-1, t, topk[k].shape[-1]) for k in _TOPK_KEYS if k in topk]
    segments = None if segments is None else segments.reshape(-1, t)
    for lo in range(0, old.shape[0], rows):
        hi = min(lo + rows, old.shape[0])
        with np.errstate(over="ignore"):  # beyond float32 is inf: _check_values names it
            parts = [a[lo:hi].astype(np.float32) for a in (old, rollout, mask, *k_arrays)]
        row = np.arange(lo, hi, dtype=np.int64)
        if segments is None:
            chunk = Chunk(
                *parts[:3], file=np.zeros(hi - lo, np.int32), row=row, start=np.zeros_like(row)
            )
        else:
            chunk = _unpack(parts[:3], segments[lo:hi], row, parts[3:])
        if k_arrays and segments is None:
            chunk.topk_old, chunk.topk_rollout = parts[3], parts[4]
        yield chunk


_TOPK_KEYS = ("topk_old_logp", "topk_rollout_logp")


def _npz_topk(path: Path, data) -> dict[str, np.ndarray]:
    """The optional top-k arrays of an ``.npz`` dump: both log-prob arrays or neither."""
    present = [k for k in _TOPK_KEYS if k in data.files]
    if len(present) == 1:
        other = next(k for k in _TOPK_KEYS if k not in present)
        raise DiagnoseError(
            f"{str(path)!r}: {present[0]!r} needs {other!r} too (the trainer's and the "
            "engine's log-probs of the same top-k ids)"
        )
    out = {k: _npz_array(path, data, k) for k in present}
    if present and "topk_ids" in data.files:
        ids = _npz_array(path, data, "topk_ids")
        if ids.shape != out["topk_old_logp"].shape:
            raise DiagnoseError(
                f"{str(path)!r}: 'topk_ids' has shape {ids.shape} but 'topk_old_logp' has "
                f"{out['topk_old_logp'].shape}"
            )
    return out


def _npz_array(path: Path, data, key: str) -> np.ndarray:
    """``data[key]`` as a numeric array, else DiagnoseError (object arrays need pickle,
    which is never allowed; strings are not log-probs)."""
    try:
        array = np.asarray(data[key])
    except ValueError as e:  # "Object arrays cannot be loaded when allow_pickle=False"
        raise DiagnoseError(f"{str(path)!r}: {key!r} cannot be read ({e})") from None
    if array.dtype.kind not in "biuf":
        raise DiagnoseError(f"{str(path)!r}: {key!r} must be numeric, got dtype {array.dtype}")
    return array


def _unpack(
    parts: list[np.ndarray], segments: np.ndarray, row: np.ndarray, topk: Sequence = ()
) -> Chunk:
    """Packed rows -> one sequence per contiguous run of a segment id (``topk``: the
    ``[B, T, K]`` top-k log-probs, unpacked alike).

    An id ``<= 0`` is padding whatever the mask says, as in the library
    (docs/semantics.md §10): its runs keep no token.
    """
    b, t = segments.shape
    parts = [*parts[:2], np.where(segments > 0, parts[2], 0.0).astype(np.float32)]
    change = np.ones((b, t), bool)
    change[:, 1:] = segments[:, 1:] != segments[:, :-1]
    flat_change = change.ravel()
    starts = np.flatnonzero(flat_change)
    run = np.cumsum(flat_change) - 1
    run_len = np.diff(np.append(starts, b * t))
    pos = np.arange(b * t) - starts[run]
    out = []
    for part in [*parts, *topk]:
        unpacked = np.zeros((starts.size, int(run_len.max()), *part.shape[2:]), np.float32)
        unpacked[run, pos] = part.reshape(b * t, *part.shape[2:])
        out.append(unpacked)
    chunk = Chunk(
        *out[:3],
        file=np.zeros(starts.size, np.int32),
        row=row[starts // t],
        start=(starts % t).astype(np.int64),
    )
    if topk:
        chunk.topk_old, chunk.topk_rollout = out[3], out[4]
    return chunk


# --------------------------------------------------------------------------- writer


def write_dump(
    path: str | os.PathLike[str],
    *,
    old_logp,
    rollout_logp,
    mask,
    advantages=None,
    segment_ids=None,
) -> Path:
    """Writes log-probs in a format ``offpolicy-jax diagnose`` reads; the suffix picks it.

    ``.npz``: the arrays as given (keys ``old_logp``, ``rollout_logp``, ``mask``, and
    ``advantages`` / ``segment_ids`` when given). ``.parquet`` / ``.jsonl``: one row per
    sequence with list columns ``old_log_probs``, ``rollout_log_probs``,
    ``response_mask`` (and ``advantages``), each row cut after its last masked-in
    token; ``segment_ids`` is npz-only.

    Args:
      path: output file; ``.npz``, ``.parquet`` or ``.jsonl``.
      old_logp, rollout_logp: ``[..., T]`` log-probs of the sampled tokens under the
        trainer and the rollout engine (any float dtype; stored as float32).
      mask: ``[..., T]`` bool or 0/1: tokens that are trained on.
      advantages: optional ``[..., T]`` per-token or ``[...]`` per-sequence advantages.
      segment_ids: optional ``[..., T]`` integer ids of packed sequences (npz only).

    Returns:
      The path written.
    """
    path = Path(path)
    old = np.asarray(old_logp, np.float32)
    rollout = np.asarray(rollout_logp, np.float32)
    m = np.asarray(mask)
    if old.ndim == 0 or rollout.shape != old.shape or m.shape != old.shape:
        raise ValueError(
            f"write_dump: old_logp {old.shape}, rollout_logp {rollout.shape} and mask "
            f"{m.shape} must have one shape [..., T]"
        )
    adv = None if advantages is None else np.asarray(advantages, np.float32)
    if adv is not None and adv.shape not in (old.shape, old.shape[:-1]):
        raise ValueError(
            f"write_dump: advantages must have shape {old.shape} or {old.shape[:-1]}, "
            f"got {adv.shape}"
        )
    fmt = file_format(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "npz":
        arrays = {"old_logp": old, "rollout_logp": rollout, "mask": m}
        if adv is not None:
            arrays["advantages"] = adv
        if segment_ids is not None:
            seg = np.asarray(segment_ids)
            if seg.shape != old.shape:
                raise ValueError(f"write_dump: segment_ids must have shape {old.shape}")
            arrays["segment_ids"] = seg
        with open(path, "wb") as f:  # np.savez would append .npz to other names
            np.savez_compressed(f, **arrays)
        return path
    if segment_ids is not None:
        raise ValueError("write_dump: segment_ids can only be written to .npz")
    t = old.shape[-1]
    old, rollout, m = old.reshape(-1, t), rollout.reshape(-1, t), m.reshape(-1, t)
    if adv is not None:
        adv = adv.reshape(-1, t) if adv.shape == old.shape else adv.reshape(-1)
    keep = m.astype(bool)
    lengths = np.where(keep.any(-1), t - np.argmax(keep[:, ::-1], axis=-1), 0)
    columns = {"old": old, "rollout": rollout, "mask": m.astype(np.int8)}

    def cut(a, i):
        return a[i, : lengths[i]].tolist()

    if fmt == "jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for i in range(old.shape[0]):
                record = {DEFAULT_COLUMNS[k]: cut(v, i) for k, v in columns.items()}
                if adv is not None:
                    record["advantages"] = cut(adv, i) if adv.ndim == 2 else float(adv[i])
                f.write(json.dumps(record) + "\n")
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq

    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    keep_flat = np.arange(t)[None, :] < lengths[:, None]

    def as_list(a):
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(a[keep_flat]))

    table = {DEFAULT_COLUMNS[k]: as_list(v) for k, v in columns.items()}
    if adv is not None:
        table["advantages"] = as_list(adv) if adv.ndim == 2 else pa.array(adv)
    pq.write_table(pa.table(table), path)
    return path
