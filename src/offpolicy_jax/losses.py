"""``policy_loss``: PPO, bypass PPO, decoupled 3-policy PPO with IS, REINFORCE-IS.

Per-token terms come from ``surrogates``, IS weights and the rejection mask from
``compute_correction`` (or ``VanillaTIS`` / a user callable), and the
aggregation below turns them into a scalar as a (numerator, denominator) pair,
so that micro-batches and devices pool exactly (semantics.md §5).

=================  ======================================  =====================
algorithm          per-token loss                          ratio denominator d
=================  ======================================  =====================
``ppo``            ``ℓ(θ; d)``                             π_old
``bypass_ppo``     ``ℓ(θ; d)``                             π_rollout
``decoupled_ppo``  ``w(o, b) · ℓ(θ; d)`` on ``m'``         π_old
``reinforce_is``   ``−sg(w(θ, b)) · A · θ`` on ``m'``      (no ratio, no clip)
=================  ======================================  =====================

Decoupled PPO: Hilton et al., "Batch size-invariance for policy optimization"
(2022); truncated IS under training–inference mismatch: Yao et al. (2025).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from offpolicy_jax import _reduce, metrics, rejection
from offpolicy_jax._reduce import AxisNames, MeanParts, MeshAxes
from offpolicy_jax._validation import (
    as_array,
    as_float_logp,
    as_float_mask,
    check_same_shape,
    check_split_over,
)
from offpolicy_jax.config import CorrectionConfig, LossConfig, VanillaTIS
from offpolicy_jax.correction import CorrectionResult, correction_parts
from offpolicy_jax.surrogates import ppo_surrogate, reinforce_term, vanilla_tis

METRICS_ONLY = CorrectionConfig()
"""The default correction: §4 mismatch metrics only (non-finite sequences left out)."""


class LossParts(NamedTuple):
    """The loss as ``numerator / denominator``; sum parts over micro-batches, then divide.

    The denominator never depends on ``logp``, so the gradient pools the same
    way: ``∇(Σ numerator) / Σ denominator``.
    """

    numerator: jax.Array
    denominator: jax.Array

    def value(self) -> jax.Array:
        return _reduce.safe_divide(self.numerator, self.denominator)


def aggregate(
    per_token_loss: jax.Array,
    final_mask: jax.Array,
    denominator_mask: jax.Array,
    aggregation: str,
    axes: MeshAxes = MeshAxes(),
) -> LossParts:
    """Aggregates per-token losses ``ℓ'`` over the final mask ``m'``.

    * ``"sequence_mean"``: mean over sequences with ``Σ m'' > 0`` of ``Σ ℓ' m' / Σ m''``
    * ``"token_mean"``: ``Σ ℓ' m' / Σ m''``
    * ``"sequence_sum"``: ``Σ_t ℓ' m'`` averaged over the same sequences as
      ``sequence_mean`` (no length normalisation)

    Args:
      per_token_loss: ``[..., T]`` weighted per-token losses ``ℓ'``.
      final_mask: ``[..., T]`` float mask ``m'`` of the tokens in the loss.
      denominator_mask: ``[..., T]`` float ``m''``: ``m'`` (D5, rejected tokens
        leave the denominator) or the original mask.
      aggregation: one of the three names above.
      axes: mesh axes to combine over inside ``shard_map``.

    Returns:
      :class:`LossParts`; an empty batch gives 0 / 0, whose value is 0.
    """
    columns = {
        "loss": _reduce.total(per_token_loss, final_mask),
        "count": _reduce.count(denominator_mask),
    }
    sums = _reduce.seq_reduce(columns, axes)
    terms = aggregation_terms(sums["loss"], sums["count"], aggregation)
    return LossParts(*_reduce.batch_means({"loss": terms}, axes)["loss"])


def aggregation_terms(
    per_seq_total: jax.Array, count: jax.Array, aggregation: str
) -> _reduce.SeqMean:
    """:func:`aggregate`'s per-sequence terms, from ``Σ_t ℓ' m'`` and ``Σ_t m''`` (``[...]``)."""
    if aggregation == "token_mean":
        return _reduce.SeqMean(per_seq_total, count)
    if aggregation == "sequence_mean":
        per_seq = _reduce.safe_divide(per_seq_total, count)
    elif aggregation == "sequence_sum":
        per_seq = per_seq_total
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}")
    nonempty = count > 0
    return _reduce.SeqMean(jnp.where(nonempty, per_seq, 0.0), jnp.where(nonempty, 1.0, 0.0))


