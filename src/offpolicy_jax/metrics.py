"""Monitoring metrics of the training–inference mismatch (semantics.md §4, §7).

Every metric is a per-token value, or a per-sequence value broadcast to its
tokens, reduced over a *population* (a float mask) with the caller's reduction:
``"sequence"`` = mean over the population's non-empty sequences of their masked
means, ``"token"`` = token-weighted mean. They are returned as
:class:`~offpolicy_jax._reduce.MeanParts` so that micro-batches and devices pool
exactly; :func:`finalize` divides them out.

The metrics are computed from per-sequence sums (:func:`mismatch_columns` lists
the ones they need), so that the caller can take those sums together with its
own in a single pass over the tokens (:func:`~offpolicy_jax._reduce.seq_reduce`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from offpolicy_jax import _reduce
from offpolicy_jax._reduce import MeanParts, Reduction, SeqMean
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


def mismatch_columns(
    old_logp: jax.Array, rollout_logp: jax.Array, delta: jax.Array, population: jax.Array
) -> dict[str, _reduce.Column]:
    """The per-sequence sums the mismatch metrics are made of (one fused pass).

    ``Σ o m``, ``Σ b m``, ``Σ δ m``, ``Σ (e^δ − δ − 1) m`` and ``Σ e^{2·clip(δ)} m``;
    :func:`mismatch_metrics` turns them into the metrics.
    """
    clamped = jnp.clip(delta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {
        "old": _reduce.total(old_logp, population),
        "rollout": _reduce.total(rollout_logp, population),
        "delta": _reduce.total(delta, population),
        "k3": _reduce.total(jnp.exp(delta) - delta - 1, population),
        "chi2": _reduce.total(jnp.exp(2 * clamped), population),
    }


MISMATCH_COLUMNS: tuple[str, ...] = ("old", "rollout", "delta", "k3", "chi2")
"""The keys of :func:`mismatch_columns`."""


def mismatch_metrics(
    sums: dict[str, jax.Array], count: jax.Array, reduction: Reduction
) -> dict[str, SeqMean]:
    """The eleven mismatch metrics between the training and the rollout engine.

    With ``mean_o = Σ o m / N̄`` and ``mean_b = Σ b m / N̄`` per sequence:
    training/rollout log-perplexity ``−mean``, perplexity ``exp(−mean)``,
    ``mis_kl`` (token ``b − o``, an estimate of KL(π_rollout‖π_old)),
    ``mis_k3_kl`` (token ``e^δ − δ − 1``, Schulman's k3 estimator), the
    log-perplexity difference, its absolute value, the perplexity ratio
    ``exp(mean_b − mean_o)``, ``mis_chi2_token = Σ e^{2δ} m / N̄ − 1`` and
    ``mis_chi2_seq = e^{2 Σ δ m} − 1`` (exponents clamped to ``±S``).

    Args:
      sums: ``[...]`` per-sequence sums of :func:`mismatch_columns` over the population.
      count: ``[...]`` per-sequence population sizes ``N``.
      reduction: ``"sequence"`` or ``"token"``.

    Returns:
      A dict from the keys in :data:`MISMATCH_METRIC_KEYS` to per-sequence
      :class:`~offpolicy_jax._reduce.SeqMean` terms (see ``_reduce.batch_means``).
    """

    def per_seq(values):
        return _reduce.seq_mean_of_values(values, count, reduction)

    def per_token(per_seq_sums):
        return _reduce.seq_mean(per_seq_sums, count, reduction)

    mean_o = _reduce.safe_divide(sums["old"], count)
    mean_b = _reduce.safe_divide(sums["rollout"], count)
    log_ppl_diff = mean_b - mean_o
    seq_log_ratio = sums["delta"]
    return {
        "mis_training_log_ppl": per_seq(-mean_o),
        "mis_training_ppl": per_seq(jnp.exp(-mean_o)),
        "mis_rollout_log_ppl": per_seq(-mean_b),
        "mis_rollout_ppl": per_seq(jnp.exp(-mean_b)),
        # b − o = −δ exactly (negation commutes with rounding), so no extra sum.
        "mis_kl": per_token(-seq_log_ratio),
        "mis_k3_kl": per_token(sums["k3"]),
        "mis_log_ppl_diff": per_seq(log_ppl_diff),
        "mis_log_ppl_abs_diff": per_seq(jnp.abs(log_ppl_diff)),
        "mis_ppl_ratio": per_seq(jnp.exp(log_ppl_diff)),
        "mis_chi2_token": per_seq(_reduce.safe_divide(sums["chi2"], count) - 1),
        "mis_chi2_seq": per_seq(
            jnp.exp(2 * jnp.clip(seq_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) - 1
        ),
    }


def weight_stats(
    mean: SeqMean,
    low: jax.Array,
    high: jax.Array,
    count: jax.Array,
    reduction: Reduction,
    *,
    prefix: str = "mis_is_ratio",
    suffix: str = "_final",
) -> dict[str, SeqMean]:
    """Mean, and per-sequence min and max (then reduced), of the weights over a population.

    Args:
      mean: the mean weight's per-sequence terms.
      low, high: ``[...]`` per-sequence minimum and maximum weight.
      count: ``[...]`` per-sequence population sizes (empty sequences are left out).
      reduction: ``"sequence"`` or ``"token"``.
    """
    return {
        f"{prefix}_mean{suffix}": mean,
        f"{prefix}_min{suffix}": _reduce.seq_mean_of_values(low, count, reduction),
        f"{prefix}_max{suffix}": _reduce.seq_mean_of_values(high, count, reduction),
    }


def finalize(parts: dict[str, MeanParts | jax.Array]) -> dict[str, jax.Array]:
    """Divides out every :class:`MeanParts`; plain arrays pass through. float32 scalars."""
    return {
        key: (value.value() if isinstance(value, MeanParts) else value).astype(jnp.float32)
        for key, value in parts.items()
    }
