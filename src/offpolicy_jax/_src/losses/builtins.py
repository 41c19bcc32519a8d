"""The built-in surrogates, registered by name, and the per-token objective around them.

Each built-in is one registered function plus its hyperparameters (a frozen dataclass
with its defaults and its validation), exactly like a user's surrogate
(:func:`offpolicy_jax.register_surrogate`). :func:`surrogate_columns` runs the one
``LossConfig.policy_loss`` names: the per-token loss ``ℓ'`` (IS weights applied) and
the metric columns the loss's per-sequence pass sums; :func:`regulariser_terms` gives
the KL-to-reference, entropy and VAPO positive-example NLL terms. Surrogates that need a
per-sequence quantity first (GSPO's sequence ratio, GMPO's geometric means, VESPO's
sequence weight, LUSPO's length) take it through the layout, so packed sequences
(several per row) work unchanged.

==============  ================================================  =============="""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax._src import reduction as _reduce
from offpolicy_jax._src.checks import (
    F32,
    check_choice,
    check_f32_coefficient,
    check_number,
    check_positive,
    f32,
)
from offpolicy_jax._src.losses import covariance as cov
from offpolicy_jax._src.losses import policy_losses as pl
from offpolicy_jax._src.losses.registry import (
    NoParams,
    SurrogateInput,
    SurrogateTerms,
    lookup,
    register_surrogate,
)
from offpolicy_jax._src.losses.surrogates import ppo_surrogate
from offpolicy_jax._src.reduction import Column

PG_METRICS: tuple[str, ...] = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")


class LossSettings(Protocol):
    """What the surrogate and regulariser terms read of a loss config (a
    :class:`~offpolicy_jax.LossConfig`): the core takes these values, not the config."""

    @property
    def policy_loss(self) -> str: ...
    @property
    def params(self) -> object: ...
    @property
    def kl_off_policy(self) -> bool: ...
    @property
    def kl_estimator(self) -> str: ...


_OWNER = "LossConfig"


def _number(params, key: str, *, positive: bool = False) -> None:
    """Validates ``params.key`` as a finite number (numeric strings too) and stores the float."""
    value = check_number(_OWNER, key, getattr(params, key), optional=True)
    object.__setattr__(params, key, value)
    if positive:
        check_positive(_OWNER, key, value)
        check_f32_coefficient(_OWNER, key, value)


# --------------------------------------------------------------------------- hyperparameters


@dataclasses.dataclass(frozen=True)
class ClipRange:
    """A ratio clip range ``[1 − ε, 1 + ε_high]``.

    Attributes:
      clip_eps: ``ε`` in ``(0, 1)`` (lower side, and upper side unless
        ``clip_eps_high`` is set).
      clip_eps_high: ``ε_high`` (DAPO-style clip-higher); None = ``ε``.
    """

    clip_eps: float = 0.2
    clip_eps_high: float | None = None

    def __post_init__(self):
        _number(self, "clip_eps")
        _number(self, "clip_eps_high")
        # In float32 terms: the clip range [1 - ε, 1 + ε_high] must differ from 1 on both
        # sides and stay finite, and ε < 1 keeps the lower clip above 0 (at ε >= 1 every
        # ratio, being positive, would pass the lower clip: it would silently be off).
        one, eps, high = np.float32(1), self.clip_eps, self.clip_eps_high
        eps32 = np.float32(f32(eps)) if eps is not None else one
        if eps is None or not (0 < eps < 1 and 0 < np.float32(one - eps32) < one < one + eps32):
            raise ValueError(
                f"{_OWNER}.clip_eps must be in (0, 1), with 0 < 1 - clip_eps < 1 < 1 + clip_eps "
                f"in float32, got {eps!r}"
            )
        if high is not None and not (high > 0 and one < f32(1 + high) <= F32.max):
            raise ValueError(
                f"{_OWNER}.clip_eps_high must be > 0 with 1 < 1 + clip_eps_high < inf in "
                f"float32, got {high!r}"
            )

    @property
    def upper_clip_eps(self) -> float:
        """``ε_high``, resolved."""
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


