"""The sweep behind ``--preset collapse``: where, at this scale, does training collapse?

Runs the demo over a grid of (mismatch source, severity, learning rate, steps) for a few
rows (uncorrected ``ppo``, untruncated ``decoupled_ppo+is``, truncated
``decoupled_ppo+tis2``) and prints, per setting and row, how many seeds collapsed
(:func:`offpolicy_jax.demo.report.collapsed`), the final reward and the peaks of the
diagnostics. docs/demo.md ("The collapse sweep") holds the table this printed. Run (about 40 CPU-minutes)::

    nice python -m offpolicy_jax.demo.sweep --out sweep.jsonl [--only N,M]

Each finished setting is appended to ``--out`` as one JSON line, so a stopped sweep
keeps what it did.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np

from offpolicy_jax.demo import report
from offpolicy_jax.demo.experiment import DemoConfig, run
from offpolicy_jax.demo.train import Mismatch

ROWS = ("ppo", "decoupled_ppo+is", "decoupled_ppo+tis2")

#: (source, severity, learning rate, steps): the grid, in the order it was run.
GRID = (
    ("stale", 64, 3e-3, 300),
    ("stale", 128, 1e-3, 300),
    ("stale", 128, 3e-3, 300),
    ("stale", 256, 3e-3, 300),
    ("precision", 7, 1e-3, 300),
    ("precision", 7, 3e-3, 300),
    ("sampling", 4, 3e-3, 300),
    ("stale", 64, 1e-2, 300),
    # Longer runs of the settings where ppo's reward peaked and fell (indices 2, 3).
    ("stale", 128, 3e-3, 600),
    ("stale", 256, 3e-3, 600),
)


def setting(source: str, severity: float, lr: float, steps: int, seeds: int) -> DemoConfig:
    base = DemoConfig()
    return dataclasses.replace(
        base,
        steps=steps,
        seeds=seeds,
        algorithms=ROWS,
        mismatch=Mismatch(source, severity),
        train=dataclasses.replace(base.train, learning_rate=lr),
    )


def outcome(history) -> dict:
    """Per row: collapsed seeds, final and peak reward, peaks of the diagnostics."""
    w = report.window(history.config.steps)
    rows = {}
    for name, m in history.metrics.items():
        r = report.smooth(m["policy_reward"], w)
        tail = max(1, history.config.steps // 10)
        rows[name] = {
            "collapsed": int(np.sum(report.collapsed(m["policy_reward"]))),
            "final": [round(float(x), 3) for x in m["policy_reward"][-tail:].mean(0)],
            "peak": [round(float(x), 3) for x in r.max(0)],
            "max_is_weight": float(np.nanmax(m["is_weight_max"])),
            "max_grad_norm": float(np.nanmax(m["grad_norm"])),
            "peak_k3": float(np.nanmax(m["mis_k3_kl"].mean(1))),
        }
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", default="sweep.jsonl")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only", default=None, help="comma-separated indices into GRID")
    args = parser.parse_args(argv)
    picks = range(len(GRID)) if args.only is None else [int(i) for i in args.only.split(",")]
    for i in picks:
        source, severity, lr, steps = GRID[i]
        t0 = time.perf_counter()
        history = run(setting(source, severity, lr, steps, args.seeds))
        line = {
            "index": i,
            "mismatch": source,
            "severity": severity,
            "lr": lr,
            "steps": steps,
            "seeds": args.seeds,
            "seconds": round(time.perf_counter() - t0, 1),
            "rows": outcome(history),
        }
        with open(args.out, "a") as f:
            f.write(json.dumps(line) + "\n")
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
