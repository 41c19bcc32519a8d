"""Where a step's device time goes: ``python -m benchmarks.kernels [--size 256x8192]``.

Traces ``--calls`` calls of one jitted computation of ``benchmarks/workloads.py``
(default: the ``policy_loss`` training step) with the JAX profiler and prints, per
kernel, its time per call, its launches per call and its name (XLA's fusion names),
slowest first: the table behind the bandwidth columns of ``benchmarks.run``. On the
CPU backend the trace has no device streams, and the command says so.
"""

from __future__ import annotations

import argparse
import collections
import sys

from benchmarks import workloads
from benchmarks.run import device_events, parse_sizes

NAMES = ("loss", "correction", "loss_trm_icepop")


def kernel_table(events: list[tuple[str, int, int]], calls: int, top: int) -> list[str]:
    """Lines of ``µs per call, launches per call, name``, slowest kernels first."""
    total: collections.Counter[str] = collections.Counter()
    launches: collections.Counter[str] = collections.Counter()
    for name, _, duration in events:
        total[name] += duration
        launches[name] += 1
    busy = sum(total.values()) / 1e3 / calls
    lines = [f"{len(events) / calls:.0f} kernels per call, {busy:.1f} µs busy per call"]
    lines += [
        f"{ns / 1e3 / calls:8.2f} µs  x{launches[name] / calls:<3.0f} {name}"
        for name, ns in total.most_common(top)
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__)
    parser.add_argument("--size", default="256x8192", help="one BxT batch (default 256x8192)")
    parser.add_argument("--computation", choices=NAMES, default="loss")
    parser.add_argument("--calls", type=int, default=20, help="calls traced (default 20)")
    parser.add_argument("--top", type=int, default=20, help="kernels listed (default 20)")
    args = parser.parse_args(argv)
    ((batch, length),) = parse_sizes(args.size)
    comp = next(
        c for c in workloads.computations(batch, length, None) if c.name == args.computation
    )
    jitted = comp.compile(comp.step)
    events = device_events(lambda: jitted(*comp.args), args.calls)
    print(f"{args.computation} at {batch} x {length}:")
    if not events:
        print("the trace has no device streams (the CPU backend): nothing to list")
        return 0
    print("\n".join(kernel_table(events, args.calls, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
