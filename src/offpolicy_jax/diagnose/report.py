"""The report of ``offpolicy-jax diagnose``: recommendation, ``report.md``/``.json``, plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import yaml

import offpolicy_jax as opj
from offpolicy_jax.diagnose import analysis

# Recommendation thresholds (docs/diagnose.md): the per-token k3 KL estimate
# E[e^δ − δ − 1] ≈ Var(δ)/2 of the rollout vs the trainer.
NEGLIGIBLE_K3 = 1e-4
SEVERE_K3 = 1e-2
MAX_REJECTED_SEQ_SHARE = 0.5
#: ``mis_k3_kl`` is *concentrated* when the tokens that carry half of its sum are at most
#: this share of the valid tokens (and among the :data:`analysis.K3_TOP` largest): k3
#: grows as e^δ, so a few tokens at δ = 15 can make the mean of a million exact tokens.
CONCENTRATED_K3_SHARE = 0.01
#: KPop is recommended when its rule rejects at least this share of the valid tokens and at
#: least :data:`KPOP_OVER_BAND` times the share IcePop's ratio band zeroes: then at least
#: ``1 − 1/KPOP_OVER_BAND`` of the tokens it flags lie inside the band, tokens whose
#: probability moved far while their ratio stayed within ``[0.5, 5]`` (confident tokens:
#: ``0.9999 → 0.52`` has ratio 0.52 and binary KL 3.7), which no ratio rule sees.
KPOP_MIN_SHARE = 1e-3
KPOP_OVER_BAND = 2.0


def kpop_evidence(what_if: dict[str, dict]) -> dict | None:
    """The shares behind a KPop recommendation, or None when the table lacks the rows.

    ``kpop_share``: valid tokens the ``kpop`` row rejects; ``band_share``: valid tokens
    the ``icepop`` row's ratio band zeroes; ``flagged``: ``kpop_share ≥``
    :data:`KPOP_MIN_SHARE` and ``kpop_share ≥`` :data:`KPOP_OVER_BAND` ``· band_share``.
    """
    kpop = what_if.get("kpop", {}).get("table")
    band = what_if.get("icepop", {}).get("table")
    if not kpop or not band:
        return None
    kpop_share = kpop.get("rejected_token_share") or 0.0
    band_share = band.get("zero_weight_share") or 0.0
    flagged = kpop_share >= KPOP_MIN_SHARE and kpop_share >= KPOP_OVER_BAND * band_share
    return {"kpop_share": kpop_share, "band_share": band_share, "flagged": flagged}


def recommend(
    metrics: dict[str, float],
    what_if: dict[str, dict],
    tail: dict | None = None,
    drivers: dict | None = None,
) -> dict:
    """The recommended config, from the pooled metrics and the what-if table.

    * ``mis_k3_kl < 1e-4`` and no catastrophic token (ratio < 1e-4): negligible mismatch,
      ``use_tis: false`` (keep monitoring the metrics);
    * ``mis_k3_kl < 1e-2`` and no catastrophic token: mild, token-level TIS truncated at 2;
    * otherwise severe: token TIS 2 + geometric RS in [0.98, 1.02] + veto at 1e-4
      (``geo_rs_veto``), unless that rejects more than half of the sequences, then the
      shipped ``mis.yaml`` (token RS + veto: drops tokens, keeps sequences);
    * but a severe headline that a few tokens carry (``drivers``, :func:`k3_drivers`:
      ``concentrated``) over a mild bulk (the median sequence's mean k3 below 1e-2) gets
      token TIS at 2 (with the veto where catastrophic tokens exist): the cap bounds
      exactly those tokens, and the rest of the dump needs no sequence-level rejection;
    * and a severe mismatch that is *discrete* (``tail``, :func:`heavy_tail`: a few tokens
      carry most of it over an exact bulk, as flipped MoE routes give) gets token TIS at
      2: the cap bounds exactly those tokens, where sequence-level rejection drops every
      sequence holding one (in the demo's router regime geometric RS + veto left a seed
      unlearned and TIS 2 learned in all; docs/demo_moe.md);
    * where any of these picks token TIS at 2 and the KPop row rejects tokens that the
      ratio band passes (:func:`kpop_evidence`): token TIS 2 + KPop (``kpop``). The
      per-token view is the right one there, and the divergence sits in probability
      space, in confident tokens, where truncating or banding the ratio does nothing;
      where the bulk drifted (sequence-level rejection) KPop is left to the what-if
      table.
    """
    k3 = metrics.get("mis_k3_kl", 0.0)
    veto = what_if.get("veto", {}).get("metrics", {})
    catastrophic = veto.get("mis_rs_catastrophic_token_fraction", 0.0)
    facts = f"mis_k3_kl = {k3:.3g}, catastrophic-token fraction = {catastrophic:.3g}"
    if k3 < NEGLIGIBLE_K3 and catastrophic == 0:
        config = opj.CorrectionConfig(use_tis=False)
        return {
            "name": "metrics_only",
            "severity": "negligible",
            "reason": f"negligible mismatch ({facts} < {NEGLIGIBLE_K3:g}, no catastrophic "
            "token): no correction needed; keep logging the metrics",
            "config": config.to_dict(),
        }
    if k3 < SEVERE_K3 and catastrophic == 0:
        name = "token_tis"
        reason = (
            f"mild mismatch ({facts}; k3 < {SEVERE_K3:g}, no token with ratio < "
            f"{analysis.VETO:g}): per-token ratios stay near 1, so token-level TIS truncated "
            "at 2 corrects the bias at little variance cost"
        )
        severity = "mild"
    elif drivers is not None and drivers["concentrated"] and drivers["median_seq_k3"] < SEVERE_K3:
        name, severity = ("veto" if catastrophic else "token_tis"), "severe"
        veto_text = (
            f", and the veto drops the sequences holding a token with ratio < {analysis.VETO:g}"
            if catastrophic
            else ""
        )
        reason = (
            f"severe headline carried by a few tokens ({facts}; {_drivers_text(drivers)}; "
            f"the median sequence's mean k3 is {drivers['median_seq_k3']:.3g} < "
            f"{SEVERE_K3:g}, so the bulk is mild): a per-token cap at 2 bounds exactly those "
            f"tokens{veto_text}; check them (report.md, 'What drives mis_k3_kl')"
        )
    elif tail is not None and tail.get("discrete"):
        name, severity = "token_tis", "severe"
        reason = (
            f"severe but discrete mismatch ({facts}; {tail['tail_token_share']:.2%} of the "
            f"tokens carry {tail['tail_abs_log_ratio_share']:.1%} of Σ|log ρ|, the median "
            "token is exact): a per-token cap at 2 bounds exactly those tokens, where "
            "sequence-level rejection would drop every sequence holding one; if the engine "
            "is a mixture of experts, routing replay (R3) removes the cause"
        )
    else:
        name, reason = _severe(k3, facts, what_if)
        severity = "severe"
    kpop = kpop_evidence(what_if)
    if name == "token_tis" and kpop is not None and kpop["flagged"]:
        name, reason = "kpop", _kpop_reason(severity, facts, kpop)
    config = next(w for w in analysis.WHAT_IFS if w.name == name).build()
    return {"name": name, "severity": severity, "reason": reason, "config": config.to_dict()}


def _kpop_reason(severity: str, facts: str, kpop: dict) -> str:
    return (
        f"{severity} mismatch in probability space ({facts}): KPop's binary KL exceeds "
        f"{analysis.KPOP_PHI:g} at {kpop['kpop_share']:.2%} of the valid tokens, at least "
        f"{KPOP_OVER_BAND:g} times the {kpop['band_share']:.2%} that the ratio band "
        f"{list(analysis.ICEPOP_BOUNDS)} zeroes, so most of them are tokens whose "
        "probability moved far while their ratio stayed in the band (confident tokens), "
        "which ratio truncation and IcePop cannot see; token TIS 2 + KPop rejects them"
    )


def _severe(k3: float, facts: str, what_if: dict[str, dict]) -> tuple[str, str]:
    """The severe rule's row and reason: ``geo_rs_veto``, or ``mis`` when geometric RS
    would reject more than half of the sequences."""
    geo = what_if.get("geo_rs_veto", {}).get("table", {})
    share = geo.get("rejected_seq_share", 1.0)
    trigger = f"k3 >= {SEVERE_K3:g}" if k3 >= SEVERE_K3 else "catastrophic tokens present"
    why = (
        f"severe mismatch ({facts}; {trigger}): token ratios compound over a sequence, "
        "so sequences that drifted are rejected"
    )
    if share <= MAX_REJECTED_SEQ_SHARE:
        return "geo_rs_veto", (
            f"{why} by their geometric-mean ratio (outside {list(analysis.GEO_BOUNDS)}: "
            f"{share:.1%} of sequences) and sequences with a catastrophic token are vetoed"
        )
    return "mis", (
        f"{why}; but geometric RS would reject {share:.1%} of the sequences (> "
        f"{MAX_REJECTED_SEQ_SHARE:.0%}), so the shipped mis.yaml instead rejects "
        "single tokens outside [0.5, 2] and vetoes catastrophic sequences"
    )


# --------------------------------------------------------------------------- quantiles


def _quantiles(hist: np.ndarray, qs=(0.05, 0.5, 0.95)) -> np.ndarray:
    """Per-row quantiles of δ from a ``[..., N_DELTA_BINS]`` histogram (bin centres)."""
    centres = analysis.delta_bin_centres()
    cdf = np.cumsum(hist, -1)
    total = cdf[..., -1:]
    out = np.full((*hist.shape[:-1], len(qs)), np.nan)
    for i, q in enumerate(qs):
        idx = np.argmax(cdf >= q * total, axis=-1)
        out[..., i] = np.where(total[..., 0] > 0, centres[idx], np.nan)
    return out


def _profile(hist, sums, abs_sums) -> dict:
    count = hist.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(count > 0, sums / np.maximum(count, 1), np.nan)
        mean_abs = np.where(count > 0, abs_sums / np.maximum(count, 1), np.nan)
    q = _quantiles(hist)
    return {
        "tokens": count,
        "mean": mean,
        "mean_abs": mean_abs,
        "p05": q[..., 0],
        "p50": q[..., 1],
        "p95": q[..., 2],
    }


def _jsonable(x) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, (float, np.floating)):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, np.integer):
        return int(x)
    return x


def _edges() -> np.ndarray:
    """δ bin edges for JSON: the open outermost bins end at ±1000."""
    return np.clip(analysis.delta_bin_edges(), -1e3, 1e3)


#: Per-token weight quantiles of the heavy-tail table (shares of the valid tokens).
TAIL_QUANTILES = (0.001, 0.01, 0.5, 0.99, 0.999)
#: A token is in the tail when its |log ρ| = |old − rollout| exceeds this (ρ beyond
#: [1/e, e]); the share of such tokens is what MoE routing reports quote.
TAIL_LOG_RATIO = 1.0
#: The mismatch is "heavy-tailed" when the tail tokens are at most this share of the
#: tokens but carry at least :data:`HEAVY_TAIL_MASS` of Σ|log ρ| (a Gaussian log-ratio
#: never is: with σ = 0.5, 4.6% of tokens carry 14% of the mass; with σ = 1, 32% carry 61%).
HEAVY_TAIL_SHARE = 0.1
HEAVY_TAIL_MASS = 0.5
#: A heavy tail over an exact bulk (median |log ρ| at most this) is a *discrete* mismatch:
#: most tokens computed identically, a few through another path (a flipped MoE route).
EXACT_BULK = 0.01


def heavy_tail(counts: np.ndarray, worst_tokens: list[dict]) -> dict:
    """How concentrated the mismatch is, from the token log-ratio histogram.

    Per-token weight ``ρ = exp(old − rollout)`` quantiles (:data:`TAIL_QUANTILES`, read off
    the 20-per-decade log bins: ±6%), the share of tokens with ``|log ρ| > 1`` and the
    share of ``Σ |log ρ|`` they carry (from the bin centres), and the largest ``|log ρ|``
    (exact, the worst token). ``heavy`` when few tokens (≤ :data:`HEAVY_TAIL_SHARE`)
    carry most of the mismatch (≥ :data:`HEAVY_TAIL_MASS`): a discrete mismatch (a
    flipped MoE route, a stale token), which a per-token cap bounds and a sequence-level
    filter over-reacts to. ``discrete`` when, besides, the median token is exact
    (``|log ρ|`` median ≤ :data:`EXACT_BULK`), the signature of flipped MoE routes.
    """
    counts = np.asarray(counts, float)
    edges = analysis.delta_bin_edges()
    centres = analysis.delta_bin_centres()
    total = counts.sum()
    tail = (edges[:-1] >= TAIL_LOG_RATIO) | (edges[1:] <= -TAIL_LOG_RATIO)
    mass = counts * np.abs(centres)
    share = float(counts[tail].sum() / total) if total else 0.0
    tail_mass = float(mass[tail].sum() / mass.sum()) if mass.sum() else 0.0
    quantiles = _quantiles(counts[None], TAIL_QUANTILES)[0]
    order = np.argsort(np.abs(centres), kind="stable")
    below = np.cumsum(counts[order])
    median = float(np.abs(centres[order][np.argmax(below >= 0.5 * total)])) if total else 0.0
    heavy = bool(0 < share <= HEAVY_TAIL_SHARE and tail_mass >= HEAVY_TAIL_MASS)
    return {
        "weight_quantiles": {
            f"{q:g}": float(np.exp(v)) for q, v in zip(TAIL_QUANTILES, quantiles, strict=True)
        },
        "tail_token_share": share,
        "tail_abs_log_ratio_share": tail_mass,
        "max_abs_log_ratio": worst_tokens[0]["abs_log_ratio"] if worst_tokens else 0.0,
        "abs_log_ratio_median": median,
        "heavy": heavy,
        "discrete": heavy and median <= EXACT_BULK,
    }


def k3_drivers(acc: analysis.Accumulator, valid_tokens: float) -> dict:
    """Which tokens carry ``mis_k3_kl``, and a robust statistic beside it.

    From the :data:`analysis.K3_TOP` tokens with the largest k3 term ``(e^δ − δ − 1)·m``
    (exact, with where they are): ``top_tokens`` of them carry ``top_k3_share`` of the
    dump's Σ k3; ``half_tokens`` is the fewest that carry half of it (None when the
    kept tokens carry less), ``half_token_share`` their share of the valid tokens and
    ``half_sequences`` how many sequences hold them. ``median_seq_k3`` is the median
    over valid sequences of their mean k3 (read off 10-per-decade log bins: ±12%),
    which no handful of tokens moves. ``concentrated``: half of Σ k3 sits in at most
    :data:`CONCENTRATED_K3_SHARE` of the tokens.
    """
    top = [item for *_, item in sorted(acc.k3_top, key=lambda e: (e[0], e[1]), reverse=True)]
    total = acc.k3_sum
    cum = np.cumsum([item["k3"] for item in top]) if top else np.zeros(0)
    reached = np.flatnonzero(cum >= 0.5 * total) if total > 0 else np.zeros(0, int)
    half = int(reached[0]) + 1 if reached.size else None
    seqs = {(t["file"], t["row"], t["start"]) for t in top[: half or 0]}
    counts = acc.seq_k3_hist
    median = 0.0
    if counts.sum() > 0:
        idx = int(np.argmax(np.cumsum(counts) >= 0.5 * counts.sum()))
        median = float(analysis.k3_bin_centres()[idx])
    share = half / valid_tokens if half is not None and valid_tokens else None
    return {
        "k3_sum": total,
        "top_tokens": len(top),
        "top_k3_share": float(cum[-1] / total) if top and total > 0 else 0.0,
        "half_tokens": half,
        "half_token_share": share,
        "half_sequences": len(seqs) if half is not None else None,
        "median_seq_k3": median,
        "concentrated": bool(share is not None and share <= CONCENTRATED_K3_SHARE),
        "tokens": top,
    }


def _drivers_text(drivers: dict) -> str:
    return (
        f"{drivers['half_tokens']:,} token(s), {drivers['half_token_share']:.3%} of the "
        f"tokens in {drivers['half_sequences']:,} sequence(s), carry half of the k3 sum"
    )


def build(acc: analysis.Accumulator, inputs: list[str]) -> dict:
    """The report as a JSON-able dict (``report.json``)."""
    metrics = acc.metrics("metrics")
    what_if = {}
    for w in analysis.WHAT_IFS:
        what_if[w.name] = {
            "description": w.description,
            "config": w.build().to_dict(),
            "table": acc.what_if(w.name),
            "metrics": acc.metrics(w.name),
        }
    position = _profile(acc.pos_hist, acc.pos_sum, acc.pos_abs)
    position["start"] = np.arange(acc.pos_hist.shape[0]) * (acc.position_bin or 1)
    prob = _profile(acc.prob_hist, acc.prob_sum, acc.prob_abs)
    edges = analysis.prob_bin_edges()
    prob["p_high"], prob["p_low"] = edges[:-1], edges[1:]
    prob["p_low"][-1] = 0.0
    worst_tokens = [item for *_, item in sorted(acc.worst_tokens, reverse=True)]
    worst_seqs = [item for *_, item in sorted(acc.worst_seqs, reverse=True)]
    drivers = k3_drivers(acc, acc.extra["metrics"].get("valid_tokens", 0.0))
    for item in worst_tokens + worst_seqs + drivers["tokens"]:
        item["file"] = inputs[item["file"]]
    report = {
        "inputs": inputs,
        "reduction": acc.reduction,
        "totals": dict(acc.totals),
        "metrics": metrics,
        "what_if": what_if,
        "by_position": position,
        "by_rollout_prob": prob,
        "token_log_ratio_hist": {
            "edges": _edges(),
            "counts": acc.pos_hist.sum(0) if acc.pos_hist.size else acc.seq_hist * 0,
        },
        "seq_geometric_log_ratio_hist": {
            "edges": _edges(),
            "counts": acc.seq_hist,
        },
        "worst_tokens": worst_tokens,
        "worst_sequences": worst_seqs,
    }
    tail = heavy_tail(report["token_log_ratio_hist"]["counts"], worst_tokens)
    report["heavy_tail"] = tail
    report["k3_drivers"] = drivers
    report["recommendation"] = recommend(metrics, what_if, tail, drivers)
    return _jsonable(report)


# --------------------------------------------------------------------------- markdown


def _g(x, digits=4) -> str:
    return "n/a" if x is None else f"{x:.{digits}g}"


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.2f}%"  # None: the config has no such step


def markdown(report: dict) -> str:
    """report.md: the recommendation first, then the evidence behind it."""
    t = report["totals"]
    lines = ["# Training–inference mismatch diagnosis", ""]
    lines.append(
        f"{t['sequences']:,} sequences, {t['tokens']:,} valid tokens from "
        f"{len(report['inputs'])} file(s); metrics with reduction={report['reduction']!r}."
    )
    if t["nonfinite_tokens"]:
        lines.append(
            f"\n**Warning:** {t['nonfinite_tokens']:,} valid tokens with NaN/inf log-probs in "
            f"{t['nonfinite_sequences']:,} sequences; those sequences are left out of every "
            "metric (docs/semantics.md §0)."
        )
    rec = report["recommendation"]
    lines += [
        "",
        "## Recommendation",
        "",
        f"**{rec['name']}** ({rec['severity']}): {rec['reason']}.",
    ]
    lines += ["", "```yaml", yaml.safe_dump(rec["config"], sort_keys=False).rstrip(), "```"]
    if "heavy_tail" in report:
        lines += _heavy_tail_lines(report["heavy_tail"], report.get("k3_drivers"))
    if "k3_drivers" in report:
        lines += _k3_driver_lines(report["metrics"].get("mis_k3_kl", 0.0), report["k3_drivers"])
    lines += _metric_lines(report)
    lines += _what_if_lines(report["what_if"])
    lines += _by_probability_lines(report["by_rollout_prob"])
    lines += _worst_lines(report)
    return "\n".join(lines) + "\n"


def _metric_lines(report: dict) -> list[str]:
    lines: list[str] = []
    lines += [
        "",
        "## Mismatch metrics (`compute_correction`)",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    lines += [f"| `{k}` | {_g(v, 6)} |" for k, v in report["metrics"].items()]
    return lines


def _what_if_lines(what_if: dict) -> list[str]:
    lines: list[str] = []
    lines += ["", "## What-if: each standard correction on this dump", ""]
    lines += [
        "| config | rejected tokens | rejected sequences | truncated | zero weight | ESS "
        "| mean weight | what |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, entry in what_if.items():
        row = entry["table"]
        lines.append(
            f"| {name} | {_pct(row['rejected_token_share'])} | {_pct(row['rejected_seq_share'])}"
            f" | {_pct(row['truncated_share'])} | {_pct(row['zero_weight_share'])} | "
            f"{_g(row['ess'], 3)} | {_g(row['mean_weight'], 4)} | {entry['description']} |"
        )
    lines += [
        "",
        "Rejected: share of valid tokens / non-empty sequences outside the final mask. "
        "Zero weight (IcePop, `tis_mode: band`): share of valid tokens that stay in the "
        "mask with weight 0 (outside the band): they count in the loss's token average "
        "but add no gradient, so rejected + zero weight is the share of tokens without "
        "gradient. Truncated: `mis_tis_truncate_fraction` (the metrics' reduction). "
        "–: the config has no such step. "
        "ESS = (Σw)² / (n·Σw²) over the n kept tokens (1 = uniform weights; zero weights "
        "count in n). Mean weight: `mis_is_ratio_mean_final` (after batch normalisation "
        "where the config has it).",
    ]
    return lines


def _by_probability_lines(prob: dict) -> list[str]:
    lines: list[str] = []
    lines += ["", "## Log-ratio δ = old − rollout by rollout probability", ""]
    lines += [
        "| rollout p | tokens | mean δ | mean abs δ | p5 | p50 | p95 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for i, n in enumerate(prob["tokens"]):
        if n:
            lines.append(
                f"| {_g(prob['p_low'][i], 2)}–{_g(prob['p_high'][i], 2)} | {int(n):,} | "
                f"{_g(prob['mean'][i], 3)} | {_g(prob['mean_abs'][i], 3)} | "
                f"{_g(prob['p05'][i], 2)} | {_g(prob['p50'][i], 2)} | {_g(prob['p95'][i], 2)} |"
            )
    lines += ["", "Quantiles are read off 20-per-decade log bins (±6% of the value)."]
    return lines


def _worst_lines(report: dict) -> list[str]:
    lines: list[str] = []
    lines += ["", "## Worst sequences (by |Σ δ|)", ""]
    lines += [
        "| file | step | row | tokens | Σ δ | mean δ | max abs δ |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in report["worst_sequences"][:10]:
        lines.append(
            f"| {Path(s['file']).name} | {_where(s)} | {s['tokens']} | {_g(s['log_ratio'])} | "
            f"{_g(s['geometric_log_ratio'])} | {_g(s['max_abs_token_log_ratio'])} |"
        )
    lines += ["", "## Worst tokens (by |δ|)", ""]
    lines += [
        "| file | step | row | position | old logp | rollout logp | δ |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in report["worst_tokens"][:10]:
        lines.append(
            f"| {Path(s['file']).name} | {_where(s)} | {s['position']} | {_g(s['old_logp'])} | "
            f"{_g(s['rollout_logp'])} | {_g(s['log_ratio'])} |"
        )
    return lines


def _k3_driver_lines(k3: float, drivers: dict) -> list[str]:
    """The 'What drives mis_k3_kl' section of report.md (:func:`k3_drivers`)."""
    lines = ["", "## What drives `mis_k3_kl`", ""]
    lines.append(
        f"`mis_k3_kl` = {_g(k3, 3)}; the median sequence's mean k3 is "
        f"{_g(drivers['median_seq_k3'], 3)} (robust: a few tokens cannot move it). The "
        f"{drivers['top_tokens']} tokens with the largest k3 term carry "
        f"{_pct(drivers['top_k3_share'])} of Σ k3"
        + (f"; {_drivers_text(drivers)}." if drivers["half_tokens"] is not None else ".")
    )
    if drivers["concentrated"]:
        lines.append(
            "\n**Concentrated:** the headline is carried by these few tokens, not by the "
            "dump as a whole; look at them (a broken token, a stale or re-routed one) "
            "before reading the mean as the state of every sequence."
        )
    lines += [
        "",
        "| file | step | row | position | δ | k3 term |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for s in drivers["tokens"][:10]:
        lines.append(
            f"| {Path(s['file']).name} | {_where(s)} | {s['position']} | "
            f"{_g(s['log_ratio'])} | {_g(s['k3'], 3)} |"
        )
    return lines


def _heavy_tail_lines(tail: dict, drivers: dict | None = None) -> list[str]:
    """The heavy-tail section of report.md (:func:`heavy_tail`)."""
    q = tail["weight_quantiles"]
    lines = ["", "## Heavy tail of the per-token weights ρ = π_old / π_rollout", ""]
    lines += [
        "| " + " | ".join(f"ρ p{100 * float(k):g}" for k in q) + " | median abs log ρ "
        f"| max abs log ρ | tokens with abs log ρ > {TAIL_LOG_RATIO:g} "
        "| their share of Σ abs log ρ |"
    ]
    lines += ["|" + "---:|" * (len(q) + 4)]
    lines += [
        "| "
        + " | ".join(_g(v, 3) for v in q.values())
        + f" | {_g(tail['abs_log_ratio_median'], 2)} | {_g(tail['max_abs_log_ratio'], 3)} "
        f"| {_pct(tail['tail_token_share'])} | {_pct(tail['tail_abs_log_ratio_share'])} |"
    ]
    lines.append("")
    if tail["heavy"]:
        lines.append(
            f"**Heavy-tailed:** {_pct(tail['tail_token_share'])} of the tokens carry "
            f"{_pct(tail['tail_abs_log_ratio_share'])} of the mismatch, the rest sit near "
            "ρ = 1: a discrete mismatch (an MoE route that flipped, a token of a stale "
            "policy), not a smooth one (precision). A per-token cap (token TIS, "
            "`token_tis`) bounds exactly those tokens' weight; sequence-level rejection "
            "(`geo_rs`, `seq_rs`) drops whole sequences for one token. If the engine is a "
            "mixture of experts, routing replay (R3: the trainer reuses the engine's "
            "experts) removes the cause."
            + (
                " Its bulk is exact (median abs log ρ ≤ "
                f"{EXACT_BULK:g}): a discrete mismatch, which the recommendation takes into "
                "account."
                if tail["discrete"]
                else ""
            )
        )
    else:
        lines.append(
            "Not heavy-tailed: by Σ abs log ρ, the mismatch is spread over the tokens (or "
            f"there is none) rather than concentrated in the {_pct(tail['tail_token_share'])} "
            f"with abs log ρ > {TAIL_LOG_RATIO:g}."
            + (
                " `mis_k3_kl` is another matter: its k3 terms grow as e^δ, and a few tokens "
                "carry it (next section)."
                if drivers is not None and drivers["concentrated"]
                else ""
            )
        )
    lines.append(
        "Quantiles are read off 20-per-decade log bins (±6%); the share of Σ abs log ρ "
        "from the bin centres."
    )
    return lines


def _where(item: dict) -> str:
    """The step and row cells of a worst sequence or token: the training step and the
    row within it for the demo's dumps, the row (or its index along the leading axes
    of an ``.npz`` array) otherwise."""
    row = item["row"]
    row = ", ".join(map(str, row)) if isinstance(row, list) else str(row)
    return f"{item.get('step', '–')} | {row}"


# --------------------------------------------------------------------------- plots


def _linthresh(report: dict, key: str = "token_log_ratio_hist") -> float:
    """Linear range of the symlog axes: the decade of the 10th percentile of |δ|.

    Mismatches span 1e-4 (precision) to 10 (stale policies), so a fixed linear range
    either hides the bulk in the linear part or splits it into two mirrored humps.
    """
    hist = report[key]
    counts = np.asarray(hist["counts"], float)
    edges = np.abs(np.asarray(hist["edges"], float))
    mid = len(counts) // 2
    # |δ| histogram: fold the negative side onto the positive one.
    folded = counts[mid:].copy()
    folded[1:] += counts[:mid][::-1]
    if folded.sum() == 0:
        return 1e-3
    idx = int(np.argmax(np.cumsum(folded) >= 0.1 * folded.sum()))
    value = max(edges[mid + idx], 1e-6)
    return float(10.0 ** np.floor(np.log10(value)))


def _symlog(ax, linthresh, axis="x"):
    getattr(ax, f"set_{axis}scale")("symlog", linthresh=linthresh, linscale=0.6)


def _hist_axes(ax, hist: dict, xlabel: str, title: str, linthresh: float, unit: str) -> None:
    edges = np.clip(np.asarray(hist["edges"], float), -1e3, 1e3)
    counts = np.asarray(hist["counts"], float)
    # Density per unit of δ, not counts per bin: the bins are logarithmic, so raw counts
    # would vanish near 0 and draw one bell as two humps.
    density = counts / np.diff(edges)
    ax.stairs(density, edges, fill=True, alpha=0.6, color="C0")
    _symlog(ax, linthresh)
    nz = np.flatnonzero(counts)
    if nz.size:
        lo, hi = edges[nz[0]], edges[nz[-1] + 1]
        span = max(abs(lo), abs(hi), 1e-5)
        ax.set_xlim(-span * 1.5, span * 1.5)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{unit} per unit of δ (log scale)")
    ax.set_title(title)
    ax.axvline(0, color="k", lw=0.6)
    ax.grid(alpha=0.3)


def _profile_axes(ax, x, profile: dict, xlabel: str, title: str, linthresh, log_x=False):
    x = np.asarray(x, float)
    have = np.asarray(profile["tokens"], float) > 0
    p05 = np.asarray(profile["p05"], float)
    p95 = np.asarray(profile["p95"], float)
    # Few buckets (short responses, a narrow probability range): markers, and the
    # 5–95% band as error bars, so that a single bucket is still a readable plot.
    few = int(have.sum()) <= 12
    style = {"marker": "o", "ms": 4} if few else {}
    if few:
        mid = np.asarray(profile["p50"], float)[have]
        band = [mid - p05[have], p95[have] - mid]
        ax.errorbar(x[have], mid, yerr=band, fmt="none", ecolor="C0", alpha=0.5, capsize=4)
    else:
        ax.fill_between(x[have], p05[have], p95[have], alpha=0.25, color="C0", label="δ 5–95%")
    label = "δ median (bars: 5–95%)" if few else "δ median"
    ax.plot(
        x[have], np.asarray(profile["p50"], float)[have], color="C0", lw=1, label=label, **style
    )
    ax.plot(
        x[have],
        np.asarray(profile["mean"], float)[have],
        color="C1",
        lw=1.5,
        label="mean δ",
        **style,
    )
    ax.plot(
        x[have],
        np.asarray(profile["mean_abs"], float)[have],
        color="C3",
        lw=1.5,
        label="mean |δ|",
        **style,
    )
    _symlog(ax, linthresh, "y")
    if log_x:
        ax.set_xscale("log")
        ax.invert_xaxis()
    ax.set_xlabel(xlabel)
    ax.set_ylabel("log-ratio δ = old − rollout")
    ax.set_title(title)
    ax.axhline(0, color="k", lw=0.6)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, framealpha=0.8)


def _prob_x(report):
    prob = report["by_rollout_prob"]
    high = np.asarray(prob["p_high"], float)
    low = np.maximum(np.asarray(prob["p_low"], float), 1e-9)
    return np.sqrt(high * low)


PANELS = {
    "log_ratio_hist.png": lambda ax, r: _hist_axes(
        ax,
        r["token_log_ratio_hist"],
        "token log-ratio δ = old − rollout (symlog)",
        "Token log-ratio",
        _linthresh(r),
        "tokens",
    ),
    "seq_ratio_hist.png": lambda ax, r: _hist_axes(
        ax,
        r["seq_geometric_log_ratio_hist"],
        "log geometric-mean ratio per sequence, mean δ (symlog)",
        "Sequence geometric ratio",
        _linthresh(r, "seq_geometric_log_ratio_hist"),
        "sequences",
    ),
    "log_ratio_vs_position.png": lambda ax, r: _profile_axes(
        ax,
        r["by_position"]["start"],
        r["by_position"],
        "token position (bucket start)",
        "Log-ratio by position",
        _linthresh(r),
    ),
    "log_ratio_vs_prob.png": lambda ax, r: _profile_axes(
        ax,
        _prob_x(r),
        r["by_rollout_prob"],
        "rollout probability of the token (log, decreasing)",
        "Log-ratio by rollout probability",
        _linthresh(r),
        log_x=True,
    ),
}


def plots(report: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, draw in PANELS.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
        draw(ax, report)
        fig.tight_layout()
        fig.savefig(out / name)
        plt.close(fig)
        paths.append(out / name)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), dpi=80)
    for ax, draw in zip(axes.ravel(), PANELS.values(), strict=True):
        draw(ax, report)
    fig.suptitle(f"Mismatch diagnosis — recommended: {report['recommendation']['name']}")
    fig.tight_layout()
    fig.savefig(out / "overview.png")
    plt.close(fig)
    paths.append(out / "overview.png")
    return paths


def write(report: dict, out: Path) -> dict[str, Path]:
    """Writes ``report.md``, ``report.json``, ``recommended.yaml`` and the plots to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"report.md": out / "report.md", "report.json": out / "report.json"}
    paths["report.md"].write_text(markdown(report))
    paths["report.json"].write_text(json.dumps(report, indent=1))
    rec = report["recommendation"]
    yaml_path = out / "recommended.yaml"
    header = f"# offpolicy-jax diagnose: {rec['name']} ({rec['severity']}).\n# {rec['reason']}.\n"
    yaml_path.write_text(header + yaml.safe_dump(rec["config"], sort_keys=False))
    paths["recommended.yaml"] = yaml_path
    for path in plots(report, out):
        paths[path.name] = path
    return paths
