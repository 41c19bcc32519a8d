"""Independent NumPy oracle for TRL's ``vespo`` / ``luspo`` losses and VAPO's NLL term.

Written from the home systems' code, never importing ``offpolicy_jax``:

* VESPO: TRL ``GRPOTrainer.get_gamma_weights`` and ``_compute_loss``
  (``trl/trainer/grpo_trainer.py``, huggingface/trl f2cd57710ae345ea6428ae95363267fcf38a3dc8);
* LUSPO: the same file, ``loss_type == "luspo"`` with ``importance_sampling_level="sequence"``;
* the positive-example NLL: NeMo-RL ``ClippedPGLossFn`` (``positive_example_nll_weight``,
  ``nemo_rl/algorithms/loss/loss_functions.py``, NVIDIA-NeMo/RL
  7ea279abfbeb698b092856d0dab61e7cf39bc909).

Float64 after casting the inputs to float32 (as ``policy_losses_reference``); the clamp
bounds are the float32 values TRL's float32 tensors compare against. Each returns the
per-token loss and ``vjp(c)`` (``Σ_t c_t ∂ℓ_t/∂θ_u``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from policy_losses_reference import Terms, _f64, _local, _ppo_branches, _theta_hat, _usable

S = 20.0
LOG_W_MIN = float(np.float32(np.log(1e-8)))  # TRL: math.log(1e-8) against a float32 tensor
LAMBDA_MIN = 1e-4


class VESPO(NamedTuple):
    terms: Terms
    phi: np.ndarray  # [B, T]
    clamped: np.ndarray  # [B, T] bool: the sequence log-weight hit a clamp bound


def _mask(valid, mask):
    valid = np.asarray(valid, bool)
    m = valid.astype(np.float64) if mask is None else np.asarray(mask, np.float64)
    return valid, np.where(valid, m, 0.0)


def vespo(theta, d, adv, valid, *, k_pos, lambda_pos, k_neg, lambda_neg, weights=None, mask=None):
    """``ℓ = −φ·A·θ``; ``φ = exp(λ + k·log W − λ·W)``, ``log W`` the clamped sequence sum
    of ``clip(x, ±20)`` (+ ``clip(log w, log 1e-8, 20)``) over the (float) mask."""
    theta, d, adv = _f64(theta, d, adv)
    valid, m = _mask(valid, mask)
    adv = np.where(valid, adv, 0.0)
    _, x = _usable(theta, d, valid)
    summand = np.clip(x, -S, S)
    if weights is not None:
        (w,) = _f64(weights)
        with np.errstate(divide="ignore"):
            summand = summand + np.clip(np.log(np.where(m > 0, w, 1.0)), LOG_W_MIN, S)
    raw = (np.where(m > 0, summand, 0.0) * m).sum(-1, keepdims=True)
    log_w = np.clip(raw, LOG_W_MIN, S)
    nonneg = adv >= 0
    k = np.where(nonneg, k_pos, k_neg)
    lam = np.where(nonneg, max(lambda_pos, LAMBDA_MIN), max(lambda_neg, LAMBDA_MIN))
    with np.errstate(over="ignore", invalid="ignore"):
        phi = np.exp(lam + k * log_w - lam * np.exp(log_w))
    phi = np.where(np.isfinite(phi), phi, 0.0)
    tok_ok, th = _theta_hat(theta, valid)
    clamped = np.broadcast_to((raw < LOG_W_MIN) | (raw > S), theta.shape)
    return VESPO(_local(-phi * adv * th, -phi * adv * tok_ok), phi, clamped)


def luspo(theta, d, adv, valid, *, clip_eps, clip_eps_high, mask=None):
    """``ℓ_t = n·max(−A·s, −A·clip(s))``, ``s = exp(clip(mean x, ±20))``, ``n = Σ m``."""
    theta, d, adv = _f64(theta, d, adv)
    valid, m = _mask(valid, mask)
    adv = np.where(valid, adv, 0.0)
    ok, x = _usable(theta, d, valid)
    n = m.sum(-1, keepdims=True)
    nbar = np.where(n > 0, n, 1.0)
    mean = (x * m).sum(-1, keepdims=True) / nbar
    gate = ((mean >= -S) & (mean <= S)).astype(np.float64)
    s = np.exp(np.clip(mean, -S, S)) * np.ones_like(theta)
    loss, clipped, dlds = _ppo_branches(s, adv, clip_eps, clip_eps_high)
    slope = n * dlds * gate  # ∂ℓ_t / ∂(log s)

    def vjp(c):
        per_seq = (np.asarray(c, np.float64) * slope).sum(-1, keepdims=True)
        return per_seq * ok * m / nbar

    return Terms(n * loss, vjp, clipped)


def positive_nll(theta, rewards, valid):
    """NeMo-RL: ``−θ`` on the tokens of samples with ``rewards > 0``."""
    (theta,) = _f64(theta)
    valid = np.asarray(valid, bool)
    rewards = np.asarray(rewards, np.float64)
    if rewards.ndim == theta.ndim - 1:
        rewards = rewards[..., None]
    with np.errstate(invalid="ignore"):
        positive = np.broadcast_to(rewards > 0, theta.shape)
    tok_ok, th = _theta_hat(theta, valid & positive)
    return _local(-th, -tok_ok.astype(np.float64))
