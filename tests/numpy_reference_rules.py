"""Independent NumPy reference for the rejection rules of docs/semantics.md §8.

Written from the rules' definitions (verl's ``rollout_corr_helper.py``, NeMo-RL's
``seq_logprob_error_threshold``, the M2PO and DeepSeek-V3.2 papers), in float64, with
loops and sorts where the library uses fused sums and a bisection. It parses the
native ``"criterion:threshold"`` strings itself and does not import the library.
"""

from __future__ import annotations

import math

import numpy as np

S = 20.0


def parse_spec(spec: str):
    """``"seq_max_k2:2.5"`` -> ``(aggregate, estimator, lower, upper)`` on the statistic."""
    name, threshold = spec.split(":")
    if name == "binary_kl":
        return name, "token", "binary_kl", None, float(threshold)
    aggregate, estimator = name.rsplit("_", 1)
    if estimator == "k1":
        if "_" in threshold:
            lo, hi = (float(x) for x in threshold.split("_"))
        else:
            hi = float(threshold)
            lo = 1.0 / hi
        return name, aggregate, estimator, math.log(lo), math.log(hi)
    return name, aggregate, estimator, None, float(threshold)


def token_statistic(delta, estimator):
    lam = np.clip(delta, -S, S)
    return {"k1": -lam, "k2": 0.5 * lam**2, "k3": np.exp(lam) - 1.0 - lam}[estimator]


def kl_criterion(delta, m, spec):
    """One KL criterion over the valid tokens ``m > 0``.

    Returns ``(keep [B, T] bool, stat [B, T] (per-sequence value broadcast), low [B, T],
    high [B, T], per_seq: bool)``.
    """
    name, aggregate, estimator, lower, upper = parse_spec(spec)
    valid = m > 0
    tok = np.where(valid, token_statistic(np.where(valid, delta, 0.0), estimator), 0.0)
    if aggregate == "token":
        stat = tok
    else:
        rows = []
        for i in range(m.shape[0]):
            vals = tok[i][valid[i]]
            if vals.size == 0:
                rows.append(0.0)
            elif aggregate == "seq_sum":
                rows.append(vals.sum())
            elif aggregate == "seq_mean":
                rows.append(vals.mean())
            else:
                rows.append(vals.max())
        stat = np.broadcast_to(np.asarray(rows)[:, None], m.shape)
    low = stat < lower if lower is not None else np.zeros(m.shape, bool)
    high = stat > upper
    return ~low & ~high, stat, low, high, aggregate != "token"


# KPop's clamp [1e-6, 1 - 1e-6] as torch applies it to float32 probabilities: both ends
# are the float32 numbers nearest 1e-6 and 1 - 1e-6 (1 - 1e-6 is not a float32).
BINARY_KL_LOW = 9.999999974752427e-07
BINARY_KL_HIGH = 1.0 - 1.0132789611816406e-06


def binary_kl(logp, logq):
    """``D_B(p‖q) = p log(p/q) + (1 − p) log((1 − p)/(1 − q))`` in float64, the textbook
    form, with ``p, q = clip(e^log, BINARY_KL_LOW, BINARY_KL_HIGH)``."""
    p = np.clip(np.exp(np.asarray(logp, np.float64)), BINARY_KL_LOW, BINARY_KL_HIGH)
    q = np.clip(np.exp(np.asarray(logq, np.float64)), BINARY_KL_LOW, BINARY_KL_HIGH)
    return p * np.log(p / q) + (1.0 - p) * np.log((1.0 - p) / (1.0 - q))


def bidirectional_binary_kl(o, b):
    """KPop's statistic ``max(D_B(o‖b), D_B(b‖o))`` per token (``≥ 0`` in float64)."""
    return np.maximum(binary_kl(o, b), binary_kl(b, o))


