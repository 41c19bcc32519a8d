"""Independent pure-NumPy reference (test oracle) for the offpolicy-jax semantics.

This module re-implements ``shared/spec/semantics.md`` §0-§5 and §7 with nothing but
NumPy, written from the spec alone (it never imports or reads ``offpolicy_jax``).
It is meant to be slow, obvious and easy to audit; the project's tests compare the
JAX library against it.

Public API
----------
``correction(old_logp, rollout_logp, mask, *, use_tis=False, tis_level="token",
tis_mode="truncate", tis_lower_bound=None, tis_upper_bound=2.0,
tis_batch_normalize=False, use_rs=False, rs_level="token", rs_lower_bound=None,
rs_upper_bound=None, rs_veto_threshold=None, reduction="sequence")
-> (weights, mask_out, metrics)``
    The ``compute_correction`` equivalent (§3, §4).

``policy_loss(logp, old_logp, rollout_logp, advantages, mask, *, algorithm,
clip_eps=0.2, clip_eps_high=None, dual_clip_c=None, correction=None,
aggregation="sequence_mean", rejected_in_denominator=False,
get_mismatch_metrics=False, metric_reduction="sequence")
-> (loss, grad_logp, metrics)``
    The ``policy_loss`` equivalent (§5) plus the *analytic* gradient of the loss
    with respect to ``logp``.  ``correction`` is ``None``, a dict of
    :func:`correction` keyword arguments, or ``("vanilla_tis", clip_low, clip)``.

``reduce_metric(values, population, reduction)``
    The one metric reduction of §7 (also handy in tests).

Numerics
--------
Inputs are first cast to float32 (bf16 / fp16 are upcast exactly, as the library
does), then everything is computed in float64.  Returned arrays are float64 and
metrics are Python floats, so the oracle is *more* precise than the float32
library; compare with a tolerance (the conformance pack uses rtol 1e-5, atol 1e-6).
Every value at a masked position (``m == 0``) may be NaN / ±inf / 1e30 garbage:
it is removed with ``np.where`` before any arithmetic that could spread it.

Masks may be bool or float.  A fractional value ``m > 0`` counts as a valid token
with weight ``m``: ``N = Σ m`` and the "``max(N, 1)``" of the spec becomes "``N``
where ``N > 0`` (else 1)"; for 0/1 masks this is identical to the spec.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

try:
    import numpy_reference_rules as rules_ref
except ModuleNotFoundError:  # loaded by file path (benchmarks/): take the sibling alike
    import importlib.util
    import pathlib

    _spec = importlib.util.spec_from_file_location(
        "numpy_reference_rules", pathlib.Path(__file__).with_name("numpy_reference_rules.py")
    )
    rules_ref = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(rules_ref)

__all__ = [
    "S",
    "BATCH_NORM_EPS",
    "LEVELS",
    "MODES",
    "ALGORITHMS",
    "AGGREGATIONS",
    "REDUCTIONS",
    "MONITORING_KEYS",
    "reduce_metric",
    "aggregate_level",
    "clamped_exp",
    "monitoring_metrics",
    "correction",
    "ppo_surrogate",
    "vanilla_tis",
    "aggregate_loss",
    "policy_loss",
]

#: Log-space safety bound ``S`` of §0.
S = 20.0
#: Batch normalisation is skipped when the mean weight is not above this (§3.6).
BATCH_NORM_EPS = 1e-8

LEVELS = ("token", "sequence", "geometric", "minpro")
MODES = ("truncate", "clip", "mask", "band", "none")
ALGORITHMS = ("ppo", "bypass_ppo", "decoupled_ppo", "reinforce_is")
AGGREGATIONS = ("sequence_mean", "token_mean", "sequence_sum")
REDUCTIONS = ("sequence", "token")

#: The §4 monitoring metric keys (always emitted by :func:`correction`).
MONITORING_KEYS = (
    "mis_training_log_ppl",
    "mis_training_ppl",
    "mis_rollout_log_ppl",
    "mis_rollout_ppl",
    "mis_kl",
    "mis_k3_kl",
    "mis_log_ppl_diff",
    "mis_log_ppl_abs_diff",
    "mis_ppl_ratio",
    "mis_chi2_token",
    "mis_chi2_seq",
)


# --------------------------------------------------------------------------------------
# input handling
# --------------------------------------------------------------------------------------


def _as_float(x) -> np.ndarray:
    """Upcast a log-prob / advantage array: ``float64(float32(x))``.

    bf16 (``ml_dtypes.bfloat16``) and fp16 convert exactly to float32; float32 is
    kept exactly; float64 input is rounded to float32 first, like the library would.
    """
    a = np.asarray(x)
    if a.dtype == np.bool_:
        return a.astype(np.float64)
    return a.astype(np.float32).astype(np.float64)


def _as_mask(mask) -> np.ndarray:
    """Mask as float64 weights ``m`` (bool → 0/1; fractional values are kept)."""
    m = np.asarray(mask)
    if m.dtype == np.bool_:
        return m.astype(np.float64)
    m = m.astype(np.float64)
    return np.where(np.isfinite(m) & (m > 0), m, 0.0)


def _safe_count(n: np.ndarray) -> np.ndarray:
    """``N̄``: the token count ``N`` where ``N > 0``, else 1 (= ``max(N, 1)`` for 0/1)."""
    return np.where(n > 0, n, 1.0)


def _seq_broadcast(per_seq: np.ndarray, shape) -> np.ndarray:
    """Broadcast a per-sequence value ``[...]`` to its tokens ``[..., T]``."""
    return np.broadcast_to(np.asarray(per_seq)[..., None], shape)


def _masked_sum(x: np.ndarray, w: np.ndarray, axis=None) -> np.ndarray:
    """``Σ x·w`` where ``w > 0`` (garbage in ``x`` at ``w == 0`` never leaks)."""
    with np.errstate(all="ignore"):
        return np.where(w > 0, x * np.where(w > 0, w, 0.0), 0.0).sum(axis=axis)


# --------------------------------------------------------------------------------------
# §7 reduction
# --------------------------------------------------------------------------------------


def reduce_metric(values, population, reduction: str) -> float:
    """Reduce a per-token metric over its population (§4 "Reduction", §7).

    ``values``: per-token values ``v`` ``[..., T]`` (a per-sequence value is
    broadcast to its tokens first); ``population``: token weights ``p`` (0 = not in
    the population).

    - ``"sequence"``: mean over the sequences with ``Σ_t p > 0`` of
      ``Σ_t v·p / Σ_t p``.
    - ``"token"``: ``Σ v·p / Σ p``.

    An empty population reduces to 0.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    v = np.asarray(values, dtype=np.float64)
    p = np.broadcast_to(np.asarray(population, dtype=np.float64), v.shape)
    with np.errstate(all="ignore"):
        if reduction == "token":
            total = float(np.where(p > 0, p, 0.0).sum())
            return float(_masked_sum(v, p)) / total if total > 0 else 0.0
        n = np.where(p > 0, p, 0.0).sum(axis=-1)
        num = _masked_sum(v, p, axis=-1)
        nonempty = n > 0
        count = int(nonempty.sum())
        if count == 0:
            return 0.0
        return float(np.where(nonempty, num / _safe_count(n), 0.0).sum()) / count


