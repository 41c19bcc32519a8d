"""What a :class:`~offpolicy_jax.LossConfig` resolves to: the loss pipeline's plan.

:func:`resolve` turns a validated config into a
:class:`~offpolicy_jax._src.losses.plan.LossPlan` once per trace (the config is a static
argument, so under ``jax.jit`` this runs when the function is traced): the algorithm as
data, the surrogate and its hyperparameters, the correction and the metrics-only
correction beside it, the aggregation and the regularisers. The plan is the core's own
description of a loss, the one :mod:`offpolicy_jax.objectives` build from their
arguments; the loss pipeline receives the plan, not the config, and nothing is derived
from the config again inside it.
"""

from __future__ import annotations

from typing import Literal

from offpolicy_jax._src.config.correction import CorrectionConfig
from offpolicy_jax._src.config.loss import LossConfig
from offpolicy_jax._src.correction.chain import Correction
from offpolicy_jax._src.losses.algorithms import ALGORITHMS, Algorithm
from offpolicy_jax._src.losses.plan import LossPlan

__all__ = ["LossPlan", "resolve"]


def _versions_key(config: LossConfig) -> str | None:
    if config.prox_logp_method != "recompute":
        return "LossConfig.prox_logp_method"
    correction = config.correction
    if isinstance(correction, CorrectionConfig) and correction.uses_versions:
        return "the correction's max_weight_staleness / mask_offpolicy_in_partial_rollout"
    if isinstance(correction, Correction):
        return correction.versions_key
    return None


def _mismatch_metrics(config: LossConfig, algorithm: Algorithm) -> CorrectionConfig | None:
    """The metrics-only correction beside the loss: §4 metrics of π_old (sg(θ) where
    absent) against π_rollout, unless the correction reports them of π_old itself."""
    correction = config.correction
    reported = (
        algorithm.weighted
        and algorithm.is_numerator == "old"
        and isinstance(correction, CorrectionConfig)
    )
    if reported or not config.wants_mismatch_metrics:
        return None
    # §4 metrics without a correction, with NeMo-RL's probability metrics when the
    # config's correction asks for them, reading non-finite π_rollout as it does.
    return CorrectionConfig(
        probability_metrics=isinstance(correction, CorrectionConfig)
        and correction.probability_metrics,
        nonfinite_rollout=_nonfinite_rollout(config),
    )


def _nonfinite_rollout(config: LossConfig) -> Literal["reject", "neutral"]:
    """The correction's ``nonfinite_rollout`` (a CorrectionConfig's or a chain's;
    ``"reject"`` without one)."""
    correction = config.correction
    if isinstance(correction, Correction) and correction.nonfinite_rollout == "neutral":
        return "neutral"
    return correction.nonfinite_rollout if isinstance(correction, CorrectionConfig) else "reject"


def resolve(config: LossConfig) -> LossPlan:
    """The plan of a validated :class:`LossConfig`; ``TypeError`` for anything else."""
    if not isinstance(config, LossConfig):
        raise TypeError(f"config must be a LossConfig, got {type(config).__name__}")
    algorithm = ALGORITHMS[config.algorithm]
    return LossPlan(
        algorithm=algorithm,
        policy_loss=config.policy_loss,
        params=config.params,
        correction=config.correction if config.reweights else None,
        aggregation=config.aggregation,
        loss_scale_factor=config.loss_scale_factor,
        rejected_in_denominator=config.rejected_in_denominator,
        metric_reduction=config.metric_reduction,
        mismatch_metrics=_mismatch_metrics(config, algorithm),
        versions_key=_versions_key(config),
        nonfinite_rollout=_nonfinite_rollout(config),
        prox_logp_method=config.prox_logp_method,
        opsm_delta=config.opsm_delta,
        kl_coef=config.kl_coef,
        kl_estimator=config.kl_estimator,
        kl_off_policy=config.kl_off_policy,
        entropy_coef=config.entropy_coef,
        positive_example_nll_weight=config.positive_example_nll_weight,
    )
