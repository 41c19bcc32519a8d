"""The policy losses from core values: a correction, a surrogate value and an aggregation.

:func:`decoupled_ppo`, :func:`ppo` and :func:`bypass_ppo` take the correction as a chain
of rules (:func:`offpolicy_jax.rules.chain`) or a precomputed
:class:`~offpolicy_jax.CorrectionResult`, the surrogate as a value
(:func:`offpolicy_jax.objectives.ppo_clip`, :func:`~offpolicy_jax.objectives.surrogate`)
and the aggregation by name. Each builds the :class:`~offpolicy_jax._src.losses.plan.LossPlan`
of its arguments (no config) and runs the loss pipeline on it, the one a
``LossConfig`` resolves into: the config that names the same pieces resolves to an
equal plan, so :func:`~offpolicy_jax.policy_loss_parts` gives the same parts and metrics.
"""

from __future__ import annotations

import jax

from offpolicy_jax._src.correction.chain import Correction
from offpolicy_jax._src.correction.compute import CorrectionResult
from offpolicy_jax._src.losses.algorithms import ALGORITHMS
from offpolicy_jax._src.losses.plan import LossPlan, check_aggregation
from offpolicy_jax._src.losses.policy_loss import LossInputs, loss_terms
from offpolicy_jax._src.losses.surrogate_values import SurrogateSpec, ppo_clip
from offpolicy_jax._src.reduction import AxisNames, MeanParts

Parts = tuple[MeanParts, dict[str, MeanParts | jax.Array]]


def _surrogate(surrogate: SurrogateSpec | None) -> SurrogateSpec:
    if surrogate is None:
        return ppo_clip()
    if not isinstance(surrogate, SurrogateSpec):
        raise TypeError(
            "surrogate must be a surrogate value (opj.objectives.ppo_clip(...) or "
            f"opj.objectives.surrogate(name, ...)), got {type(surrogate).__name__}"
        )
    return surrogate


def _plan(
    algorithm: str,
    correction: Correction | None,
    surrogate: SurrogateSpec | None,
    *,
    aggregation: str,
    loss_scale_factor: float | None,
    rejected_in_denominator: bool,
    metric_reduction: str,
) -> LossPlan:
    """The plan of an objective's arguments (validated; errors name the argument)."""
    spec = _surrogate(surrogate)
    settings = check_aggregation(
        f"objectives.{algorithm}",
        aggregation=aggregation,
        loss_scale_factor=loss_scale_factor,
        rejected_in_denominator=rejected_in_denominator,
        metric_reduction=metric_reduction,
    )
    return LossPlan(
        ALGORITHMS[algorithm],
        spec.name,
        spec.params,
        correction,
        aggregation=settings.aggregation,
        loss_scale_factor=settings.loss_scale_factor,
        rejected_in_denominator=settings.rejected_in_denominator,
        metric_reduction=settings.metric_reduction,
    )


def _parts(inputs: LossInputs, plan: LossPlan) -> Parts:
    terms = loss_terms(inputs, plan)
    return terms.parts, terms.metrics