def _per_seq_extreme(values: np.ndarray, population: np.ndarray, kind: str) -> np.ndarray:
    """Per-sequence min or max of ``values`` over ``population > 0`` (0 if empty)."""
    fill = np.inf if kind == "min" else -np.inf
    x = np.where(population > 0, values, fill)
    ext = x.min(axis=-1) if kind == "min" else x.max(axis=-1)
    return np.where(np.isfinite(ext), ext, 0.0)


# --------------------------------------------------------------------------------------
# §2 level aggregation
# --------------------------------------------------------------------------------------


def aggregate_level(delta, m, level: str) -> np.ndarray:
    """``λ = agg(δ, m, level)`` of §2 (``δ`` must already be 0 where ``m == 0``).

    - token:     ``λ_t = δ_t``
    - sequence:  ``λ_t = Σ_s δ_s m_s``            (log of the product of ratios)
    - geometric: ``λ_t = (Σ_s δ_s m_s) / N̄``      (log of the geometric mean)
    - minpro:    ``λ_t = δ_t + min_{s<t, m_s>0} δ_s`` (0 without an earlier valid token;
      MinPRO, arXiv:2601.22718)
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    delta = np.where(m > 0, delta, 0.0)
    if level == "token":
        return delta
    if level == "minpro":
        return rules_ref.minpro_log_ratio(delta, m)
    total = _masked_sum(delta, m, axis=-1)
    if level == "geometric":
        total = total / _safe_count(np.where(m > 0, m, 0.0).sum(axis=-1))
    return np.broadcast_to(total[..., None], delta.shape).copy()


def clamped_exp(lam) -> np.ndarray:
    """``ρ = exp(clip(λ, −S, S))`` (clamping happens after aggregation)."""
    return np.exp(np.clip(lam, -S, S))


# --------------------------------------------------------------------------------------
# §0 non-finite rejection
# --------------------------------------------------------------------------------------


def _nonfinite_sequences(o: np.ndarray, b: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Per-sequence flag: some valid token has a non-finite ``o`` or ``b`` (§0)."""
    bad_tok = (m > 0) & ~(np.isfinite(o) & np.isfinite(b))
    return bad_tok.any(axis=-1)


# --------------------------------------------------------------------------------------
# §4 monitoring metrics
# --------------------------------------------------------------------------------------


