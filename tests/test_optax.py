"""The optax transform of VCPO's step scaling (offpolicy_jax.integrations.optax).

``optax.chain(optimizer, scale_by_ess())`` must give exactly the plain optimizer's
update times the paper's factor ``min(1, ρ/ρ_base)^{1/2 or 1}``, leave the optimizer's
own state untouched, skip the step (a zero update, never NaN) for an ESS of 0 / NaN /
inf, refuse a missing ESS, and work under jit, ``optax.inject_hyperparams`` and with
the pooled ``mis_ess`` parts of micro-batches. Runs where optax is installed (the
``optax``, ``demo`` and ``test`` extras).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

optax = pytest.importorskip("optax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import offpolicy_jax as opj  # noqa: E402
from offpolicy_jax.integrations.optax import ScaleByESSState, scale_by_ess  # noqa: E402

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
}
# Factors that are powers of two make the scaled update exact whatever the order of the
# products; the others are within two float32 roundings (XLA may fuse (−η·g)·s as −η·(g·s)).
EXACT_FACTORS = (0.5, 0.25, 1.0)
OTHER_ESS = (0.81, 0.3, 0.05)


def _params_and_grads(step: int):
    key = jax.random.fold_in(jax.random.key(0), step)
    k1, k2 = jax.random.split(key)
    params = {"w": jax.random.normal(k1, (3, 4)), "b": jnp.arange(4.0)}
    grads = {"w": jax.random.normal(k2, (3, 4)), "b": jnp.linspace(-1.0, 1.0, 4)}
    return params, grads


def _factor(ess: float, base: float, rule: str) -> np.float32:
    """The paper's factor, in NumPy float32 (IEEE sqrt: correctly rounded, like XLA's)."""
    scale = np.minimum(np.float32(ess) / np.float32(base), np.float32(1.0))
    return np.sqrt(scale) if rule == "sqrt" else scale


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize(("rule", "base"), [("sqrt", 1.0), ("linear", 1.0), ("sqrt", 0.5)])
def test_update_is_the_plain_update_times_the_ess_factor(name, rule, base):
    plain = OPTIMIZERS[name]()
    scaled = optax.chain(OPTIMIZERS[name](), scale_by_ess(base_ess_ratio=base, scaling_rule=rule))
    params, _ = _params_and_grads(0)
    plain_state, scaled_state = plain.init(params), scaled.init(params)
    plain_update = jax.jit(plain.update)
    scaled_update = jax.jit(scaled.update)
    exact_ess = [base * (f * f if rule == "sqrt" else f) for f in EXACT_FACTORS]
    for step, ess in enumerate([*exact_ess, *OTHER_ESS]):
        _, grads = _params_and_grads(step + 1)
        want, plain_state = plain_update(grads, plain_state, params)
        got, scaled_state = scaled_update(grads, scaled_state, params, ess=jnp.float32(ess))
        factor = _factor(ess, base, rule)
        for leaf_got, leaf_want in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            if step < len(exact_ess):
                assert factor == EXACT_FACTORS[step]
                np.testing.assert_array_equal(leaf_got, np.asarray(leaf_want) * factor)
            else:
                np.testing.assert_array_max_ulp(leaf_got, np.asarray(leaf_want) * factor, 2)
        # The optimizer's own state (moments, counts) is the plain optimizer's.
        inner, own = scaled_state
        jax.tree.map(np.testing.assert_array_equal, inner, plain_state)
        assert isinstance(own, ScaleByESSState) and float(own.lr_scale) == float(factor)
        params = optax.apply_updates(params, got)


@pytest.mark.parametrize("ess", [0.0, -0.2, math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_an_unusable_ess_skips_the_step_without_nan(ess, name):
    optimizer = optax.chain(OPTIMIZERS[name](), scale_by_ess())
    params, grads = _params_and_grads(0)
    grads = {"w": grads["w"].at[0, 0].set(jnp.inf), "b": grads["b"]}  # even with an inf
    state = optimizer.init(params)
    updates, state = jax.jit(optimizer.update)(grads, state, params, ess=ess)
    for leaf in jax.tree.leaves(updates):
        np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
    assert float(state[1].lr_scale) == 0.0


def test_missing_or_malformed_ess_is_a_clear_error():
    optimizer = optax.chain(optax.adam(1e-3), scale_by_ess())
    params, grads = _params_and_grads(0)
    state = optimizer.init(params)
    with pytest.raises(ValueError, match=r"ess=metrics\[\"mis_ess\"\]"):
        optimizer.update(grads, state, params)
    with pytest.raises(ValueError, match="scalar"):
        optimizer.update(grads, state, params, ess=jnp.ones(3))
    with pytest.raises(ValueError, match="scaling_rule"):
        scale_by_ess(scaling_rule="cubic")
    with pytest.raises(ValueError, match="base_ess_ratio"):
        scale_by_ess(base_ess_ratio=0.0)


def test_inject_hyperparams_injects_the_base_ratio():
    transform = optax.inject_hyperparams(scale_by_ess)(base_ess_ratio=0.5, scaling_rule="linear")
    optimizer = optax.chain(optax.sgd(1.0), transform)
    params, grads = _params_and_grads(0)
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    got, state = update(grads, state, params, ess=0.25)  # min(1, 0.25 / 0.5) = 0.5
    np.testing.assert_array_equal(got["b"], -np.asarray(grads["b"]) * np.float32(0.5))
    state[1].hyperparams["base_ess_ratio"] = jnp.float32(0.125)  # now min(1, 2) = 1
    got, state = update(grads, state, params, ess=0.25)
    np.testing.assert_array_equal(got["b"], -np.asarray(grads["b"]))
    assert float(optax.tree_utils.tree_get(state, "lr_scale")) == 1.0


def test_chains_with_an_injected_learning_rate():
    schedule = optax.linear_schedule(1e-2, 0.0, 10)
    optimizer = optax.chain(
        optax.inject_hyperparams(optax.adam)(learning_rate=schedule), scale_by_ess()
    )
    plain = optax.inject_hyperparams(optax.adam)(learning_rate=schedule)
    params, grads = _params_and_grads(0)
    state, plain_state = optimizer.init(params), plain.init(params)
    for ess in (0.64, 0.09):
        updates, state = jax.jit(optimizer.update)(grads, state, params, ess=jnp.float32(ess))
        want, plain_state = plain.update(grads, plain_state, params)
        np.testing.assert_allclose(
            updates["w"], np.asarray(want["w"]) * np.sqrt(np.float32(ess)), rtol=1e-6
        )
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(state))  # a pytree


def test_keeps_the_dtype_of_bf16_updates():
    optimizer = optax.chain(optax.adam(1e-2), scale_by_ess())
    params = {"w": jnp.ones((2, 3), jnp.bfloat16)}
    grads = {"w": jnp.full((2, 3), 0.5, jnp.bfloat16)}
    updates, _ = jax.jit(optimizer.update)(grads, optimizer.init(params), params, ess=0.64)
    assert updates["w"].dtype == jnp.bfloat16
    plain, _ = optax.adam(1e-2).update(grads, optax.adam(1e-2).init(params), params)
    want = np.asarray(plain["w"], np.float32) * np.float32(0.8)
    np.testing.assert_allclose(np.asarray(updates["w"], np.float32), want, rtol=1e-2)


@pytest.mark.heavy
def test_policy_loss_metrics_feed_the_transform_in_a_jitted_step():
    """The training step of the docs: mis_ess from policy_loss's metrics, under jit; its
    parts from policy_loss_parts give the same update (pooling: tests/test_vcpo.py)."""
    rng = np.random.default_rng(0)
    old = rng.normal(-1.0, 0.5, (6, 8)).astype(np.float32)
    rollout = (old + rng.normal(0, 0.5, old.shape)).astype(np.float32)
    mask = np.arange(8)[None] < np.array([[8], [5], [0], [3], [8], [1]])
    adv = rng.normal(size=6).astype(np.float32)
    config = opj.LossConfig(
        algorithm="decoupled_ppo", correction=opj.CorrectionConfig.preset("mis")
    )
    optimizer = optax.chain(optax.adam(1e-2), scale_by_ess())
    params = {"logp": jnp.asarray(old)}
    state = optimizer.init(params)

    @jax.jit
    def step(params, state):
        def loss_fn(p):
            return opj.policy_loss(p["logp"], old, rollout, adv, mask, config)

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, state = optimizer.update(grads, state, params, ess=metrics["mis_ess"])
        return updates, state, metrics["mis_ess"], grads

    updates, new_state, ess, grads = step(params, state)
    assert 0 < float(ess) < 1
    plain, _ = optax.adam(1e-2).update(grads, optax.adam(1e-2).init(params), params)
    np.testing.assert_allclose(
        updates["logp"], np.asarray(plain["logp"]) * np.sqrt(np.float32(ess)), rtol=1e-6
    )
    # The mis_ess parts of policy_loss_parts (a MeanParts) are divided out by the transform.
    parts = opj.policy_loss_parts(old, old, rollout, adv, mask, config)[1]["mis_ess"]
    assert isinstance(parts, opj.MeanParts)
    from_parts, _ = jax.jit(optimizer.update)(grads, state, params, ess=parts)
    np.testing.assert_allclose(from_parts["logp"], updates["logp"], rtol=1e-6)
