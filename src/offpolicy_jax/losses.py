"""``policy_loss``: PPO, bypass PPO, decoupled 3-policy PPO with IS, REINFORCE-IS.

Per-token terms come from ``surrogates``, IS weights and the rejection mask from
``compute_correction`` (or ``VanillaTIS`` / a user callable), and the
aggregation below turns them into a scalar as a (numerator, denominator) pair,
so that micro-batches and devices pool exactly (docs/semantics.md §5).

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

import dataclasses

import jax
import jax.numpy as jnp

from offpolicy_jax import _objective, metrics, rules
from offpolicy_jax import reduction as _reduce
from offpolicy_jax._validation import (
    as_array,
    as_float_logp,
    as_float_mask,
    check_same_shape,
    check_split_over,
)
from offpolicy_jax.config import CorrectionConfig, LossConfig, VanillaTIS
from offpolicy_jax.correction import CorrectionResult, correction_parts
from offpolicy_jax.ratios import metric_exp
from offpolicy_jax.reduction import AxisNames, MeanParts
from offpolicy_jax.surrogates import ppo_surrogate, reinforce_term, vanilla_tis

METRICS_ONLY = CorrectionConfig()
"""The default correction: §4 mismatch metrics only (non-finite sequences left out)."""


LossParts = MeanParts
"""The loss as ``numerator / denominator``: the library's one poolable type.