def monitoring_metrics(o, b, m, reduction: str) -> dict[str, float]:
    """The §4 metrics of ``o`` against ``b`` over population ``m``.

    ``m`` must already exclude sequences with non-finite valid inputs.
    Per sequence: ``mean_o = Σ o m / N̄``, ``mean_b = Σ b m / N̄``, ``δ = o − b``.

    ====================  =========================================
    mis_training_log_ppl  ``−mean_o``
    mis_training_ppl      ``exp(−mean_o)``
    mis_rollout_log_ppl   ``−mean_b``
    mis_rollout_ppl       ``exp(−mean_b)``
    mis_kl                token ``b_t − o_t``
    mis_k3_kl             token ``exp(δ_t) − δ_t − 1``
    mis_log_ppl_diff      ``mean_b − mean_o``
    mis_log_ppl_abs_diff  ``|mean_b − mean_o|``
    mis_ppl_ratio         ``exp(mean_b − mean_o)``
    mis_chi2_token        ``Σ exp(2·clip(δ, −S, S)) m / N̄ − 1``
    mis_chi2_seq          ``exp(2·clip(Σ δ m, −S, S)) − 1``
    ====================  =========================================
    """
    with np.errstate(all="ignore"):
        valid = m > 0
        o = np.where(valid, o, 0.0)
        b = np.where(valid, b, 0.0)
        delta = o - b
        nbar = _safe_count(np.where(valid, m, 0.0).sum(axis=-1))
        mean_o = _masked_sum(o, m, axis=-1) / nbar
        mean_b = _masked_sum(b, m, axis=-1) / nbar
        seq_sum_delta = _masked_sum(delta, m, axis=-1)
        chi2_tok = _masked_sum(np.exp(2.0 * np.clip(delta, -S, S)), m, axis=-1) / nbar - 1.0
        chi2_seq = np.exp(2.0 * np.clip(seq_sum_delta, -S, S)) - 1.0
        shape = o.shape
        per_seq = {
            "mis_training_log_ppl": -mean_o,
            "mis_training_ppl": np.exp(-mean_o),
            "mis_rollout_log_ppl": -mean_b,
            "mis_rollout_ppl": np.exp(-mean_b),
            "mis_log_ppl_diff": mean_b - mean_o,
            "mis_log_ppl_abs_diff": np.abs(mean_b - mean_o),
            "mis_ppl_ratio": np.exp(mean_b - mean_o),
            "mis_chi2_token": chi2_tok,
            "mis_chi2_seq": chi2_seq,
        }
        per_token = {
            "mis_kl": b - o,
            "mis_k3_kl": np.exp(delta) - delta - 1.0,
        }
        values = {k: _seq_broadcast(v, shape) for k, v in per_seq.items()}
        values.update(per_token)
        return {k: reduce_metric(values[k], m, reduction) for k in MONITORING_KEYS}


# --------------------------------------------------------------------------------------
# §3 correction steps
# --------------------------------------------------------------------------------------


def _batch_extreme(values: np.ndarray, population: np.ndarray, kind: str) -> float:
    """The batch min or max of ``values`` over ``population > 0`` (0 if empty)."""
    x = values[np.broadcast_to(population > 0, values.shape)]
    return float((x.min() if kind == "min" else x.max()) if x.size else 0.0)


def _tails_before_bound(lam, m, mode: str, lower: float, upper: float, reduction: str):
    """Both tails of the ratio before any bound or clamp: the batch extremes of
    ``exp(min(λ, 50))`` over the valid tokens and, where the mode bounds, the shares of
    valid tokens with the unclamped ratio below ``L`` / above ``U``."""
    ratio = np.exp(np.minimum(lam, 50.0))
    out = {
        "mis_is_ratio_min_before_bound": _batch_extreme(ratio, m, "min"),
        "mis_is_ratio_max_before_bound": _batch_extreme(ratio, m, "max"),
    }
    if mode != "none":
        for side, outside in (("low", ratio < lower), ("high", ratio > upper)):
            out[f"mis_is_ratio_fraction_{side}_before_bound"] = reduce_metric(
                outside.astype(np.float64), m, reduction
            )
    return out


def _apply_mode(rho, mode: str, lower: float, upper: float):
    """§3.2: bound the raw weights ``ρ``; returns ``(w, keep, fractions)``.

    - truncate: ``w = min(ρ, U)``;   ``truncate_fraction = [ρ > U]``
    - clip:     ``w = clip(ρ, L, U)``; ``clip_fraction_low/high = [ρ < L] / [ρ > U]``
    - mask:     keep iff ``L ≤ ρ ≤ U`` (w = ρ kept, 0 rejected);
      ``mask_fraction_low/high = [ρ < L] / [ρ > U]``

    Fractions are per-token indicators, reduced later over the valid tokens.
    """
    if mode not in MODES:
        raise ValueError(f"tis_mode must be one of {MODES}, got {mode!r}")
    low, high = rho < lower, rho > upper
    if mode == "none":  # §8: no IS weight, only the rejection rules
        return np.ones_like(rho), np.ones_like(rho, bool), {}
    if mode == "band":  # §8: weight 0 outside [L, U], the token stays in the mask
        return (
            np.where(~low & ~high, rho, 0.0),
            np.ones_like(rho, bool),
            {"mis_tis_band_fraction_low": low, "mis_tis_band_fraction_high": high},
        )
    if mode == "truncate":
        return np.minimum(rho, upper), np.ones_like(rho, bool), {"mis_tis_truncate_fraction": high}
    if mode == "clip":
        return (
            np.clip(rho, lower, upper),
            np.ones_like(rho, bool),
            {"mis_tis_clip_fraction_low": low, "mis_tis_clip_fraction_high": high},
        )
    keep = ~low & ~high
    return (
        np.where(keep, rho, 0.0),
        keep,
        {"mis_tis_mask_fraction_low": low, "mis_tis_mask_fraction_high": high},
    )