def _check_inputs(config, logp, old_logp, rollout_logp, advantages, mask):
    if not isinstance(config, LossConfig):
        raise TypeError(f"config must be a LossConfig, got {type(config).__name__}")
    algorithm = config.algorithm
    theta = as_float_logp("logp", logp)
    if old_logp is None and algorithm in ("ppo", "decoupled_ppo"):
        raise ValueError(
            f"old_logp is required for algorithm {algorithm!r} (it is the ratio denominator); "
            "only 'bypass_ppo' and 'reinforce_is' accept old_logp=None"
        )
    needs_rollout = (
        algorithm != "ppo" or config.correction is not None or config.get_mismatch_metrics
    )
    if rollout_logp is None and needs_rollout:
        raise ValueError(
            f"rollout_logp is required for algorithm {algorithm!r} with this correction/metrics "
            "setting: without the inference engine's log-probs there is nothing to correct"
        )
    # π_old and π_rollout are data, never differentiated: the IS weights and the
    # ratio denominator must carry no gradient into them.
    old = None if old_logp is None else jax.lax.stop_gradient(as_float_logp("old_logp", old_logp))
    rollout = (
        None
        if rollout_logp is None
        else jax.lax.stop_gradient(as_float_logp("rollout_logp", rollout_logp))
    )
    weights_mask = as_float_mask("mask", mask)
    check_same_shape("logp", theta, old_logp=old, rollout_logp=rollout, mask=weights_mask)
    if advantages is None:
        raise ValueError("advantages is required but got None")
    adv = jnp.asarray(as_array("advantages", advantages))
    if not (jnp.issubdtype(adv.dtype, jnp.floating) or jnp.issubdtype(adv.dtype, jnp.integer)):
        raise TypeError(f"advantages must be a numeric array, got dtype {adv.dtype}")
    if adv.shape == theta.shape[:-1]:
        adv = adv[..., None]
    elif adv.shape != theta.shape:
        raise ValueError(
            f"advantages has shape {adv.shape}; expected {theta.shape} (per token) or "
            f"{theta.shape[:-1]} (per sequence) to match logp {theta.shape}"
        )
    return theta, old, rollout, adv.astype(jnp.float32), weights_mask


def _correct(config, old, rollout, mask, reduction, axes, precomputed):
    """IS weights (unmasked), final mask and metric parts of the configured correction."""
    correction = config.correction
    if precomputed is not None:
        final = jnp.asarray(precomputed.mask, jnp.float32)
        # CorrectionResult weights are w·m'; the loss applies m' once, itself.
        weights = _reduce.safe_divide(jnp.asarray(precomputed.weights, jnp.float32), final)
        # Its metrics describe the whole batch and live in precomputed.metrics;
        # repeating them here would count them once per micro-batch when pooled.
        return jax.lax.stop_gradient(weights), final, {}
    if isinstance(correction, CorrectionConfig):
        return correction_parts(old, rollout, mask, correction, reduction=reduction, axes=axes)
    if isinstance(correction, VanillaTIS):
        finite = rejection.finite_sequences(mask, old, rollout, axes=axes)
        weights, parts = vanilla_tis(
            old,
            rollout,
            mask,
            clip_low=correction.clip_low,
            clip=correction.clip,
            reduction=reduction,
            axes=axes,
        )
        return weights, jnp.where(finite, mask, 0.0), parts
    result = correction(old, rollout, mask, reduction=reduction, axis_names=axes)
    final = jnp.asarray(result.mask, jnp.float32)
    weights = _reduce.safe_divide(jnp.asarray(result.weights, jnp.float32), final)
    return jax.lax.stop_gradient(weights), final, dict(result.metrics)


