"""The policy losses from core values: a correction, a surrogate value and an aggregation.

:func:`decoupled_ppo`, :func:`ppo`, :func:`bypass_ppo` and :func:`reinforce_is` take the
correction as a chain of rules (:func:`offpolicy_jax.rules.chain`) or a precomputed
:class:`~offpolicy_jax.CorrectionResult`, the surrogate as a value
(:func:`offpolicy_jax.objectives.ppo_clip`, :func:`~offpolicy_jax.objectives.surrogate`),
the aggregation by name, the regularisers as values
(:func:`~offpolicy_jax.objectives.kl_penalty`, ...) and the loss's other settings as
keywords named as the ``LossConfig`` keys. Each builds the
:class:`~offpolicy_jax._src.losses.plan.LossPlan` of its arguments (no config) and runs the loss pipeline on it, the one a
``LossConfig`` resolves into: the config that names the same pieces resolves to an
equal plan, so :func:`~offpolicy_jax.policy_loss_parts` gives the same parts and metrics.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any, Literal

import jax
from jax.typing import ArrayLike

from offpolicy_jax._src.checks import check_bool
from offpolicy_jax._src.config.correction import CorrectionConfig
from offpolicy_jax._src.correction.bounds import TISWeights
from offpolicy_jax._src.correction.chain import Correction
from offpolicy_jax._src.correction.compute import CorrectionResult
from offpolicy_jax._src.correction.rules import AReaLRejection
from offpolicy_jax._src.correction.vanilla import VanillaIS
from offpolicy_jax._src.logprobs.topk import TopKLogprobs
from offpolicy_jax._src.losses import regularisers as _regularisers
from offpolicy_jax._src.losses.algorithms import ALGORITHMS
from offpolicy_jax._src.losses.plan import (
    LossPlan,
    check_aggregation,
    check_opsm_delta,
    check_prox_logp_method,
)
from offpolicy_jax._src.losses.policy_loss import LossInputs, loss_terms
from offpolicy_jax._src.losses.regularisers import Regularisers
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
    regularisers: Regularisers = (),
    opsm_delta: float | None = None,
    get_mismatch_metrics: bool = False,
    prox_logp_method: str = "recompute",
    metrics_chain: Correction | None = None,
) -> LossPlan:
    """The plan of an objective's arguments (validated; errors name the argument);
    ``metrics_chain``: a chain that only reports metrics, beside the loss."""
    owner = f"objectives.{algorithm}"
    spec = _surrogate(surrogate)
    settings = check_aggregation(
        owner,
        aggregation=aggregation,
        loss_scale_factor=loss_scale_factor,
        rejected_in_denominator=rejected_in_denominator,
        metric_reduction=metric_reduction,
    )
    method = check_prox_logp_method(owner, prox_logp_method, algorithm)
    # The §4 metrics beside the loss, as LossConfig.get_mismatch_metrics asks for them
    # (a chain reports its own only through its mismatch_metrics() rule).
    # A chain's nonfinite_rollout is the loss's too, as a CorrectionConfig's is.
    reads = correction if correction is not None else metrics_chain
    neutral = reads is not None and reads.nonfinite_rollout == "neutral"
    nonfinite: Literal["reject", "neutral"] = "neutral" if neutral else "reject"
    metrics_only: CorrectionConfig | Correction | None = (
        CorrectionConfig(nonfinite_rollout=nonfinite)
        if check_bool(owner, "get_mismatch_metrics", get_mismatch_metrics)
        else None
    )
    if metrics_chain is not None:  # as a metrics-only CorrectionConfig of a LossConfig
        metrics_only = metrics_chain
    versions_key = None if reads is None else reads.versions_key
    if method != "recompute":
        versions_key = f"{owner}.prox_logp_method"
    return LossPlan(
        ALGORITHMS[algorithm],
        spec.name,
        spec.params,
        correction,
        aggregation=settings.aggregation,
        loss_scale_factor=settings.loss_scale_factor,
        rejected_in_denominator=settings.rejected_in_denominator,
        metric_reduction=settings.metric_reduction,
        mismatch_metrics=metrics_only,
        versions_key=versions_key,
        nonfinite_rollout=nonfinite,
        prox_logp_method=method,
        opsm_delta=check_opsm_delta(owner, opsm_delta),
        **_regularisers.plan_fields(owner, regularisers),
    )


def _correction(
    correction: Correction | CorrectionResult,
) -> tuple[Correction, CorrectionResult | None]:
    """The chain the plan holds and the precomputed result, if ``correction`` is one."""
    if isinstance(correction, CorrectionResult):
        # The result replaces the pipeline's correction; an empty chain stands in for it.
        return Correction(()), correction
    if not isinstance(correction, Correction):
        raise TypeError(
            "correction must be a chain of rules (opj.rules.chain(...)) or a CorrectionResult "
            f"(opj.correct(...)), got {type(correction).__name__}"
        )
    return correction, None


def _metrics_only(correction: Correction | None) -> Correction | None:
    """PPO's correction: a chain that only reports metrics, or None."""
    if correction is None:
        return None
    if not isinstance(correction, Correction):
        raise TypeError(
            "correction must be a chain of rules (opj.rules.chain(...)) that only reports "
            f"metrics, or None, got {type(correction).__name__}"
        )
    if correction.reweights:
        raise ValueError(
            "objectives.ppo.correction: PPO applies no rollout correction, so its chain may "
            "only report metrics (e.g. rules.mismatch_metrics()); use objectives.decoupled_ppo "
            "for a chain that weights or rejects"
        )
    return correction