def _rejection_sampling(delta, m, level: str, lower: float, upper: float):
    """§3.3: ``ρ_rs = exp(clip(agg(δ, m, rs_level), −S, S))``; keep iff ``L_rs ≤ ρ_rs ≤ U_rs``.

    Returns ``(keep, {"mis_rs_mask_fraction_low": [ρ_rs < L_rs], ..._high: [ρ_rs > U_rs]})``.
    """
    rho_rs = clamped_exp(aggregate_level(delta, m, level))
    low, high = rho_rs < lower, rho_rs > upper
    return ~low & ~high, {"mis_rs_mask_fraction_low": low, "mis_rs_mask_fraction_high": high}


def _veto(delta, m, threshold: float):
    """§3.4 (D1): reject a sequence if any valid token has raw ``δ_t < log(threshold)``.

    Returns ``(catastrophic_token [..., T], catastrophic_sequence [...])``.
    """
    cat_tok = (m > 0) & (delta < math.log(threshold))
    return cat_tok, cat_tok.any(axis=-1)


def _batch_normalize(w, m_final, level: str):
    """§3.6 (D4, D6): ``μ`` over the final mask; ``w / μ`` if ``μ > 1e-8`` else ``μ := 1``.

    token level: ``μ = Σ w·m' / Σ m'``; sequence / geometric: ``μ`` = mean over the
    sequences with ``Σ m' > 0`` of their masked mean weight.  Returns ``(w, μ)``.
    """
    mu = reduce_metric(w, m_final, "token" if level in ("token", "minpro") else "sequence")
    if mu > BATCH_NORM_EPS:
        return w / mu, mu
    return w, 1.0