def policy_loss_parts(
    logp: jax.typing.ArrayLike,
    old_logp: jax.typing.ArrayLike | None,
    rollout_logp: jax.typing.ArrayLike | None,
    advantages: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike,
    config: LossConfig,
    *,
    axis_names: AxisNames = None,
    correction_result: CorrectionResult | None = None,
) -> tuple[LossParts, dict[str, MeanParts | jax.Array]]:
    """:func:`policy_loss` as poolable parts: ``(LossParts, metric parts)``.

    Sum both over micro-batches (``jax.tree.map(jnp.add, ...)``), then call
    ``.value()`` on the loss and :func:`offpolicy_jax.finalize_metrics` on the
    metrics: the result equals the full-batch call. With batch normalisation
    or sequence-level statistics that need the whole batch, compute the
    correction once on the full batch and pass it as ``correction_result``
    (normalising per micro-batch would bias the pooled loss).

    Args: as :func:`policy_loss`, plus
      correction_result: a :class:`CorrectionResult` computed beforehand for
        exactly these tokens (decoupled_ppo); replaces the configured correction,
        whose metrics are then only in ``correction_result.metrics``.
    """
    theta, old, rollout, adv, mask = _check_inputs(
        config, logp, old_logp, rollout_logp, advantages, mask
    )
    if correction_result is not None and not config.reweights:
        raise ValueError(
            f"correction_result is only used by algorithms that apply IS weights "
            f"(decoupled_ppo, reinforce_is), not {config.algorithm!r}"
        )
    axes = _reduce.as_mesh_axes(axis_names)
    # Per-sequence advantages are legitimately replicated across token shards.
    check_split_over(
        axes.batch + axes.token, logp=logp, old_logp=old_logp, rollout_logp=rollout_logp, mask=mask
    )
    reduction = config.metric_reduction
    algorithm = config.algorithm
    valid = mask > 0
    # Garbage advantages at padded positions would turn 0-cotangents into NaN.
    adv = jnp.where(valid, adv, 0.0)
    theta_sg = jax.lax.stop_gradient(theta)
    # π_old for the IS ratio and the mismatch metrics: sg(θ) where it is absent.
    proxy_old = old if old is not None else theta_sg

    parts: dict[str, MeanParts | jax.Array] = {}
    if config.reweights:
        is_numerator = theta_sg if algorithm == "reinforce_is" else old
        weights, final_mask, correction_metrics = _correct(
            config, is_numerator, rollout, mask, reduction, axes, correction_result
        )
        parts.update(correction_metrics)
    else:
        weights, final_mask = None, mask
    correction_has_them = algorithm == "decoupled_ppo" and isinstance(
        config.correction, CorrectionConfig
    )
    if config.wants_mismatch_metrics and not correction_has_them:
        # §4 metrics of π_old (sg(θ) where absent) against π_rollout; the loss is
        # unchanged. In reinforce_is they replace those of the correction's sg(θ).
        _, _, mismatch = correction_parts(
            proxy_old, rollout, mask, METRICS_ONLY, reduction=reduction, axes=axes
        )
        parts.update(mismatch)

    # The loss and its metrics are per-sequence sums of per-token terms: one pass
    # (seq_reduce) takes them all, and its backward is one elementwise pass.
    kept = final_mask > 0
    sg = jax.lax.stop_gradient
    columns = {"count": _reduce.count(final_mask), "mask_count": _reduce.count(mask)}
    if algorithm == "reinforce_is":
        per_token = reinforce_term(jnp.where(kept, theta, 0.0), adv, weights)
    else:
        denominator = rollout if algorithm == "bypass_ppo" else old
        terms = ppo_surrogate(
            theta,
            denominator,
            adv,
            valid,
            clip_eps=config.clip_eps,
            clip_eps_high=config.upper_clip_eps,
            dual_clip_c=config.dual_clip_c,
        )
        per_token = terms.loss if weights is None else jnp.where(kept, weights, 0.0) * terms.loss
        columns["pg_clipfrac"] = _reduce.count_where(terms.clipped, final_mask)
        columns["ppo_kl"] = _reduce.total(sg(terms.log_ratio), final_mask)
        if rollout is not None:
            # D8b: in bypass mode π_old is sg(θ); the reference reports 0 here.
            source = theta_sg if algorithm == "bypass_ppo" else old
            diff = jnp.abs(source - rollout)
            columns["train_rollout_logprob_abs_diff"] = _reduce.total(
                sg(jnp.where(jnp.isfinite(diff), diff, 0.0)), final_mask
            )
        if config.correction is not None or config.get_mismatch_metrics:
            columns["ois"] = _reduce.total(sg(terms.ratio), mask)
    columns["loss"] = _reduce.total(per_token, final_mask)
    sums = _reduce.seq_reduce(columns, axes)

    denominator = sums["mask_count"] if config.rejected_in_denominator else sums["count"]
    means = {"pg_loss": aggregation_terms(sums["loss"], denominator, config.aggregation)}
    for key in ("pg_clipfrac", "ppo_kl", "train_rollout_logprob_abs_diff"):
        if key in sums:
            means[key] = _reduce.seq_mean(sums[key], sums["count"], reduction)
    if "ois" in sums:
        means["ois"] = _reduce.seq_mean(sums["ois"], sums["mask_count"], reduction)
    parts.update(_reduce.batch_means(means, axes))
    return LossParts(*parts["pg_loss"]), parts


