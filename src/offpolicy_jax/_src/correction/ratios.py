"""Log-ratios, their aggregation to a level, and the two exponentials of the library.

The importance ratio of the rollout correction is ``π_old / π_rollout``; in log
space ``δ_t = o_t − b_t``. Levels (docs/semantics.md §2):

* token:     ``λ_t = δ_t``
* sequence:  ``λ = Σ_s δ_s m_s``          (log of the product of ratios)
* geometric: ``λ = Σ_s δ_s m_s / N̄``      (log of their geometric mean)
* minpro:    ``λ_t = δ_t + min_{s<t} δ_s`` (MinPRO's minimum prefix ratio times the
  token's ratio, :func:`minpro_log_ratio`; per token)

and ``ρ = exp(clip(λ, −S, S))`` with ``S = 20``: the clamp comes after the
aggregation, so a long sequence of small ratios is bounded as a whole.

Metrics follow one rule for exponentials: every ``exp`` inside a
*metric* is taken of an exponent capped at :data:`METRIC_LOG_CAP` = 50
(:func:`metric_exp`, :func:`metric_expm1`), so a metric saturates at ``e^50 ≈ 5.2e21``
instead of overflowing to inf, identically under jit and eager, and a sum of up to
``6e16`` such terms stays finite. Weights and losses use the ``±S`` clamp instead.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from offpolicy_jax._src import reduction as _reduce

LOG_RATIO_CLAMP = 20.0
"""``S``: log-space bound applied before every ``exp`` of a ratio."""


def log_ratio(
    numerator_logp: jax.Array, denominator_logp: jax.Array, valid: jax.Array
) -> jax.Array:
    """``δ = numerator − denominator`` on valid tokens and exactly 0 elsewhere.

    Args:
      numerator_logp: ``[..., T]`` log-probs of the target policy (e.g. π_old).
      denominator_logp: ``[..., T]`` log-probs of the sampling policy (π_rollout).
      valid: ``[..., T]`` bool, where the difference is meaningful.

    Returns:
      ``[..., T]`` log-ratio; garbage at invalid positions never leaks.
    """
    return jnp.where(valid, numerator_logp - denominator_logp, 0)


def sequence_log_ratio(delta_sum: jax.Array, count: jax.Array, level: str) -> jax.Array:
    """``λ`` of each sequence, ``[...]``, from ``Σ_t δ_t m_t`` and ``N = Σ_t m_t``.

    sequence: ``Σ δ m``; geometric: ``Σ δ m / N̄``. Here ``N̄ = N`` where ``N > 0``:
    identical to ``max(N, 1)`` for 0/1 masks, but it does not under-scale a
    sequence whose fractional mask sums to less than 1.
    """
    _check_level(level)
    if level == "sequence":
        return delta_sum
    if level == "geometric":
        return _reduce.safe_divide(delta_sum, count)
    raise ValueError(f"the token level has no per-sequence log-ratio, got {level!r}")


def _check_level(level: str) -> None:
    if level not in ("token", "sequence", "geometric", "minpro"):
        raise ValueError(
            f"level must be one of 'token', 'sequence', 'geometric', 'minpro', got {level!r}"
        )


def minpro_log_ratio(delta: jax.Array, prefix_min: jax.Array) -> jax.Array:
    """MinPRO's per-token log-ratio ``λ_t = δ_t + min_{s<t} δ_s`` (0 for no prefix).

    Lei, Cheng & Tao, "A Step Back: Prefix Importance Ratio Stabilizes Policy
    Optimization", arXiv:2601.22718 (2026): the prefix importance ratio
    ``ρ_{1:t} = Π_{s≤t} ρ_s`` is replaced by ``ρ̲_t · ρ_t`` with the non-cumulative
    ``ρ̲_t = min_{s<t} ρ_s``, the smallest token ratio of the preceding prefix; in log
    space (``exp`` is increasing) ``log(ρ̲_t ρ_t) = min_{s<t} δ_s + δ_t``. The first
    token of a sequence has an empty prefix, ``ρ̲ = 1`` (the empty product it stands
    for). The ratio is then ``exp(clip(λ, −S, S))`` like every level's.

    Args:
      delta: ``[..., T]`` per-token log-ratios ``δ`` (anything where not valid).
      prefix_min: ``[..., T]`` ``min_{s<t} δ_s`` over the earlier valid tokens of each
        token's sequence, ``+inf`` where there is none (the layout's
        :meth:`~offpolicy_jax._src.reduction.Rows.exclusive_min`).

    Returns:
      ``[..., T]`` log-ratios (garbage where ``delta`` is).
    """
    return delta + jnp.where(prefix_min < jnp.inf, prefix_min, 0.0)


def clamped_exp(log_value: jax.Array) -> jax.Array:
    """``exp(clip(x, −S, S))``: a ratio that can neither overflow nor underflow to 0."""
    return jnp.exp(jnp.clip(log_value, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


METRIC_LOG_CAP = 50.0
"""The largest exponent of any ``exp`` inside a metric (saturation value ``e^50``)."""


def metric_exp(x: jax.Array) -> jax.Array:
    """``exp(min(x, 50))``: a metric's exponential, finite for every finite ``x``."""
    return jnp.exp(jnp.minimum(x, METRIC_LOG_CAP))


# k3(x) = x² Σ_{n≥2} x^{n−2}/n!: the series up to x⁹/9! is exact to float32 for |x| < ½
# (truncation < 3e-9 relative); beyond, e^x − 1 − x cancels by less than a factor 4.
_K3_SERIES_BOUND = 0.5
_K3_COEFFICIENTS = tuple(1.0 / math.factorial(n) for n in range(2, 10))


def k3(x: jax.Array) -> jax.Array:
    """Schulman's k3 estimator ``e^x − 1 − x ≥ 0`` without cancellation near 0.

    A Taylor series for ``|x| < ½``, else ``e^x − 1 − x``, with the exponent capped at
    :data:`METRIC_LOG_CAP`. No library function computes ``e^x − 1 − x``, and
    ``expm1(x) − x`` loses ``log2(2/|x|)`` bits near 0 (``k3 ≈ x²/2``); the series is
    exact to float32 there.
    """
    x = jnp.minimum(x, METRIC_LOG_CAP)
    s = jnp.clip(x, -_K3_SERIES_BOUND, _K3_SERIES_BOUND)
    series = jnp.full_like(s, _K3_COEFFICIENTS[-1])
    for c in reversed(_K3_COEFFICIENTS[:-1]):
        series = c + s * series
    series = s * s * series
    direct = jnp.maximum(jnp.exp(x) - 1.0 - x, 0.0)
    return jnp.where(jnp.abs(x) < _K3_SERIES_BOUND, series, direct)


def metric_expm1(x: jax.Array) -> jax.Array:
    """``e^x − 1`` without cancellation near 0 (``expm1``), capped like :func:`metric_exp`."""
    return jnp.expm1(jnp.minimum(x, METRIC_LOG_CAP))