def _correction_core(
    o,
    b,
    m,
    *,
    use_tis,
    tis_level,
    tis_mode,
    tis_lower_bound,
    tis_upper_bound,
    tis_batch_normalize,
    use_rs,
    rs_level,
    rs_lower_bound,
    rs_upper_bound,
    rs_veto_threshold,
    reduction,
    rs_criteria=(),
    seq_logprob_error_threshold=None,
    m2po_tau=None,
    probability_metrics=False,
    rejection_sampling=None,
):
    """Shared body of :func:`correction`: returns ``(w, m_final, metrics)``.

    ``w`` is the final (bounded, normalised) weight *before* the ``· m'`` of §3.7,
    finite everywhere; ``m_final`` is ``m'``.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    with np.errstate(all="ignore"):
        bad_seq = _nonfinite_sequences(o, b, m)
        # population of §4 / before-bound / fractions: valid tokens of finite sequences
        m_valid = np.where(_seq_broadcast(bad_seq, m.shape), 0.0, m)
        delta = np.where(m_valid > 0, o - b, 0.0)
        metrics = monitoring_metrics(o, b, m_valid, reduction)
        if probability_metrics:
            metrics.update(rules_ref.probability_metrics(o, b, m_valid, reduction))
        if not use_tis:
            # metrics only: weights = m, mask unchanged, nothing rejected (§7)
            return np.ones_like(m), m.copy(), metrics

        metrics["mis_nonfinite_seq_fraction"] = reduce_metric(
            _seq_broadcast(bad_seq.astype(np.float64), m.shape), m, reduction
        )

        upper = float(tis_upper_bound)
        lower = float(tis_lower_bound) if tis_lower_bound is not None else 1.0 / upper

        if rejection_sampling is not None:
            # 1-2. AReaL's grid is the weight (tis_mode none)
            _, w, keep_mode, areal_metrics = rules_ref.areal_rejection(
                o, b, m_valid, rejection_sampling, reduction
            )
            metrics.update(areal_metrics)
            tis_level = rejection_sampling["level"]  # batch normalisation's reduction
        else:
            # 1. weights before bound
            lam = aggregate_level(delta, m_valid, tis_level)
            rho = clamped_exp(lam)
            metrics["mis_tis_weight_before_bound"] = reduce_metric(rho, m_valid, reduction)
            metrics.update(_tails_before_bound(lam, m_valid, tis_mode, lower, upper, reduction))

            # 2. mode
            w, keep_mode, fractions = _apply_mode(rho, tis_mode, lower, upper)
            for key, ind in fractions.items():
                metrics[key] = reduce_metric(ind.astype(np.float64), m_valid, reduction)
            m_mode = np.where(keep_mode, m_valid, 0.0)
            metrics["mis_tis_weight_after_bound"] = reduce_metric(w, m_mode, reduction)
        if "minpro" in (tis_level, rs_level if use_rs else None):
            metrics.update(rules_ref.minpro_metrics(delta, m_valid, reduction))

        # 3. rejection sampling
        keep = keep_mode.copy()
        if use_rs:
            rs_up = float(rs_upper_bound) if rs_upper_bound is not None else upper
            rs_low = float(rs_lower_bound) if rs_lower_bound is not None else lower
            keep_rs, rs_fractions = _rejection_sampling(delta, m_valid, rs_level, rs_low, rs_up)
            keep &= keep_rs
            for key, ind in rs_fractions.items():
                metrics[key] = reduce_metric(ind.astype(np.float64), m_valid, reduction)

        # 4. veto (independent of use_rs, D1)
        if rs_veto_threshold is not None:
            cat_tok, cat_seq = _veto(delta, m_valid, float(rs_veto_threshold))
            keep &= ~_seq_broadcast(cat_seq, m.shape)
            metrics["mis_rs_catastrophic_token_fraction"] = reduce_metric(
                cat_tok.astype(np.float64), m_valid, reduction
            )
            metrics["mis_rs_catastrophic_seq_fraction"] = reduce_metric(
                _seq_broadcast(cat_seq.astype(np.float64), m.shape), m_valid, reduction
            )

        # §8 rules, each on the valid tokens
        keep_rules, rule_metrics = rules_ref.apply_rules(
            o,
            b,
            m_valid,
            reduction,
            rs_criteria=rs_criteria,
            seq_logprob_error_threshold=seq_logprob_error_threshold,
            m2po_tau=m2po_tau,
        )
        keep &= keep_rules
        metrics.update(rule_metrics)

        m_final = np.where(keep, m_valid, 0.0)

        # 5. mean of the bounded weights over the final mask
        metrics["mis_is_ratio_mean_after_tis_rs"] = reduce_metric(w, m_final, reduction)
        if rejection_sampling is None and tis_mode != "none":
            for side, outside in (("low", w < lower), ("high", w > upper)):
                metrics[f"mis_is_ratio_fraction_{side}_final"] = reduce_metric(
                    outside.astype(np.float64), m_final, reduction
                )

        # 6. batch normalisation
        mu = 1.0
        if tis_batch_normalize:
            w, mu = _batch_normalize(w, m_final, tis_level)
        metrics["mis_batch_norm_factor"] = float(mu)

        # 7. final statistics over m' (D7)
        metrics["mis_is_ratio_mean_final"] = reduce_metric(w, m_final, reduction)
        for kind in ("min", "max"):
            ext = _per_seq_extreme(w, m_final, kind)
            metrics[f"mis_is_ratio_{kind}_final"] = reduce_metric(
                _seq_broadcast(ext, m.shape), m_final, reduction
            )
            metrics[f"mis_is_ratio_batch_{kind}_final"] = _batch_extreme(w, m_final, kind)
        metrics["mis_ess"] = rules_ref.ess(w, m_final)
        return np.where(m_final > 0, w, 0.0), m_final, metrics


def correction(
    old_logp,
    rollout_logp,
    mask,
    *,
    use_tis=False,
    tis_level="token",
    tis_mode="truncate",
    tis_lower_bound=None,
    tis_upper_bound=2.0,
    tis_batch_normalize=False,
    use_rs=False,
    rs_level="token",
    rs_lower_bound=None,
    rs_upper_bound=None,
    rs_veto_threshold=None,
    reduction="sequence",
    rs_criteria=(),
    seq_logprob_error_threshold=None,
    m2po_tau=None,
    probability_metrics=False,
    nonfinite_rollout="reject",
    max_weight_staleness=None,
    staleness_level="sequence",
    mask_offpolicy_in_partial_rollout=False,
    rejection_sampling=None,
):
    """Reference ``compute_correction`` (§0, §2-§4, §7, §8).

    The asynchronous-RL keys are accepted at their defaults only (they change nothing
    without versions); tests/test_staleness.py has their reference.

    With ``δ = o − b`` over the valid tokens of finite sequences:

    1. ``ρ = exp(clip(agg(δ, m, tis_level), −S, S))``
    2. mode (truncate / clip / mask) with ``L = tis_lower_bound or 1/U``, ``U``
    3. RS (``use_rs``): keep iff ``L_rs ≤ exp(clip(agg(δ, m, rs_level), −S, S)) ≤ U_rs``
    4. veto (``rs_veto_threshold``): drop sequences with a valid ``δ_t < log(thr)``
    5. (sequences with a non-finite valid ``o``/``b`` are rejected as well, §0)
    6. batch normalisation over the final mask ``m'``
    7. ``weights = w · m'``

    Returns ``(weights, mask_out, metrics)``: float64 arrays shaped like ``mask`` and a
    dict of Python floats.  With ``use_tis=False``: ``weights = m``, ``mask_out = m``,
    §4 metrics only.
    """
    _only_async_defaults(
        nonfinite_rollout=nonfinite_rollout,
        max_weight_staleness=max_weight_staleness,
        staleness_level=staleness_level,
        mask_offpolicy_in_partial_rollout=mask_offpolicy_in_partial_rollout,
    )
    o, b, m = _as_float(old_logp), _as_float(rollout_logp), _as_mask(mask)
    if not (o.shape == b.shape == m.shape):
        raise ValueError(
            f"shape mismatch: old_logp {o.shape}, rollout_logp {b.shape}, mask {m.shape}"
        )
    w, m_final, metrics = _correction_core(
        o,
        b,
        m,
        use_tis=use_tis,
        tis_level=tis_level,
        tis_mode=tis_mode,
        tis_lower_bound=tis_lower_bound,
        tis_upper_bound=tis_upper_bound,
        tis_batch_normalize=tis_batch_normalize,
        use_rs=use_rs,
        rs_level=rs_level,
        rs_lower_bound=rs_lower_bound,
        rs_upper_bound=rs_upper_bound,
        rs_veto_threshold=rs_veto_threshold,
        reduction=reduction,
        rs_criteria=tuple(rs_criteria),
        seq_logprob_error_threshold=seq_logprob_error_threshold,
        m2po_tau=m2po_tau,
        probability_metrics=probability_metrics,
        rejection_sampling=rejection_sampling,
    )
    weights = np.where(m_final > 0, w * m_final, 0.0)
    return weights, m_final, metrics


# --------------------------------------------------------------------------------------
# §5 losses
# --------------------------------------------------------------------------------------


def ppo_surrogate(theta, d, adv, valid, *, clip_eps, clip_eps_high, dual_clip_c):
    """Per-token PPO surrogate of §5 and its analytic derivative w.r.t. ``θ``.

    ``k = d − θ`` (0 where masked or non-finite), ``x = −k``, ``r = exp(clip(x, −S, S))``,
    ``L1 = −r·A``, ``L2 = −clip(r, 1 − ε, 1 + ε_high)·A``, ``ℓ = max(L1, L2)``;
    dual clip (``c``): where ``A < 0``, ``ℓ = min(−c·A, ℓ)``.

    Derivative (``dr/dθ = r`` on the closed interval ``|x| ≤ S``, else 0):

    - ``L2 > L1`` (clipped branch; then ``r`` is strictly outside the clip range): 0
    - otherwise (including the tie ``L1 == L2``): ``−A · dr/dθ``
    - dual clip active (``A < 0`` and ``−c·A < ℓ``): 0; at a tie ``ℓ``'s gradient flows
    - ``k`` zeroed (masked / non-finite): 0

    Returns ``(ell, dell_dtheta, clipped, k)``; ``clipped = [L2 > L1]`` is the
    ``pg_clipfrac`` indicator.
    """
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    with np.errstate(all="ignore"):
        k_raw = d - theta
        ok = valid & np.isfinite(k_raw)
        k = np.where(ok, k_raw, 0.0)
        a = np.where(valid, adv, 0.0)
        x = -k
        r = np.exp(np.clip(x, -S, S))
        dr = np.where(ok & (np.abs(x) <= S), r, 0.0)
        l1 = -r * a
        l2 = -np.clip(r, 1.0 - clip_eps, 1.0 + eps_high) * a
        clipped = l2 > l1
        ell = np.where(clipped, l2, l1)
        grad = np.where(clipped, 0.0, -a * dr)
        if dual_clip_c is not None:
            dual = (a < 0) & (-dual_clip_c * a < ell)
            ell = np.where(dual, -dual_clip_c * a, ell)
            grad = np.where(dual, 0.0, grad)
    return ell, grad, clipped, k


def vanilla_tis(o, b, m, *, clip_low, clip, reduction):
    """The reference's built-in correction: ``w = clip(exp(o − b), clip_low, clip)``.

    Mask unchanged.  Metrics over the original mask: ``tis`` = pre-clip ratio,
    ``tis_clipfrac = [w ≠ ratio]``, ``tis_abs = |ratio − 1|``.
    Returns ``(w, metrics)``.  (A non-finite ``o − b`` at a valid position gives ratio 1.)
    """
    with np.errstate(all="ignore"):
        delta = o - b
        delta = np.where((m > 0) & np.isfinite(delta), delta, 0.0)
        ratio = np.exp(delta)
        w = np.clip(ratio, clip_low, clip)
        metrics = {
            "tis": reduce_metric(ratio, m, reduction),
            "tis_clipfrac": reduce_metric((w != ratio).astype(np.float64), m, reduction),
            "tis_abs": reduce_metric(np.abs(ratio - 1.0), m, reduction),
        }
    return np.where(m > 0, w, 0.0), metrics


def aggregate_loss(ell, m_final, m_den, aggregation: str):
    """Aggregate weighted per-token losses ``ℓ'`` (§5 "Aggregation").

    With ``n_i = Σ_t ℓ' m'`` and ``d_i = Σ_t m''`` per sequence and ``K`` = number of
    sequences with ``d_i > 0``:

    - sequence_mean: ``Σ_{d_i>0} n_i / d_i / K``
    - token_mean:    ``Σ_i n_i / Σ_i d_i``
    - sequence_sum:  ``Σ_i n_i / K``

    Everything empty gives 0.  Returns ``(loss, dloss_dell)`` where ``dloss_dell`` is
    the per-token factor ``∂loss/∂ℓ'_t`` (0 outside ``m'``).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    keep = m_final > 0
    num = _masked_sum(ell, m_final, axis=-1)
    den = np.where(m_den > 0, m_den, 0.0).sum(axis=-1)
    nonempty = den > 0
    n_seq = int(nonempty.sum())
    if aggregation == "token_mean":
        total = float(den.sum())
        if total <= 0:
            return 0.0, np.zeros_like(ell)
        return float(num.sum()) / total, np.where(keep, m_final / total, 0.0)
    if n_seq == 0:
        return 0.0, np.zeros_like(ell)
    if aggregation == "sequence_mean":
        per_seq = np.where(nonempty, num / _safe_count(den), 0.0)
        factor = np.where(keep, m_final / _seq_broadcast(_safe_count(den), ell.shape), 0.0)
        return float(per_seq.sum()) / n_seq, factor / n_seq
    per_seq = np.where(nonempty, num, 0.0)
    return float(per_seq.sum()) / n_seq, np.where(keep, m_final / n_seq, 0.0)


