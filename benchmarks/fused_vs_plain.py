"""The XLA:CPU fused reductions against the plain path TPU/GPU run, paired in one process.

``python -m benchmarks.fused_vs_plain --out benchmarks`` loads the library of commit
``05d9d1f`` (the last one with the fused machinery: ``_fusion``'s chunked variadic
loops, ``_segments``' windowed packed path under ``dispatch``'s ``cond``) twice. One
copy runs as shipped on CPU (*fused*); in the other, ``_fusion`` and ``_segments`` see
``jax.default_backend() == "gpu"`` (*plain*: one ``jnp.sum`` / ``min`` / ``max`` per
column with the one-pass custom-JVP backward; packed rows by the compare-and-reduce,
called once, without the ``cond``), which is exactly the code a TPU or GPU runs.

Both copies build the same computations on the same inputs: ``policy_loss`` forward +
backward and ``compute_correction`` (decoupled PPO, the shipped ``mis.yaml``, every
metric) on padded batches, and ``policy_loss`` forward + backward on the 64 x 4096
workload packed into rows of 18432 tokens with at most 8 sequences each
(``benchmarks.packing``). Timed call by call, interleaved (``benchmarks/paired.py``),
and the cold compile time (``jax.clear_caches()``, trace + lower + compile),
alternated too. Issue 25 keeps the fused machinery only if it is more than 15% faster
(plain / fused > 1.15) at some size that matters.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
import types
from importlib import resources

import jax
import jax.numpy as jnp

from benchmarks import workloads
from benchmarks.compare import load_commit
from benchmarks.packing import NAMES, packed_inputs
from benchmarks.paired import environment, environment_line, paired_cell, paired_ratio

FUSED_COMMIT = "05d9d1f"


def as_accelerator(package: types.ModuleType) -> None:
    """Makes the package's reduction engine see a non-CPU backend (``"gpu"``): the
    plain path, as TPU/GPU run it. Only ``_fusion`` and ``_segments`` ask."""
    seen = types.ModuleType("jax_seen_as_gpu")
    seen.__dict__.update(jax.__dict__)
    seen.default_backend = lambda: "gpu"  # type: ignore[attr-defined]
    for module in ("_fusion", "_segments"):
        getattr(package, module).jax = seen


def steps(opj: types.ModuleType, inputs: dict, packed: dict, num_segments: int) -> dict:
    """The jittable computations of one copy, with their arguments."""
    correction = opj.CorrectionConfig.from_yaml(
        resources.files("offpolicy_jax") / "configs" / "mis.yaml"
    )
    config = opj.LossConfig(
        algorithm="decoupled_ppo", correction=correction, get_mismatch_metrics=True
    )

    def loss(logp, old, rollout, adv, mask, segment_ids=None):
        def value(lp):
            return opj.policy_loss(
                lp,
                old,
                rollout,
                adv,
                mask,
                config,
                segment_ids=segment_ids,
                num_segments=None if segment_ids is None else num_segments,
            )

        return jax.value_and_grad(value, has_aux=True)(logp)

    def correct(old, rollout, mask):
        return opj.compute_correction(old, rollout, mask, correction)

    out = {}
    for size, args in inputs.items():
        out[("loss", size)] = (loss, tuple(args[k] for k in workloads.LOSS_INPUTS))
        out[("correction", size)] = (correct, tuple(args[k] for k in workloads.CORRECTION_INPUTS))
    for size, args in packed.items():
        out[("packed loss", size)] = (loss, args)
    return out


def cold_compiles(fns: dict[str, tuple], repeats: int) -> dict[str, list[float]]:
    """Trace + lower + compile from cold caches, the variants alternated."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, (fn, args) in fns.items():
            jax.clear_caches()
            start = time.perf_counter()
            jax.jit(fn).lower(*args).compile()
            times[name].append(time.perf_counter() - start)
    return times


