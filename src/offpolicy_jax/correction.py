"""``compute_correction``: importance weights, rejection mask and mismatch metrics.

The JAX equivalent of the reference rollout-correction helper (miles/slime
``mis.py``), composed from the primitives in ``ratios``, ``bounds``,
``rejection``, ``normalize`` and ``metrics`` exactly as semantics.md §3 orders
them:

1. ``w = ρ`` at ``tis_level`` (ratio π_old / π_rollout, clamped in log space),
2. bound by ``tis_mode`` (truncate / clip / mask),
3. rejection sampling at ``rs_level`` (mask only),
4. veto of sequences holding a catastrophic token,
5. batch normalisation over what stays in the loss,
6. weights ``w`` on the final mask ``m'``, 0 elsewhere; all stop-gradient.

References: Yao et al., "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training" (2025) for truncated IS under mismatch; Liu et al.,
"When Speed Kills Stability" (2025) for masked/sequence-level IS and rejection.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from offpolicy_jax import _reduce, bounds, metrics, normalize, ratios, rejection
from offpolicy_jax._reduce import REDUCTIONS, AxisNames, MeanParts, MeshAxes, Reduction
from offpolicy_jax._validation import (
    as_float_logp,
    as_float_mask,
    check_same_shape,
    check_split_over,
)
from offpolicy_jax.config import CorrectionConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CorrectionResult:
    """Result of :func:`compute_correction` (a pytree: it passes through jit/vmap).

    Attributes:
      weights: ``[..., T]`` float32 IS weights times the final mask (``w · m'``): 0
        where rejected or padded; stop-gradient.
      mask: ``[..., T]`` float32 mask after rejection (``m'``).
      metrics: ``dict[str, float32 scalar]``; the set of keys depends on the config only.
    """

    weights: jax.Array
    mask: jax.Array
    metrics: dict[str, jax.Array]


def _check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {list(REDUCTIONS)}, got {reduction!r}")


def correction_parts(
    old_logp: jax.Array,
    rollout_logp: jax.Array,
    mask: jax.Array,
    config: CorrectionConfig,
    *,
    reduction: Reduction,
    axes: MeshAxes,
) -> tuple[jax.Array, jax.Array, dict[str, MeanParts | jax.Array]]:
    """:func:`compute_correction` on validated float32 inputs, metrics as ``MeanParts``.

    ``old_logp`` here is whatever plays π_old (``sg(logp)`` in REINFORCE-IS).
    Returns ``(w, m', parts)`` where ``w`` is the IS weight on kept tokens and 0
    elsewhere, *not* yet multiplied by the mask value (the loss applies ``m'``
    once itself; :func:`compute_correction` returns ``w · m'``).

    Two passes over the tokens (each one fused :func:`~offpolicy_jax._reduce.seq_reduce`)
    compute every per-sequence sum: the first what each sequence *is* (its size, whether
    its log-probs are finite, its summed log-ratio, whether it holds a catastrophic
    token, and the mismatch metrics), the second how its tokens are *weighted* (bounds,
    rejection, the final mask and its statistics), which needs the first's per-sequence
    decisions. Everything after them works on ``[...]`` per-sequence values.
    """
    valid_in = mask > 0
    # δ over the mask; in a sequence with a non-finite log-prob it is garbage, and
    # that sequence leaves every population below (§0).
    delta = ratios.log_ratio(old_logp, rollout_logp, valid_in)
    veto = config.use_tis and config.rs_veto_threshold is not None
    facts = {
        "count": _reduce.count(mask),
        "nonfinite": _reduce.count_where(rejection.nonfinite_tokens(old_logp, rollout_logp), mask),
        **metrics.mismatch_columns(old_logp, rollout_logp, delta, mask),
    }
    if veto:
        catastrophic = rejection.catastrophic_tokens(delta, valid_in, config.rs_veto_threshold)
        facts["catastrophic"] = _reduce.count_where(catastrophic, mask)
    seq = _reduce.seq_reduce(facts, axes)
    finite = seq["nonfinite"] == 0

    def over_valid(per_seq):  # restricts a sum over the mask to the finite sequences
        return jnp.where(finite, per_seq, 0.0)

    n_valid = over_valid(seq["count"])
    # Every metric is kept as per-sequence terms and summed over the batch once, at the end.
    means = metrics.mismatch_metrics(
        {key: over_valid(seq[key]) for key in metrics.MISMATCH_COLUMNS}, n_valid, reduction
    )
    if not config.use_tis:
        # Metrics only: nothing is reweighted or rejected.
        return jnp.where(valid_in, 1.0, 0.0), mask, dict(_reduce.batch_means(means, axes))

    valid = jnp.where(finite[..., None], mask, 0.0)

    def ratio_at(level):  # ρ: [..., T] per token, or [..., 1] per sequence
        if level == "token":
            return ratios.clamped_exp(delta)
        log_ratio = ratios.sequence_log_ratio(over_valid(seq["delta"]), n_valid, level)
        return ratios.clamped_exp(log_ratio)[..., None]

    # The second pass sums per-token values; a per-sequence value ([..., 1], at the
    # sequence and geometric levels) needs no sum: it is its own masked mean.
    columns: dict[str, _reduce.Column] = {}

    def add(key, level, column):
        if level == "token":
            columns.setdefault(key, column)

    def mean(key, level, value, counts, how=reduction):  # after the pass
        if level == "token":
            return _reduce.seq_mean(sums[key], counts, how)
        return _reduce.seq_mean_of_values(value[..., 0], counts, how)

    lower, upper = config.lower_bound, config.upper_bound
    raw = ratio_at(config.tis_level)
    weights, keep = bounds.apply_mode(raw, config.tis_mode, lower, upper)
    kept = valid if keep is None else jnp.where(keep, valid, 0.0)
    tis_level = config.tis_level
    add("raw", tis_level, _reduce.total(raw, valid))
    add("after_bound", tis_level, _reduce.total(weights, kept))
    if keep is not None:
        columns["kept"] = _reduce.count(kept)

    # Mode and RS fractions: the share of valid tokens whose ratio is below / above a
    # bound. A column is named by its test, so RS at the TIS level and bound (the
    # reference mis.yaml: truncation and RS both above 2) shares one.
    fractions = {}  # metric -> (column, level, per-token or per-sequence 0/1 value)

    def fraction(metric, level, ratio, side, bound):
        outside = jnp.where(ratio < bound if side == "<" else ratio > bound, 1.0, 0.0)
        fractions[metric] = (f"{level} {side} {bound!r}", level, outside)
        add(fractions[metric][0], level, _reduce.total(outside, valid))

    if config.tis_mode == "truncate":
        fraction("mis_tis_truncate_fraction", config.tis_level, raw, ">", upper)
    else:
        fraction(f"mis_tis_{config.tis_mode}_fraction_low", config.tis_level, raw, "<", lower)
        fraction(f"mis_tis_{config.tis_mode}_fraction_high", config.tis_level, raw, ">", upper)
    if config.use_rs:
        rs_ratio = raw if config.rs_level == config.tis_level else ratio_at(config.rs_level)
        rs_lower, rs_upper = config.rs_lower, config.rs_upper
        fraction("mis_rs_mask_fraction_low", config.rs_level, rs_ratio, "<", rs_lower)
        fraction("mis_rs_mask_fraction_high", config.rs_level, rs_ratio, ">", rs_upper)
        kept = jnp.where(rejection.rejection_keep(rs_ratio, rs_lower, rs_upper), kept, 0.0)

    if veto:
        vetoed = over_valid(seq["catastrophic"]) > 0
        kept = jnp.where(vetoed[..., None], 0.0, kept)

    final_mask = kept
    columns["final"] = _reduce.count(final_mask)
    add("final_sum", tis_level, _reduce.total(weights, final_mask))
    add("final_min", tis_level, _reduce.minimum(weights, final_mask))
    add("final_max", tis_level, _reduce.maximum(weights, final_mask))
    sums = _reduce.seq_reduce(columns, axes)

    n_final = sums["final"]
    means["mis_tis_weight_before_bound"] = mean("raw", tis_level, raw, n_valid)
    means["mis_tis_weight_after_bound"] = mean(
        "after_bound", tis_level, weights, n_valid if keep is None else sums["kept"]
    )
    for metric, (column, level, outside) in fractions.items():
        means[metric] = mean(column, level, outside, n_valid)
    if veto:
        means["mis_rs_catastrophic_token_fraction"] = _reduce.seq_mean(
            over_valid(seq["catastrophic"]), n_valid, reduction
        )
        means["mis_rs_catastrophic_seq_fraction"] = _reduce.seq_mean_of_values(
            jnp.where(vetoed, 1.0, 0.0), n_valid, reduction
        )
    means["mis_nonfinite_seq_fraction"] = _reduce.seq_mean_of_values(
        jnp.where(finite, 0.0, 1.0), seq["count"], reduction
    )

    after_tis_rs = mean("final_sum", tis_level, weights, n_final)
    means["mis_is_ratio_mean_after_tis_rs"] = after_tis_rs
    if config.tis_batch_normalize:
        how = normalize.normalizer_reduction(config.tis_level)
        mu = after_tis_rs
        if how != reduction:
            mu = mean("final_sum", tis_level, weights, n_final, how)
        norm_factor = normalize.normalizer(_reduce.batch_means({"mu": mu}, axes)["mu"].value())
    else:
        norm_factor = jnp.ones((), jnp.float32)
    # Normalising is one division by μ > 0: it scales the mean, and min(w/μ) = min(w)/μ
    # exactly, so the final statistics come from the same sums.
    if tis_level == "token":
        low, high = sums["final_min"], sums["final_max"]
    else:  # one weight per sequence: its own minimum and maximum
        low = high = weights[..., 0]
    means.update(
        metrics.weight_stats(
            after_tis_rs._replace(numerator=after_tis_rs.numerator / norm_factor),
            low / norm_factor,
            high / norm_factor,
            n_final,
            reduction,
        )
    )
    parts: dict[str, MeanParts | jax.Array] = dict(_reduce.batch_means(means, axes))
    # As (μ, 1): pooled over micro-batches it reports their mean normaliser.
    parts["mis_batch_norm_factor"] = MeanParts(norm_factor, jnp.ones((), jnp.float32))
    # `where`, not a product: rejected positions may hold e^20-sized mask-mode ratios.
    weights = jnp.where(final_mask > 0, weights / norm_factor, 0.0)
    return jax.lax.stop_gradient(weights), final_mask, parts


def compute_correction(
    old_logp: jax.typing.ArrayLike,
    rollout_logp: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike,
    config: CorrectionConfig,
    *,
    reduction: Reduction = "sequence",
    axis_names: AxisNames = None,
) -> CorrectionResult:
    """Rollout correction: IS weights, rejection mask and mismatch metrics.

    For ``δ_t = o_t − b_t`` (training vs. rollout log-prob) the weight is
    ``w = exp(clip(agg(δ), −20, 20))`` at ``config.tis_level``, bounded by
    ``config.tis_mode``; rejection sampling and the veto shrink the mask;
    optional batch normalisation makes the mean kept weight 1. See
    semantics.md §3 for every rule and metric.

    Args:
      old_logp: ``[..., T]`` log π_old of the sampled tokens (training engine).
        float32, bf16 or fp16 (upcast to float32).
      rollout_logp: ``[..., T]`` log π_rollout reported by the inference engine.
      mask: ``[..., T]`` bool or 0/1 float; 1 = token is trained on. NaN/inf at
        masked positions of the log-probs never reach any output.
      config: a :class:`CorrectionConfig` (static: hashable).
      reduction: how metrics reduce: ``"sequence"`` (mean over non-empty sequences
        of per-sequence means) or ``"token"`` (mean over all valid tokens).
      axis_names: inside ``shard_map``, the mesh axes the batch is split over: a
        name or names of data-parallel axes, or ``MeshAxes(batch=..., token=...)``
        when the token axis is sharded too. Reductions are ``psum``-ed so the
        result equals the unsharded call.

    Returns:
      A :class:`CorrectionResult` with float32 ``weights`` and ``mask`` of the
      input's shape (weights stop-gradient, 0 where ``mask`` is 0) and a dict of
      float32 scalar ``metrics``.
    """
    if not isinstance(config, CorrectionConfig):
        raise TypeError(f"config must be a CorrectionConfig, got {type(config).__name__}")
    _check_reduction(reduction)
    axes = _reduce.as_mesh_axes(axis_names)
    old = jax.lax.stop_gradient(as_float_logp("old_logp", old_logp))
    rollout = jax.lax.stop_gradient(as_float_logp("rollout_logp", rollout_logp))
    weights_mask = as_float_mask("mask", mask)
    check_same_shape("old_logp", old, rollout_logp=rollout, mask=weights_mask)
    check_split_over(
        axes.batch + axes.token, old_logp=old_logp, rollout_logp=rollout_logp, mask=mask
    )
    weights, final_mask, parts = correction_parts(
        old, rollout, weights_mask, config, reduction=reduction, axes=axes
    )
    return CorrectionResult(
        weights=jnp.broadcast_to(weights * final_mask, old.shape).astype(jnp.float32),
        mask=jnp.broadcast_to(final_mask, old.shape).astype(jnp.float32),
        metrics=metrics.finalize(parts),
    )