ASYNC_DEFAULTS = dict(
    nonfinite_rollout="reject",
    max_weight_staleness=None,
    staleness_level="sequence",
    mask_offpolicy_in_partial_rollout=False,
)


def _only_async_defaults(**keys) -> None:
    for key, value in keys.items():
        if value != ASYNC_DEFAULTS[key]:
            raise NotImplementedError(f"this reference does not implement {key}={value!r}")


def _correction_kwargs(corr: dict) -> dict:
    """Fill a correction dict with :func:`correction`'s defaults (unknown keys rejected)."""
    defaults = dict(
        use_tis=False,
        tis_level="token",
        tis_mode="truncate",
        tis_lower_bound=None,
        tis_upper_bound=2.0,
        tis_batch_normalize=False,
        use_rs=False,
        rs_level="token",
        rs_lower_bound=None,
        rs_upper_bound=None,
        rs_veto_threshold=None,
        rs_criteria=(),
        seq_logprob_error_threshold=None,
        m2po_tau=None,
        probability_metrics=False,
        rejection_sampling=None,
    )
    # The asynchronous-RL keys (tests/test_staleness.py has their own reference): only
    # their defaults, which change nothing without versions, are accepted here.
    _only_async_defaults(**{k: v for k, v in corr.items() if k in ASYNC_DEFAULTS})
    corr = {k: v for k, v in corr.items() if k not in ASYNC_DEFAULTS}
    unknown = set(corr) - set(defaults)
    if unknown:
        raise ValueError(f"unknown correction keys: {sorted(unknown)}")
    defaults.update(corr)
    return defaults