@dataclasses.dataclass(frozen=True)
class PPOClip(ClipRange):
    """PPO's clip range and the dual-clip constant ``c > 1`` (Ye et al., 2020; None: off)."""

    dual_clip_c: float | None = None

    def __post_init__(self):
        super().__post_init__()
        _number(self, "dual_clip_c")
        c = self.dual_clip_c
        if c is not None and not np.float32(1) < f32(c) <= F32.max:
            raise ValueError(
                f"{_OWNER}.dual_clip_c must be > 1 and finite in float32 (or None), got {c!r}"
            )


@dataclasses.dataclass(frozen=True)
class DPPOTrustRegion(ClipRange):
    """DPPO: the trust-region thresholds ``δ`` (``clip_eps``), ``δ_high``
    (``clip_eps_high``), the cap ``C`` of the stop-gradient ratio, and TRL's
    ``divergence_type`` / ``divergence_topk``: ``"binary_tv"`` (``dppo_tv``'s default)
    or ``"topk_tv"`` for ``dppo_tv``, ``"binary_kl"`` (``dppo_kl``'s) or ``"topk_kl"``
    for ``dppo_kl``; a top-k type takes ``topk=`` with ``K = divergence_topk`` ids."""

    dppo_ratio_cap: float = 20.0
    divergence_type: str = "binary_tv"
    divergence_topk: int = 20

    def __post_init__(self):
        super().__post_init__()
        _number(self, "dppo_ratio_cap", positive=True)
        allowed = tuple(t for t in DPPO_DIVERGENCE_TYPES if t.endswith("_" + self.family))
        if self.divergence_type in DPPO_DIVERGENCE_TYPES and self.divergence_type not in allowed:
            other = self.divergence_type.rsplit("_", 1)[-1]
            raise ValueError(
                f"{_OWNER}.divergence_type must be one of {list(allowed)} for policy_loss "
                f"'dppo_{self.family}', got {self.divergence_type!r} (a divergence of "
                f"policy_loss 'dppo_{other}')"
            )
        check_choice(_OWNER, "divergence_type", self.divergence_type, allowed)
        k = self.divergence_topk
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
            raise ValueError(f"{_OWNER}.divergence_topk must be an int >= 1, got {k!r}")
        object.__setattr__(self, "divergence_topk", int(k))

    @property
    def family(self) -> str:
        """``"tv"`` or ``"kl"``: the divergence the loss is named after."""
        return "tv"

    @property
    def uses_topk(self) -> bool:
        """The trust region is taken over the engine's top-k ids (``topk=``)."""
        return self.divergence_type.startswith("topk_")


DPPO_DIVERGENCE_TYPES: tuple[str, ...] = ("binary_tv", "binary_kl", "topk_tv", "topk_kl")
"""TRL's ``DPPOConfig.divergence_type`` values."""


@dataclasses.dataclass(frozen=True)
class DPPOKLTrustRegion(DPPOTrustRegion):
    """:class:`DPPOTrustRegion` of ``dppo_kl``: ``divergence_type`` ``"binary_kl"`` or
    ``"topk_kl"``."""

    divergence_type: str = "binary_kl"

    @property
    def family(self) -> str:
        return "kl"


@dataclasses.dataclass(frozen=True)
class SAPOTemperatures:
    """SAPO's gate temperatures for ``A > 0`` and ``A ≤ 0`` (verl's defaults)."""

    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def __post_init__(self):
        _number(self, "tau_pos", positive=True)
        _number(self, "tau_neg", positive=True)


@dataclasses.dataclass(frozen=True)
class DROPenalty:
    """DRO's quadratic log-ratio penalty ``β``."""

    dro_beta: float = 0.1

    def __post_init__(self):
        _number(self, "dro_beta", positive=True)


def _non_negative(params, key: str) -> None:
    """``params.key`` as a finite float ``≥ 0`` that float32 represents (0 or normal)."""
    _number(params, key)
    value = getattr(params, key)
    if value is None or value < 0:
        raise ValueError(f"{_OWNER}.{key} must be a number >= 0, got {value!r}")
    check_f32_coefficient(_OWNER, key, value)