def decoupled_ppo(
    logp: jax.typing.ArrayLike,
    old_logp: jax.typing.ArrayLike,
    rollout_logp: jax.typing.ArrayLike,
    advantages: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike,
    *,
    correction: Correction | CorrectionResult,
    surrogate: SurrogateSpec | None = None,
    aggregation: str = "sequence_mean",
    rejected_in_denominator: bool = False,
    metric_reduction: str = "sequence",
    loss_scale_factor: float | None = None,
    axis_names: AxisNames = None,
    segment_ids: jax.typing.ArrayLike | None = None,
    num_segments: int | None = None,
) -> Parts:
    """Decoupled (3-policy) PPO: ``w(π_old/π_rollout) · ℓ(θ; π_old)`` on the corrected mask ``m'``.

    Hilton et al., "Batch size-invariance for policy optimization" (2022); truncated IS
    under training–inference mismatch: Yao et al. (2025). ``ℓ`` is the surrogate (PPO's
    clipped objective by default) with ratio ``r = π_θ / π_old``; ``w`` and ``m'`` come
    from ``correction`` (stop-gradient); the per-token ``ℓ' = w·ℓ`` is aggregated over
    ``m'`` (docs/semantics.md §5). Equal to :func:`~offpolicy_jax.policy_loss_parts` with
    ``LossConfig(algorithm="decoupled_ppo", ...)`` naming the same pieces.

    Args:
      logp: ``[..., T]`` log π_θ of the sampled tokens: the differentiated input.
      old_logp: ``[..., T]`` log π_old (the training engine's, stop-gradient).
      rollout_logp: ``[..., T]`` log π_rollout (the inference engine's).
      advantages: ``[..., T]`` per token or ``[...]`` per sequence (per token with
        ``segment_ids``).
      mask: ``[..., T]`` bool, 0/1 integers or floats; > 0 = trained on.
      correction: a chain of rules (:func:`offpolicy_jax.rules.chain`), run here on
        π_old and π_rollout with its metrics as poolable parts; or a
        :class:`~offpolicy_jax.CorrectionResult` computed beforehand for exactly these
        tokens (e.g. by :func:`~offpolicy_jax.correct` on the whole batch), whose
        metrics are then only in it.
      surrogate: a surrogate value; None is ``opj.objectives.ppo_clip()``.
      aggregation: ``"sequence_mean"``, ``"token_mean"``, ``"sequence_sum"``,
        ``"sequence_sum_norm"``, ``"token_sum"`` or ``"row_mean"`` (see
        :func:`~offpolicy_jax.aggregate`).
      rejected_in_denominator: keep rejected tokens in the loss denominator.
      metric_reduction: ``"sequence"`` or ``"token"`` reduction of the metrics (and of
        the correction's, when it runs here).
      loss_scale_factor: ``"sequence_sum_norm"``'s divisor (None: the padded length).
      axis_names: mesh axes to ``psum`` over inside ``shard_map``.
      segment_ids: packed rows: int ``[..., T]``, 1..K the sequences, 0 padding.
      num_segments: ``K``, static, given exactly when ``segment_ids`` is.

    Returns:
      ``(loss_parts, metric_parts)``: the loss as :class:`~offpolicy_jax.MeanParts`
      (``.value()`` is the scalar; 0 with zero gradients when nothing is left to train
      on) and the metrics as parts (:func:`~offpolicy_jax.finalize_metrics` divides them
      out); both pool exactly over micro-batches with ``+``.

    Raises:
      TypeError / ValueError: a bad argument or hyperparameter (naming it).
    """
    precomputed = None
    if isinstance(correction, CorrectionResult):
        # The result replaces the pipeline's correction; an empty chain stands in for it.
        precomputed, correction = correction, Correction(())
    elif not isinstance(correction, Correction):
        raise TypeError(
            "correction must be a chain of rules (opj.rules.chain(...)) or a CorrectionResult "
            f"(opj.correct(...)), got {type(correction).__name__}"
        )
    plan = _plan(
        "decoupled_ppo",
        correction,
        surrogate,
        aggregation=aggregation,
        loss_scale_factor=loss_scale_factor,
        rejected_in_denominator=rejected_in_denominator,
        metric_reduction=metric_reduction,
    )
    inputs = LossInputs(
        logp,
        old_logp,
        rollout_logp,
        advantages,
        mask,
        axis_names=axis_names,
        correction_result=precomputed,
        segment_ids=segment_ids,
        num_segments=num_segments,
    )
    return _parts(inputs, plan)