def policy_loss(
    logp,
    old_logp,
    rollout_logp,
    advantages,
    mask,
    *,
    algorithm,
    clip_eps=0.2,
    clip_eps_high=None,
    dual_clip_c=None,
    correction=None,
    aggregation="sequence_mean",
    rejected_in_denominator=False,
    get_mismatch_metrics=False,
    metric_reduction="sequence",
):
    """Reference ``policy_loss`` (§5, §7) with the analytic gradient w.r.t. ``logp``.

    ======================  ===================================================
    ``ppo``                 ``ℓ(θ; d = o)``
    ``bypass_ppo``          ``ℓ(θ; d = b)`` (``old_logp`` may be None)
    ``decoupled_ppo``       ``w(o, b) · ℓ(θ; d = o)``, mask ``m'`` of the correction
    ``reinforce_is``        ``−sg(w(θ, b)) · A · θ`` (correction with ``δ = sg(θ) − b``)
    ======================  ===================================================

    ``correction``: None, a dict of :func:`correction` keyword arguments, or
    ``("vanilla_tis", clip_low, clip)``.  A correction only changes the loss for
    ``decoupled_ppo`` / ``reinforce_is``; with ``ppo`` / ``bypass_ppo`` it only adds the
    §4 metrics.  Returns ``(loss, grad_logp, metrics)``; ``loss`` is a float,
    ``grad_logp`` a float64 array shaped like ``logp``.

    Metrics: ``pg_loss`` (= loss); ``pg_clipfrac = [L2 > L1]``, ``ppo_kl = k`` and
    ``train_rollout_logprob_abs_diff = |o − b|`` (``|sg(θ) − b|`` in bypass, D8b) over
    ``m'``; ``ois = exp(θ − d)`` over the original mask when a correction or mismatch
    metrics are configured; ``tis``/``tis_clipfrac``/``tis_abs`` for VanillaTIS; the
    correction's ``mis_*``; §4 metrics of ``o`` (or ``sg(θ)`` if ``o`` is None) vs ``b``
    when a correction dict or ``get_mismatch_metrics`` is configured (not for
    VanillaTIS alone).  ``reinforce_is`` has no ``pg_clipfrac`` / ``ppo_kl`` / ``ois`` /
    ``train_rollout_logprob_abs_diff``.

    Masks: the per-token loss is ``w · ℓ`` with the *unmasked* final weight ``w`` and it
    is aggregated with ``m'`` once, so a fractional mask value weights its token once
    (the ``weights`` returned by :func:`correction` are ``w · m'``).  Garbage
    (NaN / inf) at masked positions of any input never reaches the loss or gradient;
    at a *valid* position a non-finite ``d − θ`` gives ``k = 0`` (ratio 1, zero
    gradient), and a non-finite ``o``/``b`` rejects the sequence only where a §3
    correction runs (``decoupled_ppo`` / ``reinforce_is`` with a correction dict).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if metric_reduction not in REDUCTIONS:
        raise ValueError(f"metric_reduction must be one of {REDUCTIONS}")
    theta = _as_float(logp)
    m = _as_mask(mask)
    o = None if old_logp is None else _as_float(old_logp)
    b = None if rollout_logp is None else _as_float(rollout_logp)
    adv = _as_float(advantages)
    if adv.shape == theta.shape[:-1]:
        adv = np.broadcast_to(adv[..., None], theta.shape)
    if adv.shape != theta.shape or m.shape != theta.shape:
        raise ValueError(
            f"shape mismatch: logp {theta.shape}, advantages {adv.shape}, mask {m.shape}"
        )
    if algorithm in ("ppo", "decoupled_ppo") and o is None:
        raise ValueError(f"old_logp is required for {algorithm!r}")
    if algorithm != "ppo" and b is None:
        raise ValueError(f"rollout_logp is required for {algorithm!r}")
    if algorithm == "decoupled_ppo" and correction is None:
        raise ValueError("decoupled_ppo requires a correction")
    if algorithm == "reinforce_is" and correction is None:
        raise ValueError("reinforce_is requires a correction")

    valid = m > 0
    metrics: dict[str, Any] = {}
    w = np.ones_like(theta)
    m_final = m.copy()

    # ---- correction (weights are stop-gradient constants) ------------------------
    is_vanilla = isinstance(correction, tuple)
    if is_vanilla:
        tag, clip_low, clip_high = correction
        if tag != "vanilla_tis":
            raise ValueError(f"unknown correction tuple {correction!r}")
    if algorithm == "decoupled_ppo":
        if is_vanilla:
            w, tis_metrics = vanilla_tis(
                o, b, m, clip_low=clip_low, clip=clip_high, reduction=metric_reduction
            )
            metrics.update(tis_metrics)
        else:
            w, m_final, corr_metrics = _correction_core(
                o, b, m, reduction=metric_reduction, **_correction_kwargs(correction)
            )
            metrics.update(corr_metrics)
    elif algorithm == "reinforce_is" and is_vanilla:
        w, tis_metrics = vanilla_tis(
            theta, b, m, clip_low=clip_low, clip=clip_high, reduction=metric_reduction
        )
        metrics.update(tis_metrics)
    elif algorithm == "reinforce_is":
        w, m_final, corr_metrics = _correction_core(
            theta, b, m, reduction=metric_reduction, **_correction_kwargs(correction)
        )
        metrics.update(corr_metrics)

    # ---- §4 metrics: old_logp (or sg(logp)) against rollout_logp --------------------
    if b is not None and (isinstance(correction, dict) or get_mismatch_metrics):
        src = o if o is not None else theta
        bad_seq = _nonfinite_sequences(src, b, m)
        m_valid = np.where(_seq_broadcast(bad_seq, m.shape), 0.0, m)
        metrics.update(monitoring_metrics(src, b, m_valid, metric_reduction))
        if isinstance(correction, dict) and correction.get("probability_metrics", False):
            metrics.update(rules_ref.probability_metrics(src, b, m_valid, metric_reduction))

    m_den = m if rejected_in_denominator else m_final

    # ---- per-token loss and its derivative -----------------------------------------
    if algorithm == "reinforce_is":
        with np.errstate(all="ignore"):
            a = np.where(valid, adv, 0.0)
            th = np.where(m_final > 0, theta, 0.0)
            ell = -w * a * th
            dell = -w * a
    else:
        d = b if algorithm == "bypass_ppo" else o
        ell_raw, dell_raw, clipped, k = ppo_surrogate(
            theta,
            d,
            adv,
            valid,
            clip_eps=clip_eps,
            clip_eps_high=clip_eps_high,
            dual_clip_c=dual_clip_c,
        )
        ell = w * ell_raw
        dell = w * dell_raw
        metrics["pg_clipfrac"] = reduce_metric(
            clipped.astype(np.float64), m_final, metric_reduction
        )
        metrics["ppo_kl"] = reduce_metric(k, m_final, metric_reduction)
        if b is not None:
            with np.errstate(all="ignore"):
                src = theta if algorithm == "bypass_ppo" else o
                diff = np.abs(src - b)
                diff = np.where(valid & np.isfinite(diff), diff, 0.0)
            metrics["train_rollout_logprob_abs_diff"] = reduce_metric(
                diff, m_final, metric_reduction
            )
        if correction is not None or get_mismatch_metrics:
            metrics["ois"] = reduce_metric(np.exp(-k), m, metric_reduction)

    loss, factor = aggregate_loss(ell, m_final, m_den, aggregation)
    grad = np.where(m_final > 0, dell * factor, 0.0)
    metrics["pg_loss"] = loss
    return loss, grad, metrics
