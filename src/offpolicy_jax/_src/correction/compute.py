"""``compute_correction``: importance weights, rejection mask and mismatch metrics.

The JAX equivalent of the reference rollout-correction helper (miles/slime
``mis.py``). :func:`correction_stages` lists the stages the config names, in the
order of docs/semantics.md §3: the mismatch metrics (``metrics``), ``w = ρ`` at
``tis_level`` bounded by ``tis_mode`` (``bounds``) or AReaL's mask / clamp grid in its
place (``rules.AReaLRejection``), rejection sampling and the veto (``rejection``), then
the field's rules of §8 (``rules``: KL criteria, sequence log-prob error, M2PO, and the
probability metrics); ``stages.run`` takes their per-sequence sums in two passes,
applies batch normalisation (``normalize``) and puts the weights on the final mask.
A new rule is one stage there plus its config key.

References: Yao et al., "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training" (2025) for truncated IS under mismatch; Liu et al.,
"When Speed Kills Stability" (2025) for masked/sequence-level IS and rejection.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from offpolicy_jax._src import reduction as _reduce
from offpolicy_jax._src.config.correction import CorrectionConfig
from offpolicy_jax._src.correction import constructors as make
from offpolicy_jax._src.correction import (
    metrics,
    normalize,
    ratios,
    rules,
    stages,
    staleness,
)
from offpolicy_jax._src.reduction import REDUCTIONS, AxisNames, Reduction
from offpolicy_jax._src.validation import (
    as_float_logp,
    as_float_mask,
    check_same_shape,
    check_split_over,
)


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


def correction_stages(config: CorrectionConfig) -> list[stages.Stage]:
    """The stages ``config`` names, in the order of docs/semantics.md §3, built by the
    public rule constructors (:mod:`offpolicy_jax.rules`)."""
    chain: list[stages.Stage] = [make.mismatch_metrics()]
    if config.probability_metrics:
        chain.append(make.probability_metrics())
    if config.use_tis:
        if config.rejection_sampling is not None:  # §8: AReaL's grid is the weight
            chain.append(rules.AReaLRejection(config.rejection_sampling))
        else:
            chain.append(
                make.importance_weights(
                    level=config.tis_level,
                    mode=config.tis_mode,
                    lower=config.lower_bound,
                    upper=config.upper_bound,
                )
            )
        weight_level = config.tis_level if config.rejection_sampling is None else None
        if "minpro" in (weight_level, config.rs_level if config.use_rs else None):
            chain.append(make.minpro_metrics())
        if config.use_rs:
            chain.append(
                make.rejection_sampling(
                    level=config.rs_level, lower=config.rs_lower, upper=config.rs_upper
                )
            )
        if config.rs_veto_threshold is not None:
            chain.append(make.veto(threshold=config.rs_veto_threshold))
        chain.extend(_rule_stages(config))  # §8: the field's rejection rules
    return chain


def _rule_stages(config: CorrectionConfig) -> list[stages.Stage]:
    """The §8 rules a config names (after §3's), by the public constructors."""
    out = [make.criterion(c.name, threshold=c.spec.split(":", 1)[1]) for c in config.criteria]
    if config.seq_logprob_error_threshold is not None:
        out.append(make.seq_logprob_error(threshold=config.seq_logprob_error_threshold))
    if config.m2po_tau is not None:
        out.append(make.m2po(tau=config.m2po_tau))
    return out


def correction_parts(
    old,
    rollout,
    mask,
    config: CorrectionConfig,
    *,
    reduction,
    layout,
    versions=None,
    current_version=None,
):
    """:func:`compute_correction` on validated float32 inputs: ``(w, m', metric parts)``.

    ``old`` is whatever plays π_old (``sg(logp)`` in REINFORCE-IS); ``w`` is the IS
    weight on kept tokens, 0 elsewhere, not yet multiplied by the mask value.
    ``versions`` / ``current_version``: integer arrays checked (and shaped) by
    :func:`~offpolicy_jax._src.correction.staleness.check_versions` (or None).
    """
    chain = correction_stages(config)
    if config.nonfinite_rollout == "neutral":
        rollout, filled = staleness.neutral_rollout(old, rollout, mask)
        chain.append(staleness.NeutralRollout(filled))
    chain.extend(staleness.async_stages(config, versions, current_version))
    level = (
        config.tis_level if config.rejection_sampling is None else config.rejection_sampling.level
    )
    norm = normalize.normalizer_reduction(level) if config.tis_batch_normalize else None
    return run_stages(
        chain,
        old,
        rollout,
        mask,
        reweights=config.use_tis,
        batch_normalize=norm,
        reduction=reduction,
        layout=layout,
    )


def run_stages(
    chain,
    old,
    rollout,
    mask,
    *,
    reweights: bool,
    batch_normalize: str | None,
    reduction,
    layout,
):
    """The stage pipeline on validated float32 inputs: ``(w, m', metric parts)``.

    ``reweights``: the chain weights or rejects (else it only reports metrics: every
    weight is 1 and the mask is left as it is); ``batch_normalize``: None or how ``μ``
    averages. The one runner of :func:`compute_correction` and
    :func:`offpolicy_jax.correct`.
    """
    tokens = stages.Tokens(
        old, rollout, ratios.log_ratio(old, rollout, mask > 0), mask, layout, reduction
    )
    weights, final, parts = stages.run(
        chain,
        tokens,
        weight_stats=reweights,
        batch_normalize=batch_normalize,
    )
    if not reweights:  # metrics only: nothing is reweighted or rejected
        return jnp.where(mask > 0, 1.0, 0.0), mask, parts
    return jax.lax.stop_gradient(weights), final, parts


def compute_correction(
    old_logp: jax.typing.ArrayLike,
    rollout_logp: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike,
    config: CorrectionConfig,
    *,
    reduction: Reduction = "sequence",
    axis_names: AxisNames = None,
    segment_ids: jax.typing.ArrayLike | None = None,
    num_segments: int | None = None,
    versions: jax.typing.ArrayLike | None = None,
    current_version: jax.typing.ArrayLike | None = None,
) -> CorrectionResult:
    """Rollout correction: IS weights, rejection mask and mismatch metrics.

    For ``δ_t = o_t − b_t`` (training vs. rollout log-prob) the weight is
    ``w = exp(clip(agg(δ), −20, 20))`` at ``config.tis_level``, bounded by
    ``config.tis_mode``; rejection sampling and the veto shrink the mask;
    optional batch normalisation makes the mean kept weight 1. See
    docs/semantics.md §3 for every rule and metric.

    Args:
      old_logp: ``[..., T]`` log π_old of the sampled tokens (training engine).
        float32, bf16 or fp16 (upcast to float32).
      rollout_logp: ``[..., T]`` log π_rollout reported by the inference engine.
      mask: ``[..., T]`` bool, 0/1 integers, or floats (a float value weights its
        token in every sum; a concrete integer mask holding a value other than 0/1
        raises ``ValueError``; docs/semantics.md §0); > 0 = token is trained on. NaN/inf at
        masked positions of the log-probs never reach any output.
      config: a :class:`CorrectionConfig` (static: hashable).
      reduction: how metrics reduce: ``"sequence"`` (mean over non-empty sequences
        of per-sequence means) or ``"token"`` (mean over all valid tokens).
      axis_names: inside ``shard_map``, the mesh axes the batch is split over: a
        name or names of data-parallel axes, or ``MeshAxes(batch=..., token=...)``
        when the token axis is sharded too. Reductions are ``psum``-ed so the
        result equals the unsharded call.
      segment_ids: packed rows (docs/semantics.md §10): int ``[..., T]``, 1..K name
        the sequences of a row, 0 is padding (never trained on, whatever ``mask``
        says). Every per-sequence quantity is then per (row, segment). None: one
        sequence per row.
      num_segments: ``K``, a static int, the most sequences a row may hold; given
        exactly when ``segment_ids`` is.
      versions: asynchronous RL (docs/guide/async.md): int ``[..., T]``, the policy
        version that sampled each token. Adds ``mis_staleness_mean`` /
        ``mis_staleness_max`` (age ``current_version − version`` over the valid
        tokens) and feeds ``config.max_weight_staleness`` and
        ``config.mask_offpolicy_in_partial_rollout``, which require it.
      current_version: the trainer's policy version, required with ``versions``: an
        int, or an int array of shape ``[...]`` (one per sequence, like ``advantages``;
        per row with ``segment_ids``), ``[..., 1]`` or ``[..., T]`` (per token).
        Versions and ages are integers (int32; int64 with ``jax_enable_x64``); a
        negative version (AReaL's −1) has no age. Concrete values are checked at the
        valid tokens (out of range, ``current_version < 0`` or a version newer than it
        raise ``ValueError``); docs/guide/async.md.

    Returns:
      A :class:`CorrectionResult` with float32 ``weights`` and ``mask`` of the
      input's shape (weights stop-gradient, 0 where ``mask`` is 0) and a dict of
      float32 scalar ``metrics``.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, offpolicy_jax as opj
      >>> old = jnp.log(jnp.array([[0.5, 0.9, 0.2], [0.4, 0.4, 0.1]]))
      >>> rollout = jnp.log(jnp.array([[0.5, 0.3, 0.2], [0.4, 0.5, 0.9]]))
      >>> mask = jnp.array([[1, 1, 1], [1, 1, 0]], bool)
      >>> res = opj.compute_correction(old, rollout, mask, opj.CorrectionConfig(use_tis=True))
      >>> np.round(np.asarray(res.weights, float), 2).tolist()  # min(π_old/π_rollout, 2)
      [[1.0, 2.0, 1.0], [1.0, 0.8, 0.0]]
      >>> round(float(res.metrics["mis_tis_truncate_fraction"]), 4)  # (1/3 + 0) / 2
      0.1667
    """
    if not isinstance(config, CorrectionConfig):
        raise TypeError(f"config must be a CorrectionConfig, got {type(config).__name__}")
    _check_reduction(reduction)
    axes = _reduce.as_mesh_axes(axis_names)
    return _compute_correction(
        old_logp,
        rollout_logp,
        mask,
        config,
        reduction,
        axes,
        segment_ids,
        num_segments,
        versions,
        current_version,
    )


def _compute_correction(
    old_logp,
    rollout_logp,
    mask,
    config,
    reduction,
    axes,
    segment_ids,
    num_segments,
    versions=None,
    current_version=None,
) -> CorrectionResult:
    old, rollout, weights_mask, layout = checked_inputs(
        old_logp, rollout_logp, mask, axes, segment_ids, num_segments
    )
    versions, current = staleness.check_versions(
        versions, current_version, old.shape, needed_by=_versions_key(config), mask=weights_mask
    )
    check_split_over(axes.batch + axes.token, versions=versions)
    weights, final_mask, parts = correction_parts(
        old,
        rollout,
        weights_mask,
        config,
        reduction=reduction,
        layout=layout,
        versions=versions,
        current_version=current,
    )
    return as_result(weights, final_mask, parts, old.shape)


def checked_inputs(old_logp, rollout_logp, mask, axes, segment_ids, num_segments):
    """The checked float32 ``(old, rollout, mask, layout)`` of a correction call (errors
    name the argument); ``old`` and ``rollout`` are stop-gradient."""
    old = jax.lax.stop_gradient(as_float_logp("old_logp", old_logp))
    rollout = jax.lax.stop_gradient(as_float_logp("rollout_logp", rollout_logp))
    weights_mask = as_float_mask("mask", mask)
    check_same_shape("old_logp", old, rollout_logp=rollout, mask=weights_mask)
    layout = _reduce.layout(axes, segment_ids, num_segments, old.shape)
    weights_mask = _reduce.only_segments(layout, weights_mask)
    check_split_over(
        axes.batch + axes.token,
        old_logp=old_logp,
        rollout_logp=rollout_logp,
        mask=mask,
        segment_ids=segment_ids,
    )
    return old, rollout, weights_mask, layout


def as_result(weights, final_mask, parts, shape) -> CorrectionResult:
    """``(w, m', parts)`` of :func:`run_stages` as a :class:`CorrectionResult`."""
    return CorrectionResult(
        weights=jnp.broadcast_to(weights * final_mask, shape).astype(jnp.float32),
        mask=jnp.broadcast_to(final_mask, shape).astype(jnp.float32),
        metrics=metrics.finalize(parts),
    )


def _versions_key(config: CorrectionConfig) -> str | None:
    """The config key that needs ``versions``, for the error message (None: none)."""
    if config.max_weight_staleness is not None:
        return "CorrectionConfig.max_weight_staleness"
    if config.mask_offpolicy_in_partial_rollout:
        return "CorrectionConfig.mask_offpolicy_in_partial_rollout"
    return None