def ppo(
    logp: jax.typing.ArrayLike,
    old_logp: jax.typing.ArrayLike,
    advantages: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike,
    *,
    surrogate: SurrogateSpec | None = None,
    aggregation: str = "sequence_mean",
    metric_reduction: str = "sequence",
    loss_scale_factor: float | None = None,
    axis_names: AxisNames = None,
    segment_ids: jax.typing.ArrayLike | None = None,
    num_segments: int | None = None,
) -> Parts:
    """PPO without rollout correction: ``ℓ(θ; π_old)`` aggregated over ``mask``.

    Schulman et al. (2017). Equal to :func:`~offpolicy_jax.policy_loss_parts` with
    ``LossConfig(algorithm="ppo")`` and the same surrogate and aggregation.

    Args:
      logp: ``[..., T]`` log π_θ (differentiated).
      old_logp: ``[..., T]`` log π_old, the ratio denominator.
      advantages: ``[..., T]`` or ``[...]``.
      mask: ``[..., T]``; > 0 = trained on.
      surrogate: as :func:`decoupled_ppo`.
      aggregation, metric_reduction, loss_scale_factor: as :func:`decoupled_ppo`.
      axis_names, segment_ids, num_segments: as :func:`decoupled_ppo`.

    Returns:
      ``(loss_parts, metric_parts)`` as :func:`decoupled_ppo`.
    """
    return _unweighted(
        "ppo",
        LossInputs(
            logp,
            old_logp,
            None,
            advantages,
            mask,
            axis_names=axis_names,
            segment_ids=segment_ids,
            num_segments=num_segments,
        ),
        surrogate,
        aggregation,
        metric_reduction,
        loss_scale_factor,
    )


def bypass_ppo(
    logp: jax.typing.ArrayLike,
    rollout_logp: jax.typing.ArrayLike,
    advantages: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike,
    *,
    surrogate: SurrogateSpec | None = None,
    aggregation: str = "sequence_mean",
    metric_reduction: str = "sequence",
    loss_scale_factor: float | None = None,
    axis_names: AxisNames = None,
    segment_ids: jax.typing.ArrayLike | None = None,
    num_segments: int | None = None,
) -> Parts:
    """Bypass PPO: ``ℓ(θ; π_rollout)``, the rollout log-probs as the ratio denominator.

    No π_old forward pass and no IS weights. Equal to
    :func:`~offpolicy_jax.policy_loss_parts` with ``LossConfig(algorithm="bypass_ppo")``
    and the same surrogate and aggregation.

    Args:
      logp: ``[..., T]`` log π_θ (differentiated).
      rollout_logp: ``[..., T]`` log π_rollout, the ratio denominator.
      advantages: ``[..., T]`` or ``[...]``.
      mask: ``[..., T]``; > 0 = trained on.
      surrogate: as :func:`decoupled_ppo`.
      aggregation, metric_reduction, loss_scale_factor: as :func:`decoupled_ppo`.
      axis_names, segment_ids, num_segments: as :func:`decoupled_ppo`.

    Returns:
      ``(loss_parts, metric_parts)`` as :func:`decoupled_ppo`.
    """
    return _unweighted(
        "bypass_ppo",
        LossInputs(
            logp,
            None,
            rollout_logp,
            advantages,
            mask,
            axis_names=axis_names,
            segment_ids=segment_ids,
            num_segments=num_segments,
        ),
        surrogate,
        aggregation,
        metric_reduction,
        loss_scale_factor,
    )


def _unweighted(
    algorithm: str,
    inputs: LossInputs,
    surrogate: SurrogateSpec | None,
    aggregation: str,
    metric_reduction: str,
    loss_scale_factor: float | None,
) -> Parts:
    """:func:`ppo` and :func:`bypass_ppo`: no correction, so nothing is rejected and
    ``rejected_in_denominator`` does not apply."""
    plan = _plan(
        algorithm,
        None,
        surrogate,
        aggregation=aggregation,
        loss_scale_factor=loss_scale_factor,
        rejected_in_denominator=False,
        metric_reduction=metric_reduction,
    )
    return _parts(inputs, plan)
