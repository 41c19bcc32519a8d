"""Independent NumPy reference (test oracle) for the surrogates of ``policy_losses``.

Written from the formulas (the papers and verl's ``core_algos.py``), never importing
``offpolicy_jax``. Everything is computed in float64 after casting the inputs to
float32; every value at an invalid position is removed with ``np.where`` first.

Each surrogate returns a :class:`Terms`: the per-token loss ``ℓ`` ``[B, T]``, the clip
indicators, and ``vjp(c)``, the analytic ``Σ_t c_t ∂ℓ_t/∂θ_u`` for a cotangent ``c``
(per-sequence surrogates couple the tokens of a sequence). Gradient conventions
(verl / PyTorch): a clamp passes the full gradient on its closed interval; at a tie
between PPO's clipped and unclipped branch the unclipped gradient flows; trust-region
masks include their boundary.

``aggregate(per_token, final_mask, denominator_mask, aggregation, scale=None)`` is the
loss aggregation (the five verl modes and ``row_mean``) with its derivative weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

S = 20.0
GSPO_MAX = 10.0
K3_MAX = 10.0


class Terms(NamedTuple):
    loss: np.ndarray
    vjp: Callable[[np.ndarray], np.ndarray]
    clipped: np.ndarray | None = None
    clipped_lower: np.ndarray | None = None


def _f64(*arrays):
    return [np.asarray(np.asarray(a, np.float32), np.float64) for a in arrays]


def _usable(theta, d, valid):
    with np.errstate(all="ignore"):
        raw = theta - d
    ok = valid & np.isfinite(raw)
    return ok, np.where(ok, raw, 0.0)


def _theta_hat(theta, valid):
    ok = valid & np.isfinite(theta)
    return ok, np.where(ok, theta, 0.0)


def _clamp_grad(x, lo, hi):
    return ((x >= lo) & (x <= hi)).astype(np.float64)


def _local(loss, slope, **kw):
    return Terms(loss, lambda c: np.asarray(c, np.float64) * slope, **kw)


def _ppo_branches(s, a, eps, eps_high):
    l1 = -s * a
    l2 = -np.clip(s, 1 - eps, 1 + eps_high) * a
    clipped = l2 > l1
    return np.where(clipped, l2, l1), clipped, np.where(clipped, 0.0, -a * s)


def gspo(theta, d, adv, valid, *, clip_eps, clip_eps_high, token_level):
    """GSPO(-token): ``s = exp(min(mean_t x, 10))`` (per sequence), PPO clip on ``s``."""
    theta, d, adv = _f64(theta, d, adv)
    valid = np.asarray(valid, bool)
    adv = np.where(valid, adv, 0.0)
    ok, x = _usable(theta, d, valid)
    n = valid.sum(-1, keepdims=True).astype(np.float64)
    nbar = np.where(n > 0, n, 1.0)
    mean = (x * valid).sum(-1, keepdims=True) / nbar
    gate = (mean <= GSPO_MAX).astype(np.float64)
    s = np.exp(np.minimum(mean, GSPO_MAX)) * np.ones_like(theta)
    loss, clipped, dlds = _ppo_branches(s, adv, clip_eps, clip_eps_high)
    slope = dlds * gate  # ∂ℓ_t / ∂(log s)

    if token_level:
        tok_ok, _ = _theta_hat(theta, valid)
        return _local(loss, slope * tok_ok, clipped=clipped)

    def vjp(c):
        per_seq = (np.asarray(c, np.float64) * slope).sum(-1, keepdims=True)
        return per_seq * ok / nbar

    return Terms(loss, vjp, clipped)


def cispo(theta, d, adv, valid, *, clip_eps, clip_eps_high):
    theta, d, adv = _f64(theta, d, adv)
    valid = np.asarray(valid, bool)
    adv = np.where(valid, adv, 0.0)
    _, x = _usable(theta, d, valid)
    r = np.exp(np.clip(x, -S, S))
    w = np.clip(r, 1 - clip_eps, 1 + clip_eps_high)
    tok_ok, th = _theta_hat(theta, valid)
    return _local(-w * adv * th, -w * adv * tok_ok, clipped=w != r)


def gmpo(theta, d, adv, valid, *, clip_eps, clip_eps_high, weights=None):
    """Per-sequence GMPO loss ``L_i`` ``[B]`` (as ``loss``) and its VJP (cotangent ``[B]``)."""
    theta, d, adv = _f64(theta, d, adv)
    valid = np.asarray(valid, bool)
    adv = np.where(valid, adv, 0.0)
    ok, x = _usable(theta, d, valid)
    pos, neg = adv > 0, adv < 0
    xt = np.where(pos, np.minimum(x, clip_eps_high), np.where(neg, np.maximum(x, -clip_eps), 0.0))
    dxt = ok & ((pos & (x <= clip_eps_high)) | (neg & (x >= -clip_eps)))
    n = valid.sum(-1).astype(np.float64)
    nbar = np.where(n > 0, n, 1.0)
    mean = (xt * valid).sum(-1) / nbar
    abar = (adv * valid).sum(-1) / nbar
    log_w = 0.0
    if weights is not None:
        (w,) = _f64(weights)
        log_w = (np.where(valid, np.log(np.where(valid, w, 1.0) + 1e-10), 0.0)).sum(-1) / nbar
    value = -abar * np.exp(np.clip(mean, -S, S) + log_w)
    gate = _clamp_grad(mean, -S, S)
    outside = (x > clip_eps_high) | (x < -clip_eps)

    def vjp(c):
        return (np.asarray(c, np.float64) * value * gate / nbar)[:, None] * dxt

    return Terms(value, vjp, outside & pos, outside & neg)


def sapo(theta, d, adv, valid, *, tau_pos, tau_neg):
    theta, d, adv = _f64(theta, d, adv)
    valid = np.asarray(valid, bool)
    adv = np.where(valid, adv, 0.0)
    ok, x = _usable(theta, d, valid)
    r = np.exp(np.clip(x, -S, S))
    tau = np.where(adv > 0, tau_pos, tau_neg)
    g = 1.0 / (1.0 + np.exp(-tau * (r - 1.0)))
    loss = -adv * g * 4.0 / tau
    slope = -adv * 4.0 * g * (1 - g) * r * _clamp_grad(x, -S, S) * ok
    return _local(loss, slope)


def gpg(theta, adv, valid):
    (theta, adv) = _f64(theta, adv)
    valid = np.asarray(valid, bool)
    adv = np.where(valid, adv, 0.0)
    tok_ok, th = _theta_hat(theta, valid)
    return _local(-adv * th, -adv * tok_ok)


def dppo(theta, d, adv, valid, *, divergence, clip_eps, clip_eps_high, ratio_cap):
    theta32, d32 = np.asarray(theta, np.float32), np.asarray(d, np.float32)
    theta, d, adv = _f64(theta, d, adv)
    valid = np.asarray(valid, bool)
    adv = np.where(valid, adv, 0.0)
    ok, x = _usable(theta, d, valid)
    r = np.exp(np.clip(x, -S, S))
    w = r if ratio_cap is None else np.minimum(r, ratio_cap)
    # The trust region is decided in float32, exactly as verl (and the library) do.
    with np.errstate(all="ignore"):
        t32 = np.where(ok, theta32, np.float32(0))
        o32 = np.where(ok, d32, np.float32(0))
        p, q = np.exp(t32), np.exp(o32)
        pos = adv > 0
        if divergence == "tv":
            inside = np.where(
                pos, p - q <= np.float32(clip_eps_high), p - q >= -np.float32(clip_eps)
            )
        else:
            one, eps = np.float32(1), np.float32(1e-8)
            kl = q * (o32 - t32) + (one - q) * np.log((one - q + eps) / (one - p + eps))
            inside = np.where(
                pos,
                (kl <= np.float32(clip_eps_high)) | (p <= q),
                (kl <= np.float32(clip_eps)) | (p >= q),
            )
    tok_ok, th = _theta_hat(theta, valid)
    loss = np.where(inside, -adv * w * th, 0.0)
    slope = np.where(inside, -adv * w, 0.0) * tok_ok
    capped = np.zeros_like(inside) if ratio_cap is None else (r > ratio_cap) & inside
    return _local(loss, slope, clipped=~inside, clipped_lower=capped)


def dro(theta, d, adv, valid, *, beta):
    theta, d, adv = _f64(theta, d, adv)
    valid = np.asarray(valid, bool)
    adv = np.where(valid, adv, 0.0)
    ok, x = _usable(theta, d, valid)
    tok_ok, th = _theta_hat(theta, valid)
    return _local(-(adv * th - 0.5 * beta * x * x), -adv * tok_ok + beta * x * ok)


def kl(theta, ref, valid, *, estimator, d=None):
    """Per-token ``k1/k2/k3`` of ``KL(π_θ‖π_ref)``; with ``d``, weighted by ``π_θ/π_d``."""
    theta, ref = _f64(theta, ref)
    valid = np.asarray(valid, bool)
    ok, x = _usable(theta, ref, valid)  # x = θ − ref
    if estimator == "k1":
        k, dk = x, ok.astype(np.float64)
    elif estimator == "k2":
        k, dk = 0.5 * x * x, x
    else:
        u = -x
        uc = np.clip(u, -S, S)
        v = np.exp(uc) - uc - 1.0
        k = np.minimum(v, K3_MAX)
        dk = -(np.exp(uc) - 1.0) * _clamp_grad(u, -S, S) * (v <= K3_MAX) * ok
    if d is None:
        return _local(k, dk)
    (d,) = _f64(d)
    ok_d, xd = _usable(theta, d, valid)
    r = np.exp(np.clip(xd, -S, S))
    return _local(r * k, r * dk + k * r * _clamp_grad(xd, -S, S) * ok_d)


def aggregate(per_token, final_mask, denominator_mask, aggregation, scale=None):
    """Aggregated loss and ``∂loss/∂ℓ_t`` per token (before ``ℓ``'s own derivative)."""
    (lt,) = _f64(per_token)
    fm = np.asarray(final_mask, np.float64)
    dm = np.asarray(denominator_mask, np.float64)
    lt = np.where(fm > 0, lt, 0.0)
    n = dm.sum(-1)
    nonempty = n > 0
    num_seq = nonempty.sum()
    if aggregation == "token_mean":
        den = n.sum()
        weight = fm / den if den > 0 else np.zeros_like(fm)
    elif aggregation == "token_sum":
        weight = fm.copy()
    elif aggregation in ("sequence_sum", "sequence_sum_norm"):
        div = num_seq * (1.0 if aggregation == "sequence_sum" else (scale or lt.shape[-1]))
        weight = fm * nonempty[:, None] / div if num_seq > 0 else np.zeros_like(fm)
    elif aggregation in ("sequence_mean", "row_mean"):
        rows = num_seq if aggregation == "sequence_mean" else fm.shape[0]
        nbar = np.where(nonempty, n, 1.0)
        weight = fm * nonempty[:, None] / nbar[:, None] / rows if rows > 0 else np.zeros_like(fm)
    else:
        raise ValueError(aggregation)
    return float((weight * lt).sum()), weight


# --------------------------------------------------------------------------- prime-rl
# From prime-rl's src/prime_rl/trainer/rl/loss.py (default_loss_fn, ipo_loss_fn; commit
# 559b44772; kpop_loss_fn as its pull request describes it) and, for INTELLECT-2, src/zeroband/training/loss.py (commit 35948297f).


class MaskTerms(NamedTuple):
    loss: np.ndarray
    vjp: Callable[[np.ndarray], np.ndarray]
    masked: np.ndarray
    masked_high: np.ndarray | None = None
    masked_low: np.ndarray | None = None


def _probs_diff(theta, d, ok):
    """prime-rl's ``exp(trainer_logprobs) − exp(inference_logprobs)``, in float32."""
    with np.errstate(all="ignore"):
        t32 = np.where(ok, np.asarray(theta, np.float32), np.float32(0))
        d32 = np.where(ok, np.asarray(d, np.float32), np.float32(0))
        return np.exp(t32) - np.exp(d32)


def _masked_ratio(theta, d, adv, valid, masked_fn, adv_tau, kl_tau):
    theta64, d64, adv = _f64(theta, d, adv)
    valid = np.asarray(valid, bool)
    adv = np.where(valid, adv, 0.0)
    ok, x = _usable(theta64, d64, valid)
    gap = _probs_diff(theta, d, ok)
    masked = masked_fn(gap, adv)
    keep = ~masked
    r = np.exp(np.clip(x, -S, S))
    pg = np.where(keep, adv_tau * adv * r, 0.0)
    loss = -pg + kl_tau * x * x
    slope = (-np.where(keep, adv_tau * adv * r, 0.0) * _clamp_grad(x, -S, S) + 2 * kl_tau * x) * ok
    return loss, slope, masked, adv, gap


def prime_dppo(theta, d, adv, valid, *, dppo_mask_low, dppo_mask_high, adv_tau, kl_tau):
    """``−keep·τ_A·A·r + τ_KL·log² r``, ``keep`` = not (``Δp > δ_h`` if A > 0 else ``Δp < −δ_l``)."""
    high32, low32 = np.float32(dppo_mask_high), np.float32(dppo_mask_low)

    def masked_fn(gap, a):
        return np.where(a > 0, gap > high32, gap < -low32)

    loss, slope, masked, a, gap = _masked_ratio(theta, d, adv, valid, masked_fn, adv_tau, kl_tau)
    return MaskTerms(
        loss,
        lambda c: np.asarray(c, np.float64) * slope,
        masked,
        (a > 0) & (gap > high32),
        (a < 0) & (gap < -low32),
    )


def ipo(theta, d, adv, valid, *, ipo_threshold, adv_tau, kl_tau):
    """The same with ``keep`` = ``|Δp| ≤ ipo_threshold``."""
    threshold = np.float32(ipo_threshold)

    def masked_fn(gap, _):
        return np.abs(gap) > threshold

    loss, slope, masked, _, _ = _masked_ratio(theta, d, adv, valid, masked_fn, adv_tau, kl_tau)
    return MaskTerms(loss, lambda c: np.asarray(c, np.float64) * slope, masked)


KPOP_EPS = 1e-6  # prime-rl's (and verl's) clamp of both probabilities to [ε, 1 − ε]


def binary_kl(log_p, log_q, eps=KPOP_EPS):
    """``D_B(p‖q) = p·log(p/q) + (1 − p)·log((1 − p)/(1 − q))`` in float64, ``p`` and ``q``
    the float32 log-probabilities' exact exponentials clamped to ``[ε, 1 − ε]`` with both
    ends rounded to float32, as ``torch.clamp`` on a float32 tensor rounds them (where
    ``1 − ε`` rounds to 1, ``1 − ε`` itself: the finite statistic)."""
    low, high = float(np.float32(eps)), float(np.float32(1 - eps))
    if high == 1.0:
        high = 1 - eps
    with np.errstate(all="ignore"):
        p = np.clip(np.exp(np.asarray(log_p, np.float64)), low, high)
        q = np.clip(np.exp(np.asarray(log_q, np.float64)), low, high)
        return p * np.log(p / q) + (1 - p) * (np.log1p(-p) - np.log1p(-q))


def kpop(theta, d, adv, valid, *, kpop_threshold, adv_tau, kl_tau):
    """IPO's loss with ``keep`` = ``max(D_B(π_θ‖π_d), D_B(π_d‖π_θ)) ≤ φ`` (KPop; prime-rl's
    ``kpop`` loss type, ``trainer_logprobs`` against ``inference_logprobs``)."""
    t32, d32 = (np.asarray(a, np.float32) for a in (theta, d))
    with np.errstate(invalid="ignore"):
        ok = np.asarray(valid, bool) & np.isfinite(np.float64(t32) - d32)
    t32, d32 = np.where(ok, t32, np.float32(0)), np.where(ok, d32, np.float32(0))
    divergence = np.maximum(binary_kl(t32, d32), binary_kl(d32, t32))
    masked = divergence > kpop_threshold

    def masked_fn(gap, _):
        return masked

    loss, slope, masked, _, _ = _masked_ratio(theta, d, adv, valid, masked_fn, adv_tau, kl_tau)
    return MaskTerms(loss, lambda c: np.asarray(c, np.float64) * slope, masked)


def two_sided_clip(theta, d, adv, valid, *, clip_eps, clip_eps_high, delta):
    """INTELLECT-2 as prime-rl wrote it: ``c1 = clamp(r, 0, δ)``, ``c2 = clamp(c1, 1−ε, 1+ε_h)``,
    ``ℓ = max(−c1·A, −c2·A)`` (a clamp's gradient passes on its closed interval; at a tie
    the unclipped branch's, the library's rule)."""
    theta, d, adv = _f64(theta, d, adv)
    valid = np.asarray(valid, bool)
    adv = np.where(valid, adv, 0.0)
    ok, x = _usable(theta, d, valid)
    r = np.exp(np.clip(x, -S, S))
    c1 = np.clip(r, 0.0, delta)
    dc1 = r * (r <= delta) * _clamp_grad(x, -S, S) * ok
    c2 = np.clip(c1, 1 - clip_eps, 1 + clip_eps_high)
    l1, l2 = -c1 * adv, -c2 * adv
    clipped = l2 > l1
    loss = np.where(clipped, l2, l1)
    slope = -adv * dc1 * np.where(clipped, _clamp_grad(c1, 1 - clip_eps, 1 + clip_eps_high), 1.0)
    return Terms(
        loss, lambda c: np.asarray(c, np.float64) * slope, clipped, (adv < 0) & (r > delta)
    )


def prime_rl_loss(theta, inference, adv, loss_mask, loss_fn, **hp):
    """prime-rl's ``compute_loss`` for one packed micro-batch of sequences (the rows):
    ``Σ_seq Σ_t ℓ / N`` with ``N`` the count of loss tokens (masked tokens included), and
    each metric as prime-rl's per-sample ``_safe_mean`` averaged over the samples that have
    a loss token (the library leaves empty sequences out of its means)."""
    loss_mask = np.asarray(loss_mask, bool)
    terms = loss_fn(theta, inference, adv, loss_mask, **hp)
    n = max(int(loss_mask.sum()), 1)
    value = float(np.where(loss_mask, terms.loss, 0.0).sum() / n)
    grad = terms.vjp(loss_mask / n)
    metrics = {}
    nonempty = loss_mask.any(-1)
    names = {"is_masked": terms.masked}
    if getattr(terms, "masked_high", None) is not None:
        names |= {"is_masked_high": terms.masked_high, "is_masked_low": terms.masked_low}
    for key, flag in names.items():
        per_sample = (flag & loss_mask).sum(-1) / np.maximum(loss_mask.sum(-1), 1)
        metrics[key] = float(per_sample[nonempty].mean()) if nonempty.any() else 0.0
    return value, grad, metrics
