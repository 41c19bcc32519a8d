"""Turn a :class:`~offpolicy_jax.demo.experiment.History` into a table, a plot and log files."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from offpolicy_jax.demo.experiment import History
from offpolicy_jax.demo.train import ALGORITHMS

#: Per-step metrics written to metrics.csv, in column order.
METRICS = ("reward", "exact_match", "mis_k3_kl", "rejected_fraction", "pg_clipfrac",
           "grad_norm")


def smooth(x: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average along axis 0 (shorter windows at the start)."""
    c = np.cumsum(np.nan_to_num(x), axis=0)
    out = c.copy()
    out[window:] = c[window:] - c[:-window]
    n = np.minimum(np.arange(1, len(x) + 1), window).reshape((-1,) + (1,) * (x.ndim - 1))
    return out / n


def window(steps: int) -> int:
    """Smoothing window for curves and for the threshold test: 5% of the run, 1–20 steps."""
    return int(min(20, max(1, steps // 20)))


def summarize(history: History) -> list[dict]:
    """One row per algorithm: the numbers of the results table."""
    cfg = history.config
    w = window(cfg.steps)
    tail = max(1, cfg.steps // 10)
    rows = []
    for name, m in history.metrics.items():
        final = m["reward"][-tail:].mean(axis=0)  # per seed
        reached = smooth(m["reward"], w) >= cfg.threshold  # [steps, seeds]
        first = [int(np.argmax(col)) + 1 if col.any() else None for col in reached.T]
        hit = [s for s in first if s is not None]
        rows.append({
            "algorithm": name,
            "label": ALGORITHMS[name].label,
            "final_reward_mean": float(final.mean()),
            "final_reward_std": float(final.std(ddof=1)) if len(final) > 1 else 0.0,
            "final_reward_per_seed": [float(f) for f in final],
            "steps_to_threshold_per_seed": first,
            "steps_to_threshold_mean": float(np.mean(hit)) if hit else None,
            "seeds_reaching_threshold": len(hit),
            "peak_mis_k3_kl": float(np.nanmax(m["mis_k3_kl"].mean(axis=1))),
            "rejected_fraction": float(np.nanmean(m["rejected_fraction"])),
        })
    return rows


def _steps_cell(row: dict, seeds: int) -> str:
    if row["steps_to_threshold_mean"] is None:
        return "never"
    cell = f"{row['steps_to_threshold_mean']:.0f}"
    return cell if row["seeds_reaching_threshold"] == seeds else \
        f"{cell} ({row['seeds_reaching_threshold']}/{seeds} seeds)"


def format_table(history: History, rows: list[dict]) -> str:
    """The results as a Markdown table."""
    cfg = history.config
    tail = max(1, cfg.steps // 10)
    head = (f"| algorithm | final reward (mean ± std, {cfg.seeds} seeds) "
            f"| steps to reward ≥ {cfg.threshold:g} | peak mis_k3_kl | rejected tokens |")
    lines = [head, "|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['final_reward_mean']:.3f} ± {r['final_reward_std']:.3f} "
            f"| {_steps_cell(r, cfg.seeds)} | {r['peak_mis_k3_kl']:.2e} "
            f"| {100 * r['rejected_fraction']:.1f}% |")
    lines.append("")
    lines.append(
        f"Final reward: mean over the last {tail} steps. Steps to threshold: first step whose "
        f"{window(cfg.steps)}-step moving-average reward reaches {cfg.threshold:g} (mean over "
        "the seeds that reach it). Peak mis_k3_kl: largest per-step seed-mean K3 KL between "
        "the rollout engine's and the trainer's log-probs. Rejected tokens: share of tokens "
        "the algorithm's correction drops, averaged over training.")
    return "\n".join(lines)


def plot(history: History, path: Path) -> None:
    """Reward curves and mismatch KL, one line per algorithm (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = history.config
    w = window(cfg.steps)
    steps = np.arange(1, cfg.steps + 1)
    fig, (ax_r, ax_k) = plt.subplots(1, 2, figsize=(12, 4.6), constrained_layout=True)
    for i, (name, m) in enumerate(history.metrics.items()):
        color = f"C{i}"
        style = "--" if name == "reference" else "-"
        label = ALGORITHMS[name].label
        r = smooth(m["reward"], w)
        mean = r.mean(axis=1)
        ax_r.plot(steps, mean, style, color=color, label=label, lw=1.8)
        if r.shape[1] > 1:
            ax_r.fill_between(steps, r.min(axis=1), r.max(axis=1), color=color, alpha=0.12,
                              lw=0)
        ax_k.plot(steps, smooth(m["mis_k3_kl"].mean(axis=1), w), style, color=color,
                  label=label, lw=1.8)
    ax_r.axhline(cfg.threshold, color="0.5", lw=0.8, ls=":")
    ax_r.set(xlabel="training step", ylabel=f"rollout reward ({w}-step moving average)",
             title="Reward (line: mean over seeds, band: min–max)", ylim=(0, 1.02))
    ax_k.set_yscale("symlog", linthresh=1e-5)
    ax_k.set(xlabel="training step", ylabel="mis_k3_kl (rollout vs trainer, symlog)",
             title="Training–inference mismatch")
    ax_k.set_ylim(bottom=0)
    for ax in (ax_r, ax_k):
        ax.grid(alpha=0.3)
    ax_r.legend(loc="lower right", fontsize=9)
    mm = cfg.mismatch
    fig.suptitle(f"offpolicy-jax demo: reverse-digits RL, mismatch = {mm.source} "
                 f"(severity {mm.severity:g}), {cfg.seeds} seeds × {cfg.steps} steps")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_metrics_csv(history: History, path: Path) -> None:
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(("algorithm", "seed", "step") + METRICS)
        for name, m in history.metrics.items():
            for seed in range(history.config.seeds):
                for t in range(history.config.steps):
                    out.writerow([name, seed, t + 1] +
                                 [_num(m[k][t, seed]) for k in METRICS])


def _num(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.6g}"


def write_outputs(history: History, out: Path, command: str) -> dict[str, Path]:
    """Write table (results.md), plot (demo.png), per-step metrics (metrics.csv) and a
    JSON summary (summary.json) into ``out``; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(history)
    table = format_table(history, rows)
    paths = {"table": out / "results.md", "plot": out / "demo.png",
             "metrics": out / "metrics.csv", "summary": out / "summary.json"}
    paths["table"].write_text(
        f"# offpolicy-jax demo results\n\nCommand: `{command}`  \n"
        f"Wall time: {history.seconds:.0f} s\n\n{table}\n")
    plot(history, paths["plot"])
    write_metrics_csv(history, paths["metrics"])
    summary = {"command": command, "wall_seconds": history.seconds,
               "config": dataclasses.asdict(history.config), "results": rows}
    paths["summary"].write_text(json.dumps(summary, indent=2) + "\n")
    return paths