def policy_loss(
    logp: jax.typing.ArrayLike,
    old_logp: jax.typing.ArrayLike | None,
    rollout_logp: jax.typing.ArrayLike | None,
    advantages: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike,
    config: LossConfig,
    *,
    axis_names: AxisNames = None,
    correction_result: CorrectionResult | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Policy-gradient loss with rollout correction (semantics.md §5).

    ``ppo``: ``ℓ(θ; π_old)``; ``bypass_ppo``: ``ℓ(θ; π_rollout)``;
    ``decoupled_ppo``: ``w(π_old/π_rollout) · ℓ(θ; π_old)`` on the corrected mask;
    ``reinforce_is``: ``−sg(w(π_θ/π_rollout)) · A · log π_θ``. ``ℓ`` is the
    clipped PPO surrogate (:func:`~offpolicy_jax.surrogates.ppo_surrogate`), the
    weights come from ``config.correction``; aggregation per
    ``config.aggregation``. IS weights never carry gradient.

    Args:
      logp: ``[..., T]`` log π_θ of the sampled tokens: the differentiated input.
      old_logp: ``[..., T]`` log π_old from the training engine, or None for
        ``bypass_ppo`` / ``reinforce_is``.
      rollout_logp: ``[..., T]`` log π_rollout from the inference engine (may be
        None only for plain ``ppo`` without correction or mismatch metrics).
      advantages: ``[..., T]`` per token or ``[...]`` per sequence.
      mask: ``[..., T]`` bool or 0/1 float; 1 = token is trained on.
      config: a :class:`LossConfig` (static: hashable).
      axis_names: mesh axes to ``psum`` over inside ``shard_map`` (see
        :func:`~offpolicy_jax.compute_correction`).
      correction_result: optional precomputed correction for these tokens.

    Returns:
      ``(loss, metrics)``: a float32 scalar (0, with zero gradients, when nothing
      is left to train on) and a dict of float32 scalar metrics.
    """
    loss, parts = policy_loss_parts(
        logp,
        old_logp,
        rollout_logp,
        advantages,
        mask,
        config,
        axis_names=axis_names,
        correction_result=correction_result,
    )
    return loss.value().astype(jnp.float32), metrics.finalize(parts)
