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
METRICS = (
    "policy_reward",
    "policy_exact_match",
    "reward",
    "mis_k3_kl",
    "rejected_fraction",
    "pg_clipfrac",
    "grad_norm",
)


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
        final = m["policy_reward"][-tail:].mean(axis=0)  # per seed
        reached = smooth(m["policy_reward"], w) >= cfg.threshold  # [steps, seeds]
        first = [int(np.argmax(col)) + 1 if col.any() else None for col in reached.T]
        hit = [s for s in first if s is not None]
        rollout = m["reward"][-tail:].mean(axis=0)
        rows.append(
            {
                "algorithm": name,
                "label": ALGORITHMS[name].label,
                "final_reward_mean": float(final.mean()),
                "final_reward_std": _std(final),
                "final_reward_per_seed": [float(f) for f in final],
                "steps_to_threshold_per_seed": first,
                "steps_to_threshold_mean": float(np.mean(hit)) if hit else None,
                "seeds_reaching_threshold": len(hit),
                "final_rollout_reward_mean": float(rollout.mean()),
                "final_rollout_reward_std": _std(rollout),
                "peak_mis_k3_kl": float(np.nanmax(m["mis_k3_kl"].mean(axis=1))),
                "rejected_fraction": float(np.nanmean(m["rejected_fraction"])),
            }
        )
    return rows


def _std(x: np.ndarray) -> float:
    """Sample standard deviation over seeds (0 for one seed)."""
    return float(x.std(ddof=1)) if len(x) > 1 else 0.0


def _steps_cell(row: dict, seeds: int) -> str:
    if row["steps_to_threshold_mean"] is None:
        return "never"
    cell = f"{row['steps_to_threshold_mean']:.0f}"
    return (
        cell
        if row["seeds_reaching_threshold"] == seeds
        else f"{cell} ({row['seeds_reaching_threshold']}/{seeds} seeds)"
    )


def format_table(history: History, rows: list[dict]) -> str:
    """The results as a Markdown table, with a note on how each column is computed."""
    cfg = history.config
    tail = max(1, cfg.steps // 10)
    header = (
        f"| algorithm | final reward (mean ± std, {cfg.seeds} seeds) "
        f"| steps to reward ≥ {cfg.threshold:g} | final rollout reward | peak mis_k3_kl "
        "| rejected tokens |"
    )
    lines = [header, "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['final_reward_mean']:.3f} ± {r['final_reward_std']:.3f} "
            f"| {_steps_cell(r, cfg.seeds)} "
            f"| {r['final_rollout_reward_mean']:.3f} ± {r['final_rollout_reward_std']:.3f} "
            f"| {r['peak_mis_k3_kl']:.3g} | {100 * r['rejected_fraction']:.1f}% |"
        )
    lines += [
        "",
        (
            "Reward: fraction of digits right, of the trained policy itself (float32, temperature "
            f"1, fresh prompts); final = mean over the last {tail} steps. Steps to threshold: "
            f"first step whose {window(cfg.steps)}-step moving average reaches {cfg.threshold:g} (mean "
            "over the seeds that reach it). Rollout reward: the same, of the responses the rollout "
            "engine sampled for training. Peak mis_k3_kl: largest per-step seed-mean K3 KL between "
            "the engine's and the trainer's log-probs. Rejected tokens: share of tokens the "
            "algorithm's correction drops, averaged over training."
        ),
    ]
    return "\n".join(lines)


def plot(history: History, path: Path) -> None:
    """Rewards and mismatch KL over training, one line per algorithm (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = history.config
    w = window(cfg.steps)
    steps = np.arange(1, cfg.steps + 1)
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2), layout="constrained")
    panels = [
        ("policy_reward", "reward of the trained policy", "Trained policy (float32 sampling)"),
        ("reward", "reward of the engine's rollouts", "Rollouts used for training"),
        ("mis_k3_kl", "mis_k3_kl (engine vs trainer, symlog)", "Training–inference mismatch"),
    ]
    for i, (name, m) in enumerate(history.metrics.items()):
        style = {
            "color": f"C{i}",
            "lw": 1.8,
            "ls": "--" if name == "reference" else "-",
            "label": ALGORITHMS[name].label,
        }
        for ax, (key, _, _) in zip(axes, panels, strict=True):
            if key == "mis_k3_kl":
                ax.plot(steps, smooth(m[key].mean(axis=1), w), **style)
                continue
            r = smooth(m[key], w)
            ax.plot(steps, r.mean(axis=1), **style)
            if r.shape[1] > 1:
                ax.fill_between(
                    steps, r.min(axis=1), r.max(axis=1), color=style["color"], alpha=0.12, lw=0
                )
    for ax, (key, ylabel, title) in zip(axes, panels, strict=True):
        ax.set(xlabel="training step", ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
        if key == "mis_k3_kl":
            ax.set_yscale("symlog", linthresh=1e-5)
            ax.set_ylim(bottom=0)
        else:
            ax.axhline(cfg.threshold, color="0.5", lw=0.8, ls=":")
            ax.set_ylim(0, 1.02)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(
        handles,
        labels,
        loc="outside lower center",
        ncol=len(labels) if len(labels) <= 3 else (len(labels) + 1) // 2,
        fontsize=10,
        frameon=False,
    )
    mm = cfg.mismatch
    fig.suptitle(
        f"offpolicy-jax demo: reverse-digits GRPO, mismatch = {mm.source} (severity "
        f"{mm.severity:g}), {cfg.seeds} seeds × {cfg.steps} steps\n"
        f"lines: mean over seeds ({w}-step moving average); bands: min–max over seeds",
        fontsize=11,
    )
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_metrics_csv(history: History, path: Path) -> None:
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(("algorithm", "seed", "step") + METRICS)
        for name, m in history.metrics.items():
            for seed in range(history.config.seeds):
                for t in range(history.config.steps):
                    out.writerow([name, seed, t + 1] + [_num(m[k][t, seed]) for k in METRICS])


def _num(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.6g}"


def write_outputs(history: History, out: Path, command: str) -> dict[str, Path]:
    """Write table (results.md), plot (demo.png), per-step metrics (metrics.csv) and a
    JSON summary (summary.json) into ``out``; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(history)
    table = format_table(history, rows)
    paths = {
        "table": out / "results.md",
        "plot": out / "demo.png",
        "metrics": out / "metrics.csv",
        "summary": out / "summary.json",
    }
    paths["table"].write_text(
        f"# offpolicy-jax demo results\n\nCommand: `{command}`  \n"
        f"Wall time: {history.seconds:.0f} s\n\n{table}\n"
    )
    plot(history, paths["plot"])
    write_metrics_csv(history, paths["metrics"])
    summary = {
        "command": command,
        "wall_seconds": history.seconds,
        "config": dataclasses.asdict(history.config),
        "results": rows,
    }
    paths["summary"].write_text(json.dumps(summary, indent=2) + "\n")
    return paths
