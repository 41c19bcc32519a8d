"""Policy-gradient surrogates beyond clipped PPO, as pure per-token functions.

Each function takes the current log-probs ``θ`` (the only differentiated input), the
ratio denominator ``d`` (π_old, or π_rollout in bypass mode), the advantages ``A`` and
a bool ``valid`` mask, and returns the per-token loss ``ℓ`` that
:func:`~offpolicy_jax.policy_loss` weights by the correction's IS weights and
aggregates. Where a surrogate needs a per-sequence quantity (GSPO's sequence ratio,
GMPO's geometric mean) the caller computes that sum through the pipeline's layout
(so packed sequences work) and passes it in, broadcastable to ``[..., T]``.

=============  ==============================================================  =========================
name           per-token loss ``ℓ`` (``x = θ − d``, ``r = e^x``)               paper
=============  ==============================================================  =========================
``gspo``       ``max(−A·s, −A·clip(s, 1−ε, 1+ε_h))``, ``s = exp(mean_t x)``     Zheng et al. 2025 (GSPO)
``gspo_token`` same with ``s_t = sg(s)·π_θ/sg(π_θ)``                            Zheng et al. 2025 (GSPO)
``cispo``      ``−sg(clip(r, 1−ε, 1+ε_h))·A·θ``                                MiniMax-M1, 2025
``gmpo``       ``−Ā·exp(mean_t clip_A(x))`` per sequence                       Zhao et al. 2025 (GMPO)
``sapo``       ``−A·(4/τ)·σ(τ(r − 1))``, ``τ = τ_pos`` if ``A > 0`` else τ_neg  Gao et al. 2025 (SAPO)
``gpg``        ``−A·θ``                                                        Chu et al. 2025 (GPG)
``dppo_tv``    ``−A·sg(min(r, C))·θ`` inside the TV trust region, else 0       DPPO, 2026
``dppo_kl``    same with the binary-KL trust region                            DPPO, 2026
``dro``        ``−(A·θ − ½β(θ − d)²)``                                          Kimi k1.5, 2025
``prime_dppo`` ``−[kept]·τ_A·A·r + τ_KL·x²``, kept by the sign of ``A`` and Δp  prime-rl (DPPO + KL), 2026
``ipo``        same, kept iff ``|Δp| ≤ ipo_threshold``                          prime-rl (IPO), 2026
``kpop``       same, kept iff ``max(D_B(π_θ‖π_d), D_B(π_d‖π_θ)) ≤ φ``         prime-rl (KPop), 2026
``two_sided_clip`` ``ppo_clip`` with ``r`` capped at ``δ`` (bounds ``A < 0``)   INTELLECT-2, 2025
``vespo``      ``−sg(φ)·A·θ``, ``φ = W^k·e^{λ(1 − W)}``, ``W = Π_t r_t·w_t``   VESPO, 2026
``luspo``      ``L·max(−A·s, −A·clip(s))``, ``L = Σ_t m'``, ``s`` as GSPO      LUSPO, 2026
``clip_cov``   ``ppo_clip``'s ``ℓ``, 0 on a random few high-covariance tokens   Cui et al. 2025 (Clip-Cov)
``kl_cov``     ``−A·r + [top-k covariance]·β·|x|``                              Cui et al. 2025 (KL-Cov)
=============  ==============================================================  =========================

``dppo_tv`` / ``dppo_kl`` with ``divergence_type="topk_tv"`` / ``"topk_kl"`` (TRL's keys)
run :func:`dppo_topk`: the same loss, the divergence taken over the engine's top-k ids.

Gradients at kinks follow the PyTorch reference (verl): a clamp passes the full
gradient on its closed interval, ties between the clipped and unclipped branch give the
unclipped gradient, and trust-region masks include their boundary. They are written with
``where`` because the JVPs of ``jnp.clip`` / ``jnp.maximum`` split a tie 50/50 (see
:mod:`offpolicy_jax._src.losses.surrogates`). Inputs at positions where ``valid`` is False (or whose
log-ratio is not finite) are replaced before any arithmetic, so NaN/inf garbage there
reaches neither the loss nor its gradient.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from offpolicy_jax._src.correction.binary_kl import bidirectional_binary_kl
from offpolicy_jax._src.correction.ratios import LOG_RATIO_CLAMP
from offpolicy_jax._src.correction.topk_divergence import topk_divergence
from offpolicy_jax._src.losses.registry import SurrogateTerms
from offpolicy_jax._src.losses.surrogates import clamp, ppo_surrogate

GSPO_LOG_RATIO_MAX = 10.0
"""Upper clamp of GSPO's log sequence ratio (verl's numerical guard; no lower clamp)."""

GMPO_LOG_WEIGHT_EPS = 1e-10
"""GMPO folds token IS weights into a geometric mean ``exp(mean log(w + eps))`` (verl)."""

DPPO_KL_EPS = 1e-8
"""Smoothing of ``log((1 − p_old + eps) / (1 − p + eps))`` in DPPO's binary KL (verl)."""

VESPO_LOG_WEIGHT_MIN = math.log(1e-8)
"""Lower clamp of VESPO's log sequence weight, ``log 1e-8`` (TRL; the upper one is 20)."""

VESPO_LAMBDA_MIN = 1e-4
"""TRL floors VESPO's decay ``λ`` at ``1e-4`` (``lambda_seq.clamp(min=1e-4)``)."""

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
K3_MAX = 10.0
"""verl's ``low_var_kl`` clamps the k3 value to ``[−10, 10]`` (it is never negative)."""


def _sg(x):
    return jax.lax.stop_gradient(x)


def safe_log_ratio(logp: jax.Array, denominator_logp: jax.Array, valid: jax.Array) -> jax.Array:
    """``x = θ − d`` where valid and finite, else exactly 0 (also in the gradient).

    Args:
      logp: ``[..., T]`` log π_θ (differentiated).
      denominator_logp: ``[..., T]`` the ratio's denominator ``d``; stop-gradient.
      valid: ``[..., T]`` bool.

    Returns:
      ``[..., T]`` log-ratio ``log(π_θ / π_d)``.
    """
    raw = logp - _sg(denominator_logp)
    return jnp.where(valid & jnp.isfinite(raw), raw, 0.0)