def binary_kl_criterion(o, b, m, threshold):
    """verl's ``rollout_rs: binary_kl`` over the valid tokens: keep iff stat ``≤ φ``.

    Returns ``(keep, stat, low, high, per_seq)`` as :func:`kl_criterion`."""
    valid = m > 0
    with np.errstate(all="ignore"):
        stat = np.where(
            valid, bidirectional_binary_kl(np.where(valid, o, -1.0), np.where(valid, b, -1.0)), 0.0
        )
    high = stat > threshold
    return ~high, stat, np.zeros(m.shape, bool), high, False


def criterion(o, b, m, spec):
    """Any ``rs_criteria`` entry: :func:`kl_criterion` or :func:`binary_kl_criterion`."""
    name, threshold = spec.split(":")
    if name == "binary_kl":
        return binary_kl_criterion(o, b, m, float(threshold))
    valid = m > 0
    return kl_criterion(np.where(valid, o - b, 0.0), m, spec)


def seq_mult_prob_error(delta, m):
    """Per sequence: ``mean_t exp(|δ_t|)`` over valid tokens (0 for an empty one), ``[B]``."""
    out = np.zeros(m.shape[0])
    for i in range(m.shape[0]):
        vals = delta[i][m[i] > 0]
        out[i] = mult_prob_error(vals).mean() if vals.size else 0.0
    return out


def seq_logprob_error_keep(delta, m, threshold):
    """NeMo-RL: keep a sequence iff ``seq_mult_prob_error ≤ threshold`` (``[B]`` bool)."""
    return seq_mult_prob_error(delta, m) <= threshold


def m2po_keep(delta, m, tau):
    """M2PO (the paper's Algorithm 1 on all valid tokens): sort ``δ²`` ascending, keep the
    longest prefix whose mean is ``≤ τ``; ties at the cut leave together.

    Returns ``[B, T]`` bool keep (True at invalid positions).
    """
    valid = m > 0
    v = np.where(valid, np.where(valid, delta, 0.0) ** 2, 0.0)
    vals = np.sort(v[valid])
    keep = np.ones(m.shape, bool)
    if vals.size == 0 or vals.mean() <= tau:
        return keep
    prefix = np.cumsum(vals) / np.arange(1, vals.size + 1)
    k = int((prefix <= tau).sum())
    # Ties: a value equal to the first dropped one leaves as well.
    cut = vals[k] if k < vals.size else np.inf
    keep = ~valid | (v < cut)
    return keep


def opsm_keep(theta, b, adv, m, delta):
    """DeepSeek-V3.2 OPSM per sequence: drop iff ``mean A < 0`` and
    ``mean_t (b − θ) > δ`` over the valid tokens. ``adv`` is ``[B, T]``. Returns ``[B]``."""
    out = np.ones(m.shape[0], bool)
    for i in range(m.shape[0]):
        valid = m[i] > 0
        if not valid.any():
            continue
        ratio = (b[i][valid] - theta[i][valid]).mean()
        out[i] = not (adv[i][valid].mean() < 0 and ratio > delta)
    return out


def ess(w, m_final):
    """``(Σ w)² / (n Σ w²)`` over the tokens with ``m' > 0``; 0 when empty."""
    kept = m_final > 0
    n = m_final[kept].sum()
    sw, sw2 = (w * m_final)[kept].sum(), (w * w * m_final)[kept].sum()
    return float(sw * sw / (n * sw2)) if n * sw2 > 0 else 0.0


def js_divergence(o, b):
    """NeMo-RL's per-token JS estimate with ``M = ½(e^o + e^b)`` and k3."""
    log_m = np.log(0.5 * np.exp(o) + 0.5 * np.exp(b))

    def k3(x):
        return np.exp(x) - x - 1.0

    return 0.5 * k3(o - log_m) + 0.5 * k3(b - log_m)


def mult_prob_error(delta):
    """``exp(|δ|)``, with ``|δ|`` capped at 50 (the library's metric cap)."""
    return np.exp(np.minimum(np.abs(delta), 50.0))


# ---------------------------------------------------------------------- verl's pipeline


