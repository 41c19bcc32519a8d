"""Wall-clock of the π_old forward pass in the demo's asynchronous run.

The demo's ``async`` mismatch (``offpolicy-jax demo --mismatch async``) samples every
prompt group with weights 0..severity updates old. Its rows ``decoupled_ppo+mis+loglinear``
and ``+linear`` approximate π_old (AReaL ``prox_logp_method``), so the trainer skips the
forward pass that computes it. This script times one compiled training step of exactly
those rows with the pass skipped and with it kept (``make_train_step(old_pass=True)``:
π_old computed and fed to the monitor metrics, as for a row that recomputes it), side by
side, and also the recomputing rows (``decoupled_ppo+mis``, ``+staleness4``) for reference.
Every variant is the demo's default model and batch, the same seeds and keys.

Run: ``python -m benchmarks.async_demo [--steps 20] [--repeats 7] [--seeds 3]``; it
prints a Markdown table (docs/guide/async.md, "In the demo", quotes one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import typing
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.paired import environment, paired_ratio
from offpolicy_jax.demo import train

PROX_ROWS = ("decoupled_ppo+mis+loglinear", "decoupled_ppo+mis+linear")
RECOMPUTE_ROWS = ("decoupled_ppo+mis", f"decoupled_ppo+mis+staleness{train.ASYNC_MAX_STALENESS}")


def make_runner(rows, old_pass, mismatch, cfg, seeds, steps):
    """``(run, flops)``: ``run()`` does ``steps`` steps of every (row, seed) from a fresh
    state, blocking; ``flops`` is XLA's cost analysis of the compiled program."""
    algos = [train.row(r) for r in rows]
    graphdef, state0 = train.init_state(cfg, mismatch, list(range(seeds)))
    state0 = jax.tree.map(lambda x: jnp.concatenate([x] * len(algos)), state0)
    algo_index = jnp.repeat(jnp.arange(len(algos), dtype=jnp.int32), seeds)
    mismatched = jnp.ones(len(algos) * seeds, bool)
    step = train.make_train_step(graphdef, cfg, algos, mismatch, old_pass=old_pass)
    runner = train.make_chunk_runner(step)
    keys = jax.vmap(lambda s: jax.random.split(jax.random.key(s), steps))(jnp.arange(seeds))
    keys = jnp.tile(keys.T, (1, len(algos)))

    def run():
        state = jax.tree.map(jnp.copy, state0)  # the runner donates its state
        out = runner(state, keys, algo_index, mismatched)
        jax.block_until_ready(out)
        return out

    run()  # compile
    lowered = typing.cast(Any, runner).lower(state0, keys, algo_index, mismatched)
    cost = lowered.compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    # XLA counts a loop's body once: these are the flops of one step (one token of
    # sampling, one minibatch), a measure of what the compiled program contains.
    return run, float(cost.get("flops", float("nan")))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--severity", type=float, default=8.0)
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    cfg, mismatch = train.TrainConfig(), train.Mismatch("async", args.severity)
    variants = {
        "prox rows, π_old pass skipped": (PROX_ROWS, None),
        "prox rows, π_old pass kept": (PROX_ROWS, True),
        "recompute rows (π_old pass)": (RECOMPUTE_ROWS, None),
    }
    built = {
        name: make_runner(rows, old, mismatch, cfg, args.seeds, args.steps)
        for name, (rows, old) in variants.items()
    }
    runners = {name: run for name, (run, _) in built.items()}
    flops = {name: f for name, (_, f) in built.items()}
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.repeats):  # interleaved: the variants share the machine's drift
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) / args.steps)
    names = list(runners)
    env = environment(load)
    print(f"`python -m benchmarks.async_demo {' '.join(argv or sys.argv[1:])}`".rstrip())
    print(
        f"{args.seeds} seeds × 2 rows per program, {args.steps} steps per call, "
        f"{args.repeats} calls; jax {env['jax']} on {jax.devices()[0].platform}, "
        f"{env['cpus']} CPUs, load {env['load_before']:.2f} → {env['load_after']:.2f}\n"
    )
    print(
        "| variant | XLA flops (loop bodies once) | ms per step (median) | vs. π_old pass kept (paired) |"
    )
    print("|---|---|---|---|")
    for name in names:
        ratio = paired_ratio(times[name], times[names[1]])
        low, high = typing.cast(list[float], ratio["paired_quartiles"])
        print(
            f"| {name} | {flops[name] / 1e6:.1f} M | "
            f"{1e3 * statistics.median(times[name]):.2f} | "
            f"{ratio['paired_ratio']:.3f} ({low:.3f}-{high:.3f}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
