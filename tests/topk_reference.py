"""Independent NumPy oracles for DPPO's top-k trust region, never importing ``offpolicy_jax``.

* :func:`divergence`: the float64 reference of ``topk_tv`` / ``topk_kl`` (the formulas
  of arXiv:2602.04879 with TRL's rest bucket, ``0·log 0 = 0``).
* :func:`trl_support`, :func:`trl_divergence_mask`, :func:`trl_loss`: a NumPy port of
  TRL's ``DPPOTrainer`` (``trl/experimental/dppo/dppo_trainer.py`` at huggingface/trl
  ef1b50008^: ``_generate_single_turn``'s transformers path for the support,
  ``_compute_divergence_mask``'s top-k branch and ``_compute_loss``), in float32 as
  TRL's ``.float()`` tensors compute.
"""

from __future__ import annotations

import numpy as np

REST_FLOOR = 1e-12


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def gather(values: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return np.take_along_axis(values, ids, axis=-1)


def divergence(logp, rollout_logp, valid, kind: str) -> np.ndarray:
    """``[B, T]`` float64: ``topk_tv`` or ``topk_kl`` (``KL(μ‖π)``), 0 where not valid."""
    valid = np.asarray(valid, bool)
    lp = np.where(valid[..., None], np.asarray(logp, np.float64), 0.0)
    lm = np.where(valid[..., None], np.asarray(rollout_logp, np.float64), 0.0)
    pi, mu = np.exp(lp), np.exp(lm)
    pi_rest = np.maximum(1.0 - pi.sum(-1), REST_FLOOR)
    mu_rest = np.maximum(1.0 - mu.sum(-1), REST_FLOOR)
    if kind == "tv":
        out = 0.5 * (np.abs(pi - mu).sum(-1) + np.abs(pi_rest - mu_rest))
    else:
        with np.errstate(invalid="ignore", divide="ignore"):
            terms = np.where(mu > 0, mu * (np.where(mu > 0, lm, 0.0) - lp), 0.0)
        out = terms.sum(-1) + mu_rest * (np.log(mu_rest) - np.log(pi_rest))
        out = np.maximum(out, 0.0)
    return np.where(valid, out, 0.0)


def trl_support(engine_logits: np.ndarray, sampled: np.ndarray, k: int):
    """TRL's ``A'_t = TopK(μ, K) ∪ {a_t}``: ``(ids, log-probs)`` ``[B, T, K]``; a sampled
    token outside the top ``K`` replaces the ``K``-th entry."""
    lp = log_softmax(engine_logits).astype(np.float32)
    ids = np.argsort(-lp, axis=-1, kind="stable")[..., :k]
    top = gather(lp, ids)
    sampled_lp = gather(lp, sampled[..., None])[..., 0]
    missing = ~(ids == sampled[..., None]).any(-1)
    ids[..., -1] = np.where(missing, sampled, ids[..., -1])
    top[..., -1] = np.where(missing, sampled_lp, top[..., -1])
    return ids, top


def trl_divergence(current_topk_logps, sampling_topk_logps, kind: str) -> np.ndarray:
    """The top-k branch of ``_compute_divergence_mask``, float32 as TRL's tensors."""
    cur = np.asarray(current_topk_logps, np.float32)
    smp = np.asarray(sampling_topk_logps, np.float32)
    current_topk_probs = np.exp(cur)
    rollout_topk_probs = np.exp(smp)
    rollout_rest = np.maximum(np.float32(1.0) - rollout_topk_probs.sum(-1), np.float32(1e-12))
    current_rest = np.maximum(np.float32(1.0) - current_topk_probs.sum(-1), np.float32(1e-12))
    if kind == "tv":
        topk_tv = np.abs(current_topk_probs - rollout_topk_probs).sum(-1)
        rest_tv = np.abs(current_rest - rollout_rest)
        return (topk_tv + rest_tv) / np.float32(2.0)
    topk_kl = (rollout_topk_probs * (smp - cur)).sum(-1)
    rest_kl = rollout_rest * (np.log(rollout_rest) - np.log(current_rest))
    return topk_kl + rest_kl


def trl_divergence_mask(
    per_token_logps, sampling_per_token_logps, advantages, completion_mask, div, eps_low, eps_high
) -> np.ndarray:
    prob = np.exp(np.asarray(per_token_logps, np.float32))
    sampling_prob = np.exp(np.asarray(sampling_per_token_logps, np.float32))
    invalid_pos = (div > eps_high) & (prob > sampling_prob)
    invalid_neg = (div > eps_low) & (prob < sampling_prob)
    mask = np.where(advantages > 0, ~invalid_pos, ~invalid_neg)
    return mask.astype(np.float32) * completion_mask


def trl_loss(logp, sampling_logp, advantages, mask, div, *, eps_low, eps_high, clip_ratio_c):
    """``_compute_loss`` with ``beta = 0``: ``(loss, d loss / d logp)`` (float64 sums of
    the float32 per-token terms; ``advantages`` ``[B, 1]``)."""
    mask = np.asarray(mask, np.float32)
    logp = np.where(mask > 0, logp, 0.0).astype(np.float32)
    sampling_logp = np.where(mask > 0, sampling_logp, 0.0).astype(np.float32)
    log_ratio = logp - sampling_logp
    ratio = np.exp(np.minimum(log_ratio, np.float32(np.log(clip_ratio_c))))
    keep = trl_divergence_mask(logp, sampling_logp, advantages, mask, div, eps_low, eps_high)
    per_token_loss = -advantages * ratio * keep * logp
    normalizer = max(mask.sum(), 1.0)
    loss = (per_token_loss.astype(np.float64) * mask).sum() / normalizer
    grad = -advantages * ratio * keep * mask / normalizer
    return loss, grad, keep
