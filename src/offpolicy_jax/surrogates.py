"""Per-token policy-gradient terms: the PPO surrogate, the REINFORCE term, VanillaTIS.

These are the only places where ``logp`` (π_θ) is differentiated. Gradients at
ties follow the reference (semantics.md §5): a clamp passes the full gradient on
its closed interval, and at ``L1 == L2`` the unclipped gradient flows. Both are
written with ``where``, because the JVPs of ``jnp.clip`` / ``jnp.maximum`` split
a tie 50/50 and would give half the gradient there.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from offpolicy_jax import _reduce
from offpolicy_jax._reduce import MeanParts, MeshAxes, Reduction
from offpolicy_jax.ratios import LOG_RATIO_CLAMP


def clamp(x: jax.Array, lower: float, upper: float) -> jax.Array:
    """``clip(x, lower, upper)`` whose gradient is 1 on the closed interval, 0 outside."""
    return jnp.where(x < lower, lower, jnp.where(x > upper, upper, x))


class PPOTerms(NamedTuple):
    """Per-token outputs of :func:`ppo_surrogate`, all ``[..., T]``."""

    loss: jax.Array  # ℓ, differentiable w.r.t. logp
    clipped: jax.Array  # bool, L2 > L1 (the clipped branch is active)
    log_ratio: jax.Array  # k = d − θ (0 where invalid or non-finite)
    ratio: jax.Array  # r = exp(clip(−k, −S, S))


def ppo_surrogate(
    logp: jax.Array,
    denominator_logp: jax.Array,
    advantages: jax.Array,
    valid: jax.Array,
    *,
    clip_eps: float,
    clip_eps_high: float,
    dual_clip_c: float | None = None,
) -> PPOTerms:
    """The clipped PPO surrogate per token (Schulman et al., 2017), as in miles.

    ``k = d − θ``, ``r = exp(clip(−k, −S, S))``, ``L1 = −r·A``,
    ``L2 = −clip(r, 1 − ε, 1 + ε_high)·A``, ``ℓ = max(L1, L2)``; with dual clip
    (Ye et al., 2020, ``c > 1``): where ``A < 0``, ``ℓ = min(−c·A, ℓ)``.

    Args:
      logp: ``[..., T]`` log π_θ (differentiated).
      denominator_logp: ``[..., T]`` the ratio's denominator ``d`` (π_old, or
        π_rollout in bypass mode); stop-gradient.
      advantages: ``[..., T]`` advantages ``A``, already 0 outside ``valid``.
      valid: ``[..., T]`` bool; elsewhere ``k = 0`` so garbage cannot leak, not
        even into gradients.
      clip_eps: ``ε``.
      clip_eps_high: ``ε_high``.
      dual_clip_c: ``c`` or None.

    Returns:
      :class:`PPOTerms`.
    """
    denominator_logp = jax.lax.stop_gradient(denominator_logp)
    raw = denominator_logp - logp
    usable = valid & jnp.isfinite(raw)
    log_ratio = jnp.where(usable, raw, 0.0)
    ratio = jnp.exp(clamp(-log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -ratio * advantages
    clipped = -clamp(ratio, 1 - clip_eps, 1 + clip_eps_high) * advantages
    is_clipped = clipped > unclipped
    loss = jnp.where(is_clipped, clipped, unclipped)
    if dual_clip_c is not None:
        floor = -dual_clip_c * advantages
        loss = jnp.where((advantages < 0) & (floor < loss), floor, loss)
    return PPOTerms(loss, is_clipped, jax.lax.stop_gradient(log_ratio), ratio)


def reinforce_term(logp: jax.Array, advantages: jax.Array, weights: jax.Array) -> jax.Array:
    """REINFORCE with importance sampling: ``−sg(w)·A·log π_θ`` per token (no clipping).

    Its gradient is ``−w·A·∇log π_θ``, the off-policy policy gradient with the
    rollout policy as the behaviour policy (D9).
    """
    return -jax.lax.stop_gradient(weights) * advantages * logp


def vanilla_tis(
    old_logp: jax.Array,
    rollout_logp: jax.Array,
    population: jax.Array,
    *,
    clip_low: float,
    clip: float,
    reduction: Reduction,
    axes: MeshAxes = MeshAxes(),
) -> tuple[jax.Array, dict[str, MeanParts]]:
    """The reference's built-in truncated IS: ``w = clip(exp(o − b), clip_low, clip)``.

    Args:
      old_logp: ``[..., T]`` log π_old (or ``sg(θ)`` in REINFORCE-IS).
      rollout_logp: ``[..., T]`` log π_rollout.
      population: ``[..., T]`` float weights of the tokens the metrics cover.
      clip_low: lower clip (0 = one-sided truncation).
      clip: upper clip.
      reduction: metric reduction.
      axes: mesh axes to combine the metrics over.

    Returns:
      ``(weights, metrics)``: stop-gradient ``[..., T]`` weights (1 where the
      log-ratio is not finite, so garbage cannot leak) and ``tis`` (pre-clip ratio),
      ``tis_clipfrac`` (share with ``w ≠ ratio``), ``tis_abs`` (``|ratio − 1|``).
    """
    log_ratio = jax.lax.stop_gradient(old_logp - rollout_logp)
    # A NaN/±inf log-ratio (a non-finite input) gets ratio 1; the loss rejects
    # such sequences anyway, so this only keeps the metrics finite.
    ratio = jnp.where((population > 0) & jnp.isfinite(log_ratio), jnp.exp(log_ratio), 1.0)
    weights = jnp.clip(ratio, clip_low, clip)

    def mean(x):
        return _reduce.mean_parts(x, population, reduction, axes)

    return weights, {
        "tis": mean(ratio),
        "tis_clipfrac": mean(jnp.where(weights != ratio, 1.0, 0.0)),
        "tis_abs": mean(jnp.abs(ratio - 1)),
    }
