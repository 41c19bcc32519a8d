"""The binary (Bernoulli) KL between two probabilities of one sampled token: KPop's statistic.

KPop (Guo et al., Ant Group, 2026, https://ringtech.notion.site/kpop) treats the sampled
token as a Bernoulli event, this token against the rest of the vocabulary, and compares
the trainer's probability ``p`` of it with the engine's ``q``:

    D_B(p‖q) = p·log(p/q) + (1 − p)·log((1 − p)/(1 − q)),

which is ``≥ 0``, ``0`` iff ``p = q``, and (unlike the ratio ``p / q``) tight for
confident tokens and loose for rare ones. The home systems (verl ``rollout_rs:
"binary_kl"``, AReaL's ``kpop`` rejection, prime-rl's ``kpop`` loss) clamp both
probabilities to ``[ε, 1 − ε]`` (``ε = 1e-6``) in float32 so the complement terms stay
finite (the clamp's ends are float32 numbers: :func:`clamp_bounds`); a token is kept
when both directions are within the threshold φ.

This module holds the formula only; the rule, the loss and the metrics that use it live
beside the other rules and losses.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

__all__ = ["BINARY_KL_EPS", "binary_kl", "bidirectional_binary_kl", "clamp_bounds"]

BINARY_KL_EPS = 1e-6
"""ε of the home systems' clamp of both probabilities to ``[ε, 1 − ε]``."""


def clamp_bounds(eps: float) -> tuple[float, float]:
    """The home systems' clamp ``[ε, 1 − ε]`` as they apply it: both ends rounded to float32.

    ``torch.clamp(p, eps, 1 - eps)`` on a float32 ``p`` rounds its bounds to float32
    first, and ``1 − 10⁻⁶`` is not a float32: the upper end is ``0.999999`` (float32),
    ``1 − 1.0133·10⁻⁶``. A probability clamped there has the complement ``1.0133·10⁻⁶``,
    and its ``log(1 − p)`` is ``0.013`` from ``log 10⁻⁶``, which moves ``D_B`` by up to
    ``0.013·(1 − q)``: far more than float32 rounding of the result, so the clamp here
    uses the same float32 ends (as float64 numbers, exactly).

    Where ``1 − ε`` rounds to 1 in float32 (``ε < 2.98·10⁻⁸``, AReaL's ``10⁻⁸``), the
    home systems' clamp leaves ``1 − p = 0`` and ``D_B`` NaN; the upper end here is then
    ``1 − ε`` itself (the clamp is applied to ``log p``, where ``log(1 − ε)`` is a
    float32), so the divergence stays finite (the caller flags those tokens where the
    home system's NaN decides).

    Returns:
      ``(low, high)``, the float32 values of ``ε`` and ``1 − ε`` as Python floats.
    """
    high = np.float32(1.0 - eps)
    if high == np.float32(1.0):
        return float(np.float32(eps)), 1.0 - eps
    return float(np.float32(eps)), float(high)


def _clamped_logs(logp: jax.Array, eps: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(log p, p, log(1 − p))`` of ``p = clip(e^logp, ε₃₂, (1 − ε)₃₂)``, in float32
    (:func:`clamp_bounds`).

    The clamp is applied to the log-probability (the same set of values, without
    rounding ``e^logp`` first), and ``log(1 − p)`` is taken as ``log(−expm1(log p))``,
    exact where ``p`` is within a few ulp of 1 (the home systems' ``1 − p`` of a
    float32 ``p`` loses up to ``2⁻²⁴ / (1 − p)`` of it there).
    """
    p_low, p_high = clamp_bounds(eps)
    low = jnp.float32(math.log(p_low))
    high = jnp.float32(math.log(p_high))
    log_p = jnp.clip(logp.astype(jnp.float32), low, high)
    return log_p, jnp.exp(log_p), jnp.log(-jnp.expm1(log_p))


def binary_kl(logp: ArrayLike, logq: ArrayLike, *, eps: float = BINARY_KL_EPS) -> jax.Array:
    """``D_B(p‖q)`` per token from log-probabilities, clamped to ``≥ 0``.

    ``D_B(p‖q) = p·(log p − log q) + (1 − p)·(log(1 − p) − log(1 − q))`` with
    ``p = clip(e^logp, ε, 1 − ε)`` and ``q = clip(e^logq, ε, 1 − ε)`` in float32, the
    clamp's ends rounded to float32 as the home systems' ``torch.clamp`` rounds them
    (:func:`clamp_bounds`).
    Float32 cancellation can leave the two terms a few ulp below zero (``−4.5e-8``);
    the divergence is never negative, so the result is ``max(·, 0)``.

    Args:
      logp: ``[...]`` log-probability of the sampled token under the first policy.
      logq: ``[...]`` the same token's log-probability under the second policy
        (broadcastable with ``logp``).
      eps: the clamp ``ε`` of both probabilities, in ``(0, 0.5)``.

    Returns:
      ``[...]`` float32 divergence (garbage where an input is not a log-probability:
      mask the result with ``jnp.where``).
    """
    _check_eps(eps)
    return _divergence(_clamped_logs(jnp.asarray(logp), eps), _clamped_logs(jnp.asarray(logq), eps))


def _check_eps(eps: float) -> None:
    if not 0.0 < eps < 0.5:
        raise ValueError(f"binary_kl: eps must be in (0, 0.5), got {eps!r}")


def _divergence(first, second) -> jax.Array:
    """``max(D_B, 0)`` of two :func:`_clamped_logs` triples."""
    log_p, p, log_1mp = first
    log_q, _, log_1mq = second
    value = p * (log_p - log_q) + (1.0 - p) * (log_1mp - log_1mq)
    return jnp.maximum(value, 0.0)


def bidirectional_binary_kl(
    logp: ArrayLike, logq: ArrayLike, *, eps: float = BINARY_KL_EPS
) -> jax.Array:
    """``max(D_B(p‖q), D_B(q‖p))`` per token: KPop keeps a token when this is within φ.

    Both directions from one clamp of each probability: three transcendentals per
    input, not six; each direction is ``≥ 0`` as in :func:`binary_kl`.

    Args:
      logp: ``[...]`` log-probability of the sampled token under the trainer.
      logq: ``[...]`` its log-probability under the engine (broadcastable).
      eps: the probability clamp ``ε`` (:data:`BINARY_KL_EPS`).

    Returns:
      ``[...]`` float32, ``≥ 0``.
    """
    _check_eps(eps)
    # Each probability's clamped logs once, for both directions (the same values as two
    # binary_kl calls, half the transcendentals).
    p = _clamped_logs(jnp.asarray(logp), eps)
    q = _clamped_logs(jnp.asarray(logq), eps)
    return jnp.maximum(_divergence(p, q), _divergence(q, p))