@dataclasses.dataclass(frozen=True)
class PrimeRLCoefficients:
    """prime-rl's coefficients of the policy-gradient (``adv_tau``) and KL (``kl_tau``)
    terms, its defaults (``DefaultLossConfig`` / ``IPOLossConfig``)."""

    adv_tau: float = 1.0
    kl_tau: float = 1e-3

    def __post_init__(self):
        _non_negative(self, "adv_tau")
        _non_negative(self, "kl_tau")


@dataclasses.dataclass(frozen=True)
class PrimeDPPOMask(PrimeRLCoefficients):
    """prime-rl's default loss: the probability-difference thresholds ``δ_low``, ``δ_high``."""

    dppo_mask_low: float = 0.2
    dppo_mask_high: float = 0.2

    def __post_init__(self):
        super().__post_init__()
        _non_negative(self, "dppo_mask_low")
        _non_negative(self, "dppo_mask_high")


@dataclasses.dataclass(frozen=True)
class IPOMask(PrimeRLCoefficients):
    """prime-rl's IPO loss: the symmetric probability-difference threshold."""

    ipo_threshold: float = 0.1

    def __post_init__(self):
        super().__post_init__()
        _non_negative(self, "ipo_threshold")


@dataclasses.dataclass(frozen=True)
class KPopMask(PrimeRLCoefficients):
    """prime-rl's KPop loss: the binary-KL threshold φ (``KPopLossConfig``)."""

    kpop_threshold: float = 0.1

    def __post_init__(self):
        super().__post_init__()
        _non_negative(self, "kpop_threshold")


@dataclasses.dataclass(frozen=True)
class TwoSidedClip(ClipRange):
    """INTELLECT-2's clip range and its ratio cap ``δ`` for ``A < 0``
    (``clamp_log_prob_coef``, 4.0 as in the INTELLECT-2 run)."""

    clamp_log_prob_coef: float = 4.0

    def __post_init__(self):
        super().__post_init__()
        _number(self, "clamp_log_prob_coef")
        delta, high = self.clamp_log_prob_coef, self.upper_clip_eps
        # δ ≤ 1 + ε_high would cap the positive-advantage side too: no longer INTELLECT-2's
        # bound on the negative side alone (the paper and TRL ask for δ > 1 + ε).
        bound = np.float32(1) + np.float32(f32(high))
        if delta is None or not bound < np.float32(f32(delta)) <= F32.max:
            raise ValueError(
                f"{_OWNER}.clamp_log_prob_coef (INTELLECT-2's δ) must be > 1 + clip_eps_high "
                f"= {float(bound):g} and finite in float32, got {delta!r}"
            )


