"""``offpolicy-jax diagnose``: how bad is the training–inference mismatch, and which correction?

Reads trainer and rollout log-probs of the same tokens (``.npz``, Parquet, JSONL), streams
them in chunks through :func:`offpolicy_jax.compute_correction`, and writes a report with
the pooled metrics, histograms, worst sequences and tokens, a what-if table of the
standard corrections and a recommended config (``recommended.yaml``). Needs the
``diagnose`` extra (pyarrow, matplotlib, tqdm); the core library never imports it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from offpolicy_jax.diagnose import analysis, report
from offpolicy_jax.diagnose.analysis import WHAT_IFS, Accumulator, WhatIf
from offpolicy_jax.diagnose.readers import DEFAULT_COLUMNS, DiagnoseError, write_dump
from offpolicy_jax.diagnose.report import recommend

__all__ = [
    "DEFAULT_COLUMNS",
    "WHAT_IFS",
    "Accumulator",
    "DiagnoseError",
    "WhatIf",
    "diagnose",
    "recommend",
    "write_dump",
]


def diagnose(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str] | None = None,
    *,
    old_col: str = DEFAULT_COLUMNS["old"],
    rollout_col: str = DEFAULT_COLUMNS["rollout"],
    mask_col: str = DEFAULT_COLUMNS["mask"],
    reduction: str = "sequence",
    chunk_rows: int = 1024,
    position_bin: int | None = None,
    top_k: int = 20,
    progress: bool = False,
) -> dict:
    """Analyses a log-prob dump; returns the report dict and writes it to ``out`` if given.

    Args:
      inputs: file paths or globs (``.npz``, ``.parquet``, ``.jsonl``), or dump folders
        (the demo's ``--dump-logprobs`` folder or its ``index.json``: the files listed).
      out: output directory for ``report.md``, ``report.json``, ``recommended.yaml`` and
        the PNG plots; None writes nothing.
      old_col, rollout_col, mask_col: Parquet/JSONL column names.
      reduction: ``"sequence"`` or ``"token"`` reduction of the metrics.
      chunk_rows: sequences per chunk (memory is O(chunk_rows x longest sequence)).
      position_bin: width of the position buckets of the position profile; None picks
        the largest power of two giving 32 buckets over the first chunk's length.
      top_k: how many worst sequences and tokens are kept.
      progress: show a tqdm progress bar on stderr.

    Returns:
      The report (the content of ``report.json``); ``report["metrics"]`` equals
      ``compute_correction(..., CorrectionConfig(), reduction=reduction).metrics`` on
      all the sequences at once, and ``report["what_if"][name]["metrics"]`` the same for
      each standard config.

    Raises:
      DiagnoseError: bad input (the message is one line).
    """
    from offpolicy_jax.diagnose import readers

    if reduction not in ("sequence", "token"):
        raise DiagnoseError(f"reduction must be 'sequence' or 'token', got {reduction!r}")
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    paths = readers.expand_inputs(inputs)
    columns = {"old": old_col, "rollout": rollout_col, "mask": mask_col}
    counts = [readers.check(path, columns) for path in paths]  # fail before any work
    configs = [("metrics", analysis.METRICS_ONLY)]
    configs += [(w.name, w.build()) for w in WHAT_IFS]
    acc = Accumulator(configs, reduction, position_bin=position_bin, top_k=top_k, rows=chunk_rows)
    known = [c for c in counts if c is not None]
    total = sum(known) if len(known) == len(counts) else None
    bar = None
    try:
        for chunk in readers.iter_chunks(paths, rows=chunk_rows, columns=columns):
            acc.add(chunk)
            if progress and bar is None:  # after the first chunk: bad input fails first
                from tqdm import tqdm

                bar = tqdm(
                    total=total, unit="row", unit_scale=True, desc="diagnose", file=sys.stderr
                )
            if bar is not None:
                bar.update(int(np.unique(chunk.row).size))  # packed rows hold several
    finally:
        if bar is not None:
            bar.close()
    _check_something_to_diagnose(acc.totals)
    result = report.build(acc, [str(p) for p in paths])
    locators = {str(p): readers.row_locator(p) for p in paths}
    located = result["worst_sequences"] + result["worst_tokens"] + result["k3_drivers"]["tokens"]
    for item in located:
        item.update(locators[item["file"]](item["row"]))  # step and row, not a flat row
    if out is not None:
        report.write(result, Path(out))
    return result


def _check_something_to_diagnose(totals: dict[str, int]) -> None:
    """A dump without one valid sequence (every one empty, or with a NaN/inf log-prob at
    a valid token) has metrics of 0, which read as "no mismatch": refuse to recommend."""
    valid = totals["sequences"] - totals["nonfinite_sequences"]
    if valid > 0:
        return
    if totals["sequences"] == 0:
        raise DiagnoseError(
            "nothing to diagnose: every sequence is empty (no token has mask > 0); check "
            "--mask-col and the mask values"
        )
    raise DiagnoseError(
        f"nothing to diagnose: all {totals['sequences']:,} non-empty sequences have NaN/inf "
        f"log-probs at valid tokens ({totals['nonfinite_tokens']:,} tokens); the dump's "
        "log-probs are broken, not mismatched"
    )