def _rejection_only(correction: Correction | None) -> Correction | None:
    """Bypass PPO's correction: a chain whose rules may reject but leave every weight
    at 1 (verl's bypass PPO-clip with ``rollout_rs``), or None."""
    if correction is None:
        return None
    if not isinstance(correction, Correction):
        raise TypeError(
            "correction must be a chain of rules (opj.rules.chain(...)) that only rejects, or "
            f"None, got {type(correction).__name__}"
        )
    for i, rule in enumerate(correction.rules):
        weighs = isinstance(rule, AReaLRejection | VanillaIS) or (
            isinstance(rule, TISWeights) and rule.mode != "none"
        )
        if weighs:
            raise ValueError(
                f"objectives.bypass_ppo.correction: bypass PPO does not apply importance "
                f"weights, but rules[{i}] ({type(rule).__name__}) sets them; use "
                "importance_weights(mode='none') to reject only, or objectives.reinforce_is"
            )
    return correction


# The settings the objectives take as the ``LossConfig`` keys of the same names: the
# plan's keywords but the chain it may carry beside the loss.
_PLAN_KEYS = tuple(
    name
    for name, parameter in inspect.signature(_plan).parameters.items()
    if parameter.kind is parameter.KEYWORD_ONLY and name != "metrics_chain"
)
_INPUT_KEYS = tuple(
    field.name for field in dataclasses.fields(LossInputs) if field.name != "correction_result"
)


def _objective(
    algorithm: str,
    arguments: Mapping[str, Any],
    *,
    chain: Correction | None,
    surrogate: SurrogateSpec | None = None,
    metrics_chain: Correction | None = None,
    precomputed: CorrectionResult | None = None,
) -> Parts:
    """One objective's loss parts: its plan and its inputs from ``arguments``, the
    entry's own arguments by name (an entry lacks the keys it does not take: PPO has no
    precomputed correction, REINFORCE no surrogate, ...)."""
    settings = {name: arguments[name] for name in _PLAN_KEYS if name in arguments}
    plan = _plan(algorithm, chain, surrogate, metrics_chain=metrics_chain, **settings)
    given: dict[str, Any] = {name: arguments.get(name) for name in _INPUT_KEYS}
    inputs = LossInputs(**given, correction_result=precomputed)
    regularisers = settings.get("regularisers", ())
    _regularisers.check_needed(regularisers, given)
    terms = loss_terms(inputs, plan)
    return terms.parts, terms.metrics