@dataclasses.dataclass(frozen=True)
class VESPOKernel:
    """VESPO's Gamma-kernel shape: the power ``k`` and decay ``λ`` for ``A ≥ 0``
    (``_pos``) and ``A < 0`` (``_neg``); TRL's ``GRPOConfig`` names and defaults (the
    paper's ``c1``, ``c2``, Section 3.4)."""

    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    def __post_init__(self):
        for key in ("vespo_k_pos", "vespo_k_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
            _number(self, key)
            value = getattr(self, key)
            # k = 0 is allowed (φ = e^{λ(1 − W)}); λ > 0 (TRL floors it at 1e-4).
            if value is None or (value < 0 if "_k_" in key else value <= 0):
                bound = ">= 0" if "_k_" in key else "> 0"
                raise ValueError(f"{_OWNER}.{key} must be a number {bound}, got {value!r}")
            check_f32_coefficient(_OWNER, key, value)


def _selection_ratio(params, key: str) -> None:
    """``params.key`` as a share of the tokens in ``(0, 1]`` (verl asserts ``> 0``)."""
    _number(params, key)
    value = getattr(params, key)
    if value is None or not 0 < value <= 1:
        raise ValueError(f"{_OWNER}.{key} must be in (0, 1] (a share of the tokens), got {value!r}")
    check_f32_coefficient(_OWNER, key, value)


@dataclasses.dataclass(frozen=True)
class ClipCovParams(ClipRange):
    """Clip-Cov: PPO's clip range, the share ``clip_cov_ratio`` of the tokens taken out of
    the gradient and the covariance band ``(clip_cov_lb, clip_cov_ub)`` they are drawn
    from (verl's ``actor.policy_loss`` keys and defaults)."""

    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0

    def __post_init__(self):
        super().__post_init__()
        _selection_ratio(self, "clip_cov_ratio")
        _number(self, "clip_cov_lb")
        _number(self, "clip_cov_ub")
        lb, ub = self.clip_cov_lb, self.clip_cov_ub
        if lb is None or ub is None or not f32(lb) < f32(ub):
            raise ValueError(
                f"{_OWNER}.clip_cov_lb must be < {_OWNER}.clip_cov_ub (in float32), got "
                f"clip_cov_lb={lb!r}, clip_cov_ub={ub!r}"
            )


@dataclasses.dataclass(frozen=True)
class KLCovParams:
    """KL-Cov: the share ``kl_cov_ratio`` of the tokens penalised and the penalty's
    coefficient ``ppo_kl_coef`` (verl's ``ActorConfig.policy_loss`` defaults; verl's
    function falls back to 1.0 when the key is None, its config says 0.1)."""

    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1

    def __post_init__(self):
        _selection_ratio(self, "kl_cov_ratio")
        _non_negative(self, "ppo_kl_coef")


# --------------------------------------------------------------------------- built-ins


@register_surrogate("ppo_clip", params=PPOClip)
def ppo_clip(x: SurrogateInput, p: PPOClip) -> SurrogateTerms:
    """The clipped PPO surrogate (:func:`~offpolicy_jax.ppo_surrogate`), dual clip optional."""
    terms = ppo_surrogate(
        x.logp,
        x.denominator,
        x.advantages,
        where=x.valid,
        clip_eps=p.clip_eps,
        clip_eps_high=p.upper_clip_eps,
        dual_clip_c=p.dual_clip_c,
    )
    return SurrogateTerms(terms.loss, terms.clipped, terms.clipped_lower)


def _gspo(x: SurrogateInput, p: ClipRange, *, token_level: bool) -> SurrogateTerms:
    sums = x.layout.reduce({"x": _reduce.total(x.log_ratio, x.mask), "n": _reduce.count(x.mask)})
    seq_log_ratio = x.layout.broadcast(sums["x"] / jnp.maximum(sums["n"], 1.0))
    return pl.gspo(
        x.logp,
        seq_log_ratio,
        x.advantages,
        x.valid,
        clip_eps=p.clip_eps,
        clip_eps_high=p.upper_clip_eps,
        token_level=token_level,
    )


@register_surrogate("gspo", params=ClipRange)
def gspo(x: SurrogateInput, p: ClipRange) -> SurrogateTerms:
    """GSPO: one clipped ratio per sequence (:func:`.policy_losses.gspo`)."""
    return _gspo(x, p, token_level=False)


@register_surrogate("gspo_token", params=ClipRange)
def gspo_token(x: SurrogateInput, p: ClipRange) -> SurrogateTerms:
    """GSPO-token, verl's ``gspo`` (:func:`.policy_losses.gspo`, ``token_level=True``)."""
    return _gspo(x, p, token_level=True)


@register_surrogate("cispo", params=ClipRange)
def cispo(x: SurrogateInput, p: ClipRange) -> SurrogateTerms:
    """CISPO (:func:`.policy_losses.cispo`)."""
    return pl.cispo(
        x.logp,
        x.denominator,
        x.advantages,
        x.valid,
        clip_eps=p.clip_eps,
        clip_eps_high=p.upper_clip_eps,
    )


@register_surrogate("gmpo", params=ClipRange, applies_weights=True)
def gmpo(x: SurrogateInput, p: ClipRange) -> SurrogateTerms:
    """GMPO (:func:`.policy_losses.gmpo_sequence_loss`): every token carries its
    sequence's loss, so any aggregation averages ``L_i`` (sequence_mean / row_mean:
    each sequence once; token_mean: by length). IS weights enter the geometric mean."""
    terms = pl.gmpo_token_log_ratio(
        x.logp,
        x.denominator,
        x.advantages,
        x.valid,
        clip_eps=p.clip_eps,
        clip_eps_high=p.upper_clip_eps,
    )
    columns = {
        "x": _reduce.total(terms.loss, x.mask),
        "adv": _reduce.total(x.advantages, x.mask),
        "n": _reduce.count(x.mask),
    }
    if x.weights is not None:
        columns["log_w"] = _reduce.total(pl.gmpo_log_weight(x.weights), x.mask)
    sums = x.layout.reduce(columns)
    n = jnp.maximum(sums["n"], 1.0)
    log_w = None if x.weights is None else sums["log_w"] / n
    per_seq = pl.gmpo_sequence_loss(sums["x"] / n, sums["adv"] / n, log_w)
    loss = jnp.broadcast_to(x.layout.broadcast(per_seq), x.logp.shape)
    return SurrogateTerms(loss, terms.clipped, terms.clipped_lower)


@register_surrogate("sapo", params=SAPOTemperatures)
def sapo(x: SurrogateInput, p: SAPOTemperatures) -> SurrogateTerms:
    """SAPO's soft gate (:func:`.policy_losses.sapo`)."""
    return pl.sapo(
        x.logp, x.denominator, x.advantages, x.valid, tau_pos=p.tau_pos, tau_neg=p.tau_neg
    )


@register_surrogate("gpg", params=NoParams)
def gpg(x: SurrogateInput, p: NoParams) -> SurrogateTerms:
    """GPG, plain REINFORCE (:func:`.policy_losses.gpg`)."""
    return pl.gpg(x.logp, x.advantages, x.valid)


def _dppo(x: SurrogateInput, p: DPPOTrustRegion, divergence: str) -> SurrogateTerms:
    if p.uses_topk:
        if x.topk is None:
            raise ValueError(
                f"policy_loss 'dppo_{divergence}' with divergence_type={p.divergence_type!r} "
                "needs topk=TopKLogprobs(ids, rollout_logp, logp): the engine's top-k ids and "
                "log-probs and the trainer's log-probs on them"
            )
        if x.topk.k != p.divergence_topk:
            raise ValueError(
                f"topk has K = {x.topk.k} ids per position but LossConfig.divergence_topk is "
                f"{p.divergence_topk}; pass the engine's top-{p.divergence_topk} or set "
                f"divergence_topk={x.topk.k}"
            )
        return pl.dppo_divergence_region(
            x.logp,
            x.denominator,
            x.advantages,
            x.valid,
            x.topk.tv if divergence == "tv" else x.topk.kl,
            clip_eps=p.clip_eps,
            clip_eps_high=p.upper_clip_eps,
            ratio_cap=p.dppo_ratio_cap,
        )
    return pl.dppo(
        x.logp,
        x.denominator,
        x.advantages,
        x.valid,
        divergence=divergence,
        clip_eps=p.clip_eps,
        clip_eps_high=p.upper_clip_eps,
        ratio_cap=p.dppo_ratio_cap,
    )


@register_surrogate("dppo_tv", params=DPPOTrustRegion)
def dppo_tv(x: SurrogateInput, p: DPPOTrustRegion) -> SurrogateTerms:
    """DPPO with the binary total-variation trust region (:func:`.policy_losses.dppo`), or
    the top-k TV one (``divergence_type="topk_tv"``, :func:`.policy_losses.dppo_topk`)."""
    return _dppo(x, p, "tv")


@register_surrogate("dppo_kl", params=DPPOKLTrustRegion)
def dppo_kl(x: SurrogateInput, p: DPPOKLTrustRegion) -> SurrogateTerms:
    """DPPO with the binary-KL trust region (:func:`.policy_losses.dppo`), or the top-k
    KL one (``divergence_type="topk_kl"``, :func:`.policy_losses.dppo_topk`)."""
    return _dppo(x, p, "kl")


@register_surrogate("dro", params=DROPenalty)
def dro(x: SurrogateInput, p: DROPenalty) -> SurrogateTerms:
    """DRO (:func:`.policy_losses.dro`)."""
    return pl.dro(x.logp, x.denominator, x.advantages, x.valid, beta=p.dro_beta)


def _probability_masks(
    loss: Callable[..., pl.ProbabilityMasks], x: SurrogateInput, **hyperparameters: float
) -> SurrogateTerms:
    """prime-rl's masked loss ``loss`` on ``x``, and its mask shares (``is_masked*``)
    over ``m'``."""
    terms = loss(x.logp, x.denominator, x.advantages, x.valid, **hyperparameters)
    masks = {
        "is_masked": terms.masked,
        "is_masked_high": terms.masked_high,
        "is_masked_low": terms.masked_low,
    }
    metrics = {k: _reduce.count_where(v, x.mask) for k, v in masks.items() if v is not None}
    return SurrogateTerms(terms.loss, metrics=metrics)


@register_surrogate("prime_dppo", params=PrimeDPPOMask)
def prime_dppo(x: SurrogateInput, p: PrimeDPPOMask) -> SurrogateTerms:
    """prime-rl's default loss, DPPO mask + KL (:func:`.policy_losses.prime_dppo`)."""
    low, high = p.dppo_mask_low, p.dppo_mask_high
    return _probability_masks(
        pl.prime_dppo, x, dppo_mask_low=low, dppo_mask_high=high, adv_tau=p.adv_tau, kl_tau=p.kl_tau
    )


@register_surrogate("ipo", params=IPOMask)
def ipo(x: SurrogateInput, p: IPOMask) -> SurrogateTerms:
    """prime-rl's IPO loss, symmetric mask + KL (:func:`.policy_losses.ipo`)."""
    return _probability_masks(
        pl.ipo, x, ipo_threshold=p.ipo_threshold, adv_tau=p.adv_tau, kl_tau=p.kl_tau
    )


@register_surrogate("kpop", params=KPopMask)
def kpop(x: SurrogateInput, p: KPopMask) -> SurrogateTerms:
    """prime-rl's KPop loss, binary-KL mask + KL (:func:`.policy_losses.kpop`)."""
    return _probability_masks(
        pl.kpop, x, kpop_threshold=p.kpop_threshold, adv_tau=p.adv_tau, kl_tau=p.kl_tau
    )


@register_surrogate("two_sided_clip", params=TwoSidedClip)
def two_sided_clip(x: SurrogateInput, p: TwoSidedClip) -> SurrogateTerms:
    """INTELLECT-2's two-sided clip (:func:`.policy_losses.two_sided_clip`)."""
    return pl.two_sided_clip(
        x.logp,
        x.denominator,
        x.advantages,
        x.valid,
        clip_eps=p.clip_eps,
        clip_eps_high=p.upper_clip_eps,
        delta=p.clamp_log_prob_coef,
    )


def _vespo_sequence_log_weight(x: SurrogateInput) -> jax.Array:
    """``Σ_t`` of VESPO's log-weight summands over each sequence's kept tokens: the
    log-ratio and, with rollout correction, the log IS weights (TRL folds them in)."""
    weights = None if x.weights is None else jnp.where(x.mask > 0, x.weights, 1.0)
    terms = pl.vespo_log_weight_terms(x.log_ratio, weights)
    return x.layout.broadcast(x.layout.reduce({"w": _reduce.total(terms, x.mask)})["w"])


@register_surrogate("vespo", params=VESPOKernel, applies_weights=True)
def vespo(x: SurrogateInput, p: VESPOKernel) -> SurrogateTerms:
    """VESPO (:func:`.policy_losses.vespo`): the IS weights enter the sequence weight
    ``W`` (as TRL's vLLM IS ratio does), not a factor of ``ℓ``. Metrics ``vespo_phi``
    (mean ``φ``) and ``vespo_clipfrac`` (``log W`` clamped to ``[log 1e-8, 20]``)."""
    terms = pl.vespo(
        x.logp,
        _vespo_sequence_log_weight(x),
        x.advantages,
        x.valid,
        k_pos=p.vespo_k_pos,
        lambda_pos=p.vespo_lambda_pos,
        k_neg=p.vespo_k_neg,
        lambda_neg=p.vespo_lambda_neg,
    )
    metrics = {
        "vespo_phi": _reduce.total(terms.phi, x.mask),
        "vespo_clipfrac": _reduce.count_where(terms.clamped, x.mask),
    }
    return SurrogateTerms(terms.loss, metrics=metrics)


@register_surrogate("luspo", params=ClipRange)
def luspo(x: SurrogateInput, p: ClipRange) -> SurrogateTerms:
    """LUSPO (:func:`.policy_losses.luspo`): GSPO's sequence loss times the sequence's
    length ``Σ_t m'``; TRL's normalisation is ``aggregation="row_mean"``."""
    sums = x.layout.reduce({"x": _reduce.total(x.log_ratio, x.mask), "n": _reduce.count(x.mask)})
    seq_log_ratio = x.layout.broadcast(sums["x"] / jnp.maximum(sums["n"], 1.0))
    return pl.luspo(
        x.logp,
        seq_log_ratio,
        x.layout.broadcast(sums["n"]),
        x.advantages,
        x.valid,
        clip_eps=p.clip_eps,
        clip_eps_high=p.upper_clip_eps,
    )


@register_surrogate("clip_cov", params=ClipCovParams)
def clip_cov(x: SurrogateInput, p: ClipCovParams) -> SurrogateTerms:
    """Clip-Cov (:func:`.policy_losses.clip_cov`): PPO, with ``max(int(clip_cov_ratio·n),
    1)`` tokens drawn with ``key`` among the unclipped ones whose covariance lies in
    ``(clip_cov_lb, clip_cov_ub)`` taken out of the gradient (:mod:`.covariance`).
    Needs ``policy_loss(..., key=jax.random.key(seed))``."""
    if x.key is None:
        raise ValueError(
            "LossConfig.policy_loss='clip_cov' draws the tokens it takes out of the gradient "
            "at random: pass key=jax.random.key(seed) to policy_loss (the library draws no "
            "randomness of its own; the same key gives the same loss)"
        )
    members, covariance, n = cov.covariance(x)
    ppo = ppo_surrogate(
        x.logp,
        x.denominator,
        x.advantages,
        where=x.valid,
        clip_eps=p.clip_eps,
        clip_eps_high=p.upper_clip_eps,
    )
    band = (covariance > p.clip_cov_lb) & (covariance < p.clip_cov_ub)
    candidates = members & ~ppo.clipped & band
    axes = x.layout.axes
    selected = cov.select_random(candidates, n, p.clip_cov_ratio, x.key, axes)
    return pl.clip_cov(
        x.logp,
        x.denominator,
        x.advantages,
        x.valid,
        selected,
        clip_eps=p.clip_eps,
        clip_eps_high=p.upper_clip_eps,
    )


@register_surrogate("kl_cov", params=KLCovParams)
def kl_cov(x: SurrogateInput, p: KLCovParams) -> SurrogateTerms:
    """KL-Cov (:func:`.policy_losses.kl_cov`): ``ppo_kl_coef·|x|`` added on the
    ``max(int(kl_cov_ratio·n), 1)`` tokens of largest covariance (:mod:`.covariance`).
    Metrics ``ppo_kl_abs`` (mean ``|x|``, verl's ``actor/ppo_kl`` of this loss) and
    ``kl_cov_frac`` (the share of penalised tokens)."""
    members, covariance, n = cov.covariance(x)
    selected = cov.select_top(covariance, members, n, p.kl_cov_ratio, x.layout.axes)
    terms = pl.kl_cov(
        x.logp, x.denominator, x.advantages, x.valid, selected, ppo_kl_coef=p.ppo_kl_coef
    )
    metrics = {
        "ppo_kl_abs": _reduce.total(jnp.abs(jax.lax.stop_gradient(x.log_ratio)), x.mask),
        "kl_cov_frac": _reduce.count_where(selected, x.mask),
    }
    return terms._replace(metrics=metrics)


# --------------------------------------------------------------------------- the objective


class SurrogateOutput(NamedTuple):
    """``ℓ'`` ``[..., T]``, the metric columns (summed over ``m'``) and the names of
    those the surrogate declared itself (:attr:`SurrogateTerms.metrics`)."""

    loss: jax.Array
    columns: dict[str, Column]
    own_metrics: tuple[str, ...] = ()


# Metric names the loss pipeline itself reports: a surrogate's own may not take them.
PIPELINE_METRICS: frozenset[str] = frozenset(
    {
        "loss",
        "pg_loss",
        "kl_loss",
        "entropy",
        "nll_loss",
        "count",
        "mask_count",
        "bad_model",
        "bad_logp",
        "ois",
        "train_rollout_logprob_abs_diff",
        "pg_nonfinite_seq_fraction",
        "mis_nonfinite_seq_fraction",
        *PG_METRICS,
    }
)


def surrogate_columns(config: LossSettings, x: SurrogateInput) -> SurrogateOutput:
    """The surrogate ``config.policy_loss`` names, with its hyperparameters ``config.params``.

    Args:
      config: the loss config.
      x: the batch as the surrogate sees it (:class:`~offpolicy_jax.SurrogateInput`).

    Returns:
      :class:`SurrogateOutput`: ``ℓ`` times the IS weights on ``m'`` (unless the
      surrogate applies them itself), and the ``ppo_kl`` / ``pg_clipfrac`` /
      ``pg_clipfrac_lower`` columns and the surrogate's own metric columns.
    """
    entry = lookup(config.policy_loss)
    terms = entry.fn(x, config.params)
    loss = terms.loss
    if x.weights is not None and not entry.applies_weights:
        loss = jnp.where(x.mask > 0, x.weights, 0.0) * loss
    sg = jax.lax.stop_gradient
    columns: dict[str, Column] = {"ppo_kl": _reduce.total(-sg(x.log_ratio), x.mask)}
    if terms.clipped is not None:
        columns["pg_clipfrac"] = _reduce.count_where(terms.clipped, x.mask)
    if terms.clipped_lower is not None:
        columns["pg_clipfrac_lower"] = _reduce.count_where(terms.clipped_lower, x.mask)
    own = dict(terms.metrics or {})
    clash = sorted(k for k in own if k in PIPELINE_METRICS or k.startswith("mis_"))
    if clash:
        raise ValueError(
            f"surrogate {config.policy_loss!r} returned metrics {clash}, names the loss "
            "pipeline reports itself; choose other names"
        )
    return SurrogateOutput(loss, columns | own, tuple(own))


def regulariser_terms(
    config: LossSettings,
    theta: jax.Array,
    denominator: jax.Array | None,
    valid: jax.Array,
    ref_logp: jax.Array | None,
    entropy: jax.Array | None,
    *,
    positive: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Per-token ``kl_loss`` (KL-to-reference estimate), ``entropy`` and ``nll_loss``
    (VAPO's positive-example NLL, where ``positive``: ``reward > 0``) where given.

    The loss adds ``kl_coef · kl − entropy_coef · H + positive_example_nll_weight ·
    nll`` per token; each is reported as a metric aggregated like the policy term
    whenever its input is passed.
    """
    out = {}
    if ref_logp is not None:
        if config.kl_off_policy:
            if denominator is None:
                raise ValueError(
                    "kl_off_policy weights the KL estimate by π_θ / π_old and needs old_logp; "
                    "pass old_logp or set kl_off_policy=False"
                )
            out["kl_loss"] = pl.off_policy_kl_estimate(
                theta, ref_logp, denominator, valid, estimator=config.kl_estimator
            )
        else:
            out["kl_loss"] = pl.kl_estimate(theta, ref_logp, valid, estimator=config.kl_estimator)
    if entropy is not None:
        out["entropy"] = jnp.where(valid & jnp.isfinite(entropy), entropy, 0.0)
    if positive is not None:
        out["nll_loss"] = pl.positive_example_nll(theta, positive, valid)
    return out