def verl_correction(o, b, m, block):
    """verl's ``compute_rollout_correction_and_rejection_mask`` outputs, from its rules:
    returns ``(weights · modified_mask, modified_mask)`` in float64.

    IS at ``rollout_is`` (token: ``exp(clip(δ))``; sequence: ``exp(clip(Σ δ))``),
    truncated at ``U`` or zeroed outside ``[L, U]`` (IcePop), batch-normalised over the
    original mask; every ``rollout_rs`` criterion ANDed into the mask.
    """
    m = m.astype(np.float64)
    valid = m > 0
    delta = np.where(valid, o - b, 0.0)
    weights = m.copy()
    if block.get("rollout_is") is not None:
        thr = str(block["rollout_is_threshold"])
        lo, hi = (float(x) for x in thr.split("_")) if "_" in thr else (None, float(thr))
        if block["rollout_is"] == "token":
            raw = np.exp(np.clip(delta, -S, S))
        else:
            raw = np.broadcast_to(np.exp(np.clip(delta.sum(-1), -S, S))[:, None], m.shape)
        raw = raw * m
        w = np.minimum(raw, hi) if lo is None else np.where((raw >= lo) & (raw <= hi), raw, 0.0)
        if block.get("rollout_is_batch_normalize"):
            if block["rollout_is"] == "token":
                mean = (w * m).sum() / m.sum()
            else:
                counts = m.sum(-1)
                ne = counts > 0
                mean = ((w * m).sum(-1)[ne] / counts[ne]).mean()
            if mean > 1e-8:
                w = w / mean
        weights = w
    mask = m.copy()
    if block.get("rollout_rs") is not None:
        names = []
        for n in block["rollout_rs"].split(","):
            if n.strip() and n.strip() not in names:
                names.append(n.strip())
        threshold = block.get("rollout_rs_threshold")
        thr = "2.0" if threshold is None else str(threshold)  # binary_kl alone: φ = 2
        thr = thr.split(",")
        thr = thr * len(names) if len(thr) == 1 else thr
        for name, t in zip(names, thr, strict=True):
            keep = criterion(o, b, m, f"{name}:{t.strip()}")[0]
            mask = np.where(keep, mask, 0.0)
    return weights * mask, mask


# ------------------------------------------------------------- the correction's rules


def _reduce(values, population, reduction):
    """§7 reduction (as numpy_reference.reduce_metric), repeated to stay self-contained."""
    v = np.asarray(values, np.float64)
    p = np.broadcast_to(np.where(population > 0, population, 0.0), v.shape)
    if reduction == "token":
        total = p.sum()
        return float(np.where(p > 0, v * p, 0.0).sum() / total) if total > 0 else 0.0
    n = p.sum(-1)
    ne = n > 0
    if not ne.any():
        return 0.0
    per = np.where(p > 0, v * p, 0.0).sum(-1)[ne] / n[ne]
    return float(per.mean())


def _extremes(stat, m, per_seq):
    """Batch max / min of a statistic over the valid tokens (or non-empty sequences)."""
    valid = m > 0
    if per_seq:
        rows = valid.any(-1)
        vals = stat[:, 0][rows] if stat.ndim == 2 else stat[rows]
    else:
        vals = stat[valid]
    if vals.size == 0:
        return 0.0, 0.0
    return float(vals.max()), float(vals.min())