def decoupled_ppo(
    logp: ArrayLike,
    old_logp: ArrayLike | None,
    rollout_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    correction: Correction | CorrectionResult,
    surrogate: SurrogateSpec | None = None,
    aggregation: str = "sequence_mean",
    rejected_in_denominator: bool = False,
    metric_reduction: str = "sequence",
    loss_scale_factor: float | None = None,
    regularisers: Regularisers = (),
    opsm_delta: float | None = None,
    get_mismatch_metrics: bool = False,
    prox_logp_method: str = "recompute",
    ref_logp: ArrayLike | None = None,
    entropy: ArrayLike | None = None,
    rewards: ArrayLike | None = None,
    versions: ArrayLike | None = None,
    current_version: ArrayLike | None = None,
    key: ArrayLike | None = None,
    topk: TopKLogprobs | None = None,
    axis_names: AxisNames = None,
    segment_ids: ArrayLike | None = None,
    num_segments: int | None = None,
) -> Parts:
    """Decoupled (3-policy) PPO: ``w(π_old/π_rollout) · ℓ(θ; π_old)`` on the corrected mask ``m'``.

    Hilton et al., "Batch size-invariance for policy optimization" (2022); truncated IS
    under training–inference mismatch: Yao et al. (2025). ``ℓ`` is the surrogate (PPO's
    clipped objective by default) with ratio ``r = π_θ / π_old``; ``w`` and ``m'`` come
    from ``correction`` (stop-gradient); the per-token ``ℓ' = w·ℓ`` plus the
    ``regularisers``' terms is aggregated over ``m'`` (docs/semantics.md §5). Equal to
    :func:`~offpolicy_jax.policy_loss_parts` with ``LossConfig(algorithm="decoupled_ppo",
    ...)`` naming the same pieces: every keyword below that is not an array is the
    ``LossConfig`` key of the same name, with its default and its validation.

    Args:
      logp: ``[..., T]`` log π_θ of the sampled tokens: the differentiated input.
      old_logp: ``[..., T]`` log π_old (the training engine's, stop-gradient); None
        when ``prox_logp_method`` approximates it.
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
      regularisers: terms added to the per-token loss, each kind at most once:
        :func:`~offpolicy_jax.objectives.kl_penalty` (reads ``ref_logp``),
        :func:`~offpolicy_jax.objectives.entropy_bonus` (reads ``entropy``),
        :func:`~offpolicy_jax.objectives.positive_example_nll` (reads ``rewards``).
      opsm_delta: DeepSeek-V3.2's off-policy sequence masking (docs/semantics.md §8):
        drop a sequence whose mean advantage is negative and whose mean
        ``log π_rollout − log π_θ`` exceeds ``δ > 0``; None: off.
      get_mismatch_metrics: add the §4 mismatch metrics of π_old against π_rollout
        (a chain reports its own through :func:`~offpolicy_jax.rules.mismatch_metrics`).
      prox_logp_method: AReaL's proximal policy (docs/guide/async.md): ``"recompute"``
        (``old_logp``), ``"loglinear"`` / ``"linear"`` (π_old approximated from
        ``rollout_logp``, ``sg(logp)`` and ``versions``) or ``"metrics"`` (``old_logp``,
        plus the ``prox_*`` errors of both approximations); all but ``"recompute"``
        need ``versions`` and ``current_version``.
      ref_logp: ``[..., T]`` log π_ref (stop-gradient), for ``kl_penalty``; given
        without one, it only adds the ``kl_loss`` metric.
      entropy: ``[..., T]`` per-token entropies of π_θ (differentiable), for
        ``entropy_bonus``; given without one, only the ``entropy`` metric.
      rewards: ``[...]`` or ``[..., T]``, for ``positive_example_nll``; given without
        one, only the ``nll_loss`` metric.
      versions: int ``[..., T]``, the policy version that sampled each token: read by
        the chain's :func:`~offpolicy_jax.rules.staleness` /
        :func:`~offpolicy_jax.rules.offpolicy_prefix` (which require it), and adding
        ``mis_staleness_mean`` / ``mis_staleness_max`` to its metrics.
      current_version: the trainer's version: an int, or int ``[...]``, ``[..., 1]`` or
        ``[..., T]``; given exactly with ``versions``.
      key: a PRNG key for surrogates that choose tokens at random (``clip_cov``).
      topk: a :class:`~offpolicy_jax.TopKLogprobs`, for the top-k trust regions
        (``dppo_tv`` / ``dppo_kl`` with ``divergence_type="topk_*"``) and the
        ``mis_topk_*`` metrics.
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
    chain, precomputed = _correction(correction)
    return _objective(
        "decoupled_ppo", locals(), chain=chain, surrogate=surrogate, precomputed=precomputed
    )


def ppo(
    logp: ArrayLike,
    old_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    surrogate: SurrogateSpec | None = None,
    aggregation: str = "sequence_mean",
    rejected_in_denominator: bool = False,
    metric_reduction: str = "sequence",
    loss_scale_factor: float | None = None,
    regularisers: Regularisers = (),
    opsm_delta: float | None = None,
    get_mismatch_metrics: bool = False,
    correction: Correction | None = None,
    rollout_logp: ArrayLike | None = None,
    ref_logp: ArrayLike | None = None,
    entropy: ArrayLike | None = None,
    rewards: ArrayLike | None = None,
    versions: ArrayLike | None = None,
    current_version: ArrayLike | None = None,
    key: ArrayLike | None = None,
    topk: TopKLogprobs | None = None,
    axis_names: AxisNames = None,
    segment_ids: ArrayLike | None = None,
    num_segments: int | None = None,
) -> Parts:
    """PPO without rollout correction: ``ℓ(θ; π_old)`` aggregated over ``mask``.

    Schulman et al. (2017). Equal to :func:`~offpolicy_jax.policy_loss_parts` with
    ``LossConfig(algorithm="ppo")`` and the same surrogate, aggregation and settings.

    Args:
      logp: ``[..., T]`` log π_θ (differentiated).
      old_logp: ``[..., T]`` log π_old, the ratio denominator.
      advantages: ``[..., T]`` or ``[...]``.
      mask: ``[..., T]``; > 0 = trained on.
      surrogate: as :func:`decoupled_ppo`.
      aggregation, metric_reduction, loss_scale_factor: as :func:`decoupled_ppo`.
      rejected_in_denominator: keep the sequences ``opsm_delta`` drops (and those
        with a non-finite input) in the loss denominator.
      regularisers, opsm_delta, get_mismatch_metrics: as :func:`decoupled_ppo`.
      correction: None, or a chain of rules that only reports metrics (the form of a
        metrics-only ``CorrectionConfig`` in ``LossConfig(algorithm="ppo", ...)``, e.g.
        ``opj.rules.chain(opj.rules.mismatch_metrics(), nonfinite_rollout="neutral")``):
        its metrics of π_old against ``rollout_logp`` beside the loss, and its
        ``nonfinite_rollout`` for the loss's reads of ``rollout_logp``.
      rollout_logp: ``[..., T]`` log π_rollout, or None; required by
        ``get_mismatch_metrics`` and ``correction``; given, it adds ``train_rollout_logprob_abs_diff`` and
        is the behaviour policy of ``opsm_delta`` (else π_old is).
      ref_logp, entropy, rewards, versions, current_version, key, topk: as
        :func:`decoupled_ppo` (``versions`` add the staleness metrics to
        ``get_mismatch_metrics``'s).
      axis_names, segment_ids, num_segments: as :func:`decoupled_ppo`.

    Returns:
      ``(loss_parts, metric_parts)`` as :func:`decoupled_ppo`.
    """
    return _objective(
        "ppo", locals(), chain=None, surrogate=surrogate, metrics_chain=_metrics_only(correction)
    )


def bypass_ppo(
    logp: ArrayLike,
    rollout_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    surrogate: SurrogateSpec | None = None,
    correction: Correction | None = None,
    aggregation: str = "sequence_mean",
    rejected_in_denominator: bool = False,
    metric_reduction: str = "sequence",
    loss_scale_factor: float | None = None,
    regularisers: Regularisers = (),
    opsm_delta: float | None = None,
    get_mismatch_metrics: bool = False,
    ref_logp: ArrayLike | None = None,
    entropy: ArrayLike | None = None,
    rewards: ArrayLike | None = None,
    versions: ArrayLike | None = None,
    current_version: ArrayLike | None = None,
    key: ArrayLike | None = None,
    topk: TopKLogprobs | None = None,
    axis_names: AxisNames = None,
    segment_ids: ArrayLike | None = None,
    num_segments: int | None = None,
) -> Parts:
    """Bypass PPO: ``ℓ(θ; π_rollout)``, the rollout log-probs as the ratio denominator.

    No π_old forward pass and no IS weights. Equal to
    :func:`~offpolicy_jax.policy_loss_parts` with ``LossConfig(algorithm="bypass_ppo")``
    and the same surrogate, aggregation and settings.

    Args:
      logp: ``[..., T]`` log π_θ (differentiated).
      rollout_logp: ``[..., T]`` log π_rollout, the ratio denominator.
      advantages: ``[..., T]`` or ``[...]``.
      mask: ``[..., T]``; > 0 = trained on.
      surrogate: as :func:`decoupled_ppo`.
      correction: None, or a chain of rules that rejects but leaves every weight at 1
        (rejection rules, the veto, metric groups, ``importance_weights(mode="none")``),
        run on ``sg(π_θ)`` against π_rollout: verl's bypass PPO-clip with
        ``rollout_rs`` (``LossConfig`` takes it as a ``CorrectionConfig`` with
        ``tis_mode: none``). A rule that sets weights raises ``ValueError``.
      aggregation, metric_reduction, loss_scale_factor: as :func:`decoupled_ppo`.
      rejected_in_denominator: keep the tokens ``correction`` and ``opsm_delta``
        reject (and the sequences with a non-finite input) in the loss denominator.
      regularisers, opsm_delta: as :func:`decoupled_ppo`.
      get_mismatch_metrics: the §4 metrics of ``sg(π_θ)`` against π_rollout.
      ref_logp, entropy, rewards, versions, current_version, key, topk: as
        :func:`decoupled_ppo`.
      axis_names, segment_ids, num_segments: as :func:`decoupled_ppo`.

    Returns:
      ``(loss_parts, metric_parts)`` as :func:`decoupled_ppo`.
    """
    old_logp = None  # the ratio's denominator is π_rollout
    return _objective(
        "bypass_ppo", locals(), chain=_rejection_only(correction), surrogate=surrogate
    )


def reinforce_is(
    logp: ArrayLike,
    rollout_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    correction: Correction | CorrectionResult,
    old_logp: ArrayLike | None = None,
    aggregation: str = "sequence_mean",
    rejected_in_denominator: bool = False,
    metric_reduction: str = "sequence",
    loss_scale_factor: float | None = None,
    regularisers: Regularisers = (),
    opsm_delta: float | None = None,
    get_mismatch_metrics: bool = False,
    ref_logp: ArrayLike | None = None,
    entropy: ArrayLike | None = None,
    rewards: ArrayLike | None = None,
    versions: ArrayLike | None = None,
    current_version: ArrayLike | None = None,
    topk: TopKLogprobs | None = None,
    axis_names: AxisNames = None,
    segment_ids: ArrayLike | None = None,
    num_segments: int | None = None,
) -> Parts:
    """REINFORCE with importance sampling: ``ℓ' = −sg(w(π_θ/π_rollout)) · A · log π_θ`` on ``m'``.

    Williams (1992); the IS weights ``w`` and the final mask ``m'`` come from
    ``correction`` run on ``sg(π_θ)`` against π_rollout (no ratio, no clip: the weights
    are the only correction; miles' ``use_rollout_logprobs`` with ``use_tis``, verl's
    bypass mode with ``loss_type: reinforce``). Equal to
    :func:`~offpolicy_jax.policy_loss_parts` with ``LossConfig(algorithm="reinforce_is",
    ...)`` naming the same pieces.

    Args:
      logp: ``[..., T]`` log π_θ (differentiated).
      rollout_logp: ``[..., T]`` log π_rollout.
      advantages: ``[..., T]`` or ``[...]``.
      mask: ``[..., T]``; > 0 = trained on.
      correction: as :func:`decoupled_ppo`, with ``sg(π_θ)`` in π_old's place.
      old_logp: ``[..., T]`` log π_old, or None: only read by ``get_mismatch_metrics``
        (the §4 metrics of π_old, else of ``sg(π_θ)``, against π_rollout).
      aggregation, rejected_in_denominator, metric_reduction, loss_scale_factor: as
        :func:`decoupled_ppo`.
      regularisers, opsm_delta, get_mismatch_metrics: as :func:`decoupled_ppo`.
      ref_logp, entropy, rewards, versions, current_version, topk: as
        :func:`decoupled_ppo`.
      axis_names, segment_ids, num_segments: as :func:`decoupled_ppo`.

    Returns:
      ``(loss_parts, metric_parts)`` as :func:`decoupled_ppo`.
    """
    chain, precomputed = _correction(correction)
    # The REINFORCE term has no surrogate; the plan keeps the default's.
    return _objective("reinforce_is", locals(), chain=chain, precomputed=precomputed)
