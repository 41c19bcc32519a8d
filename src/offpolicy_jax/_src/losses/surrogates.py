"""Per-token policy-gradient terms: the PPO surrogate, the REINFORCE term, VanillaTIS.

These are the only places where ``logp`` (π_θ) is differentiated. Gradients at
ties follow the reference (docs/semantics.md §5): a clamp passes the full gradient on
its closed interval, and at ``L1 == L2`` the unclipped gradient flows. Both are
written with ``where``, because the JVPs of ``jnp.clip`` / ``jnp.maximum`` split
a tie 50/50 and would give half the gradient there.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax._src.correction.ratios import LOG_RATIO_CLAMP, metric_exp

_RATIO_MIN = float(np.exp(np.float32(-LOG_RATIO_CLAMP)))
_RATIO_MAX = float(np.exp(np.float32(LOG_RATIO_CLAMP)))


def clamp(x: jax.Array, lower: float, upper: float) -> jax.Array:
    """``clip(x, lower, upper)`` whose gradient is 1 on the closed interval, 0 outside."""
    return jnp.where(x < lower, lower, jnp.where(x > upper, upper, x))


class PPOTerms(NamedTuple):
    """Per-token outputs of :func:`ppo_surrogate`, all ``[..., T]``."""

    loss: jax.Array  # ℓ, differentiable w.r.t. logp
    clipped: jax.Array  # bool, L2 > L1 (the clipped branch is active)
    log_ratio: jax.Array  # k = d − θ (0 where invalid or non-finite)
    ratio: jax.Array  # r = exp(clip(−k, −S, S))
    clipped_lower: jax.Array | None = None  # bool, the dual-clip floor −c·A is active


def ppo_surrogate(
    logp: jax.typing.ArrayLike,
    denominator_logp: jax.typing.ArrayLike,
    advantages: jax.typing.ArrayLike,
    *,
    where: jax.typing.ArrayLike | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
) -> PPOTerms:
    """The clipped PPO surrogate per token (Schulman et al., 2017), as in miles.

    ``k = d − θ``, ``r = exp(clip(−k, −S, S))``, ``L1 = −r·A``,
    ``L2 = −clip(r, 1 − ε, 1 + ε_high)·A``, ``ℓ = max(L1, L2)``; with dual clip
    (Ye et al., 2020, ``c > 1``): where ``A < 0``, ``ℓ = min(−c·A, ℓ)``
    (docs/semantics.md §5). Gradients at ties follow the reference.

    Args:
      logp: ``[..., T]`` log π_θ (differentiated).
      denominator_logp: ``[..., T]`` the ratio's denominator ``d`` (π_old, or
        π_rollout in bypass mode); stop-gradient.
      advantages: ``[..., T]`` advantages ``A`` (stop-gradient).
      where: optional ``[..., T]`` bool: the tokens that count. Elsewhere ``k = 0``
        and ``A`` is taken as 0, so garbage (NaN/inf) cannot leak, not even into
        gradients; ``loss`` there is 0.
      clip_eps: ``ε``.
      clip_eps_high: ``ε_high`` (default ``ε``).
      dual_clip_c: ``c`` or None.

    Returns:
      :class:`PPOTerms`: per-token ``loss``, ``clipped``, ``log_ratio``, ``ratio``.

    Examples:
      >>> import jax, jax.numpy as jnp, offpolicy_jax as opj
      >>> lp = jnp.log(jnp.array([0.7, 0.3, 0.5]))
      >>> old = jnp.log(jnp.array([0.5, 0.5, 0.5]))
      >>> t = opj.ppo_surrogate(lp, old, jnp.array([1.0, 1.0, jnp.nan]),
      ...                       where=jnp.array([True, True, False]), clip_eps=0.2)
      >>> [round(float(x), 3) + 0.0 for x in t.loss]  # ratio 1.4 clipped to 1.2
      [-1.2, -0.6, 0.0]
      >>> [bool(c) for c in t.clipped]
      [True, False, False]
    """
    logp = jnp.asarray(logp, jnp.float32)
    valid = jnp.ones(logp.shape, bool) if where is None else jnp.asarray(where)
    if valid.dtype != bool:  # a bool mask as it is: the same array as the caller's
        valid = valid > 0
    clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    clips = (clip_eps, clip_eps_high, dual_clip_c)
    denominator_logp = jax.lax.stop_gradient(jnp.asarray(denominator_logp, jnp.float32))
    advantages = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))
    advantages = jnp.where(valid & jnp.isfinite(advantages), advantages, 0.0)
    terms = _ppo_terms(logp, denominator_logp, advantages, valid, *clips)
    loss = _ppo_loss(clips, logp, denominator_logp, advantages, valid)
    return PPOTerms(
        loss, terms.clipped, jax.lax.stop_gradient(terms.log_ratio), terms.ratio, terms.floored
    )


class _Branches(NamedTuple):
    loss: jax.Array  # ℓ
    clipped: jax.Array  # bool: L2 > L1
    floored: jax.Array | None  # bool: the dual-clip floor −c·A replaced ℓ


def _branches(ratio, advantages, clip_eps, clip_eps_high, dual_clip_c) -> _Branches:
    """``ℓ = max(L1, L2)`` (and the dual-clip floor) for a given ratio ``r``."""
    unclipped = -ratio * advantages
    clipped = -clamp(ratio, 1 - clip_eps, 1 + clip_eps_high) * advantages
    is_clipped = clipped > unclipped
    loss = jnp.where(is_clipped, clipped, unclipped)
    floored = None
    if dual_clip_c is not None:
        floor = -dual_clip_c * advantages
        floored = (advantages < 0) & (floor < loss)
        loss = jnp.where(floored, floor, loss)
    return _Branches(loss, is_clipped, floored)


class _Terms(NamedTuple):
    loss: jax.Array
    clipped: jax.Array
    log_ratio: jax.Array
    ratio: jax.Array
    floored: jax.Array | None


def _ppo_terms(logp, denominator_logp, advantages, valid, clip_eps, clip_eps_high, dual_clip_c):
    """``k``, ``r``, ℓ and the clipped-branch mask, per token."""
    # −k = θ − d exactly as policy_losses.safe_log_ratio writes it (negation is exact),
    # and exp(clip(−k, −S, S)) as clip(exp(min(−k, 50)), e^−S, e^S): the same values, and
    # the exponential is the one the loss's `ois` metric takes of that log-ratio
    # (ratios.metric_exp), so it is computed once per token.
    raw = logp - denominator_logp
    exponent = jnp.where(valid & jnp.isfinite(raw), raw, 0.0)
    log_ratio = -exponent
    ratio = clamp(metric_exp(exponent), _RATIO_MIN, _RATIO_MAX)
    branches = _branches(ratio, advantages, clip_eps, clip_eps_high, dual_clip_c)
    return _Terms(branches.loss, branches.clipped, log_ratio, ratio, branches.floored)


def _ppo_slope(logp, denominator_logp, advantages, valid, clip_eps, clip_eps_high, dual_clip_c):
    """``∂ℓ/∂θ`` per token, in closed form.

    It is what JAX's autodiff gives for the ``where`` formulas of :func:`_ppo_terms`:
    ``∂r/∂θ = r`` where ``θ`` is used (valid, finite ``d − θ``) and the exponent lies
    in the clamp's closed interval ``[−S, S]``, else 0; then the selected branch's
    derivative (``−A·∂r``, or ``0`` outside ``[1 − ε, 1 + ε_high]`` for the clipped
    one, or ``0`` under the dual-clip floor).

    Where the slope can be non-zero ``r = exp(θ − d)`` exactly, and that is how it is
    computed here, not as the forward's ``exp(clip(θ − d))``: XLA would otherwise
    merge the two exponentials and keep ``r`` as a ``[..., T]`` array from the forward
    to the backward instead of recomputing it.
    """
    raw = denominator_logp - logp
    usable = valid & jnp.isfinite(raw)
    exponent = jnp.where(usable, logp - denominator_logp, 0.0)  # = −k
    in_range = usable & (exponent >= -LOG_RATIO_CLAMP) & (exponent <= LOG_RATIO_CLAMP)
    ratio = jnp.where(in_range, jnp.exp(exponent), 1.0)
    branches = _branches(ratio, advantages, clip_eps, clip_eps_high, dual_clip_c)
    d_unclipped = jnp.where(in_range, -advantages * ratio, 0.0)
    inside_clip = (ratio >= 1 - clip_eps) & (ratio <= 1 + clip_eps_high)
    slope = jnp.where(branches.clipped & ~inside_clip, 0.0, d_unclipped)
    if branches.floored is not None:
        slope = jnp.where(branches.floored, 0.0, slope)
    return slope


# ℓ gets its derivative in closed form (a custom JVP, so forward mode and higher
# orders keep working): `∂ℓ = (∂ℓ/∂θ) · ∂θ`. Reverse mode then needs only that slope,
# which XLA computes inside the backward's single elementwise pass from the inputs;
# JAX's own derivative would keep five [..., T] intermediates of the forward (k, r,
# L1, L2, the branch mask) as residuals, written by the forward and read back.
@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _ppo_loss(clips, logp, denominator_logp, advantages, valid):
    return _ppo_terms(logp, denominator_logp, advantages, valid, *clips).loss


@_ppo_loss.defjvp
def _ppo_loss_jvp(clips, primals, tangents):
    # π_old / π_rollout and the advantages are data (stop-gradient): only θ moves ℓ.
    slope = _ppo_slope(*primals, *clips)
    return _ppo_loss(clips, *primals), slope * tangents[0]


def reinforce_term(logp: jax.Array, advantages: jax.Array, weights: jax.Array) -> jax.Array:
    """REINFORCE with importance sampling: ``−sg(w)·A·log π_θ`` per token (no clipping).

    Its gradient is ``−w·A·∇log π_θ``, the off-policy policy gradient with the
    rollout policy as the behaviour policy (D9).
    """
    return -jax.lax.stop_gradient(weights) * advantages * logp
