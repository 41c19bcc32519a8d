"""Packed vs padded ``policy_loss``: ``python -m benchmarks.packing [--sizes 64x2048,...]``.

For each ``[B, T]`` size, the padded workload of ``benchmarks/workloads.py`` (one
sequence per row, lengths uniform in ``[T/8, T]``, so about 44% of the tokens are
padding) is taken apart into its ``B`` sequences, which are packed first fit into
rows of ``--row-factor · T`` tokens (4.5: room for 8 sequences of the mean
length ``9T/16``) holding at most ``--segments`` sequences each
(:func:`offpolicy_jax.pack_sequences`). Both layouts then run the same step,
forward + backward of :func:`offpolicy_jax.policy_loss` (decoupled PPO, the
reference ``mis.yaml`` correction, every metric), on the same valid tokens.

Reported per layout: the median time of ``--repeats`` interleaved calls, the time
per *valid* token, the cold compile time (trace + lower + compile after
``jax.clear_caches()``, the two layouts alternating) and the compiled temporary
memory. The targets: packed time per valid token <= 1.5x the padded layout's, and
packed compile <= 1.5x padded. Both layouts hold the same valid tokens, so the first
is the ratio of their times; the headline is the *paired* ratio (each packed call
over the padded call beside it, median and quartiles: ``benchmarks/paired.py``),
steadier than the ratio of the medians on a machine whose speed drifts during the
run (or that other work shares). The default size, ``64x4096``, is 64 sequences of
U(512, 4096) tokens packed into rows of 18432 tokens, ``K = 8``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import offpolicy_jax as opj
from benchmarks import workloads
from benchmarks.paired import paired_cell, paired_ratio

HERE = pathlib.Path(__file__).resolve().parent
NAMES = ("logp", "old_logp", "rollout_logp", "advantages", "mask")


def packed_inputs(host: dict[str, np.ndarray], row_length: int, segments: int):
    """The padded batch's sequences, packed first fit (longest first)."""
    lengths = host["mask"].sum(-1)
    seqs = [{k: host[k][i, :n] for k in NAMES} for i, n in enumerate(lengths)]
    return opj.pack_sequences(seqs, row_length, max_segments=segments, sort=True)


def padded_step(config):
    def step(logp, old, rollout, adv, mask):
        def loss(lp):
            return opj.policy_loss(lp, old, rollout, adv, mask, config)

        return jax.value_and_grad(loss, has_aux=True)(logp)

    return step


def packed_step(config, k):
    def step(logp, old, rollout, adv, mask, segment_ids):
        def loss(lp):
            return opj.policy_loss(
                lp,
                old,
                rollout,
                adv,
                mask,
                config,
                segment_ids=segment_ids,
                num_segments=k,
            )

        return jax.value_and_grad(loss, has_aux=True)(logp)

    return step


