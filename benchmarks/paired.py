"""Paired timing: each call's time over the call of the other variant right beside it.

On a shared machine whose speed drifts during a run, two variants timed alternately
share the machine's state call by call; the median of those per-call ratios is steadier
than the ratio of two medians. Used by ``benchmarks.compare`` and ``benchmarks.odd_lengths``.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
from collections.abc import Sequence

import jax


def paired_ratio(these: Sequence[float], those: Sequence[float]) -> dict[str, object]:
    """Median and quartiles of ``these[i] / those[i]`` (times of calls made side by side)."""
    ratios = sorted(a / b for a, b in zip(these, those, strict=True))
    low, _, high = statistics.quantiles(ratios, n=4)
    return {"paired_ratio": statistics.median(ratios), "paired_quartiles": [low, high]}


def environment(load_before: float) -> dict[str, object]:
    """Date, versions, CPUs and load average around a run (recorded at its end)."""
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "cpus": len(os.sched_getaffinity(0)),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


def environment_line(report: dict) -> str:
    """``report``'s command and :func:`environment` as one sentence of a results file."""
    return (
        f"Produced by `{report['command']}` on {report['date']}; jax {report['jax']}, Python "
        f"{report['python']}, {report['cpus']} CPUs, load average (1 min) "
        f"{report['load_before']:.2f} before / {report['load_after']:.2f} after"
    )


def paired_cell(row: dict) -> str:
    """A row's paired ratio as a results-table cell: ``**median** (q1-q3)``."""
    low, high = row["paired_quartiles"]
    return f"**{row['paired_ratio']:.2f}** ({low:.2f}-{high:.2f})"
