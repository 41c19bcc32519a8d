"""The loss pipeline's plan: what one call of it computes, as plain values.

A :class:`LossPlan` names the algorithm (as data), the surrogate and its
hyperparameters, the correction, the aggregation and the regularisers. The pipeline
(:func:`offpolicy_jax._src.losses.policy_loss.loss_terms`) reads only the plan and the call's
inputs. Two layers build plans: :mod:`offpolicy_jax.objectives` from their keyword
arguments, and :func:`offpolicy_jax._src.config.plan.resolve` from a validated
:class:`~offpolicy_jax.LossConfig`; a config and an objective that name the same
pieces build equal plans, so they compute the same numbers.

:func:`check_aggregation` validates the aggregation settings both layers take, and
:func:`check_coefficient`, :func:`check_opsm_delta` and :func:`check_prox_logp_method`
the regularisers' and the loss's other settings; each names the owner's key in its errors.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple, cast

from offpolicy_jax._src.checks import (
    check_bool,
    check_choice,
    check_f32_coefficient,
    check_number,
    check_positive,
)
from offpolicy_jax._src.config.correction import Correction, CorrectionConfig, CorrectionFn
from offpolicy_jax._src.losses.algorithms import Algorithm
from offpolicy_jax._src.losses.policy_losses import KL_ESTIMATORS
from offpolicy_jax._src.messages import shown

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "METRIC_REDUCTIONS",
    "PROX_LOGP_METHODS",
    "Aggregation",
    "LossPlan",
    "check_aggregation",
    "check_coefficient",
    "check_opsm_delta",
    "check_prox_logp_method",
]

AGGREGATIONS: tuple[str, ...] = (
    "sequence_mean",
    "token_mean",
    "sequence_sum",
    "sequence_sum_norm",
    "token_sum",
    "row_mean",
)
METRIC_REDUCTIONS: tuple[str, ...] = ("sequence", "token")
PROX_LOGP_METHODS: tuple[str, ...] = ("recompute", "loglinear", "linear", "metrics")


class Aggregation(NamedTuple):
    """How per-token losses become the loss, and how the metrics reduce (validated).

    Attributes:
      aggregation: one of :data:`AGGREGATIONS` (see :func:`~offpolicy_jax.aggregate`).
      loss_scale_factor: ``"sequence_sum_norm"``'s divisor (None: the padded length).
      rejected_in_denominator: keep rejected tokens in the loss denominator.
      metric_reduction: ``"sequence"`` or ``"token"`` reduction of the metrics.
    """

    aggregation: str
    loss_scale_factor: float | None
    rejected_in_denominator: bool
    metric_reduction: Literal["sequence", "token"]


def check_aggregation(
    owner: str,
    *,
    aggregation: object,
    loss_scale_factor: object,
    rejected_in_denominator: object,
    metric_reduction: object,
) -> Aggregation:
    """The aggregation settings as an :class:`Aggregation`; ``ValueError`` naming
    ``<owner>.<key>`` for a bad value (a numeric string reads as its number)."""
    choice = check_choice(owner, "aggregation", aggregation, AGGREGATIONS)
    reduction = check_choice(owner, "metric_reduction", metric_reduction, METRIC_REDUCTIONS)
    in_denominator = check_bool(owner, "rejected_in_denominator", rejected_in_denominator)
    scale = check_number(owner, "loss_scale_factor", loss_scale_factor, optional=True)
    check_positive(owner, "loss_scale_factor", scale)
    check_f32_coefficient(owner, "loss_scale_factor", scale)
    if scale is not None and choice != "sequence_sum_norm":
        raise ValueError(
            f"{owner}.loss_scale_factor only applies to aggregation='sequence_sum_norm', "
            f"not {shown(choice)}; leave it None"
        )
    return Aggregation(choice, scale, in_denominator, cast(Literal["sequence", "token"], reduction))


def check_coefficient(owner: str, key: str, value: object, *, nonnegative: bool) -> float:
    """A loss coefficient (a finite number, ``>= 0`` where ``nonnegative``, a normal
    float32 or 0) as a float; ``ValueError`` naming ``<owner>.<key>``."""
    number = check_number(owner, key, value, optional=False)
    assert number is not None  # optional=False
    if nonnegative and number < 0:
        raise ValueError(f"{owner}.{key} must be >= 0, got {shown(number)}")
    check_f32_coefficient(owner, key, number)
    return number


def check_opsm_delta(owner: str, value: object) -> float | None:
    """The off-policy sequence mask's ``δ > 0`` (None: off); ``ValueError`` naming
    ``<owner>.opsm_delta``."""
    delta = check_number(owner, "opsm_delta", value, optional=True)
    check_positive(owner, "opsm_delta", delta)
    check_f32_coefficient(owner, "opsm_delta", delta)
    return delta


def check_prox_logp_method(owner: str, value: object, algorithm: str) -> str:
    """AReaL's ``prox_logp_method``: one of :data:`PROX_LOGP_METHODS`; anything but
    ``"recompute"`` approximates decoupled PPO's π_old, so needs that algorithm."""
    method = check_choice(owner, "prox_logp_method", value, PROX_LOGP_METHODS)
    if method != "recompute" and algorithm != "decoupled_ppo":
        raise ValueError(
            f"{owner}.prox_logp_method={shown(method)} approximates decoupled PPO's "
            f"proximal policy; it needs algorithm='decoupled_ppo', not {shown(algorithm)}"
        )
    return method