def cold_compiles(runs: dict, repeats: int) -> dict[str, list[float]]:
    """Cold trace + lower + compile of each run, ``repeats`` times, the runs alternating
    (so that a busy machine slows them alike)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (fn, args) in runs.items():
            jax.clear_caches()
            start = time.perf_counter()
            jax.jit(fn).lower(*args).compile()
            times[name].append(time.perf_counter() - start)
    return times


def measure(batch: int, length: int, args) -> dict:
    host = workloads.make_inputs(batch, length)
    config = workloads.reference_loss_config()
    row_length = max(128, round(args.row_factor * length / 128) * 128)
    packed = packed_inputs(host, row_length, args.segments)
    k = packed.num_segments
    padded_args = tuple(jnp.asarray(host[n]) for n in NAMES)
    packed_args = tuple(jnp.asarray(packed.arrays[n]) for n in NAMES) + (
        jnp.asarray(packed.segment_ids),
    )
    runs = {
        "padded": (padded_step(config), padded_args),
        "packed": (packed_step(config, k), packed_args),
    }
    compiled = {name: jax.jit(fn).lower(*a).compile() for name, (fn, a) in runs.items()}
    # the same loss and metrics in both layouts
    loss_padded = float(compiled["padded"](*padded_args)[0][0])
    loss_packed = float(compiled["packed"](*packed_args)[0][0])
    samples = {name: [] for name in runs}
    for _ in range(args.warmup):
        for name, c in compiled.items():
            jax.block_until_ready(c(*runs[name][1]))
    for _ in range(args.repeats):
        for name, c in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(c(*runs[name][1]))
            samples[name].append(time.perf_counter() - start)
    valid = int(host["mask"].sum())
    out = {
        "batch": batch,
        "length": length,
        "valid_tokens": valid,
        "packed_shape": list(packed.segment_ids.shape),
        "num_segments": k,
        "segments_per_row": float(np.mean([len(set(r[r > 0])) for r in packed.segment_ids])),
        "padded_fill": valid / host["mask"].size,
        "packed_fill": valid / packed.segment_ids.size,
        "loss_padded": loss_padded,
        "loss_packed": loss_packed,
    }
    compiles = cold_compiles(runs, args.compile_repeats)
    for name in runs:
        median = statistics.median(samples[name])
        memory = compiled[name].memory_analysis()
        out[name] = {
            "ms": median * 1e3,
            "min_ms": min(samples[name]) * 1e3,
            "ns_per_valid_token": median / valid * 1e9,
            "compile_s": statistics.median(compiles[name]),
            "temp_mb": None if memory is None else memory.temp_size_in_bytes / 1e6,
        }
    out["ratio"] = out["packed"]["ms"] / out["padded"]["ms"]
    out["ratio_min"] = out["packed"]["min_ms"] / out["padded"]["min_ms"]
    out.update(paired_ratio(samples["packed"], samples["padded"]))
    compile_paired = paired_ratio(compiles["packed"], compiles["padded"])
    out["compile_paired_ratio"] = compile_paired["paired_ratio"]
    out["compile_paired_quartiles"] = compile_paired["paired_quartiles"]
    out["packed"]["compile_over_padded"] = out["packed"]["compile_s"] / out["padded"]["compile_s"]
    return out


def markdown(results, command) -> str:
    lines = [
        "# Packed vs padded `policy_loss` (forward + backward, decoupled PPO, mis.yaml)",
        "",
        f"Produced by `{command}`; jax {jax.__version__}, {jax.devices()[0].device_kind}, "
        f"{len(os.sched_getaffinity(0))} CPUs, load average {os.getloadavg()[0]:.1f}.",
        "",
        "Both layouts run in one process on the same valid tokens, timed call by call, "
        "interleaved (the CPU is shared with other work: only the paired ratios are "
        "meaningful). Targets: packed / padded time per valid token <= 1.5 and packed / "
        "padded compile <= 1.5. *paired*: the median (quartiles) over calls of each packed "
        "call's time over the padded call beside it; *medians*: the ratio of the two "
        "medians (of the two minima). *compile*: cold trace + lower + compile, the two "
        "layouts alternating; *compile paired*: the median (quartiles) of each packed "
        "compile over the padded compile beside it.",
        "",
        "| padded [B, T] | packed [R, T'] | K (mean used) | fill padded / packed | layout "
        "| ms | ns/valid tok | **packed / padded, paired** | medians (minima) "
        "| compile s | **compile packed / padded, paired** | temp MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        shape = f"{r['packed_shape'][0]} x {r['packed_shape'][1]}"
        for name in ("padded", "packed"):
            q = r[name]
            if name == "padded":
                paired, medians, over = "–", "–", "–"
            else:
                paired = paired_cell(r)
                medians = f"{r['ratio']:.2f} ({r['ratio_min']:.2f})"
                over = paired_cell(
                    {
                        "paired_ratio": r["compile_paired_ratio"],
                        "paired_quartiles": r["compile_paired_quartiles"],
                    }
                )
            lines.append(
                f"| {r['batch']} x {r['length']} | {shape} "
                f"| {r['num_segments']} ({r['segments_per_row']:.1f}) "
                f"| {r['padded_fill']:.2f} / {r['packed_fill']:.2f} | {name} "
                f"| {q['ms']:.2f} | {q['ns_per_valid_token']:.2f} | {paired} | {medians} "
                f"| {q['compile_s']:.2f} | {over} | {q['temp_mb']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.packing", description=__doc__)
    parser.add_argument("--sizes", default="64x4096")
    parser.add_argument("--segments", type=int, default=8, help="K: most sequences per row")
    parser.add_argument(
        "--row-factor", type=float, default=4.5, help="packed row length / T (rounded to 128)"
    )
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile-repeats", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="write .md and .json here")
    args = parser.parse_args(argv)
    results = []
    for item in args.sizes.split(","):
        batch, length = (int(v) for v in item.lower().split("x"))
        results.append(measure(batch, length, args))
        print(json.dumps(results[-1]), flush=True)
    command = "python -m benchmarks.packing " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(results, command.strip())
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "packing_results.md").write_text(text)
        (args.out / "packing_results.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
