"""The sweep behind docs/demo_moe.md: do MoE routing or fp8 rollouts collapse training?

Runs the demo's routed policy (4 experts, top-1) over a grid of (mismatch, severity,
learning rate, gradient clip) for the rows :data:`ROWS` (uncorrected ``ppo``, the
untruncated weight, TIS at 2, the shipped mis.yaml, IcePop's band, routing replay, KPop's
binary-KL rejection at φ 0.1 and 2 and DPPO's top-k TV trust region, with the
mismatch-free reference) and appends, per setting, one JSON line with each row's outcome
at two horizons: the first half of the run and all of it
(:func:`offpolicy_jax.demo.sweep.outcome` on the prefix). Run::

    nice python -m offpolicy_jax.demo.moe_sweep --out moe_sweep.jsonl [--only 0,3] [--rows a,b]

``--rows`` runs only those rows of each setting (a later run adds rows to a setting).
``--table moe_sweep.jsonl`` prints the Markdown tables of docs/demo_moe.md from the lines,
one line per setting with the rows of every run of it;
``--regimes regimes.jsonl`` measures each mismatch of :data:`REGIMES` on the same routed
policy the way MoE reports quote it (``--table`` prints those lines too).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import numpy as np

from offpolicy_jax.demo import report
from offpolicy_jax.demo.experiment import DemoConfig, History, run
from offpolicy_jax.demo.train import DEMO_TOPK, Mismatch, TrainConfig

ROWS = (
    "ppo:no-mismatch",
    "ppo",
    "decoupled_ppo+is",
    "decoupled_ppo+tis2",
    "decoupled_ppo+mis",
    "decoupled_ppo+icepop",
    "ppo+replay",
    "decoupled_ppo+kpop",
    "decoupled_ppo+kpop2",
    "bypass_ppo+topk_tv",
)

#: The routed policy of the sweep: the demo's model with a 4-expert top-1 FFN.
MOE = TrainConfig(n_experts=4, top_k=1)

#: (source, severity, learning rate, max grad norm; 0 = no clipping), in priority order.
GRID = (
    ("router", 30, 1e-2, 0.0),
    ("router", 30, 1e-2, 1.0),
    ("router", 30, 3e-3, 0.0),
    ("router", 30, 3e-3, 1.0),
    ("router", 10, 1e-2, 0.0),
    ("router", 10, 1e-2, 1.0),
    ("fp8", 2, 1e-2, 0.0),
    ("fp8", 2, 1e-2, 1.0),
    ("router", 10, 3e-3, 0.0),
    ("router", 10, 3e-3, 1.0),
)


#: The regimes of the measurement table: (source, severity), each trained with ``ppo``
#: for :data:`REGIME_STEPS` steps at the default learning rate and clip.
REGIMES = (
    ("router", 10),
    ("router", 30),
    ("fp8", 1),
    ("fp8", 2),
    ("precision", 1),
    ("precision", 5),
    ("stale", 16),
    ("stale", 64),
)
REGIME_STEPS = 100


def measure(
    source: str, severity: float, steps: int = REGIME_STEPS, seeds: int = 3, topk: bool = False
) -> dict:
    """One regime's mismatch over a ``ppo`` run of the routed policy: mean over the
    steps and seeds, and the last 10% of steps (policies sharpen as they train).
    ``topk``: the engine also returns its top-k, and the means gain KPop's ``binary_kl``
    and DPPO's ``topk_tv`` (another program, so another float32 draw of the run)."""
    train = dataclasses.replace(MOE, topk_logprobs=DEMO_TOPK) if topk else MOE
    config = DemoConfig(
        steps=steps,
        seeds=seeds,
        algorithms=("ppo",),
        mismatch=Mismatch(source, severity),
        train=train,
        chunk=20,
    )
    m = run(config).metrics["ppo"]
    tail = max(1, steps // 10)
    keys = ("route_flip_fraction", "mis_k3_kl", "is_weight_max", "log_ratio_above_1")
    keys += ("binary_kl", "topk_tv") if topk else ()
    return {
        "mismatch": source,
        "severity": severity,
        "steps": steps,
        "seeds": seeds,
        "mean": {k: float(np.nanmean(m[k])) for k in keys},
        "end": {k: float(np.nanmean(m[k][-tail:])) for k in keys},
        "max_weight": float(np.nanmax(m["is_weight_max"])),
        "final_reward": float(m["policy_reward"][-tail:].mean()),
    }


def regime_table(lines: list[dict]) -> str:
    """The measurement table: one line per regime."""
    out = [
        "| mismatch | routing decisions that differ (mean · last 10%) | K3 KL (mean · last "
        "10%) | max weight (largest of the run) | tokens with abs(log ρ) > 1 (mean) "
        "| ppo final reward |",
        "|---|---|---|---|---|---|",
    ]
    extra = all("topk_tv" in r["mean"] for r in lines)  # lines of a --topk run
    if extra:
        out[0] += " KPop binary KL (mean) | top-k TV (mean) |"
        out[1] += "---|---|"
    for r in lines:
        mean, end = r["mean"], r["end"]
        out.append(
            f"| {_mismatch(r)} | {100 * mean['route_flip_fraction']:.1f}% · "
            f"{100 * end['route_flip_fraction']:.1f}% | {mean['mis_k3_kl']:.2g} · "
            f"{end['mis_k3_kl']:.2g} | {_big(r['max_weight'])} "
            f"| {100 * mean['log_ratio_above_1']:.2f}% | {r['final_reward']:.2f} |"
        )
        if extra:
            out[-1] += f" {mean['binary_kl']:.2g} | {mean['topk_tv']:.2g} |"
    return "\n".join(out)


def setting(
    source: str,
    severity: float,
    lr: float,
    clip: float,
    steps: int,
    seeds: int,
    rows: tuple[str, ...] = ROWS,
) -> DemoConfig:
    return DemoConfig(
        steps=steps,
        seeds=seeds,
        algorithms=rows,
        mismatch=Mismatch(source, severity),
        train=dataclasses.replace(MOE, learning_rate=lr, max_grad_norm=clip),
        chunk=20,
    )


def outcome(history: History, steps: int) -> dict:
    """Per row, over the first ``steps`` steps: collapsed seeds, final and peak reward,
    and the mismatch as the field reports it (routing decisions that differ, K3, largest
    weight, share of tokens with |log ρ| > 1)."""
    rows = {}
    w = report.window(steps)
    tail = max(1, steps // 10)
    for name, m in history.metrics.items():
        m = {k: v[:steps] for k, v in m.items()}
        rows[name] = {
            "collapsed": int(np.sum(report.collapsed(m["policy_reward"]))),
            "final": [round(float(x), 3) for x in m["policy_reward"][-tail:].mean(0)],
            "peak": [round(float(x), 3) for x in report.smooth(m["policy_reward"], w).max(0)],
            "max_is_weight": float(np.nanmax(m["is_weight_max"])),
            "max_grad_norm": float(np.nanmax(m["grad_norm"])),
            "peak_k3": float(np.nanmax(m["mis_k3_kl"].mean(1))),
            "mean_k3": float(np.nanmean(m["mis_k3_kl"])),
            "route_flips": float(np.nanmean(m["route_flip_fraction"])),
            "log_ratio_above_1": float(np.nanmean(m["log_ratio_above_1"])),
            "rejected": float(np.nanmean(m["rejected_fraction"])),
        }
        # Runs with the engine's top-k (a top-k row) also measure KPop's and DPPO's
        # divergences of π_old from π_rollout, and the share of tokens DPPO's trust region
        # leaves out of the gradient.
        for key in ("binary_kl", "topk_tv"):
            if key in m:
                rows[name][key] = float(np.nanmean(m[key]))
        if np.isfinite(m.get("loss/mis_topk_tv", np.nan)).any():  # the row's loss read top-k
            rows[name]["trust_region_masked"] = float(np.nanmean(m["loss/pg_clipfrac"]))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", default="moe_sweep.jsonl")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--only", default=None, help="comma-separated indices into GRID")
    parser.add_argument(
        "--rows", default=None, help="comma-separated rows to run (default: all of ROWS)"
    )
    parser.add_argument("--table", default=None, help="print the table of a finished sweep")
    parser.add_argument("--regimes", default=None, help="measure REGIMES into this file")
    parser.add_argument(
        "--topk", action="store_true", help="--regimes: also measure binary_kl and topk_tv"
    )
    args = parser.parse_args(argv)
    if args.table:
        lines = [json.loads(line) for line in open(args.table)]
        if "mean" in lines[0]:
            print(regime_table(lines))
        else:
            lines = merge(lines)
            print(collapsed_table(lines) + "\n\n" + table(lines))
        return
    if args.regimes:
        for source, severity in REGIMES:
            line = measure(source, severity, seeds=args.seeds, topk=args.topk)
            with open(args.regimes, "a") as f:
                f.write(json.dumps(line) + "\n")
            print(json.dumps(line), flush=True)
        return
    picks = range(len(GRID)) if args.only is None else [int(i) for i in args.only.split(",")]
    rows = ROWS if args.rows is None else tuple(args.rows.split(","))
    for i in picks:
        source, severity, lr, clip = GRID[i]
        t0 = time.perf_counter()
        history = run(setting(source, severity, lr, clip, args.steps, args.seeds, rows))
        line = {
            "index": i,
            "mismatch": source,
            "severity": severity,
            "lr": lr,
            "clip": clip,
            "steps": args.steps,
            "seeds": args.seeds,
            "seconds": round(time.perf_counter() - t0, 1),
            "horizons": {
                str(h): outcome(history, h) for h in sorted({args.steps // 2, args.steps})
            },
        }
        with open(args.out, "a") as f:
            f.write(json.dumps(line) + "\n")
        print(json.dumps(line), flush=True)


def _mismatch(line: dict) -> str:
    if line["mismatch"] == "fp8":
        return {1: "fp8 e4m3", 2: "fp8 e5m2"}[int(line["severity"])]
    return f"{line['mismatch']} {line['severity']:g}"


def merge(lines: list[dict]) -> list[dict]:
    """One line per setting (GRID index, steps, seeds): the rows of every run of it, in
    :data:`ROWS` order then first seen (``--rows`` runs add rows to a setting). A row run
    twice keeps its first line. Rows of different runs do not share a program: each is
    its own float32 draw of the setting (the set of rows changes XLA's rounding)."""
    merged: dict[tuple, dict] = {}
    for line in lines:
        key = (line["index"], line["steps"], line["seeds"])
        if key not in merged:
            merged[key] = {**line, "horizons": {h: dict(r) for h, r in line["horizons"].items()}}
            continue
        for h, r in line["horizons"].items():
            for name, out in r.items():
                merged[key]["horizons"].setdefault(h, {}).setdefault(name, out)
    order = {name: i for i, name in enumerate(ROWS)}
    for line in merged.values():
        for h, r in line["horizons"].items():
            line["horizons"][h] = dict(
                sorted(r.items(), key=lambda kv: order.get(kv[0], len(order)))
            )
    return list(merged.values())


def collapsed_table(lines: list[dict]) -> str:
    """Collapsed seeds per setting and row, at half the horizon · at the end."""
    names = list(dict.fromkeys(n for line in lines for n in _horizons(line)[1]))
    out = [
        "| # | mismatch | lr | clip | " + " | ".join(f"`{n}`" for n in names) + " |",
        "|" + "---|" * (4 + len(names)),
    ]
    for line in lines:
        half, end = _horizons(line)
        cells = [
            f"{half[n]['collapsed']} · {end[n]['collapsed']}" if n in end else "–" for n in names
        ]
        out.append(
            f"| {line['index']} | {_mismatch(line)} | {line['lr']:g} | {_clip(line)} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(out)


def _horizons(line: dict) -> tuple[dict, dict]:
    half, end = (line["horizons"][k] for k in sorted(line["horizons"], key=int))
    return half, end


def _clip(line: dict) -> str:
    return "none" if not line["clip"] or math.isinf(line["clip"]) else f"{line['clip']:g}"


def table(lines: list[dict]) -> str:
    """The sweep as one Markdown table: a line per setting and row."""
    head = (
        "| # | mismatch | lr | clip | row | collapsed @ half | collapsed @ end "
        "| final reward per seed (peak) | routes differ | mean K3 | max weight "
        "| tokens with abs(log ρ) > 1 | max grad norm | rejected tokens (mean) |"
    )
    out = [head, "|" + "---|" * 14]
    for line in lines:
        half, end = _horizons(line)
        clip = _clip(line)
        for name, r in end.items():
            # Lines written before the column existed have no "rejected".
            rejected = f"{100 * r['rejected']:.2f}%" if "rejected" in r else "–"
            if "trust_region_masked" in r:  # DPPO drops tokens in its loss, not a correction
                rejected = f"{100 * r['trust_region_masked']:.2f}% (trust region)"
            finals = ", ".join(
                f"{f:.2f} ({p:.2f})" for f, p in zip(r["final"], r["peak"], strict=True)
            )
            out.append(
                f"| {line['index']} | {_mismatch(line)} | {line['lr']:g} | {clip} | `{name}` "
                f"| {half[name]['collapsed']}/{line['seeds']} | {r['collapsed']}/{line['seeds']} "
                f"| {finals} | {100 * r['route_flips']:.1f}% | {r['mean_k3']:.3g} "
                f"| {_big(r['max_is_weight'])} | {100 * r['log_ratio_above_1']:.2f}% "
                f"| {_big(r['max_grad_norm'])} | {rejected} |"
            )
    return "\n".join(out)


def _big(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1e4 else f"{x:.1e}"


if __name__ == "__main__":
    main()
