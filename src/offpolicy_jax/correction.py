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
from offpolicy_jax._validation import as_float_logp, as_float_mask, check_same_shape
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
    """
    # Non-finite log-probs at a valid position reject the whole sequence (§0);
    # everything downstream sees the cleaned population only.
    finite = rejection.finite_sequences(mask, old_logp, rollout_logp, axes=axes)
    valid = jnp.where(finite, mask, 0.0)
    delta = ratios.log_ratio(old_logp, rollout_logp, valid > 0)
    parts: dict[str, MeanParts | jax.Array] = dict(
        metrics.mismatch_metrics(old_logp, rollout_logp, delta, valid, reduction, axes)
    )
    if not config.use_tis:
        # Metrics only: nothing is reweighted or rejected.
        return jnp.where(mask > 0, 1.0, 0.0), mask, parts

    def frac(condition, population=valid):
        return metrics.fraction(condition, population, reduction, axes)

    lower, upper = config.lower_bound, config.upper_bound
    raw = ratios.level_ratio(delta, valid, config.tis_level, axes)
    parts["mis_tis_weight_before_bound"] = _reduce.mean_parts(raw, valid, reduction, axes)

    weights, keep = bounds.apply_mode(raw, config.tis_mode, lower, upper)
    if config.tis_mode == "truncate":
        parts["mis_tis_truncate_fraction"] = frac(raw > upper)
    else:
        parts[f"mis_tis_{config.tis_mode}_fraction_low"] = frac(raw < lower)
        parts[f"mis_tis_{config.tis_mode}_fraction_high"] = frac(raw > upper)
    kept = valid if keep is None else jnp.where(keep, valid, 0.0)
    parts["mis_tis_weight_after_bound"] = _reduce.mean_parts(weights, kept, reduction, axes)

    if config.use_rs:
        rs_ratio = (
            raw
            if config.rs_level == config.tis_level
            else ratios.level_ratio(delta, valid, config.rs_level, axes)
        )
        rs_lower, rs_upper = config.rs_lower, config.rs_upper
        parts["mis_rs_mask_fraction_low"] = frac(rs_ratio < rs_lower)
        parts["mis_rs_mask_fraction_high"] = frac(rs_ratio > rs_upper)
        kept = jnp.where(rejection.rejection_keep(rs_ratio, rs_lower, rs_upper), kept, 0.0)

    if config.rs_veto_threshold is not None:
        catastrophic, keep_seq = rejection.veto(delta, valid, config.rs_veto_threshold, axes)
        parts["mis_rs_catastrophic_token_fraction"] = frac(catastrophic)
        parts["mis_rs_catastrophic_seq_fraction"] = frac(~keep_seq)
        kept = jnp.where(keep_seq, kept, 0.0)

    final_mask = kept
    parts["mis_is_ratio_mean_after_tis_rs"] = _reduce.mean_parts(weights, final_mask, reduction, axes)
    if config.tis_batch_normalize:
        weights, norm_factor = normalize.batch_normalize(weights, final_mask, config.tis_level, axes)
    else:
        norm_factor = jnp.ones((), jnp.float32)
    # As (μ, 1): pooled over micro-batches it reports their mean normaliser.
    parts["mis_batch_norm_factor"] = MeanParts(norm_factor, jnp.ones((), jnp.float32))
    parts.update(metrics.weight_stats(weights, final_mask, reduction, axes))
    parts["mis_nonfinite_seq_fraction"] = frac(~finite, mask)
    # `where`, not a product: rejected positions may hold e^20-sized mask-mode ratios.
    weights = jnp.where(final_mask > 0, weights, 0.0)
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
        raise TypeError(
            f"config must be a CorrectionConfig, got {type(config).__name__}"
        )
    _check_reduction(reduction)
    axes = _reduce.as_mesh_axes(axis_names)
    old = jax.lax.stop_gradient(as_float_logp("old_logp", old_logp))
    rollout = jax.lax.stop_gradient(as_float_logp("rollout_logp", rollout_logp))
    weights_mask = as_float_mask("mask", mask)
    check_same_shape("old_logp", old, rollout_logp=rollout, mask=weights_mask)
    # A mask entry that is not > 0 (0, negative, NaN) is padding.
    weights_mask = jnp.where(weights_mask > 0, weights_mask, 0.0)
    weights, final_mask, parts = correction_parts(
        old, rollout, weights_mask, config, reduction=reduction, axes=axes
    )
    return CorrectionResult(
        weights=jnp.broadcast_to(weights * final_mask, old.shape).astype(jnp.float32),
        mask=jnp.broadcast_to(final_mask, old.shape).astype(jnp.float32),
        metrics=metrics.finalize(parts),
    )