def apply_rules(
    o, b, m, reduction, *, rs_criteria=(), seq_logprob_error_threshold=None, m2po_tau=None
):
    """The §8 rules of ``compute_correction`` on the valid tokens ``m`` (finite sequences).

    Every rule tests the valid population on its own; a token stays only if every rule
    keeps it. Returns ``(keep [B, T] bool, metrics)``.
    """
    valid = m > 0
    delta = np.where(valid, o - b, 0.0)
    keep = np.ones(m.shape, bool)
    metrics = {}

    def record(prefix, stat, low, high, rule_keep, per_seq, two_sided):
        metrics[f"{prefix}_mean"] = _reduce(stat, m, reduction)
        metrics[f"{prefix}_max"], metrics[f"{prefix}_min"] = _extremes(stat, m, per_seq)
        if two_sided:
            metrics[f"{prefix}_fraction_low"] = _reduce(low.astype(float), m, reduction)
        metrics[f"{prefix}_fraction_high"] = _reduce(high.astype(float), m, reduction)
        seq_rejected = (valid & ~rule_keep).any(-1)
        metrics[f"{prefix}_seq_fraction"] = _reduce(
            np.broadcast_to(seq_rejected[:, None], m.shape).astype(float), m, reduction
        )

    for spec in rs_criteria:
        name, _, estimator, lower, _ = parse_spec(spec)
        rule_keep, stat, low, high, per_seq = criterion(o, b, m, spec)
        keep &= rule_keep
        record(f"mis_rs_{name}", stat, low, high, rule_keep, per_seq, lower is not None)

    if seq_logprob_error_threshold is not None:
        per_seq = seq_mult_prob_error(delta, m)
        stat = np.broadcast_to(per_seq[:, None], m.shape)
        high = stat > seq_logprob_error_threshold
        keep &= ~high
        record("mis_seq_logprob_error", stat, None, high, ~high, True, False)

    if m2po_tau is not None:
        rule_keep = m2po_keep(delta, m, m2po_tau)
        stat = delta**2
        keep &= rule_keep
        record("mis_m2po", stat, None, ~rule_keep, rule_keep, False, False)
        kept = valid & rule_keep
        metrics["mis_m2po_m2_after"] = float(stat[kept].mean()) if kept.any() else 0.0
    return keep, metrics


def probability_metrics(o, b, m, reduction):
    """``mis_token_mult_prob_error`` and ``mis_js_divergence`` over the valid tokens."""
    valid = m > 0
    o0, b0 = np.where(valid, o, 0.0), np.where(valid, b, 0.0)
    return {
        "mis_token_mult_prob_error": _reduce(mult_prob_error(o0 - b0), m, reduction),
        "mis_js_divergence": _reduce(js_divergence(o0, b0), m, reduction),
    }


# ------------------------------------------------------------------ AReaL's grid, MinPRO

STAT_CAP = math.exp(50.0)  # metrics report a statistic capped at ±e^50


def areal_statistic(delta, metric):
    """AReaL's ``apply_rejection_sampling`` metric per token (``KLEstimator``'s k1/k2/k3
    with ``log_probs = π_old``, ``apply_clamp=False``; ratio ``e^δ``), float64."""
    with np.errstate(over="ignore"):
        if metric == "ratio":
            return np.exp(delta)
        if metric == "kl_k1":
            return delta
        if metric == "kl_k2":
            return delta**2 / 2.0
        return np.exp(-delta) - 1.0 + delta  # kl_k3: log_ratio = -δ; e^x - 1 - x