The denominator never depends on ``logp``, so the gradient pools the same way:
``∇(Σ numerator) / Σ denominator``.
"""


def aggregate(
    per_token_loss: jax.Array,
    final_mask: jax.Array,
    denominator_mask: jax.Array,
    aggregation: str,
    axis_names: AxisNames = None,
    segment_ids: jax.typing.ArrayLike | None = None,
    num_segments: int | None = None,
    *,
    loss_scale_factor: float | None = None,
) -> MeanParts:
    """Aggregates per-token losses ``ℓ'`` over the final mask ``m'`` (docs/semantics.md §5).

    * ``"sequence_mean"``: mean over sequences with ``Σ m'' > 0`` of ``Σ ℓ' m' / Σ m''``
    * ``"token_mean"``: ``Σ ℓ' m' / Σ m''``
    * ``"sequence_sum"``: ``Σ_t ℓ' m'`` averaged over the same sequences as
      ``sequence_mean`` (no length normalisation)
    * ``"sequence_sum_norm"``: ``sequence_sum / loss_scale_factor`` (default: the padded
      length ``T`` of the token axis; verl's ``seq-mean-token-sum-norm``)
    * ``"token_sum"``: ``Σ ℓ' m'`` (no normalisation; its parts have denominator 0, and
      the value of parts with denominator 0 is their numerator)
    * ``"row_mean"``: ``Σ_t ℓ' m' / Σ m''`` averaged over every sequence slot, empty
      and fully rejected ones included (verl's GMPO: ``torch.mean`` over the rows)

    Use it with :func:`policy_loss_terms` to add a per-token term (KL, entropy) over
    the same post-rejection mask as the policy loss.

    Args:
      per_token_loss: ``[..., T]`` per-token losses ``ℓ'``.
      final_mask: ``[..., T]`` mask ``m'`` of the tokens in the loss (a float value
        is the token's loss weight).
      denominator_mask: ``[..., T]`` ``m''``: ``m'`` (D5) or the original mask.
      aggregation: one of the names above.
      axis_names: mesh axes to ``psum`` over inside ``shard_map``.
      segment_ids, num_segments: packed rows (see :func:`policy_loss`).
      loss_scale_factor: ``sequence_sum_norm``'s divisor (None: the padded length).

    Returns:
      :class:`MeanParts`; an empty batch gives 0 / 0, whose value is 0.

    Examples:
      >>> import jax.numpy as jnp, offpolicy_jax as opj
      >>> m = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
      >>> x = jnp.array([[1.0, 3.0, 9.0], [5.0, 9.0, 9.0]])
      >>> float(opj.aggregate(x, m, m, "sequence_mean").value())
      3.5
    """
    raw_final, raw_denominator = final_mask, denominator_mask
    final_mask = as_float_mask("final_mask", final_mask)
    denominator_mask = as_float_mask("denominator_mask", denominator_mask)
    layout = _reduce.layout(
        _reduce.as_mesh_axes(axis_names), segment_ids, num_segments, final_mask.shape
    )
    final_mask = _reduce.only_segments(layout, final_mask, raw=raw_final)
    denominator_mask = _reduce.only_segments(layout, denominator_mask, raw=raw_denominator)
    sums = layout.reduce(
        {
            "loss": _reduce.total(per_token_loss, final_mask),
            "count": _reduce.count(denominator_mask),
        }
    )
    horizon = _horizon(aggregation, loss_scale_factor, final_mask.shape[-1], layout)
    terms = aggregation_terms(sums["loss"], sums["count"], aggregation, horizon=horizon)
    return layout.batch_means({"loss": terms})["loss"]


def _horizon(aggregation, loss_scale_factor, length, layout):
    """``sequence_sum_norm``'s divisor: the configured constant, or the padded length."""
    if aggregation != "sequence_sum_norm":
        return 1.0
    if loss_scale_factor is not None:
        return loss_scale_factor
    # The whole token axis: a context-parallel shard holds 1/n of it.
    return length * (jax.lax.psum(1, layout.axes.token) if layout.axes.token else 1)


def aggregation_terms(
    per_seq_total: jax.Array,
    count: jax.Array,
    aggregation: str,
    *,
    horizon: float | jax.Array = 1.0,
) -> MeanParts:
    """:func:`aggregate`'s per-sequence terms, from ``Σ_t ℓ' m'`` and ``Σ_t m''``.

    ``horizon`` is ``sequence_sum_norm``'s divisor.
    """
    if aggregation == "token_mean":
        return MeanParts(per_seq_total, count)
    if aggregation == "token_sum":
        return MeanParts(per_seq_total, jnp.zeros_like(count))
    if aggregation in ("sequence_mean", "row_mean"):
        per_seq = _reduce.safe_divide(per_seq_total, count)
    elif aggregation in ("sequence_sum", "sequence_sum_norm"):
        per_seq = per_seq_total
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}")
    nonempty = count > 0
    if aggregation == "row_mean":
        return MeanParts(jnp.where(nonempty, per_seq, 0.0), jnp.ones_like(count))
    weight = horizon if aggregation == "sequence_sum_norm" else 1.0
    return MeanParts(jnp.where(nonempty, per_seq, 0.0), jnp.where(nonempty, weight, 0.0))


def _check_regularisers(config, theta, ref_logp, entropy):
    """``ref_logp`` / ``entropy``: required by a non-zero coefficient, shaped like ``logp``."""
    if config.kl_coef > 0 and ref_logp is None:
        raise ValueError(
            f"ref_logp is required: LossConfig.kl_coef = {config.kl_coef} adds a KL-to-reference "
            "term (pass the reference policy's log-probs of the sampled tokens)"
        )
    if config.entropy_coef != 0 and entropy is None:
        raise ValueError(
            f"entropy is required: LossConfig.entropy_coef = {config.entropy_coef} adds an "
            "entropy bonus (pass the per-token entropies [..., T])"
        )
    ref = None if ref_logp is None else jax.lax.stop_gradient(as_float_logp("ref_logp", ref_logp))
    ent = None if entropy is None else as_float_logp("entropy", entropy)
    check_same_shape("logp", theta, ref_logp=ref, entropy=ent)
    return ref, ent


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


def _precomputed(name, result, shape):
    final = jnp.asarray(result.mask, jnp.float32)
    weights = jnp.asarray(result.weights, jnp.float32)
    for field, value in (("mask", final), ("weights", weights)):
        if value.shape != tuple(shape):
            raise ValueError(
                f"{name}.{field} has shape {value.shape} but logp has shape {tuple(shape)}; "
                f"{name} must be computed for exactly these tokens"
            )
    # CorrectionResult weights are w·m'; the loss applies m' once, itself.
    return jax.lax.stop_gradient(_reduce.safe_divide(weights, final)), final


def _correct(config, old, rollout, mask, reduction, layout, precomputed, also_over_final=()):
    """IS weights (unmasked), final mask and metric parts of the configured correction
    (``also_over_final``: see :func:`~offpolicy_jax.correction.correction_parts`)."""
    correction = config.correction
    if precomputed is not None:
        # Its metrics describe the whole batch and live in precomputed.metrics;
        # repeating them here would count them once per micro-batch when pooled.
        return (*_precomputed("correction_result", precomputed, mask.shape), {})
    if isinstance(correction, CorrectionConfig):
        return correction_parts(
            old,
            rollout,
            mask,
            correction,
            reduction=reduction,
            layout=layout,
            also_over_final=also_over_final,
        )
    if isinstance(correction, VanillaTIS):
        clip_low, clip = correction.clip_low, correction.clip
        weights, parts = vanilla_tis(
            old, rollout, mask, clip_low=clip_low, clip=clip, reduction=reduction, layout=layout
        )
        return weights, mask, parts
    result = correction(
        old,
        rollout,
        mask,
        reduction=reduction,
        axis_names=layout.axes,
        **_reduce.segment_arguments(layout),
    )
    return (*_precomputed("config.correction's result", result, mask.shape), dict(result.metrics))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PolicyLossTerms:
    """Per-token view of :func:`policy_loss` (a pytree).

    Attributes:
      loss: ``[..., T]`` per-token loss ``ℓ'`` (IS-weighted; 0 outside ``mask``).
      mask: ``[..., T]`` float final mask ``m'``: after rejection and without the
        sequences that hold a non-finite input at a valid token.
      denominator_mask: ``[..., T]`` ``m''`` of the aggregation (``m'``, or the
        original mask with ``rejected_in_denominator``).
      parts: the loss as :class:`MeanParts` (``aggregate(loss, mask,
        denominator_mask, config.aggregation)``, computed in the same pass).
      metrics: metric parts (``MeanParts`` or arrays), for ``finalize_metrics``.
    """

    loss: jax.Array
    mask: jax.Array
    denominator_mask: jax.Array
    parts: MeanParts
    metrics: dict[str, MeanParts | jax.Array]


def policy_loss_terms(
    logp: jax.typing.ArrayLike,
    old_logp: jax.typing.ArrayLike | None,
    rollout_logp: jax.typing.ArrayLike | None,
    advantages: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike,
    config: LossConfig,
    *,
    axis_names: AxisNames = None,
    correction_result: CorrectionResult | None = None,
    segment_ids: jax.typing.ArrayLike | None = None,
    num_segments: int | None = None,
    contiguous_segments: bool = False,
    ref_logp: jax.typing.ArrayLike | None = None,
    entropy: jax.typing.ArrayLike | None = None,
) -> PolicyLossTerms:
    """:func:`policy_loss` with its per-token terms and its final mask.

    A per-token KL or entropy term over the same post-rejection mask is then a few
    lines (see the example). Arguments as :func:`policy_loss`.

    Returns:
      :class:`PolicyLossTerms`.

    Examples:
      >>> import jax, jax.numpy as jnp, offpolicy_jax as opj
      >>> logp = jnp.log(jnp.array([[0.5, 0.4, 0.9], [0.3, 0.2, 0.7]]))
      >>> ref_logp = jnp.log(jnp.array([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
      >>> mask = jnp.array([[1, 1, 0], [1, 1, 1]], bool)
      >>> cfg = opj.LossConfig(algorithm="ppo")
      >>> def loss_fn(lp):
      ...     t = opj.policy_loss_terms(lp, logp, None, jnp.array([1.0, -1.0]), mask, cfg)
      ...     d = ref_logp - lp  # per-token k3 estimate of KL(π_θ ‖ π_ref)
      ...     kl = jnp.exp(d) - d - 1
      ...     kl = opj.aggregate(kl, t.mask, t.denominator_mask, cfg.aggregation)
      ...     return t.parts.value() + 0.1 * kl.value()
      >>> round(float(loss_fn(logp)), 4)  # PPO part 0 (ratio 1, advantages ±1) + 0.1 · KL
      0.0138
      >>> jax.grad(loss_fn)(logp).shape
      (2, 3)
    """
    return _policy_loss_terms(
        logp,
        old_logp,
        rollout_logp,
        advantages,
        mask,
        config,
        axis_names=axis_names,
        correction_result=correction_result,
        segment_ids=segment_ids,
        num_segments=num_segments,
        contiguous_segments=contiguous_segments,
        ref_logp=ref_logp,
        entropy=entropy,
    )


def _policy_loss_terms(
    logp,
    old_logp,
    rollout_logp,
    advantages,
    mask,
    config: LossConfig,
    *,
    axis_names: AxisNames = None,
    correction_result: CorrectionResult | None = None,
    segment_ids=None,
    num_segments: int | None = None,
    contiguous_segments: bool = False,
    ref_logp=None,
    entropy=None,
) -> PolicyLossTerms:
    raw_mask = mask
    theta, old, rollout, adv, mask = _check_inputs(
        config, logp, old_logp, rollout_logp, advantages, mask
    )
    axes = _reduce.as_mesh_axes(axis_names)
    layout = _reduce.layout(axes, segment_ids, num_segments, theta.shape, contiguous_segments)
    if segment_ids is not None and jnp.shape(advantages) != theta.shape:
        raise ValueError(
            f"advantages has shape {jnp.shape(advantages)}; with segment_ids they must be "
            f"per token, {theta.shape} (give each token its sequence's advantage)"
        )
    mask = _reduce.only_segments(layout, mask, raw=raw_mask)
    ref, ent = _check_regularisers(config, theta, ref_logp, entropy)
    if correction_result is not None and not config.reweights:
        raise ValueError(
            f"correction_result is only used by algorithms that apply IS weights "
            f"(decoupled_ppo, reinforce_is), not {config.algorithm!r}"
        )
    # Per-sequence advantages are legitimately replicated across token shards.
    check_split_over(
        axes.batch + axes.token,
        logp=logp,
        old_logp=old_logp,
        rollout_logp=rollout_logp,
        mask=mask,
        segment_ids=segment_ids,
    )
    reduction = config.metric_reduction
    algorithm = config.algorithm
    valid = mask > 0
    # A non-finite θ or advantage at a valid token takes its sequence out of the loss
    # (§0); garbage advantages elsewhere would turn 0-cotangents into NaN.
    bad_model = ~jnp.isfinite(theta) | ~jnp.isfinite(adv)
    # So does a non-finite reference log-prob or entropy that enters the loss: read as
    # 0 it would silently drop the KL / entropy term of that token (§5.2).
    if ref is not None and config.kl_coef > 0:
        bad_model = bad_model | ~jnp.isfinite(ref)
    if ent is not None and config.entropy_coef != 0:
        bad_model = bad_model | ~jnp.isfinite(ent)
    adv = jnp.where(valid & jnp.isfinite(adv), adv, 0.0)
    theta_sg = jax.lax.stop_gradient(theta)
    # π_old for the IS ratio and the mismatch metrics: sg(θ) where it is absent.
    proxy_old = old if old is not None else theta_sg

    sg = jax.lax.stop_gradient
    abs_diff = None
    if algorithm != "reinforce_is" and rollout is not None:
        # D8b: in bypass mode π_old is sg(θ); the reference reports 0 here.
        source = theta_sg if algorithm == "bypass_ppo" else old
        assert source is not None  # ppo / decoupled_ppo require old_logp
        diff = jnp.abs(source - rollout)
        abs_diff = sg(jnp.where(jnp.isfinite(diff), diff, 0.0))

    parts: dict[str, MeanParts | jax.Array] = {}
    if config.reweights:
        # In reinforce_is (and a rejection-only bypass_ppo) π_old is sg(θ).
        is_numerator = theta_sg if algorithm in ("reinforce_is", "bypass_ppo") else old
        weights, final_mask, correction_metrics = _correct(
            config,
            is_numerator,
            rollout,
            mask,
            reduction,
            layout,
            correction_result,
            also_over_final=() if abs_diff is None else (abs_diff,),
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
        probability = (
            isinstance(config.correction, CorrectionConfig)
            and config.correction.probability_metrics
        )
        metrics_only = CorrectionConfig(probability_metrics=True) if probability else METRICS_ONLY
        _, _, mismatch = correction_parts(
            proxy_old, rollout, mask, metrics_only, reduction=reduction, layout=layout
        )
        parts.update(mismatch)

    if config.opsm_delta is not None:  # §8 OPSM: drops sequences, like a rejection
        behaviour = rollout if rollout is not None else proxy_old
        keep, opsm_parts = rules.opsm(
            theta_sg, behaviour, adv, mask, config.opsm_delta, layout, reduction
        )
        final_mask = jnp.where(keep, final_mask, 0.0)
        parts.update(opsm_parts)

    # The loss and its metrics are per-sequence sums of per-token terms: one pass
    # (layout.reduce) takes them all, and its backward is one elementwise pass.
    kept = final_mask > 0
    columns = {
        "count": _reduce.count(final_mask),
        "mask_count": _reduce.count(mask),
        "bad_model": _reduce.count_where(bad_model, mask),
    }
    if "mis_nonfinite_seq_fraction" not in parts:
        # Not rejected by a correction pipeline: reject (and count) here, alike.
        logps = [
            x
            for x in (old, rollout, theta_sg if algorithm == "reinforce_is" else None)
            if x is not None
        ]
        bad_logp = jnp.zeros(mask.shape, bool)
        for x in logps:
            bad_logp = bad_logp | ~jnp.isfinite(x)
        columns["bad_logp"] = _reduce.count_where(bad_logp, mask)
    ratio_denominator = rollout if algorithm == "bypass_ppo" else old
    ratio_columns: dict[str, _reduce.Column] = {}
    ois_token = None
    if algorithm == "reinforce_is":
        assert weights is not None  # reinforce_is always reweights (LossConfig.reweights)
        per_token = reinforce_term(jnp.where(kept, theta, 0.0), adv, weights)
    elif config.policy_loss != "ppo_clip":
        # _check_inputs: ppo / decoupled_ppo require old_logp, bypass_ppo rollout_logp.
        assert ratio_denominator is not None
        surrogate = _objective.surrogate_columns(
            config, theta, ratio_denominator, adv, valid, final_mask, weights, layout
        )
        per_token = surrogate.loss
        columns.update(surrogate.columns)
    else:
        assert ratio_denominator is not None  # as above
        terms = ppo_surrogate(
            theta,
            ratio_denominator,
            adv,
            where=valid,
            clip_eps=config.clip_eps,
            clip_eps_high=config.upper_clip_eps,
            dual_clip_c=config.dual_clip_c,
        )
        per_token = terms.loss if weights is None else jnp.where(kept, weights, 0.0) * terms.loss
        ratio_columns["pg_clipfrac"] = _reduce.count_where(terms.clipped, final_mask)
        if terms.clipped_lower is not None:
            ratio_columns["pg_clipfrac_lower"] = _reduce.count_where(
                terms.clipped_lower, final_mask
            )
        columns["ppo_kl"] = _reduce.total(sg(terms.log_ratio), final_mask)
        # exp(θ − d) as the surrogate takes it for its ratio (one exponential for both).
        ois_token = metric_exp(-terms.log_ratio)
    if algorithm != "reinforce_is":
        if abs_diff is not None:
            # Taken in the correction's second pass when its final mask is this one
            # (the layout then finds it done): one pass reads `rollout`, not two.
            columns["train_rollout_logprob_abs_diff"] = _reduce.total(abs_diff, final_mask)
        if config.correction is not None or config.get_mismatch_metrics:
            # ois = mean exp(θ − d) (§5), not the ±S-clamped ratio: it must show the
            # divergence it exists to show; capped like every metric exponential.
            assert ratio_denominator is not None  # only reinforce_is may lack it
            if ois_token is None:
                raw = jnp.where(valid, theta_sg - sg(ratio_denominator), 0.0)
                ois_token = metric_exp(jnp.where(jnp.isnan(raw), 0.0, raw))
            columns["ois"] = _reduce.total(ois_token, mask)
    # KL-to-reference and entropy join the policy term per token: one sum, one
    # aggregation, the same final mask.
    regularisers = _objective.regulariser_terms(config, theta, ratio_denominator, valid, ref, ent)
    pg_per_token = per_token
    if "kl_loss" in regularisers:
        columns["kl_loss"] = _reduce.total(regularisers["kl_loss"], final_mask)
        if config.kl_coef:
            per_token = per_token + config.kl_coef * regularisers["kl_loss"]
    if "entropy" in regularisers:
        columns["entropy"] = _reduce.total(regularisers["entropy"], final_mask)
        if config.entropy_coef:
            per_token = per_token - config.entropy_coef * regularisers["entropy"]
    if per_token is not pg_per_token:
        columns["pg_loss"] = _reduce.total(pg_per_token, final_mask)
    columns.update(ratio_columns)
    columns["loss"] = _reduce.total(per_token, final_mask)
    sums = layout.reduce(columns)

    ok = sums["bad_model"] == 0
    means = {
        "pg_nonfinite_seq_fraction": _reduce.seq_mean_of_values(
            jnp.where(ok, 0.0, 1.0), sums["mask_count"], reduction
        )
    }
    if "bad_logp" in sums:
        logp_ok = sums["bad_logp"] == 0
        means["mis_nonfinite_seq_fraction"] = _reduce.seq_mean_of_values(
            jnp.where(logp_ok, 0.0, 1.0), sums["mask_count"], reduction
        )
        ok = ok & logp_ok
    # Such sequences are rejected like any other: they leave m' (the loss, its metrics)
    # and stay in m'' = m under rejected_in_denominator, as in the correction's path.
    count = jnp.where(ok, sums["count"], 0.0)
    mask_count = jnp.where(ok, sums["mask_count"], 0.0)
    denominator = sums["mask_count"] if config.rejected_in_denominator else count
    horizon = _horizon(config.aggregation, config.loss_scale_factor, mask.shape[-1], layout)
    for key in ("loss", "pg_loss", "kl_loss", "entropy"):
        if key in sums:
            means[key] = aggregation_terms(
                jnp.where(ok, sums[key], 0.0), denominator, config.aggregation, horizon=horizon
            )
    means.setdefault("pg_loss", means["loss"])
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "train_rollout_logprob_abs_diff"):
        if key in sums:
            means[key] = _reduce.seq_mean(jnp.where(ok, sums[key], 0.0), count, reduction)
    if "ois" in sums:
        means["ois"] = _reduce.seq_mean(jnp.where(ok, sums["ois"], 0.0), mask_count, reduction)
    parts.update(layout.batch_means(means))
    keep = layout.broadcast(ok)
    final_mask = jnp.where(keep, final_mask, 0.0)
    denominator_mask = mask if config.rejected_in_denominator else final_mask
    loss_parts = parts.pop("loss")
    assert isinstance(loss_parts, MeanParts)  # aggregation_terms -> batch_means
    return PolicyLossTerms(
        loss=jnp.where(final_mask > 0, per_token, 0.0),
        mask=final_mask,
        denominator_mask=denominator_mask,
        parts=loss_parts,
        metrics=parts,
    )


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
    segment_ids: jax.typing.ArrayLike | None = None,
    num_segments: int | None = None,
    contiguous_segments: bool = False,
    ref_logp: jax.typing.ArrayLike | None = None,
    entropy: jax.typing.ArrayLike | None = None,
) -> tuple[MeanParts, dict[str, MeanParts | jax.Array]]:
    """:func:`policy_loss` as poolable parts: ``(LossParts, metric parts)``.

    Add both over micro-batches (``a + b``, or ``jax.tree.map(jnp.add, ...)``), then
    call ``.value()`` on the loss and :func:`offpolicy_jax.finalize_metrics` on the
    metrics: the result equals the full-batch call. With batch normalisation
    or sequence-level statistics that need the whole batch, compute the
    correction once on the full batch and pass it as ``correction_result``
    (normalising per micro-batch would bias the pooled loss).

    Args: as :func:`policy_loss`, plus
      correction_result: a :class:`CorrectionResult` computed beforehand for
        exactly these tokens (decoupled_ppo); replaces the configured correction,
        whose metrics are then only in ``correction_result.metrics``.

    Examples:
      >>> import jax.numpy as jnp, offpolicy_jax as opj
      >>> lp = jnp.log(jnp.array([[0.5, 0.4], [0.3, 0.2]]))
      >>> m = jnp.ones((2, 2), bool)
      >>> cfg = opj.LossConfig(algorithm="ppo")
      >>> a, _ = opj.policy_loss_parts(lp[:1], lp[:1], None, jnp.ones(1), m[:1], cfg)
      >>> b, _ = opj.policy_loss_parts(lp[1:], lp[1:], None, jnp.ones(1), m[1:], cfg)
      >>> float((a + b).value())
      -1.0
    """
    terms = policy_loss_terms(
        logp,
        old_logp,
        rollout_logp,
        advantages,
        mask,
        config,
        axis_names=axis_names,
        correction_result=correction_result,
        segment_ids=segment_ids,
        num_segments=num_segments,
        contiguous_segments=contiguous_segments,
        ref_logp=ref_logp,
        entropy=entropy,
    )
    return terms.parts, terms.metrics


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
    segment_ids: jax.typing.ArrayLike | None = None,
    num_segments: int | None = None,
    contiguous_segments: bool = False,
    ref_logp: jax.typing.ArrayLike | None = None,
    entropy: jax.typing.ArrayLike | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Policy-gradient loss with rollout correction (docs/semantics.md §5).

    ``ppo``: ``ℓ(θ; π_old)``; ``bypass_ppo``: ``ℓ(θ; π_rollout)``;
    ``decoupled_ppo``: ``w(π_old/π_rollout) · ℓ(θ; π_old)`` on the corrected mask;
    ``reinforce_is``: ``−sg(w(π_θ/π_rollout)) · A · log π_θ``. ``ℓ`` is the
    surrogate ``config.policy_loss``: the clipped PPO surrogate
    (:func:`~offpolicy_jax.surrogates.ppo_surrogate`) by default, or GSPO, CISPO, GMPO,
    SAPO, GPG, DPPO, DRO (:mod:`offpolicy_jax.policy_losses`, docs/semantics.md §5.1);
    the weights come from ``config.correction``; aggregation per
    ``config.aggregation``. IS weights never carry gradient.

    Args:
      logp: ``[..., T]`` log π_θ of the sampled tokens: the differentiated input.
      old_logp: ``[..., T]`` log π_old from the training engine, or None for
        ``bypass_ppo`` / ``reinforce_is``.
      rollout_logp: ``[..., T]`` log π_rollout from the inference engine (may be
        None only for plain ``ppo`` without correction or mismatch metrics).
      advantages: ``[..., T]`` per token or ``[...]`` per sequence.
      mask: ``[..., T]`` bool, 0/1 integers, or floats; > 0 = token is trained on. A
        float value is the token's weight in every sum (so a uniform 0.5 mask gives the
        same mean losses as 1); an integer mask must be 0/1 (a concrete one holding
        another value raises ``ValueError``); docs/semantics.md §0.
      config: a :class:`LossConfig` (static: hashable).
      axis_names: mesh axes to ``psum`` over inside ``shard_map`` (see
        :func:`~offpolicy_jax.compute_correction`).
      correction_result: optional precomputed correction for these tokens.
      segment_ids: packed rows (docs/semantics.md §10): int ``[..., T]``, 1..K name
        the sequences of a row, 0 is padding (never trained on, whatever ``mask``
        says); every per-sequence quantity (ratios, rejection, veto, batch
        normalisation, ``sequence_mean`` / ``sequence_sum``, sequence metrics) is
        then per (row, segment). ``advantages`` must be per token. None: one
        sequence per row.
      num_segments: ``K``, a static int, the most sequences a row may hold; given
        exactly when ``segment_ids`` is.
      contiguous_segments: static; the promise that every row is laid out as
        :func:`~offpolicy_jax.pack_sequences` does (see
        :func:`~offpolicy_jax.compute_correction`): a faster exact path on CPU.
      ref_logp: ``[..., T]`` log π_ref of the sampled tokens (stop-gradient), for the
        KL-to-reference term (``config.kl_coef``, ``kl_estimator``, ``kl_off_policy``;
        docs/semantics.md §5.2); required when ``kl_coef > 0``, else it only adds the
        ``kl_loss`` metric. Non-finite at a valid token (with ``kl_coef > 0``): the
        sequence is rejected, like a non-finite ``logp``.
      entropy: ``[..., T]`` per-token entropies ``H`` (differentiable), for the bonus
        ``−entropy_coef · H``; required when ``entropy_coef != 0``, else it only adds
        the ``entropy`` metric.

    Returns:
      ``(loss, metrics)``: a float32 scalar (0, with zero gradients, when nothing
      is left to train on) and a dict of float32 scalar metrics.

    Examples:
      >>> import jax, jax.numpy as jnp, offpolicy_jax as opj
      >>> logp = jnp.log(jnp.array([[0.5, 0.4, 0.9], [0.3, 0.2, 0.7]]))
      >>> old = logp - 0.1
      >>> rollout = logp - jnp.array([[0.1, 0.2, 0.1], [0.1, 3.0, 0.1]])
      >>> mask = jnp.array([[1, 1, 0], [1, 1, 1]], bool)
      >>> cfg = opj.LossConfig(algorithm="decoupled_ppo",
      ...                      correction=opj.CorrectionConfig.preset("mis"))
      >>> loss, metrics = opj.policy_loss(logp, old, rollout, jnp.array([1.0, -1.0]), mask, cfg)
      >>> round(float(loss), 4), round(float(metrics["mis_rs_mask_fraction_high"]), 4)
      (-0.0283, 0.1667)
      >>> jax.grad(lambda lp: opj.policy_loss(lp, old, rollout, 1.0 + 0 * lp, mask, cfg)[0])(
      ...     logp).shape
      (2, 3)
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
        segment_ids=segment_ids,
        num_segments=num_segments,
        contiguous_segments=contiguous_segments,
        ref_logp=ref_logp,
        entropy=entropy,
    )
    return loss.value().astype(jnp.float32), metrics.finalize(parts)
