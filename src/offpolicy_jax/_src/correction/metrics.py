"""Monitoring metrics of the training–inference mismatch (docs/semantics.md §4, §7).

Every metric is a per-token value, or a per-sequence value broadcast to its
tokens, reduced over a *population* (a float mask) with the caller's reduction:
``"sequence"`` = mean over the population's non-empty sequences of their masked
means, ``"token"`` = token-weighted mean. They are returned as
:class:`~offpolicy_jax._src.reduction.MeanParts` so that micro-batches and devices pool
exactly; :func:`finalize` divides them out.

:class:`MismatchMetrics` is the §4 metric group as a pipeline stage
(``offpolicy_jax._src.correction.stages``): its per-sequence sums are taken in the pipeline's first
pass together with every other stage's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from offpolicy_jax._src import reduction as _reduce
from offpolicy_jax._src.correction import ratios
from offpolicy_jax._src.correction.ratios import LOG_RATIO_CLAMP
from offpolicy_jax._src.correction.stages import Decision, Stage
from offpolicy_jax._src.reduction import MeanParts

_E2S_M1 = math.expm1(2 * LOG_RATIO_CLAMP)


@dataclasses.dataclass(frozen=True)
class MismatchMetrics(Stage):
    """The eleven mismatch metrics between the training and the rollout engine (§4).

    With ``mean_o = Σ o m / N̄`` and ``mean_b = Σ b m / N̄`` per sequence:
    training/rollout log-perplexity ``−mean``, perplexity ``exp(−mean)``,
    ``mis_kl`` (token ``b − o``, an estimate of KL(π_rollout‖π_old)),
    ``mis_k3_kl`` (token ``e^δ − δ − 1``, Schulman's k3 estimator), the
    log-perplexity difference, its absolute value, the perplexity ratio
    ``exp(mean_b − mean_o)``, ``mis_chi2_token = Σ e^{2δ} m / N̄ − 1`` and
    ``mis_chi2_seq = e^{2 Σ δ m} − 1`` (χ² exponents clamped to ``±S``). The χ² and
    k3 terms are computed as ``e^x − 1`` forms (``ratios.k3``), without cancellation near δ = 0; every
    other exponential follows the metric cap (``ratios.metric_exp``).
    """

    def columns(self, t):
        k3 = ratios.k3(t.delta)
        # e^{2δ} − 1 = u (u + 2) with u = e^δ − 1 = δ + k3: one exponential for both
        # columns. δ > S saturates at e^{2S} − 1 (the χ² exponent is clamped); below −S
        # u (u + 2) is already −1 to float32.
        u = t.delta + k3
        chi2 = jnp.where(t.delta > LOG_RATIO_CLAMP, _E2S_M1, u * (u + 2.0))
        return {
            "old": _reduce.total(t.old, t.population),
            "rollout": _reduce.total(t.rollout, t.population),
            "k3": _reduce.total(k3, t.population),
            # Σ (e^{2δ} − 1) m / N = Σ e^{2δ} m / N − 1 exactly, without the cancellation.
            # It reuses k3's exponential.
            "chi2": _reduce.total(chi2, t.population),
        }

    def decide(self, t, sums):
        count, how = sums["count"], t.reduction

        def per_seq(values):
            return _reduce.seq_mean_of_values(values, count, how)

        mean_o = _reduce.safe_divide(sums["old"], count)
        mean_b = _reduce.safe_divide(sums["rollout"], count)
        log_ppl_diff = mean_b - mean_o
        seq_log_ratio = sums["delta"]
        clamped = jnp.clip(seq_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return Decision(
            metrics={
                "mis_training_log_ppl": per_seq(-mean_o),
                "mis_training_ppl": per_seq(ratios.metric_exp(-mean_o)),
                "mis_rollout_log_ppl": per_seq(-mean_b),
                "mis_rollout_ppl": per_seq(ratios.metric_exp(-mean_b)),
                # b − o = −δ exactly (negation commutes with rounding), so no extra sum.
                "mis_kl": _reduce.seq_mean(-seq_log_ratio, count, how),
                "mis_k3_kl": _reduce.seq_mean(sums["k3"], count, how),
                "mis_log_ppl_diff": per_seq(log_ppl_diff),
                "mis_log_ppl_abs_diff": per_seq(jnp.abs(log_ppl_diff)),
                "mis_ppl_ratio": per_seq(ratios.metric_exp(log_ppl_diff)),
                "mis_chi2_token": per_seq(_reduce.safe_divide(sums["chi2"], count)),
                "mis_chi2_seq": per_seq(ratios.metric_expm1(2 * clamped)),
            }
        )


def finalize(parts: Mapping[str, MeanParts | jax.Array]) -> dict[str, jax.Array]:
    """Divides out every :class:`MeanParts`; plain arrays pass through. float32 scalars."""
    return {
        key: (value.value() if isinstance(value, MeanParts) else value).astype(jnp.float32)
        for key, value in parts.items()
    }
