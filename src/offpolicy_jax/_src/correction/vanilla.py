"""The reference's built-in truncated IS as a rule: :func:`vanilla_tis`.

The chain's form of a :class:`~offpolicy_jax.VanillaTIS` correction. It is a correction
of its own, not a stage of the pipeline: its weight is not bounded, rejected or
normalised by other rules, its metrics cover every valid token, and it rejects nothing
(the loss rejects the sequences with a non-finite log-prob, as it does for
``VanillaTIS``). A chain holding it holds nothing else.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from offpolicy_jax._src import reduction as _reduce
from offpolicy_jax._src.config.correction import check_vanilla_tis
from offpolicy_jax._src.correction.ratios import metric_exp, metric_expm1
from offpolicy_jax._src.reduction import MeanParts, Reduction, Rows


@dataclasses.dataclass(frozen=True)
class VanillaIS:
    """The truncated IS weight ``clip(exp(o − b), clip_low, clip)`` (built by :func:`vanilla_tis`).

    Attributes:
      clip_low: the lower clip (0: one-sided truncation).
      clip: the upper clip (``math.inf``: no cap).
    """

    clip_low: float = 0.0
    clip: float = 2.0

    def parts(
        self,
        old: jax.Array,
        rollout: jax.Array,
        mask: jax.Array,
        *,
        reduction: Reduction,
        layout: Rows,
    ) -> tuple[jax.Array, dict[str, MeanParts]]:
        """``(w, metric parts)`` on checked float32 inputs (``w`` stop-gradient, 1 where
        the log-ratio is not finite; the mask is left as it is)."""
        return _vanilla_tis(
            old,
            rollout,
            mask,
            clip_low=self.clip_low,
            clip=self.clip,
            reduction=reduction,
            layout=layout,
        )


def _vanilla_tis(
    old_logp: jax.Array,
    rollout_logp: jax.Array,
    population: jax.Array,
    *,
    clip_low: float,
    clip: float,
    reduction: Reduction,
    layout: Rows,
) -> tuple[jax.Array, dict[str, MeanParts]]:
    """The reference's built-in truncated IS: ``w = clip(exp(o − b), clip_low, clip)``.

    Args:
      old_logp: ``[..., T]`` log π_old (or ``sg(θ)`` in REINFORCE-IS).
      rollout_logp: ``[..., T]`` log π_rollout.
      population: ``[..., T]`` float weights of the tokens the metrics cover.
      clip_low: lower clip (0 = one-sided truncation).
      clip: upper clip.
      reduction: metric reduction.
      layout: per-sequence reductions (and mesh axes).

    Returns:
      ``(weights, metrics)``: stop-gradient ``[..., T]`` weights (1 where the
      log-ratio is not finite: the loss rejects such sequences) and ``tis`` (pre-clip
      ratio), ``tis_clipfrac`` (share with ``w ≠ ratio``), ``tis_abs`` (``|ratio − 1|``);
      the metric exponentials are capped (``ratios.metric_exp``).
    """
    log_ratio = jax.lax.stop_gradient(old_logp - rollout_logp)
    usable = (population > 0) & jnp.isfinite(log_ratio)
    log_ratio = jnp.where(usable, log_ratio, 0.0)
    weights = jnp.clip(jnp.exp(log_ratio), clip_low, clip)
    sums = layout.reduce(
        {
            "tis": _reduce.total(metric_exp(log_ratio), population),
            "tis_clipfrac": _reduce.count_where(weights != jnp.exp(log_ratio), population),
            "tis_abs": _reduce.total(jnp.abs(metric_expm1(log_ratio)), population),
            "count": _reduce.count(population),
        }
    )
    means = {
        key: _reduce.seq_mean(sums[key], sums["count"], reduction)
        for key in ("tis", "tis_clipfrac", "tis_abs")
    }
    return weights, layout.batch_means(means)


def vanilla_tis(*, clip_low: float = 0.0, clip: float = 2.0) -> VanillaIS:
    """The reference's built-in truncated IS: ``w = clip(exp(o − b), clip_low, clip)``.

    With ``o = log π_old`` and ``b = log π_rollout`` per token; the mask is left
    unchanged. ``opj.rules.chain(opj.rules.vanilla_tis(clip_low=l, clip=c))`` equals the
    correction ``VanillaTIS(clip_low=l, clip=c)``; it is a correction of its own, so a
    chain holding it holds no other rule.

    Args:
      clip_low: ``0 <= clip_low < clip`` (0: one-sided truncation).
      clip: the cap; ``math.inf`` means none (the untruncated IS weight).

    Returns:
      The rule (a frozen, hashable value). Metrics (over the valid tokens): ``tis`` (the
      mean ratio before clipping), ``tis_clipfrac`` (share of tokens whose weight the
      clip changed), ``tis_abs`` (mean ``|ratio − 1|``).

    Raises:
      ValueError: naming ``rules.vanilla_tis.clip_low`` or ``rules.vanilla_tis.clip``.
    """
    low, high = check_vanilla_tis("rules.vanilla_tis", clip_low, clip)
    return VanillaIS(low, math.inf if high == math.inf else high)