def areal_rejection(o, b, m, rs, reduction):
    """AReaL's ``apply_rejection_sampling`` (2D padded path), on the valid tokens ``m`` of
    the finite sequences, written from AReaL's code with loops per sequence.

    ``rs`` is the dict of ``RejectionSamplingConfig`` keys. Deviations are the library's
    documented ones only: weights are ``exp(clip(·, −20, 20))``, and a float mask weights
    its token in the sums (``Σ δ m``, ``N = Σ m``).

    Returns ``(w_raw [B, T], w_after [B, T], keep [B, T] bool, metrics)``; ``keep`` is
    all True for ``clamp``.
    """
    level, action, metric = rs["level"], rs["action"], rs["metric"]
    agg, upper, lower = rs["agg"], float(rs["upper"]), rs["lower"]
    valid = m > 0
    delta = np.where(valid, o - b, 0.0)
    stat_tok = np.where(valid, areal_statistic(delta, metric), 0.0)
    w_raw = np.exp(np.clip(delta, -S, S))
    rows, length = m.shape
    if level == "sequence":
        agg_values = delta if metric == "ratio" else stat_tok
        seq_stat = np.zeros(rows)
        geo = np.zeros(rows)
        for i in range(rows):
            v, wt = agg_values[i][valid[i]], m[i][valid[i]]
            n = wt.sum()
            if v.size:
                a = {"sum": (v * wt).sum(), "mean": (v * wt).sum() / n, "max": v.max()}[agg]
            else:
                a = 0.0
            with np.errstate(over="ignore"):
                seq_stat[i] = np.exp(a) if metric == "ratio" else a
            geo[i] = (delta[i][valid[i]] * wt).sum() / n if v.size else 0.0
        stat = np.broadcast_to(seq_stat[:, None], m.shape)
        if metric == "ratio":
            w_raw = np.broadcast_to(np.exp(np.clip(geo, -S, S))[:, None], m.shape).copy()
    else:
        stat = stat_tok
    high = stat > upper
    low = stat < lower if lower is not None else np.zeros(m.shape, bool)
    inside = ~high & ~low
    w_after = w_raw.copy()
    keep = np.ones(m.shape, bool)
    if action == "mask":
        keep = inside
        affected = ~inside
    else:
        lo = 0.0 if lower is None else float(lower)
        moved = (w_raw < lo) | (w_raw > upper)
        if level == "sequence":
            moved &= ~inside
        w_after = np.where(moved, np.clip(w_raw, lo, upper), w_raw)
        affected = moved
    reported = np.clip(stat, -STAT_CAP, STAT_CAP)
    prefix = "mis_rs_areal"
    metrics = {
        "mis_tis_weight_before_bound": _reduce(w_raw, m, reduction),
        "mis_tis_weight_after_bound": _reduce(w_after, np.where(keep, m, 0.0), reduction),
        f"{prefix}_filtered_fraction": _reduce(affected.astype(float), m, reduction),
        f"{prefix}_mean": _reduce(reported, m, reduction),
        f"{prefix}_fraction_high": _reduce(high.astype(float), m, reduction),
        f"{prefix}_seq_fraction": _reduce(
            np.broadcast_to((valid & affected).any(-1)[:, None], m.shape).astype(float),
            m,
            reduction,
        ),
    }
    metrics[f"{prefix}_max"], metrics[f"{prefix}_min"] = _extremes(reported, m, level == "sequence")
    if lower is not None:
        metrics[f"{prefix}_fraction_low"] = _reduce(low.astype(float), m, reduction)
    return w_raw, w_after, keep, metrics


def minpro_prefix_min(delta, m):
    """``min_{s<t} δ_s`` over the earlier valid tokens of each row (``+inf``: none), by a loop."""
    out = np.full(m.shape, np.inf)
    for i in range(m.shape[0]):
        running = np.inf
        for t in range(m.shape[1]):
            out[i, t] = running
            if m[i, t] > 0:
                running = min(running, delta[i, t])
    return out


def minpro_log_ratio(delta, m):
    """MinPRO (arXiv:2601.22718): ``log(ρ̲_t ρ_t) = δ_t + min_{s<t} δ_s`` (0: no prefix)."""
    prefix = minpro_prefix_min(delta, m)
    return np.where(m > 0, delta, 0.0) + np.where(np.isfinite(prefix), prefix, 0.0)


def minpro_metrics(delta, m, reduction):
    """``mis_minpro_prefix_ratio_mean`` / ``_min`` / ``mis_minpro_prefix_fraction_low``."""
    prefix = minpro_prefix_min(delta, m)
    factor = np.exp(np.clip(np.where(np.isfinite(prefix), prefix, 0.0), -S, S))
    valid = m > 0
    return {
        "mis_minpro_prefix_ratio_mean": _reduce(factor, m, reduction),
        "mis_minpro_prefix_ratio_min": float(factor[valid].min()) if valid.any() else 0.0,
        "mis_minpro_prefix_fraction_low": _reduce((factor < 1.0).astype(float), m, reduction),
    }