@dataclasses.dataclass(frozen=True)
class LossPlan:
    """The loss pipeline's settings.

    Attributes:
      algorithm: the algorithm as data (ratio denominator, IS numerator, weighting).
      policy_loss: the registered surrogate's name; ``params`` its hyperparameters (an
        instance of its registered params class).
      correction: the correction that reweights and rejects (a ``CorrectionConfig``,
        ``VanillaTIS``, a chain of rules or another callable), or None (no correction,
        or a metrics-only ``CorrectionConfig``).
      aggregation, loss_scale_factor, rejected_in_denominator, metric_reduction: the
        :class:`Aggregation` (validated by :func:`check_aggregation`).
      mismatch_metrics: the metrics-only correction (a ``CorrectionConfig``, or a chain
        of rules that only report metrics) that reports the §4 metrics beside
        the loss, or None (not asked for, or reported by ``correction`` itself).
      versions_key: the setting that reads ``versions``, named in the error when they are
        missing, or None; a label, left out of the plan's equality and hash.
      nonfinite_rollout: the correction's ``nonfinite_rollout`` (``"reject"`` without a
        ``CorrectionConfig``): how the loss reads a non-finite ``π_rollout``.
      prox_logp_method: AReaL's proximal approximation (``"recompute"``: none).
      opsm_delta: the off-policy sequence mask's threshold, or None.
      kl_coef, kl_estimator, kl_off_policy, entropy_coef, positive_example_nll_weight:
        the regularisers (:class:`~offpolicy_jax.LossConfig`'s fields of those names).
    """

    algorithm: Algorithm
    policy_loss: str
    params: object
    correction: Correction
    aggregation: str = "sequence_mean"
    loss_scale_factor: float | None = None
    rejected_in_denominator: bool = False
    metric_reduction: Literal["sequence", "token"] = "sequence"
    mismatch_metrics: CorrectionConfig | CorrectionFn | None = None
    versions_key: str | None = dataclasses.field(default=None, compare=False)
    nonfinite_rollout: Literal["reject", "neutral"] = "reject"
    prox_logp_method: str = "recompute"
    opsm_delta: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_off_policy: bool = False
    entropy_coef: float = 0.0
    positive_example_nll_weight: float = 0.0

    @property
    def reweights(self) -> bool:
        """Whether the correction produces importance weights (not metrics only)."""
        return self.correction is not None

    @property
    def reports_ois(self) -> bool:
        """The ``ois`` metric is reported (a correction or mismatch metrics)."""
        return self.correction is not None or self.mismatch_metrics is not None

    @property
    def needs_rollout(self) -> bool:
        """``rollout_logp`` is required (by the algorithm, or to correct or compare)."""
        return self.algorithm.needs_rollout or self.reports_ois

    @property
    def approximates_old(self) -> bool:
        """π_old is approximated (``old_logp`` is not needed)."""
        return self.prox_logp_method in ("loglinear", "linear")
