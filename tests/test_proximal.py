"""The proximal-policy approximation (AReaL ``prox_logp_method``) against NumPy.

``α``, ``loglinear`` and ``linear`` from their definitions in float64 (AReaL's
``compute_prox_logp_approximations``, with its ``1e−10`` in the log of ``linear``,
which the stable form here agrees with wherever the probability is not tiny); a token
sampled by the proximal version gets π_rollout exactly.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from offpolicy_jax import proximal


def np_alpha(versions, current):
    v = np.asarray(versions, np.float64)
    span = current - v
    usable = (span > 0) & (v >= 0)
    return np.where(usable, np.clip((current - 1 - v) / np.where(usable, span, 1), 0, 1), 0.0)


def np_approx(method, rollout, theta, alpha):
    if method == "loglinear":
        return rollout + alpha * (theta - rollout)
    return np.log((1 - alpha) * np.exp(rollout) + alpha * np.exp(theta) + 1e-10)


@pytest.mark.parametrize("method", proximal.METHODS)
def test_approximations_match_numpy(method):
    rng = np.random.default_rng(0)
    shape = (4, 9)
    current = 7
    versions = rng.integers(-1, current + 2, size=shape)  # prompt (-1), older, current, newer
    rollout = rng.uniform(-6, -0.01, size=shape)
    theta = rollout + rng.normal(0, 0.5, size=shape)
    alpha = proximal.interpolation_weight(jnp.asarray(versions, jnp.float32), jnp.float32(current))
    np.testing.assert_allclose(alpha, np_alpha(versions, current), rtol=1e-6, atol=1e-7)
    got = proximal.approximate(
        method, jnp.asarray(rollout, jnp.float32), jnp.asarray(theta, jnp.float32), alpha
    )
    want = np_approx(method, rollout, theta, np_alpha(versions, current))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # On-policy for the proximal version (v = c − 1), and for prompt / newer tokens: α = 0.
    on_policy = (versions == current - 1) | (versions < 0) | (versions >= current)
    np.testing.assert_array_equal(np.asarray(got)[on_policy], np.float32(rollout)[on_policy])


def test_alpha_follows_areal_examples():
    # AReaL tests/test_prox_approx.py: v = c − 2 → α = 1/2; v = c − 4 → 3/4.
    alpha = proximal.interpolation_weight(jnp.array([8.0, 6.0, 9.0, -1.0]), jnp.float32(10.0))
    np.testing.assert_allclose(alpha, [0.5, 0.75, 0.0, 0.0])
    loglinear = proximal.approximate("loglinear", jnp.float32(-1.0), jnp.float32(-1.5), alpha[0])
    np.testing.assert_allclose(loglinear, -1.25)
    with pytest.raises(ValueError, match="unknown proximal approximation"):
        proximal.approximate("cubic", jnp.float32(0), jnp.float32(0), jnp.float32(0))
