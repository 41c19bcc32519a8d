"""Monitoring metrics of the training–inference mismatch (semantics.md §4, §7).

Every metric is a per-token value, or a per-sequence value broadcast to its
tokens, reduced over a *population* (a float mask) with the caller's reduction:
``"sequence"`` = mean over the population's non-empty sequences of their masked
means, ``"token"`` = token-weighted mean. They are returned as
:class:`~offpolicy_jax._reduce.MeanParts` so that micro-batches and devices pool
exactly; :func:`finalize` divides them out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from offpolicy_jax import _reduce
from offpolicy_jax._reduce import MeanParts, MeshAxes, Reduction
from offpolicy_jax.ratios import LOG_RATIO_CLAMP

MISMATCH_METRIC_KEYS: tuple[str, ...] = (
    "mis_training_log_ppl",
    "mis_training_ppl",
    "mis_rollout_log_ppl",
    "mis_rollout_ppl",
    "mis_kl",
    "mis_k3_kl",
    "mis_log_ppl_diff",
    "mis_log_ppl_abs_diff",
    "mis_ppl_ratio",
    "mis_chi2_token",
    "mis_chi2_seq",
)


def mismatch_metrics(
    old_logp: jax.Array,
    rollout_logp: jax.Array,
    delta: jax.Array,
    population: jax.Array,
    reduction: Reduction,
    axes: MeshAxes = MeshAxes(),
) -> dict[str, MeanParts]:
    """The eleven mismatch metrics between the training and the rollout engine.

    With ``mean_o = Σ o m / N̄`` and ``mean_b = Σ b m / N̄`` per sequence:
    training/rollout log-perplexity ``−mean``, perplexity ``exp(−mean)``,
    ``mis_kl`` (token ``b − o``, an estimate of KL(π_rollout‖π_old)),
    ``mis_k3_kl`` (token ``e^δ − δ − 1``, Schulman's k3 estimator), the
    log-perplexity difference, its absolute value, the perplexity ratio
    ``exp(mean_b − mean_o)``, ``mis_chi2_token = Σ e^{2δ} m / N̄ − 1`` and
    ``mis_chi2_seq = e^{2 Σ δ m} − 1`` (exponents clamped to ``±S``).

    Args:
      old_logp: ``[..., T]`` float32 π_old log-probs.
      rollout_logp: ``[..., T]`` float32 π_rollout log-probs.
      delta: ``[..., T]`` ``o − b``, 0 outside the population.
      population: ``[..., T]`` float weights of the valid tokens.
      reduction: ``"sequence"`` or ``"token"``.
      axes: mesh axes to combine over inside ``shard_map``.

    Returns:
      A dict from the keys in :data:`MISMATCH_METRIC_KEYS` to :class:`MeanParts`.
    """
    count = _reduce.seq_count(population, axes)

    def seq_mean(x):
        return _reduce.safe_divide(_reduce.seq_sum(x, population, axes), count)

    def per_seq(values):
        return _reduce.per_seq_values_parts(values, count, reduction, axes)

    def per_token(values):
        return _reduce.mean_parts(values, population, reduction, axes)

    mean_o = seq_mean(old_logp)
    mean_b = seq_mean(rollout_logp)
    log_ppl_diff = mean_b - mean_o
    clamped_delta = jnp.clip(delta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    seq_log_ratio = _reduce.seq_sum(delta, population, axes)
    return {
        "mis_training_log_ppl": per_seq(-mean_o),
        "mis_training_ppl": per_seq(jnp.exp(-mean_o)),
        "mis_rollout_log_ppl": per_seq(-mean_b),
        "mis_rollout_ppl": per_seq(jnp.exp(-mean_b)),
        "mis_kl": per_token(rollout_logp - old_logp),
        "mis_k3_kl": per_token(jnp.exp(delta) - delta - 1),
        "mis_log_ppl_diff": per_seq(log_ppl_diff),
        "mis_log_ppl_abs_diff": per_seq(jnp.abs(log_ppl_diff)),
        "mis_ppl_ratio": per_seq(jnp.exp(log_ppl_diff)),
        "mis_chi2_token": per_seq(seq_mean(jnp.exp(2 * clamped_delta)) - 1),
        "mis_chi2_seq": per_seq(
            jnp.exp(2 * jnp.clip(seq_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) - 1
        ),
    }


def fraction(
    condition: jax.Array, population: jax.Array, reduction: Reduction, axes: MeshAxes = MeshAxes()
) -> MeanParts:
    """Share of the population where ``condition`` holds (per token or per sequence)."""
    return _reduce.mean_parts(jnp.where(condition, 1.0, 0.0), population, reduction, axes)


def weight_stats(
    weights: jax.Array,
    population: jax.Array,
    reduction: Reduction,
    axes: MeshAxes = MeshAxes(),
    *,
    prefix: str = "mis_is_ratio",
    suffix: str = "_final",
) -> dict[str, MeanParts]:
    """Mean, and per-sequence min and max (then reduced), of the weights over the population."""
    count = _reduce.seq_count(population, axes)
    return {
        f"{prefix}_mean{suffix}": _reduce.mean_parts(weights, population, reduction, axes),
        f"{prefix}_min{suffix}": _reduce.per_seq_values_parts(
            _reduce.seq_min(weights, population, axes), count, reduction, axes
        ),
        f"{prefix}_max{suffix}": _reduce.per_seq_values_parts(
            _reduce.seq_max(weights, population, axes), count, reduction, axes
        ),
    }


def finalize(parts: dict[str, MeanParts | jax.Array]) -> dict[str, jax.Array]:
    """Divides out every :class:`MeanParts`; plain arrays pass through. float32 scalars."""
    return {
        key: (value.value() if isinstance(value, MeanParts) else value).astype(jnp.float32)
        for key, value in parts.items()
    }
