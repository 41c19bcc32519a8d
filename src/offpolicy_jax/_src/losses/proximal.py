"""The proximal-policy approximation of decoupled PPO (AReaL ``prox_logp_method``).

Decoupled PPO (Hilton et al. 2022) anchors the clipped ratio at a proximal policy
``π_prox`` (``old_logp``) and corrects ``π_prox / π_behave`` with importance weights;
``π_prox`` costs one more forward pass over every token. AReaL (Fu et al. 2025,
"AReaL: A Large-Scale Asynchronous Reinforcement Learning System", arXiv:2505.24298;
``areal/trainer/ppo/actor.py::compute_prox_logp_approximations``, docs
``algorithms/prox_approx.md``) approximates it from the behaviour log-prob
``b = log π_rollout``, the current ``θ = sg(log π_θ)`` and the token's policy version
``v``, assuming the policy moves along a straight line between versions. With the
current version ``c`` and the proximal version ``c − 1`` (the last one broadcast)::

    α = clip((c − 1 − v) / (c − v), 0, 1)   where c > v and v ≥ 0, else α = 0
    loglinear:  log π_prox ≈ b + α (θ − b)                  (log space)
    linear:     log π_prox ≈ log((1 − α) e^b + α e^θ)       (probability space)

A token sampled by the proximal version (``v = c − 1``) gets ``α = 0``, ``π_prox = π_rollout``
(the same weights); the older the token, the closer ``α`` comes to 1. AReaL reports
207 → 163 minutes (1.27×) on Qwen2.5-1.5B at staleness 8 with comparable rewards.
``linear`` is computed as a ``logaddexp`` (AReaL adds ``1e−10`` inside the log
instead; the two agree wherever ``π > 1e−6``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from offpolicy_jax._src import reduction as _reduce
from offpolicy_jax._src.messages import shown
from offpolicy_jax._src.reduction import MeanParts

METHODS: tuple[str, ...] = ("loglinear", "linear")
_REL_EPS = 1e-8  # AReaL's _EPSILON in the relative error


def interpolation_weight(versions: jax.Array, current_version: jax.Array) -> jax.Array:
    """``α`` per token (module docstring), float32.

    Integer inputs (what the losses pass) are subtracted as integers, so
    ``c − v`` is exact at any version; ``α = (c − v − 1) / (c − v)`` is then rounded
    once to float32. A token without a version (``v < 0``, AReaL's −1) and one at or
    above ``c`` get ``α = 0``, as in AReaL.
    """
    span = current_version - versions
    usable = (span > 0) & (versions >= 0)
    gap = jnp.where(usable, span - 1, 0).astype(jnp.float32)
    alpha = gap / jnp.where(usable, span, 1).astype(jnp.float32)
    return jnp.where(usable, jnp.clip(alpha, 0.0, 1.0), 0.0)


def approximate(method: str, rollout: jax.Array, theta: jax.Array, alpha: jax.Array) -> jax.Array:
    """``log π_prox`` by ``method`` from ``b``, ``θ`` (stop-gradient) and ``α``."""
    theta = jax.lax.stop_gradient(theta)
    if method == "loglinear":
        return rollout + alpha * (theta - rollout)
    if method == "linear":
        # log((1 − α) e^b + α e^θ); α = 0 gives b and α = 1 gives θ exactly.
        keep_b = jnp.where(alpha < 1.0, jnp.log1p(-jnp.minimum(alpha, 1.0)) + rollout, -jnp.inf)
        take_t = jnp.where(
            alpha > 0.0, jnp.log(jnp.where(alpha > 0.0, alpha, 1.0)) + theta, -jnp.inf
        )
        return jnp.logaddexp(keep_b, take_t)
    raise ValueError(f"unknown proximal approximation {shown(method)}; one of {list(METHODS)}")


def error_columns(method: str, approx, old, rollout, theta, population) -> dict:
    """Per-token errors of an approximation against the recomputed ``π_prox``
    (AReaL's ``metrics`` mode), as ``_reduce`` columns over ``population``."""
    diff = old - approx
    # exp of differences of log-probs: capped like every metric exponential.
    behave_true = jnp.exp(jnp.clip(old - rollout, -20.0, 20.0))
    behave_approx = jnp.exp(jnp.clip(approx - rollout, -20.0, 20.0))
    ratio_true = jnp.exp(jnp.clip(theta - old, -20.0, 20.0))
    ratio_approx = jnp.exp(jnp.clip(theta - approx, -20.0, 20.0))
    values = {
        f"prox_{method}_abs_error": jnp.abs(diff),
        f"prox_{method}_rel_error": jnp.abs(diff) / (jnp.abs(old) + _REL_EPS),
        f"prox_{method}_squared_error": diff * diff,
        f"prox_{method}_behave_weight_abs_error": jnp.abs(behave_true - behave_approx),
        f"prox_{method}_importance_weight_abs_error": jnp.abs(ratio_true - ratio_approx),
    }
    return {k: _reduce.total(v, population) for k, v in values.items()}


def metric_parts(
    methods, alpha, old, rollout, theta, population, layout, reduction
) -> dict[str, MeanParts]:
    """``prox_alpha_mean`` and, where ``old`` (the recomputed ``π_prox``) is given, each
    method's errors: batch-total parts over ``population`` (the valid tokens of
    sequences whose inputs are all finite)."""
    columns = {
        "count": _reduce.count(population),
        "prox_alpha_mean": _reduce.total(alpha, population),
    }
    if old is not None:
        for method in methods:
            approx = approximate(method, rollout, theta, alpha)
            columns.update(error_columns(method, approx, old, rollout, theta, population))
    sums = layout.reduce(columns)
    count = sums.pop("count")
    parts = {k: _reduce.seq_mean(v, count, reduction) for k, v in sums.items()}
    return layout.batch_means(parts)
