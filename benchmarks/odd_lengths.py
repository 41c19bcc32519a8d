"""Odd and prime token counts against the nearest multiple of 128, call beside call.

``python -m benchmarks.odd_lengths --out benchmarks/ragged`` writes ``paired.md`` /
``paired.json``. For each pair of ``workloads.RAGGED_SIZES`` (an odd or prime ``T``
and its aligned neighbour, same ``B``) and each computation of ``workloads`` (the
``mis.yaml`` training step, ``compute_correction``, the Trust Region Masking + IcePop
step) it compiles both sizes and times them alternately, call by call: each ragged
call's time per token over the aligned call's right beside it, median over the calls
(quartiles too). The target: at most 1.25 (a cliff of 7x at ``T = 131071`` was found once).

Why not the ragged table of ``run.py --ragged``: that one divides medians measured
minutes apart, one size after the other, and on a shared machine whose speed drifts
by 2x over a run the same cell read 0.72, 1.02 and 4.05 in three runs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import jax

from benchmarks import workloads
from benchmarks.paired import environment, environment_line, paired_cell, paired_ratio


def pairs(text: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """``(ragged, aligned)`` ``(B, T)`` pairs from a ``BxT,...`` list."""
    sizes = [tuple(int(x) for x in item.lower().split("x")) for item in text.split(",")]
    out = []
    for batch, length in sizes:
        if length % 128:
            aligned = (batch, workloads.nearest_aligned(length))
            if aligned not in sizes:
                raise ValueError(f"{batch}x{length} has no aligned neighbour {aligned} listed")
            out.append(((batch, length), aligned))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=workloads.RAGGED_SIZES, help="BxT,BxT,...")
    parser.add_argument("--repeats", type=int, default=31, help="timed call pairs")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)

    rows = []
    load_before = os.getloadavg()[0]
    for ragged, aligned in pairs(args.sizes):
        both = {
            size: {c.name: c for c in workloads.computations(*size, None)}
            for size in (ragged, aligned)
        }
        for name in both[ragged]:
            calls = {}
            for size in (ragged, aligned):
                comp = both[size][name]
                compiled = comp.compile(comp.step)
                tokens = comp.host_inputs["mask"].size
                calls[size] = (compiled, comp.args, tokens)
            for compiled, call_args, _ in calls.values():
                for _ in range(3):
                    jax.block_until_ready(compiled(*call_args))
            per_token: dict[tuple[int, int], list[float]] = {size: [] for size in calls}
            for _ in range(args.repeats):
                for size, (compiled, call_args, tokens) in calls.items():
                    start = time.perf_counter()
                    jax.block_until_ready(compiled(*call_args))
                    per_token[size].append((time.perf_counter() - start) / tokens * 1e9)
            paired = paired_ratio(per_token[ragged], per_token[aligned])
            low, high = paired["paired_quartiles"]
            row = {
                "computation": name,
                "ragged": list(ragged),
                "aligned": list(aligned),
                "ragged_ns_per_token": statistics.median(per_token[ragged]),
                "aligned_ns_per_token": statistics.median(per_token[aligned]),
                **paired,
            }
            rows.append(row)
            print(
                f"{name:>16} {ragged[0]}x{ragged[1]} vs {aligned[0]}x{aligned[1]}: "
                f"{row['paired_ratio']:.2f} ({low:.2f}-{high:.2f})",
                flush=True,
            )
    report = {
        "command": "python -m benchmarks.odd_lengths",
        **environment(load_before),
        "repeats": args.repeats,
        "rows": rows,
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "paired.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "paired.md").write_text(render(report))


def render(report: dict) -> str:
    lines = [
        "# Odd and prime lengths against the nearest multiple of 128 (paired)",
        "",
        f"{environment_line(report)}; {report['repeats']} call pairs.",
        "",
        "Each ragged call's time per token over the aligned call's right beside it: median "
        "(quartiles in brackets). Target: at most 1.25.",
        "",
        "| computation | ragged [B, T] | ns/token | aligned [B, T] | ns/token | **paired ratio** |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['computation']} | {r['ragged'][0]} x {r['ragged'][1]} | "
            f"{r['ragged_ns_per_token']:.2f} | {r['aligned'][0]} x {r['aligned'][1]} | "
            f"{r['aligned_ns_per_token']:.2f} | {paired_cell(r)} |"
        )
    worst = max(r["paired_ratio"] for r in report["rows"])
    verdict = "met" if worst <= 1.25 else "**not met**"
    lines += ["", f"Largest paired ratio: {worst:.2f} (target <= 1.25): {verdict}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