def measure(key, variants: dict[str, tuple], repeats: int, compile_repeats: int) -> dict:
    compiled = {
        name: (jax.jit(fn).lower(*args).compile(), args) for name, (fn, args) in variants.items()
    }
    results = {name: c(*args) for name, (c, args) in compiled.items()}
    leaves = {name: jax.tree.leaves(r) for name, r in results.items()}
    # The two paths agree (to float32 rounding): the benchmark compares equal work. Per
    # output, the largest difference relative to the output's largest value.
    worst = max(
        float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-6))
        for a, b in zip(leaves["fused"], leaves["plain"], strict=True)
    )
    for c, args in compiled.values():
        for _ in range(3):
            jax.block_until_ready(c(*args))
    times: dict[str, list[float]] = {name: [] for name in compiled}
    for _ in range(repeats):
        for name, (c, args) in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(c(*args))
            times[name].append(time.perf_counter() - start)
    compiles = cold_compiles(variants, compile_repeats)
    fused, plain = (statistics.median(times[n]) * 1e3 for n in ("fused", "plain"))
    computation, size = key
    row = {
        "computation": computation,
        "size": size,
        "fused_ms": fused,
        "plain_ms": plain,
        "ratio": plain / fused,
        **paired_ratio(times["plain"], times["fused"]),
        "compile_fused_s": statistics.median(compiles["fused"]),
        "compile_plain_s": statistics.median(compiles["plain"]),
        "max_relative_difference": worst,
    }
    low, high = row["paired_quartiles"]
    print(
        f"{computation:>12} {size}: fused {fused:.2f} ms, plain {plain:.2f} ms, paired "
        f"plain/fused {row['paired_ratio']:.2f} ({low:.2f}-{high:.2f}); compile "
        f"{row['compile_fused_s']:.2f} / {row['compile_plain_s']:.2f} s; max rel diff {worst:.1e}",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64x2048,256x4096,256x8192", help="padded BxT,...")
    parser.add_argument("--packed", default="64x4096", help="padded BxT,... to pack")
    parser.add_argument("--segments", type=int, default=8, help="most sequences a packed row")
    parser.add_argument("--repeats", type=int, default=31, help="timed calls per variant")
    parser.add_argument("--compile-repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="directory for fused_vs_plain.md/.json")
    args = parser.parse_args(argv)

    inputs, packed = {}, {}
    for item in filter(None, args.sizes.split(",")):
        batch, length = (int(x) for x in item.lower().split("x"))
        host = workloads.make_inputs(batch, length)
        inputs[f"{batch} x {length}"] = {k: jnp.asarray(v) for k, v in host.items()}
    num_segments = args.segments
    for item in filter(None, args.packed.split(",")):
        batch, length = (int(x) for x in item.lower().split("x"))
        host = workloads.make_inputs(batch, length)
        rows = packed_inputs(host, max(128, round(4.5 * length / 128) * 128), args.segments)
        num_segments = rows.num_segments
        shape = rows.segment_ids.shape
        packed[f"{batch} x {length} as {shape[0]} x {shape[1]}, K = {num_segments}"] = tuple(
            jnp.asarray(rows.arrays[n]) for n in NAMES
        ) + (jnp.asarray(rows.segment_ids),)

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        fused, sha = load_commit(FUSED_COMMIT, pathlib.Path(tmp), "_fused")
        plain, _ = load_commit(FUSED_COMMIT, pathlib.Path(tmp), "_plain")
        as_accelerator(plain)
        ours = steps(fused, inputs, packed, num_segments)
        theirs = steps(plain, inputs, packed, num_segments)
        rows = [
            measure(
                key, {"fused": ours[key], "plain": theirs[key]}, args.repeats, args.compile_repeats
            )
            for key in ours
        ]
    report = {
        "commit": sha,
        "command": "python -m benchmarks.fused_vs_plain "
        + " ".join(sys.argv[1:] if argv is None else argv),
        **environment(load_before),
        "rows": rows,
    }
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fused_vs_plain.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "fused_vs_plain.md").write_text(render(report))


def render(report: dict) -> str:
    lines = [
        f"# Fused XLA:CPU reductions vs the plain path (commit `{report['commit']}`)",
        "",
        f"{environment_line(report)}.",
        "",
        "Both copies of the library run in one process on the same inputs (decoupled PPO with "
        "the shipped `mis.yaml`, every metric); *plain* is the same code made to see a GPU "
        "backend, i.e. the path TPU/GPU run. Medians of interleaved calls; **paired**: the "
        "median (quartiles) over calls of each plain call's time over the fused call beside "
        "it (> 1: fused faster). Compile: cold trace + lower + compile, medians. *max rel "
        "diff*: over every output (loss, gradient, metrics), the largest difference relative to "
        "that output's largest magnitude.",
        "",
        "| computation | [B, T] | fused ms | plain ms | **plain / fused, paired** "
        "| compile s fused / plain | max rel diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['computation']} | {r['size']} | {r['fused_ms']:.2f} | {r['plain_ms']:.2f} | "
            f"{paired_cell(r)} | {r['compile_fused_s']:.2f} / {r['compile_plain_s']:.2f} | "
            f"{r['max_relative_difference']:.1e} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
