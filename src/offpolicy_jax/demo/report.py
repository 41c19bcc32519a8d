"""Turn a :class:`~offpolicy_jax.demo.experiment.History` into a table, a plot and log files."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from offpolicy_jax.demo.experiment import History
from offpolicy_jax.demo.train import DIAGNOSTIC_CAP, STEP_METRICS, TIS_CAPS, row

#: The demo's own per-step metrics, first in metrics.csv; every metric the loss returns
#: follows as ``loss/<key>`` (see :func:`metric_columns`).
METRICS = STEP_METRICS


def metric_columns(history: History) -> list[str]:
    """The per-step columns of metrics.csv: :data:`METRICS`, then ``loss/<key>`` for every
    key ``opj.policy_loss`` returns for any row (empty where that row's loss lacks it)."""
    names = set().union(*(m.keys() for m in history.metrics.values()))
    return list(METRICS) + sorted(k for k in names if k not in METRICS)


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


#: A seed has collapsed when its trained policy's final reward (mean of the last 10% of
#: steps) lies this far below the peak of its smoothed reward curve: it fell, and did not
#: recover.
COLLAPSE_DROP = 0.25


def collapsed(policy_reward: np.ndarray) -> np.ndarray:
    """Per seed, whether the reward collapsed (:data:`COLLAPSE_DROP`), ``bool [seeds]``.

    Args:
      policy_reward: ``[steps, seeds]`` reward of the trained policy per step.
    """
    steps = len(policy_reward)
    peak = smooth(policy_reward, window(steps)).max(axis=0)
    final = policy_reward[-max(1, steps // 10) :].mean(axis=0)
    return final <= peak - COLLAPSE_DROP


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
                "label": row(name).label,
                "final_reward_mean": float(final.mean()),
                "final_reward_std": _std(final),
                "final_reward_per_seed": [float(f) for f in final],
                "steps_to_threshold_per_seed": first,
                "steps_to_threshold_mean": float(np.mean(hit)) if hit else None,
                "seeds_reaching_threshold": len(hit),
                "collapsed_seeds": int(collapsed(m["policy_reward"]).sum()),
                "final_rollout_reward_mean": float(rollout.mean()),
                "final_rollout_reward_std": _std(rollout),
                "peak_mis_k3_kl": float(np.nanmax(m["mis_k3_kl"].mean(axis=1))),
                "peak_is_weight": float(np.nanmax(m["is_weight_max"])),
                "peak_grad_norm": float(np.nanmax(m["grad_norm"])),
                "rejected_fraction": float(np.nanmean(m["rejected_fraction"])),
                # NaN for a dense policy (no routes): null in summary.json, not a made-up 0.
                "route_flip_fraction": _nanmean(m["route_flip_fraction"]),
                "log_ratio_above_1": float(np.nanmean(m["log_ratio_above_1"])),
            }
        )
    return rows


def _nanmean(x: np.ndarray) -> float:
    return float(np.nanmean(x)) if np.isfinite(x).any() else float("nan")


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


def _clip(norm: float) -> str:
    return "not clipped" if norm in (0.0, math.inf) else f"at {norm:g}"


def _big(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1e4 else f"{x:.1e}"


def format_table(history: History, rows: list[dict]) -> str:
    """The results as a Markdown table, with a note on how each column is computed."""
    cfg = history.config
    tail = max(1, cfg.steps // 10)
    header = (
        f"| row | final reward (mean ± std, {cfg.seeds} seeds) "
        f"| steps to reward ≥ {cfg.threshold:g} | collapsed seeds | final rollout reward "
        "| peak mis_k3_kl | peak IS weight | peak grad norm | rejected tokens |"
    )
    routed = cfg.train.n_experts > 0
    if routed:  # the mismatch as MoE reports give it (a dense run keeps the table above)
        header += " routes differ | tokens with abs(log ρ) > 1 |"
    lines = [header, "|---" * header.count(" | ") + "|---|"]
    for r in rows:
        line = (
            f"| `{r['algorithm']}` "
            f"| {r['final_reward_mean']:.3f} ± {r['final_reward_std']:.3f} "
            f"| {_steps_cell(r, cfg.seeds)} | {r['collapsed_seeds']}/{cfg.seeds} "
            f"| {r['final_rollout_reward_mean']:.3f} ± {r['final_rollout_reward_std']:.3f} "
            f"| {r['peak_mis_k3_kl']:.3g} | {_big(r['peak_is_weight'])} "
            f"| {_big(r['peak_grad_norm'])} | {100 * r['rejected_fraction']:.1f}% |"
        )
        if routed:
            line += (
                f" {100 * r['route_flip_fraction']:.1f}% | {100 * r['log_ratio_above_1']:.2f}% |"
            )
        lines.append(line)
    lines += [
        "",
        (
            "Rows: `algorithm[+correction]` of `opj.LossConfig`: `is` = decoupled_ppo with the "
            "untruncated weight π_old/π_rollout, `tis<C>` = that weight truncated at C "
            "(`VanillaTIS(clip_low=0, clip=C)`), `mis` = the shipped mis.yaml; "
            "`ppo:no-mismatch` = ppo with an engine that computes exactly like the trainer. "
            "Reward: fraction of digits right, of the trained policy itself (float32, temperature "
            f"1, fresh prompts); final = mean over the last {tail} steps. Steps to threshold: "
            f"first step whose {window(cfg.steps)}-step moving average reaches {cfg.threshold:g} "
            "(mean over the seeds that reach it). Collapsed: seeds whose final reward is "
            f"{COLLAPSE_DROP:g} or more below the peak of their moving average. Rollout reward: "
            "the same, of the responses the rollout engine sampled for training. Peak "
            "mis_k3_kl: largest per-step seed-mean K3 KL between the engine's and the trainer's "
            "log-probs. Peak IS weight: largest per-token π_old/π_rollout of any step and seed "
            "(before any cap; the library clamps the log-ratio at ±20). Peak grad norm: largest "
            f"per-step gradient norm before clipping ({_clip(cfg.train.max_grad_norm)}). "
            "Rejected tokens: share of tokens "
            "the row's correction drops, averaged over training."
        ),
    ]
    if routed:
        lines[-1] += (
            " Routes differ: share of routing decisions (response positions × layers) where "
            "the engine's experts differ from those the trainer's router picks, averaged over "
            "training (a `+replay` row trains on the engine's, but the share is still "
            "measured). abs(log ρ) > 1: share of tokens whose log π_old − log π_rollout "
            "exceeds 1 in magnitude, averaged over training."
        )
    log_prob_rows = [r["algorithm"] for r in rows if _reports_log_prob_loss(r["algorithm"])]
    if log_prob_rows:
        lines += ["", _LOG_PROB_LOSS_NOTE.format(rows=", ".join(f"`{r}`" for r in log_prob_rows))]
    return "\n".join(lines)


#: Surrogates whose per-token loss is ``−sg(w)·A·log π_θ`` (a REINFORCE term).
LOG_PROB_SURROGATES = ("cispo", "gpg", "dppo_tv", "dppo_kl", "dro", "vespo")

_LOG_PROB_LOSS_NOTE = (
    "Note on {rows}: their `loss/pg_loss` in metrics.csv is −sg(w)·A·log π_θ averaged "
    "(a stop-gradient weight times the REINFORCE term): its gradient is the policy "
    "gradient, but its value is not an objective that training lowers. It scales with "
    "log π_θ of the sampled tokens, which goes to 0 as the policy sharpens, so it can rise "
    "while the reward improves. Judge these rows by the reward columns, not by pg_loss."
)


def _reports_log_prob_loss(name: str) -> bool:
    try:
        loss = row(name).loss
    except ValueError:
        return False
    return loss.algorithm == "reinforce_is" or loss.policy_loss in LOG_PROB_SURROGATES


#: Colours of rows with LossConfig overrides (``ROW/field=value``), in order of appearance.
_OVERRIDE_COLOURS = ("#17becf", "#e377c2", "#bcbd22", "#7f7f7f", "#ff7f0e", "#1f77b4")


def _style(name: str, nth_override: int = 0) -> dict:
    """Colour by family, so that a reader finds rows across panels: greys for the
    uncorrected baselines, red for untruncated IS, blues (darker = larger C) for TIS."""
    algo = row(name)
    if not algo.mismatch:
        return {"color": "0.25", "ls": "--"}
    fixed = {
        "ppo": "#e08a00",
        "bypass_ppo": "#8c564b",
        "decoupled_ppo+is": "#d62728",
        "decoupled_ppo+mis": "#2ca02c",
        "reinforce_is+mis": "#9467bd",
        "decoupled_ppo+icepop": "#e377c2",
        "ppo+replay": "#7f7f00",
    }
    if algo.routing_replay and name not in fixed:  # a replay row: its base row, dash-dotted
        return {**_style(name.replace("+replay", "", 1), nth_override), "ls": "-."}
    if name in fixed:
        return {"color": fixed[name], "ls": "-"}
    if "/" in name:  # a row with LossConfig overrides (e.g. another surrogate)
        colour = _OVERRIDE_COLOURS[nth_override % len(_OVERRIDE_COLOURS)]
        return {"color": colour, "ls": "-."}
    caps = sorted(TIS_CAPS)
    cap = getattr(algo.loss.correction, "clip", None)  # a VanillaTIS cap, if any
    shade = caps.index(cap) / max(1, len(caps) - 1) if cap in caps else 0.5
    return {"color": plt_blues(0.45 + 0.5 * shade), "ls": "-"}


def plt_blues(x: float):
    import matplotlib

    return matplotlib.colormaps["Blues"](x)


def plot(history: History, path: Path) -> None:
    """Rewards, mismatch and the per-step diagnostics, one line per row (mean over seeds),
    bands from the min to the max over seeds. A row whose seeds collapsed says so in the
    legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = history.config
    w = window(cfg.steps)
    steps = np.arange(1, cfg.steps + 1)
    fig, axes = plt.subplots(2, 3, figsize=(17, 10), layout="constrained")
    # (key, y label, title, scale, band over seeds)
    panels = [
        ("policy_reward", "reward (fraction of digits right)", "Trained policy (float32)", "lin"),
        ("reward", "reward of the engine's rollouts", "Rollouts used for training", "lin"),
        ("mis_k3_kl", "mis_k3_kl (symlog)", "Mismatch: K3 KL, engine vs trainer", "symlog"),
        ("grad_norm", "gradient norm before clipping (log)", "Gradient norm", "log"),
        ("is_weight_max", "max π_old/π_rollout over tokens (log)", "Largest IS weight", "log"),
        (
            "is_weight_above_2",
            "fraction of tokens",
            f"Tokens with π_old/π_rollout > {DIAGNOSTIC_CAP:g}",
            "lin0",
        ),
    ]
    flat = axes.ravel()
    overrides = [name for name in history.metrics if "/" in name]
    for name, m in history.metrics.items():
        style = _style(name, overrides.index(name) if name in overrides else 0)
        bad = int(collapsed(m["policy_reward"]).sum())
        label = name + (f"  (collapsed: {bad}/{cfg.seeds} seeds)" if bad else "")
        lw = 2.6 if bad else 1.6
        for ax, (key, _, _, scale) in zip(flat, panels, strict=True):
            r = smooth(m[key], w)
            if scale == "log":
                r = np.exp(smooth(np.log(np.maximum(m[key], 1e-12)), w))
                line = np.exp(np.log(r).mean(axis=1))
            else:
                line = r.mean(axis=1)
            ax.plot(steps, line, lw=lw, label=label, **style)
            if r.shape[1] > 1 and key in ("policy_reward", "reward"):
                ax.fill_between(
                    steps, r.min(axis=1), r.max(axis=1), color=style["color"], alpha=0.10, lw=0
                )
    for ax, (_, ylabel, title, scale) in zip(flat, panels, strict=True):
        ax.set(xlabel="training step", ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
        if scale == "symlog":
            ax.set_yscale("symlog", linthresh=1e-3)
            ax.set_ylim(bottom=0)
        elif scale == "log":
            ax.set_yscale("log")
        elif scale == "lin0":
            ax.set_ylim(bottom=0)
        else:
            ax.axhline(cfg.threshold, color="0.5", lw=0.8, ls=":")
            ax.set_ylim(0, 1.02)
    handles, labels = flat[0].get_legend_handles_labels()
    fig.legend(
        handles,
        labels,
        loc="outside lower center",
        ncol=min(len(labels), 4),
        fontsize=11,
        frameon=False,
    )
    mm = cfg.mismatch
    fig.suptitle(
        f"offpolicy-jax demo ({cfg.preset} preset): reverse-digits GRPO, mismatch = {mm.source} "
        f"(severity {mm.severity:g}), lr {cfg.train.learning_rate:g}, {cfg.seeds} seeds × "
        f"{cfg.steps} steps\nlines: mean over seeds ({w}-step moving average; geometric mean "
        "on log panels); bands: min–max over seeds; thick lines: rows with a collapsed seed",
        fontsize=12,
    )
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_metrics_csv(history: History, path: Path) -> None:
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        columns = metric_columns(history)
        out.writerow(["algorithm", "seed", "step", *columns])
        for name, m in history.metrics.items():
            for seed in range(history.config.seeds):
                for t in range(history.config.steps):
                    out.writerow([name, seed, t + 1] + [_num(m[k][t, seed]) for k in columns])


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
    # allow_nan=False: a bare NaN is not JSON (JSON.parse and strict parsers reject it).
    paths["summary"].write_text(json.dumps(_finite(summary), indent=2, allow_nan=False) + "\n")
    return paths


def _finite(x):
    """``x`` with every NaN/inf float replaced by None (JSON null), recursively."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(float(x)) else None
    return x