def safe_logp(logp: jax.Array, valid: jax.Array) -> jax.Array:
    """``θ`` where valid and finite, else 0: for the terms linear in ``log π_θ``."""
    return jnp.where(valid & jnp.isfinite(logp), logp, 0.0)


def clamped_ratio(log_ratio: jax.Array) -> jax.Array:
    """``r = exp(clip(x, −S, S))`` with the full gradient on ``[−S, S]`` (``S = 20``)."""
    return jnp.exp(clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _ppo_max(ratio, advantages, clip_eps, clip_eps_high):
    """``max(−r·A, −clip(r)·A)`` with the unclipped gradient at ties; and ``[L2 > L1]``."""
    unclipped = -ratio * advantages
    clipped = -clamp(ratio, 1 - clip_eps, 1 + clip_eps_high) * advantages
    is_clipped = clipped > unclipped
    return jnp.where(is_clipped, clipped, unclipped), is_clipped


# --------------------------------------------------------------------------- GSPO


def gspo(
    logp: jax.Array,
    sequence_log_ratio: jax.Array,
    advantages: jax.Array,
    valid: jax.Array,
    *,
    clip_eps: float,
    clip_eps_high: float,
    token_level: bool = False,
) -> SurrogateTerms:
    """Group Sequence Policy Optimization (Zheng et al., 2025, arXiv:2507.18071).

    GSPO clips one ratio per sequence, the length-normalised sequence likelihood ratio
    ``s_i = (π_θ(y_i)/π_d(y_i))^{1/|y_i|} = exp(mean_t (θ_t − d_t))``:
    ``ℓ_t = max(−A_t·s_i, −A_t·clip(s_i, 1 − ε, 1 + ε_high))``, whose gradient reaches
    every token of the sequence through ``s_i``. GSPO-token (``token_level=True``) uses
    ``s_{i,t} = sg(s_i)·π_θ(y_t)/sg(π_θ(y_t))``: the same value and clipping, but each
    token's gradient is its own (``A_t·s_i·∇θ_t``), so per-token advantages and per-token
    IS weights act per token. With one advantage per sequence and equal token weights the
    two gradients coincide. verl's ``gspo`` loss mode is GSPO-token. The log ratio is
    clamped above at 10 (verl); hyperparameters: ``ε`` (``clip_eps``), ``ε_high``.

    Args:
      logp: ``[..., T]`` log π_θ.
      sequence_log_ratio: ``[..., T]`` or ``[..., 1]``: ``mean_t (θ_t − d_t)`` over the
        sequence's kept tokens (from :func:`safe_log_ratio`, summed through the layout),
        differentiable w.r.t. ``θ``.
      advantages: ``[..., T]``, 0 outside ``valid``; stop-gradient.
      valid: ``[..., T]`` bool.
      clip_eps: ``ε``.
      clip_eps_high: ``ε_high``.
      token_level: GSPO-token instead of GSPO.

    Returns:
      :class:`SurrogateTerms` with ``clipped = [L2 > L1]``.
    """
    advantages = _sg(advantages)
    if token_level:
        theta = safe_logp(logp, valid)
        log_s = theta - _sg(theta) + _sg(sequence_log_ratio)
    else:
        log_s = jnp.broadcast_to(sequence_log_ratio, jnp.shape(logp))
    log_s = jnp.where(log_s > GSPO_LOG_RATIO_MAX, GSPO_LOG_RATIO_MAX, log_s)
    loss, is_clipped = _ppo_max(jnp.exp(log_s), advantages, clip_eps, clip_eps_high)
    return SurrogateTerms(loss, is_clipped)


# --------------------------------------------------------------------------- CISPO


def cispo(
    logp: jax.Array,
    denominator_logp: jax.Array,
    advantages: jax.Array,
    valid: jax.Array,
    *,
    clip_eps: float,
    clip_eps_high: float,
) -> SurrogateTerms:
    """Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv:2506.13585).

    ``ℓ = −sg(clip(r, 1 − ε, 1 + ε_high))·A·log π_θ`` with ``r = exp(clip(θ − d, −20, 20))``:
    the ratio only weights the REINFORCE gradient ``−w·A·∇θ``, so no token's gradient is
    ever dropped by clipping (unlike PPO). ``clipped = [clip(r) ≠ r]`` (verl's
    ``pg_clipfrac``). Hyperparameters: ``ε`` (``clip_eps``), ``ε_high``.

    The reported loss (``pg_loss``) is not an objective that training lowers: with the
    weight stop-gradient, only its gradient is meaningful, and its value scales with
    ``log π_θ`` of the sampled tokens, which goes to 0 as the policy sharpens. It can
    rise while the reward improves (in a 200-step demo run its mean went from −0.12 over
    steps 120–160 to −0.06 over steps 160–200 while the reward rose from 0.70 to 0.88;
    docs/demo.md has the command); monitor the reward, not ``pg_loss``.

    Args: as :func:`dppo`, without the trust-region parameters.

    Returns:
      :class:`SurrogateTerms`.
    """
    ratio = clamped_ratio(_sg(safe_log_ratio(logp, denominator_logp, valid)))
    weight = clamp(ratio, 1 - clip_eps, 1 + clip_eps_high)
    loss = -weight * _sg(advantages) * safe_logp(logp, valid)
    return SurrogateTerms(loss, weight != ratio)


# --------------------------------------------------------------------------- GMPO


def gmpo_token_log_ratio(
    logp: jax.Array,
    denominator_logp: jax.Array,
    advantages: jax.Array,
    valid: jax.Array,
    *,
    clip_eps: float,
    clip_eps_high: float,
) -> SurrogateTerms:
    """GMPO's per-token clipped log-ratio ``x̃_t`` (the ``loss`` field of the result).

    ``x̃ = sgn(A)·min(sgn(A)·x, sgn(A)·clip(x, −ε, ε_high))`` with ``x = θ − d``: for
    ``A > 0`` the log-ratio is capped at ``ε_high``, for ``A < 0`` floored at ``−ε``, and
    ``A = 0`` contributes 0. Unlike PPO the bounds are in log space (the GMPO paper
    uses ``ε = ε_high = 0.4``). ``clipped = [x ≠ clip(x)] ∧ A > 0`` and
    ``clipped_lower = [x ≠ clip(x)] ∧ A < 0`` (verl's metrics).

    Returns:
      :class:`SurrogateTerms` whose ``loss`` is ``x̃`` (to be averaged per sequence by
      the caller and passed to :func:`gmpo_sequence_loss`).
    """
    x = safe_log_ratio(logp, denominator_logp, valid)
    advantages = _sg(advantages)
    positive, negative = advantages > 0, advantages < 0
    capped = jnp.where(positive & (x > clip_eps_high), clip_eps_high, x)
    floored = jnp.where(negative & (capped < -clip_eps), -clip_eps, capped)
    clipped_log_ratio = jnp.where(positive | negative, floored, 0.0)
    outside = (x > clip_eps_high) | (x < -clip_eps)
    return SurrogateTerms(clipped_log_ratio, outside & positive, outside & negative)


def gmpo_sequence_loss(
    mean_clipped_log_ratio: jax.Array,
    mean_advantage: jax.Array,
    mean_log_weight: jax.Array | None = None,
) -> jax.Array:
    """Geometric-Mean Policy Optimization (Zhao et al., 2025, arXiv:2507.20673), per sequence.

    ``L_i = −Ā_i · exp(mean_t x̃_t) · exp(mean_t log(w_t + 1e-10))``: the geometric mean of
    the clipped token ratios times the sequence's mean advantage, and (with rollout
    correction) the geometric mean of its token IS weights, as verl folds them in. The
    mean log-ratio is clamped to ``[−20, 20]`` so that the value stays finite.

    Args:
      mean_clipped_log_ratio: ``[...]``-broadcastable ``mean_t x̃_t`` over the sequence's
        kept tokens (:func:`gmpo_token_log_ratio`), differentiable.
      mean_advantage: ``mean_t A_t`` over the same tokens; stop-gradient.
      mean_log_weight: ``mean_t log(w_t + 1e-10)`` of the IS weights, or None.

    Returns:
      The per-sequence loss ``L_i`` (same shape as the inputs).
    """
    log_ratio = clamp(mean_clipped_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if mean_log_weight is not None:
        log_ratio = log_ratio + _sg(mean_log_weight)
    return -_sg(mean_advantage) * jnp.exp(log_ratio)


def gmpo_log_weight(weights: jax.Array) -> jax.Array:
    """``log(w + 1e-10)`` of (stop-gradient) IS weights, GMPO's geometric-mean summand."""
    return jnp.log(_sg(weights) + GMPO_LOG_WEIGHT_EPS)


# --------------------------------------------------------------------------- SAPO


def sapo(
    logp: jax.Array,
    denominator_logp: jax.Array,
    advantages: jax.Array,
    valid: jax.Array,
    *,
    tau_pos: float,
    tau_neg: float,
) -> SurrogateTerms:
    """Soft Adaptive Policy Optimization (Gao et al., 2025, arXiv:2511.20347).

    A smooth gate replaces the hard clip: ``ℓ = −A·f_τ(r)`` with
    ``f_τ(r) = (4/τ)·σ(τ(r − 1))`` and ``τ = τ_pos`` where ``A > 0``, ``τ_neg`` elsewhere
    (``τ_neg > τ_pos`` damps negative updates faster). At ``r = 1`` the gradient is the
    on-policy ``−A·∇θ``; it decays smoothly as ``r`` leaves 1. ``r = exp(clip(θ − d,
    −20, 20))``. Hyperparameters ``tau_pos``, ``tau_neg`` (verl defaults 1.0, 1.05).

    Returns:
      :class:`SurrogateTerms` (no clip fractions).
    """
    advantages = _sg(advantages)
    ratio = clamped_ratio(safe_log_ratio(logp, denominator_logp, valid))
    tau = jnp.where(advantages > 0, tau_pos, tau_neg)
    gate = jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return SurrogateTerms(-gate * advantages)


# --------------------------------------------------------------------------- GPG


def gpg(logp: jax.Array, advantages: jax.Array, valid: jax.Array) -> SurrogateTerms:
    """Group Policy Gradient (Chu et al., 2025; github.com/AMAP-ML/GPG): ``ℓ = −A·log π_θ``.

    Plain REINFORCE with group-normalised advantages: no ratio, no clipping, no KL. IS
    weights of a correction multiply it like every other surrogate.
    """
    return SurrogateTerms(-_sg(advantages) * safe_logp(logp, valid))


# --------------------------------------------------------------------------- DPPO


def dppo(
    logp: jax.Array,
    denominator_logp: jax.Array,
    advantages: jax.Array,
    valid: jax.Array,
    *,
    divergence: str,
    clip_eps: float,
    clip_eps_high: float,
    ratio_cap: float | None,
) -> SurrogateTerms:
    """Divergence PPO, binary TV / binary KL trust region (arXiv:2602.04879).

    ``ℓ = −A·sg(min(r, C))·log π_θ·[token inside the trust region]``: a truncated-IS
    policy gradient that drops a token once the policy moved too far *in the direction
    its advantage pushes*. With ``p = π_θ``, ``q = π_d`` (probabilities of the sampled
    token):

    * ``divergence="tv"``: inside iff ``p − q ≤ δ_high`` (``A > 0``) or ``p − q ≥ −δ``
      (``A ≤ 0``);
    * ``divergence="kl"``: ``KL = q·log(q/p) + (1 − q)·log((1 − q + 1e-8)/(1 − p + 1e-8))``;
      inside iff ``KL ≤ δ_high ∨ p ≤ q`` (``A > 0``) or ``KL ≤ δ ∨ p ≥ q`` (``A ≤ 0``).

    The thresholds ``δ = clip_eps``, ``δ_high = clip_eps_high`` are divergences, not
    ratio ranges; ``C = ratio_cap`` (verl's ``clip_ratio_c``) truncates the stop-gradient
    ratio ``r = exp(clip(θ − d, −20, 20))``, None for no truncation.
    ``clipped = [outside]`` (``pg_clipfrac``), ``clipped_lower = [r > C] ∧ inside``.

    Args:
      logp: ``[..., T]`` log π_θ.
      denominator_logp: ``[..., T]`` log π_d; stop-gradient.
      advantages: ``[..., T]``, 0 outside ``valid``; stop-gradient.
      valid: ``[..., T]`` bool.
      divergence: ``"tv"`` or ``"kl"``.
      clip_eps: ``δ``.
      clip_eps_high: ``δ_high``.
      ratio_cap: ``C`` or None.

    Returns:
      :class:`SurrogateTerms`.
    """
    theta, old, ratio = _dppo_inputs(logp, denominator_logp, valid)
    p, q = jnp.exp(theta), jnp.exp(old)
    positive = _sg(advantages) > 0
    if divergence == "tv":
        inside = jnp.where(positive, p - q <= clip_eps_high, p - q >= -clip_eps)
    elif divergence == "kl":
        binary_kl = q * (old - theta) + (1 - q) * jnp.log(
            (1.0 - q + DPPO_KL_EPS) / (1.0 - p + DPPO_KL_EPS)
        )
        inside = _dppo_region(binary_kl, p, q, positive, clip_eps, clip_eps_high)
    else:
        raise ValueError(f"divergence must be 'tv' or 'kl', got {divergence!r}")
    return _dppo_terms(logp, advantages, valid, ratio, inside, ratio_cap)


def _dppo_inputs(logp, denominator_logp, valid) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(θ, d, r)`` stop-gradient, 0 where not usable, and ``r = exp(clip(θ − d, ±20))``."""
    theta, old = _sg(logp), _sg(denominator_logp)
    usable = valid & jnp.isfinite(theta - old)
    # p and q from θ and d themselves (not from θ − x): the region's boundary is then
    # decided on the same float32 values as in verl.
    theta, old = jnp.where(usable, theta, 0.0), jnp.where(usable, old, 0.0)
    return theta, old, clamped_ratio(theta - old)


def _dppo_region(divergence, p, q, positive, clip_eps, clip_eps_high) -> jax.Array:
    """Inside iff ``D ≤ δ_high ∨ p ≤ q`` (``A > 0``) or ``D ≤ δ ∨ p ≥ q`` (``A ≤ 0``): a
    token leaves only when the policy moved past ``δ`` the way its advantage pushes."""
    return jnp.where(
        positive,
        (divergence <= clip_eps_high) | (p <= q),
        (divergence <= clip_eps) | (p >= q),
    )


def _dppo_terms(logp, advantages, valid, ratio, inside, ratio_cap) -> SurrogateTerms:
    weight = ratio if ratio_cap is None else jnp.minimum(ratio, ratio_cap)
    loss = jnp.where(inside, -_sg(advantages) * weight * safe_logp(logp, valid), 0.0)
    capped = jnp.zeros_like(inside) if ratio_cap is None else (ratio > ratio_cap) & inside
    return SurrogateTerms(loss, ~inside, capped)


def dppo_topk(
    logp: jax.Array,
    denominator_logp: jax.Array,
    advantages: jax.Array,
    valid: jax.Array,
    topk_logp: jax.Array,
    topk_rollout_logp: jax.Array,
    *,
    divergence: str,
    clip_eps: float,
    clip_eps_high: float,
    ratio_cap: float | None,
) -> SurrogateTerms:
    """Divergence PPO with the top-k TV / KL trust region (arXiv:2602.04879; TRL's DPPO).

    As :func:`dppo`, with the divergence ``D`` estimated over the engine's top-k ids
    plus a rest bucket (:func:`~offpolicy_jax._src.correction.topk_divergence.topk_divergence`,
    ``topk_tv`` or ``topk_kl = KL(μ‖π)``) instead of the sampled token alone; the
    direction still comes from the sampled token's ``p = π_θ``, ``q = π_d``::

        inside = D ≤ δ_high ∨ p ≤ q   (A > 0)
        inside = D ≤ δ      ∨ p ≥ q   (A ≤ 0)

    which is TRL's ``DPPOTrainer._compute_divergence_mask`` (``divergence_type="topk_tv"
    | "topk_kl"``; TRL's ``π_d`` is the rollout policy, ``algorithm="bypass_ppo"`` here).
    ``ℓ = −A·sg(min(r, C))·log π_θ`` inside, else 0; ``clipped = [outside]``,
    ``clipped_lower = [r > C] ∧ inside``.

    Args:
      logp, denominator_logp, advantages, valid: as :func:`dppo`.
      topk_logp: ``[..., T, K]`` the trainer's log-probs on the engine's top-k ids;
        stop-gradient.
      topk_rollout_logp: ``[..., T, K]`` the engine's log-probs on them; stop-gradient.
      divergence: ``"tv"`` or ``"kl"``.
      clip_eps, clip_eps_high, ratio_cap: ``δ``, ``δ_high``, ``C`` as :func:`dppo`.

    Returns:
      :class:`SurrogateTerms`.
    """
    d = topk_divergence(_sg(topk_logp), _sg(topk_rollout_logp), valid, divergence=divergence)
    return dppo_divergence_region(
        logp,
        denominator_logp,
        advantages,
        valid,
        d,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        ratio_cap=ratio_cap,
    )


def dppo_divergence_region(
    logp: jax.Array,
    denominator_logp: jax.Array,
    advantages: jax.Array,
    valid: jax.Array,
    divergence: jax.Array,
    *,
    clip_eps: float,
    clip_eps_high: float,
    ratio_cap: float | None,
) -> SurrogateTerms:
    """:func:`dppo_topk` with the per-token divergence ``D`` (``[..., T]``, stop-gradient)
    given: the region and the loss of any divergence estimate."""
    theta, old, ratio = _dppo_inputs(logp, denominator_logp, valid)
    p, q = jnp.exp(theta), jnp.exp(old)
    d = _sg(divergence)
    inside = _dppo_region(d, p, q, _sg(advantages) > 0, clip_eps, clip_eps_high)
    return _dppo_terms(logp, advantages, valid, ratio, inside, ratio_cap)


# --------------------------------------------------------------------------- DRO


def dro(
    logp: jax.Array,
    denominator_logp: jax.Array,
    advantages: jax.Array,
    valid: jax.Array,
    *,
    beta: float,
) -> SurrogateTerms:
    """DRO: REINFORCE with a quadratic log-ratio penalty (Kimi k1.5).

    ``ℓ = −(A·log π_θ − ½·β·(θ − d)²)``: REINFORCE plus a squared-log-ratio penalty that
    keeps ``π_θ`` near ``π_d``: the squared-log-ratio regularised policy-mirror-descent
    surrogate of Kimi k1.5 (Kimi Team, 2025, arXiv:2501.12599), as verl's and Tinker's
    ``dro`` loss.
    Gradient ``−A + β(θ − d)``. Hyperparameter ``β`` (``dro_beta``).
    """
    x = safe_log_ratio(logp, denominator_logp, valid)
    return SurrogateTerms(-(_sg(advantages) * safe_logp(logp, valid) - 0.5 * beta * x * x))


# --------------------------------------------------------------------------- VESPO


def vespo_log_weight_terms(log_ratio: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """Per-token summands of VESPO's log sequence weight ``log W`` (stop-gradient).

    ``clip(x_t, −20, 20) + clip(log w_t, log 1e-8, 20)``: the log-ratio ``x = θ − d``
    and, with rollout correction, the log of the token IS weight ``w = π_old/π_rollout``
    (truncated or normalised by the correction), as TRL folds its vLLM importance
    sampling ratio into the sequence weight. Summed over a sequence's kept tokens
    (through the layout) they give ``log W`` for :func:`vespo`.

    Args:
      log_ratio: ``[..., T]`` ``x`` (0 where not valid, :func:`safe_log_ratio`).
      weights: ``[..., T]`` IS weights, 1 where not kept (``log 1 = 0``), or None.

    Returns:
      ``[..., T]`` summands (stop-gradient).
    """
    terms = jnp.clip(_sg(log_ratio), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if weights is None:
        return terms
    # log 0 = −inf is clamped to log 1e-8: a zero weight all but zeroes φ, as in TRL.
    log_w = jnp.clip(jnp.log(_sg(weights)), VESPO_LOG_WEIGHT_MIN, LOG_RATIO_CLAMP)
    return terms + log_w


class VESPOTerms(NamedTuple):
    """Per-token outputs of :func:`vespo`, all ``[..., T]``."""

    loss: jax.Array  # −sg(φ)·A·θ
    phi: jax.Array  # the Gamma weight φ (stop-gradient; 0 where it is not finite)
    clamped: jax.Array  # bool: log W was outside [log 1e-8, 20] and clamped


def vespo(
    logp: jax.Array,
    sequence_log_weight: jax.Array,
    advantages: jax.Array,
    valid: jax.Array,
    *,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
) -> VESPOTerms:
    """Variational Sequence-Level Soft Policy Optimization (VESPO, arXiv:2602.10693).

    A smooth, asymmetric Gamma kernel of the *sequence* importance weight replaces the
    hard clip: ``ℓ_t = −sg(φ_t)·A_t·log π_θ(y_t)``, with
    ``φ(W) = W^k·e^{λ(1 − W)} = exp(λ + k·log W − λ·W)`` (``φ(1) = 1``, maximal at
    ``W = k/λ``; ``k`` damps small weights, ``λ`` large ones). ``W`` is the product of
    the sequence's token ratios (not GSPO's geometric mean): ``log W = clip(Σ_t
    [clip(x_t, −20, 20) + clip(log w_t, log 1e-8, 20)], log 1e-8, 20)``
    (:func:`vespo_log_weight_terms`). ``(k, λ) = (k_pos, λ_pos)`` where ``A_t ≥ 0``,
    ``(k_neg, λ_neg)`` where ``A_t < 0``; ``λ`` is floored at ``1e-4`` and a
    non-finite ``φ`` (overflow) is 0, as in TRL's ``get_gamma_weights``
    (``trl/trainer/grpo_trainer.py``). ``φ`` carries no gradient: the gradient is the
    reweighted REINFORCE ``−φ·A·∇θ``, and the value, like CISPO's, is not an objective.

    Args:
      logp: ``[..., T]`` log π_θ (differentiated).
      sequence_log_weight: ``[..., T]`` or ``[..., 1]`` the sequence's ``Σ_t`` of
        :func:`vespo_log_weight_terms` over its kept tokens, unclamped.
      advantages: ``[..., T]``, 0 outside ``valid``; stop-gradient.
      valid: ``[..., T]`` bool.
      k_pos, lambda_pos: ``k`` and ``λ`` for ``A ≥ 0`` (TRL: 2.0, 3.0).
      k_neg, lambda_neg: ``k`` and ``λ`` for ``A < 0`` (TRL: 3.0, 2.0).

    Returns:
      :class:`VESPOTerms`.
    """
    advantages = _sg(advantages)
    raw = jnp.broadcast_to(_sg(sequence_log_weight), jnp.shape(logp))
    log_w = jnp.clip(raw, VESPO_LOG_WEIGHT_MIN, LOG_RATIO_CLAMP)
    nonnegative = advantages >= 0
    k = jnp.where(nonnegative, k_pos, k_neg)
    lam = jnp.where(
        nonnegative, max(lambda_pos, VESPO_LAMBDA_MIN), max(lambda_neg, VESPO_LAMBDA_MIN)
    )
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    phi = jnp.where(jnp.isfinite(phi), phi, 0.0)
    loss = -phi * advantages * safe_logp(logp, valid)
    clamped = (raw < VESPO_LOG_WEIGHT_MIN) | (raw > LOG_RATIO_CLAMP)
    return VESPOTerms(loss, phi, clamped)


# --------------------------------------------------------------------------- LUSPO


def luspo(
    logp: jax.Array,
    sequence_log_ratio: jax.Array,
    sequence_length: jax.Array,
    advantages: jax.Array,
    valid: jax.Array,
    *,
    clip_eps: float,
    clip_eps_high: float,
) -> SurrogateTerms:
    """Length-Unbiased Sequence Policy Optimization (LUSPO, arXiv:2602.05261).

    GSPO's sequence objective scaled by the sequence's length ``|y_i|``:
    ``ℓ_t = |y_i|·max(−A_t·s_i, −A_t·clip(s_i, 1 − ε, 1 + ε_high))`` with
    ``s_i = exp(clip(mean_t x_t, −20, 20))`` (the gradient reaches every token through
    the mean). Averaged once per sequence (``aggregation="sequence_mean"`` or
    ``"row_mean"``) this is TRL's ``loss_type="luspo"``
    (``(per_token_loss * mask.sum(1)).mean()``): each token's gradient is
    ``−A·s_i·∇θ_t``, undivided by the length, which removes GSPO's bias against long
    responses. TRL does not clamp ``mean_t x`` (the ±20 clamp here only keeps ``s``
    finite). Hyperparameters: ``ε`` (``clip_eps``), ``ε_high`` (the paper uses
    2e-3 and 2.5e-3).

    Args:
      logp: ``[..., T]`` log π_θ (sets the shape).
      sequence_log_ratio: ``[..., T]`` or ``[..., 1]``: ``mean_t x_t`` over the
        sequence's kept tokens, differentiable w.r.t. ``θ``.
      sequence_length: ``[..., T]`` or ``[..., 1]``: ``|y_i| = Σ_t m'_t``.
      advantages: ``[..., T]``, 0 outside ``valid``; stop-gradient.
      valid: ``[..., T]`` bool.
      clip_eps: ``ε``.
      clip_eps_high: ``ε_high``.

    Returns:
      :class:`SurrogateTerms` with ``clipped = [L2 > L1]``.
    """
    del valid  # the caller's mean and length cover only the kept tokens
    log_s = jnp.broadcast_to(sequence_log_ratio, jnp.shape(logp))
    loss, is_clipped = _ppo_max(clamped_ratio(log_s), _sg(advantages), clip_eps, clip_eps_high)
    return SurrogateTerms(_sg(sequence_length) * loss, is_clipped)


# --------------------------------------------------------------------------- VAPO NLL


def positive_example_nll(logp: jax.Array, positive: jax.Array, valid: jax.Array) -> jax.Array:
    """VAPO's positive-example NLL per token (arXiv:2504.05118, Eq. 10): ``−log π_θ``
    on the tokens of positively rewarded sequences, 0 elsewhere.

    ``L = L_PPO + μ·L_NLL``: behaviour cloning on the correct samples. NeMo-RL's
    ``positive_example_nll_weight`` (``nemo_rl/algorithms/loss/loss_functions.py``)
    selects them by ``rewards > 0``.

    Args:
      logp: ``[..., T]`` log π_θ (differentiated).
      positive: ``[..., T]`` (or broadcastable) bool: the token's sequence has
        ``reward > 0``.
      valid: ``[..., T]`` bool.

    Returns:
      ``[..., T]`` ``−θ`` where valid and positive (and ``θ`` finite), else 0.
    """
    return -safe_logp(logp, valid & positive)


# --------------------------------------------------------------------------- prime-rl


class ProbabilityMasks(NamedTuple):
    """prime-rl's per-token loss and the masks it reports (bool ``[..., T]``).

    ``masked`` drops the token's policy-gradient term; ``masked_high`` / ``masked_low``
    are the shares prime-rl logs as ``is_masked_high`` / ``is_masked_low`` (None for
    IPO, which logs only ``is_masked``).
    """

    loss: jax.Array
    masked: jax.Array
    masked_high: jax.Array | None = None
    masked_low: jax.Array | None = None


def probability_difference(
    logp: jax.Array, denominator_logp: jax.Array, valid: jax.Array
) -> jax.Array:
    """``Δp = e^θ − e^d``, prime-rl's ``probs_diff`` (stop-gradient; 0 where unusable).

    The probabilities are taken of ``θ`` and ``d`` themselves (not of ``θ − x``), so a
    token exactly at a threshold is decided on the same float32 values as in prime-rl.
    """
    theta, d = _sg(logp), _sg(denominator_logp)
    usable = valid & jnp.isfinite(theta - d)
    return jnp.exp(jnp.where(usable, theta, 0.0)) - jnp.exp(jnp.where(usable, d, 0.0))


def _masked_ratio_loss(logp, denominator_logp, advantages, valid, masked, adv_tau, kl_tau):
    """``−[¬masked]·τ_A·A·r + τ_KL·x²`` with the differentiable ``r = exp(clip(x, −S, S))``."""
    x = safe_log_ratio(logp, denominator_logp, valid)
    policy_term = jnp.where(masked, 0.0, adv_tau * _sg(advantages) * clamped_ratio(x))
    return -policy_term + kl_tau * x * x


def prime_dppo(
    logp: jax.Array,
    denominator_logp: jax.Array,
    advantages: jax.Array,
    valid: jax.Array,
    *,
    dppo_mask_low: float,
    dppo_mask_high: float,
    adv_tau: float,
    kl_tau: float,
) -> ProbabilityMasks:
    """prime-rl's default loss: a DPPO binary-TV mask plus a squared-log-ratio KL term.

    ``ℓ = −[kept]·τ_A·A·r + τ_KL·x²`` with ``x = θ − d``, ``r = e^x`` differentiable
    (the policy term's gradient ``−τ_A·A·r·∇θ`` is DPPO's ``−A·sg(r)·∇θ``, scaled) and
    ``Δp = e^θ − e^d`` (:func:`probability_difference`). The mask follows the
    advantage's sign (DPPO binary TV, arXiv:2602.04879): a token is dropped where ``A > 0`` and
    ``Δp > δ_high`` (its probability rose too far) or where ``A ≤ 0`` and
    ``Δp < −δ_low`` (it fell too far); a token exactly at a threshold is kept. The KL
    term (Kimi K2.5, arXiv:2602.02276) applies to every token, dropped ones included,
    with gradient ``2·τ_KL·x·∇θ``. prime-rl compares the trainer with the inference
    engine, ``d = π_rollout``: ``algorithm="bypass_ppo"``
    (prime-rl ``src/prime_rl/trainer/rl/loss.py::default_loss_fn``, since commit
    ff4b125e4, 2026-04-06).

    Args:
      logp: ``[..., T]`` log π_θ (differentiated).
      denominator_logp: ``[..., T]`` log π_d (π_rollout in prime-rl); stop-gradient.
      advantages: ``[..., T]``, 0 outside ``valid``; stop-gradient.
      valid: ``[..., T]`` bool.
      dppo_mask_low: ``δ_low ≥ 0``.
      dppo_mask_high: ``δ_high ≥ 0``.
      adv_tau: ``τ_A ≥ 0``, the policy-gradient term's coefficient.
      kl_tau: ``τ_KL ≥ 0``, the KL term's coefficient.

    Returns:
      :class:`ProbabilityMasks`: ``masked = [Δp > δ_high]`` where ``A > 0`` else
      ``[Δp < −δ_low]`` (so an ``A = 0`` token can count, as in prime-rl, although
      its policy term is 0 anyway), ``masked_high = [A > 0 ∧ Δp > δ_high]``,
      ``masked_low = [A < 0 ∧ Δp < −δ_low]``.
    """
    advantages = _sg(advantages)
    gap = probability_difference(logp, denominator_logp, valid)
    high, low = gap > dppo_mask_high, gap < -dppo_mask_low
    positive = advantages > 0
    masked = jnp.where(positive, high, low)
    loss = _masked_ratio_loss(logp, denominator_logp, advantages, valid, masked, adv_tau, kl_tau)
    return ProbabilityMasks(loss, masked, positive & high, (advantages < 0) & low)


def ipo(
    logp: jax.Array,
    denominator_logp: jax.Array,
    advantages: jax.Array,
    valid: jax.Array,
    *,
    ipo_threshold: float,
    adv_tau: float,
    kl_tau: float,
) -> ProbabilityMasks:
    """prime-rl's IPO loss (INTELLECT Policy Optimization): a symmetric trust region.

    As :func:`prime_dppo`, but a token is dropped wherever ``|Δp| > ipo_threshold``,
    whatever the advantage's sign (prime-rl's reason: an asynchronous run takes one step
    per batch, so the advantage's sign predicts the update's direction poorly). prime-rl
    ``src/prime_rl/trainer/rl/loss.py::ipo_loss_fn``, ``type = "ipo"`` (commit
    77af03753, 2026-06-14). From 2026-03-03 to 2026-04-06 IPO was prime-rl's default,
    then with two thresholds (``ipo_mask_low`` / ``ipo_mask_high``, 0.2 each) instead of
    one.

    Args: as :func:`prime_dppo`, with ``ipo_threshold ≥ 0`` for the two thresholds.

    Returns:
      :class:`ProbabilityMasks` with ``masked = [|Δp| > ipo_threshold]``.
    """
    gap = probability_difference(logp, denominator_logp, valid)
    masked = jnp.abs(gap) > ipo_threshold
    loss = _masked_ratio_loss(logp, denominator_logp, advantages, valid, masked, adv_tau, kl_tau)
    return ProbabilityMasks(loss, masked)


def kpop(
    logp: jax.Array,
    denominator_logp: jax.Array,
    advantages: jax.Array,
    valid: jax.Array,
    *,
    kpop_threshold: float,
    adv_tau: float,
    kl_tau: float,
) -> ProbabilityMasks:
    """prime-rl's KPop loss: IPO's loss with KPop's binary-KL trust region.

    KPop (Guo et al., Ant Group, 2026, https://ringtech.notion.site/kpop) treats the
    sampled token as a Bernoulli event (this token against the rest of the vocabulary)
    and drops its policy term where the binary KL between the trainer's probability
    ``p = e^θ`` and the denominator's ``q = e^d`` exceeds φ in either direction:

        D_B(p‖q) = p·log(p/q) + (1 − p)·log((1 − p)/(1 − q)),
        kept  ⟺  D_B(p‖q) ≤ φ  and  D_B(q‖p) ≤ φ,

    with both probabilities clamped to ``[1e-6, 1 − 1e-6]`` in float32
    (:func:`~offpolicy_jax._src.correction.binary_kl.bidirectional_binary_kl`); a token
    exactly at φ is kept. Tight for confident tokens, loose (in ratio terms) for rare
    ones, where :func:`ipo`'s ``|Δp|`` band is the same width everywhere. The rest is
    :func:`ipo`'s: ``ℓ = −[kept]·τ_A·A·r + τ_KL·x²``, the unclipped ratio on the kept
    tokens and the squared-log-ratio term on every token. prime-rl PR 3283 (open,
    ``kpop_loss_fn`` in ``src/prime_rl/trainer/rl/loss.py``, ``type = "kpop"``), where
    ``d`` is the inference engine's log-prob: ``algorithm="bypass_ppo"``.

    Args: as :func:`prime_dppo`, with ``kpop_threshold`` (φ ``≥ 0``; prime-rl's and the
      paper's default 0.1).

    Returns:
      :class:`ProbabilityMasks` with ``masked = [max(D_B(p‖q), D_B(q‖p)) > φ]``.
    """
    theta, d = _sg(logp), _sg(denominator_logp)
    usable = valid & jnp.isfinite(theta - d)
    divergence = bidirectional_binary_kl(jnp.where(usable, theta, 0.0), jnp.where(usable, d, 0.0))
    masked = divergence > kpop_threshold
    loss = _masked_ratio_loss(logp, denominator_logp, advantages, valid, masked, adv_tau, kl_tau)
    return ProbabilityMasks(loss, masked)


def two_sided_clip(
    logp: jax.Array,
    denominator_logp: jax.Array,
    advantages: jax.Array,
    valid: jax.Array,
    *,
    clip_eps: float,
    clip_eps_high: float,
    delta: float,
) -> SurrogateTerms:
    """INTELLECT-2's two-sided GRPO clipping (arXiv:2505.07291, §4.1).

    PPO's clipped surrogate on the ratio capped at ``δ``: ``c = min(r, δ)``,
    ``ℓ = max(−c·A, −clip(c, 1 − ε, 1 + ε_high)·A)``. For ``A < 0`` the loss is then
    bounded by ``δ·|A|`` (with zero gradient beyond ``r = δ``): a token the policy now
    favours far more than the sampler did can no longer produce an unbounded update.
    For ``δ > 1 + ε_high`` (required by the config) the positive-advantage side is
    PPO's, and the whole is PPO's dual clip with ``c = δ`` (Ye et al. 2020), which is
    how it is computed (:func:`~offpolicy_jax.ppo_surrogate`). prime-rl at the
    INTELLECT-2 run: ``src/zeroband/training/loss.py::grpo_loss``, key
    ``clamp_log_prob_coef = 4.0`` (commit 35948297f, 2025-05-07); ``clip_ratio`` in its
    later ``ClippingLossConfig``; TRL's ``GRPOConfig.delta``.

    Args:
      logp, denominator_logp, advantages, valid: as :func:`dppo`.
      clip_eps: ``ε``.
      clip_eps_high: ``ε_high``.
      delta: ``δ > 1 + ε_high``.

    Returns:
      :class:`SurrogateTerms`: ``clipped = [L2 > L1]`` (INTELLECT-2's ``clip_ratio``
      metric), ``clipped_lower = [A < 0 ∧ r > δ]`` (the bound binds).
    """
    terms = ppo_surrogate(
        logp,
        denominator_logp,
        advantages,
        where=valid,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        dual_clip_c=delta,
    )
    return SurrogateTerms(terms.loss, terms.clipped, terms.clipped_lower)


# --------------------------------------------------------------------------- Clip-Cov, KL-Cov


def clip_cov(
    logp: jax.Array,
    denominator_logp: jax.Array,
    advantages: jax.Array,
    valid: jax.Array,
    selected: jax.Array,
    *,
    clip_eps: float,
    clip_eps_high: float,
) -> SurrogateTerms:
    """Clip-Cov (Cui et al. 2025, arXiv:2505.22617, §4): PPO without the selected tokens.

    ``ℓ = [t ∉ S]·max(−r·A, −clip(r, 1 − ε, 1 + ε_high)·A)``: the clipped PPO loss, set
    to 0 (value and gradient) on the selected tokens ``S``, a few chosen at random
    among the unclipped tokens whose covariance ``(A − Ā)(θ − θ̄)`` lies in
    ``(lb, ub)``; the selection is :func:`offpolicy_jax._src.losses.covariance.select_random`.
    The selected tokens stay in the aggregation's denominator, as in verl
    (``compute_policy_loss_clip_cov``, ``verl/trainer/ppo/core_algos.py``; the loss is
    multiplied by ``corr = 0``).

    Args:
      logp, denominator_logp, advantages, valid: as :func:`dppo`.
      selected: ``[..., T]`` bool, ``S``.
      clip_eps: ``ε``.
      clip_eps_high: ``ε_high``.

    Returns:
      :class:`SurrogateTerms`: ``clipped = S`` (verl's ``pg_clipfrac`` of this loss,
      the share of tokens with ``corr = 0``).
    """
    terms = ppo_surrogate(
        logp,
        denominator_logp,
        advantages,
        where=valid,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
    )
    return SurrogateTerms(jnp.where(selected, 0.0, terms.loss), selected & valid)


def kl_cov(
    logp: jax.Array,
    denominator_logp: jax.Array,
    advantages: jax.Array,
    valid: jax.Array,
    selected: jax.Array,
    *,
    ppo_kl_coef: float,
) -> SurrogateTerms:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617, §4): a KL penalty on the top tokens.

    ``ℓ = −r·A + [t ∈ S]·β·|x|`` with ``x = θ − d``, ``r = exp(clip(x, −20, 20))``,
    ``β`` = ``ppo_kl_coef`` and ``S`` the ``k`` tokens of largest covariance
    ``(A − Ā)(θ − θ̄)`` (:func:`offpolicy_jax._src.losses.covariance.select_top`). No ratio
    clipping. ``|x|`` has gradient ``sign(x)`` (0 at ``x = 0``, as ``torch.abs``).
    verl: ``compute_policy_loss_kl_cov``, ``verl/trainer/ppo/core_algos.py``.

    Args:
      logp, denominator_logp, advantages, valid: as :func:`dppo`.
      selected: ``[..., T]`` bool, ``S``.
      ppo_kl_coef: ``β``.

    Returns:
      :class:`SurrogateTerms` (no clipped indicator).
    """
    log_ratio = safe_log_ratio(logp, denominator_logp, valid)
    absolute = jnp.sign(log_ratio) * log_ratio  # d|x|/dx = sign(x): 0 at x = 0
    penalty = jnp.where(selected & valid, ppo_kl_coef * absolute, 0.0)
    return SurrogateTerms(-clamped_ratio(log_ratio) * _sg(advantages) + penalty)


# --------------------------------------------------------------------------- KL, entropy


def kl_estimate(
    logp: jax.Array, ref_logp: jax.Array, valid: jax.Array, *, estimator: str
) -> jax.Array:
    """Per-token estimate of ``KL(π_θ ‖ π_ref)`` from samples of π_θ (Schulman, 2020).

    With ``u = ref − θ`` (0 where invalid or non-finite):

    * ``k1 = −u = θ − ref`` (unbiased, high variance, can be negative);
    * ``k2 = ½·u²``;
    * ``k3 = e^u − u − 1`` (unbiased, low variance, ≥ 0), ``u`` clamped to ``[−20, 20]``
      and the value to ``≤ 10`` as verl's ``low_var_kl``.

    Args:
      logp: ``[..., T]`` log π_θ (differentiated).
      ref_logp: ``[..., T]`` log π_ref; stop-gradient.
      valid: ``[..., T]`` bool.
      estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
      ``[..., T]`` per-token estimate, 0 where invalid.
    """
    u = -safe_log_ratio(logp, ref_logp, valid)
    if estimator == "k1":
        return -u
    if estimator == "k2":
        return 0.5 * u * u
    if estimator == "k3":
        u = clamp(u, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        value = jnp.exp(u) - u - 1.0
        return jnp.where(value > K3_MAX, K3_MAX, value)
    raise ValueError(f"kl estimator must be one of {list(KL_ESTIMATORS)}, got {estimator!r}")


def off_policy_kl_estimate(
    logp: jax.Array,
    ref_logp: jax.Array,
    denominator_logp: jax.Array,
    valid: jax.Array,
    *,
    estimator: str,
) -> jax.Array:
    """The KL estimate re-weighted to samples of π_d: ``(π_θ/π_d)·k(θ, ref)``.

    Tokens are drawn from π_d (π_old or π_rollout), not π_θ; weighting the estimator by
    ``r = π_θ/π_d`` (differentiable, ``exp(clip(θ − d, −20, 20))``) makes both its value
    and its gradient unbiased for ``KL(π_θ ‖ π_ref)`` (DeepSeek-V3.2 technical report, 2025,
    "unbiased KL estimate"; for k3: ``∇(r·k3) = r·(θ − ref)·∇θ``).

    Returns:
      ``[..., T]`` per-token weighted estimate, 0 where invalid.
    """
    ratio = clamped_ratio(safe_log_ratio(logp, denominator_logp, valid))
    return ratio * kl_estimate(logp, ref_logp, valid, estimator=estimator)
