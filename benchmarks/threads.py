"""What one elementwise pass over ``[B, T]`` costs XLA:CPU on one CPU and on all of them.

``python -m benchmarks.threads`` times, at each benchmark size, jitted loops whose
every iteration is one memory-bound elementwise kernel (``v * c + x``, float32), in
two child processes: pinned to one CPU and on every CPU. It reports the time of a
call that runs one such kernel (what any jitted call pays at least) and the cost per
token of each further kernel. No library code runs: it shows what the machine and
XLA's thread pool do to kernels of each size, which every pass of the library
inherits. On the 2-core VM of results.md, one CPU makes a ``[64, 2048]`` pass 4x
cheaper per token than a ``[256, 8192]`` one (its arrays stay in cache); on two CPUs
the small pass loses that advantage to the cost of splitting it across threads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.run import DEFAULT_SIZES, TINY_SIZES, parse_sizes

PASSES = 8  # kernels beyond the first in the long call: their mean is the per-pass cost


def pass_seconds(batch: int, length: int, repeats: int) -> tuple[float, float]:
    """Seconds of a one-kernel call, and of each further elementwise pass, at
    ``[batch, length]``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    x = jnp.asarray(np.random.default_rng(0).normal(size=(batch, length)), jnp.float32)

    def chain(passes):
        # fori_loop: XLA cannot fuse iterations, so each one is its own kernel.
        return jax.jit(lambda x: jax.lax.fori_loop(0, passes, lambda i, v: v * 1.0001 + x, x))

    def median_seconds(fn):
        jax.block_until_ready(fn(x))
        calls = max(3, int(4e6 // (batch * length)))
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                out = fn(x)
            jax.block_until_ready(out)
            samples.append((time.perf_counter() - start) / calls)
        return sorted(samples)[len(samples) // 2]

    one = median_seconds(chain(1))
    return one, (median_seconds(chain(1 + PASSES)) - one) / PASSES


def child(sizes: str, repeats: int) -> None:
    """Runs in a child process whose CPU affinity the parent already chose."""
    rows = []
    for b, t in parse_sizes(sizes):
        call, per_pass = pass_seconds(b, t, repeats)
        rows.append({"batch": b, "length": t, "call_seconds": call, "pass_seconds": per_pass})
    print(json.dumps({"cpus": len(os.sched_getaffinity(0)), "rows": rows}))


def run_child(sizes: str, repeats: int, cpus: set[int]) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.threads",
            "--child",
            "--sizes",
            sizes,
            "--repeats",
            str(repeats),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
        # Pinned before the child starts, so XLA's thread pool is born with it.
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.threads", description=__doc__)
    parser.add_argument(
        "--sizes", default=DEFAULT_SIZES, help=f"BxT sizes (default {DEFAULT_SIZES})"
    )
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--tiny", action="store_true", help=f"smoke test: sizes {TINY_SIZES}")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        args.sizes, args.repeats = TINY_SIZES, 3
    if args.child:
        child(args.sizes, args.repeats)
        return 0
    available = sorted(os.sched_getaffinity(0))
    runs = [run_child(args.sizes, args.repeats, {available[0]})]
    if len(available) > 1:
        runs.append(run_child(args.sizes, args.repeats, set(available)))
    print("Elementwise passes over a [B, T] float32 array (v * c + x): the time of a call")
    print("running one such kernel, and the cost per token of each further kernel.\n")
    heads = [f"{name}, {r['cpus']} CPU(s)" for r in runs for name in ("call us", "pass ns/token")]
    print("| [B, T] | " + " | ".join(heads) + " |")
    print("|---|" + "---|" * len(heads))
    for i, (b, t) in enumerate(parse_sizes(args.sizes)):
        cells = " | ".join(
            f"{r['rows'][i]['call_seconds'] * 1e6:.1f} | "
            f"{r['rows'][i]['pass_seconds'] / (b * t) * 1e9:.3f}"
            for r in runs
        )
        print(f"| {b} x {t} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
