"""Regression tests of the stage pipeline: non-finite inputs, metrics near float32's
limits, integer mask values, result shapes and the shipped presets.

Each test failed on the code before the pipeline (commit e700430).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import offpolicy_jax as opj

NAN = float("nan")
ALGORITHMS = {
    "ppo": opj.LossConfig(algorithm="ppo", get_mismatch_metrics=True),
    "bypass_ppo": opj.LossConfig(algorithm="bypass_ppo"),
    "decoupled_ppo": opj.LossConfig(
        algorithm="decoupled_ppo", correction=opj.CorrectionConfig.preset("mis")
    ),
    "decoupled_vanilla": opj.LossConfig(algorithm="decoupled_ppo", correction=opj.VanillaTIS()),
    "reinforce_is": opj.LossConfig(
        algorithm="reinforce_is", correction=opj.CorrectionConfig(use_tis=True)
    ),
}


def _batch():
    logp = np.full((3, 4), -1.0, np.float32)
    logp[:, 1] = -1.1
    return {
        "logp": logp,
        "old_logp": np.full((3, 4), -1.05, np.float32),
        "rollout_logp": np.full((3, 4), -1.0, np.float32),
        "advantages": np.array([1.0, -0.5, 2.0], np.float32),
        "mask": np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], bool),
    }


# The batch as arguments, not constants: one compile per config and shape, shared by
# the tests (a closure over the batch compiled a program per call).
_jit_value_and_grad = jax.jit(
    jax.value_and_grad(
        lambda lp, old, rollout, adv, mask, config: opj.policy_loss(
            lp, old, rollout, adv, mask, config
        ),
        has_aux=True,
    ),
    static_argnums=5,
)


def _value_and_grad(batch, config):
    keys = ("logp", "old_logp", "rollout_logp", "advantages", "mask")
    return _jit_value_and_grad(*(batch[k] for k in keys), config)


def _without_row(batch, row):
    out = {k: np.delete(v, row, axis=0) for k, v in batch.items()}
    return out


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(ALGORITHMS))
@pytest.mark.parametrize("field", ["logp", "advantages"])
def test_nonfinite_model_input_drops_its_sequence(name, field):
    config = ALGORITHMS[name]
    batch = _batch()
    if field == "advantages":
        batch["advantages"] = np.broadcast_to(batch["advantages"][:, None], (3, 4)).copy()
    batch[field][1, 0] = NAN
    (loss, metrics), grad = _value_and_grad(batch, config)
    (want, _), want_grad = _value_and_grad(_without_row(batch, 1), config)
    assert np.isfinite(loss) and float(loss) == pytest.approx(float(want), rel=1e-5)
    assert np.all(np.asarray(grad)[1] == 0) and np.all(np.isfinite(grad))
    np.testing.assert_allclose(np.delete(np.asarray(grad), 1, 0), want_grad, rtol=1e-5)
    assert float(metrics["pg_nonfinite_seq_fraction"]) == pytest.approx(1 / 3)


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(ALGORITHMS))
@pytest.mark.parametrize("field", ["old_logp", "rollout_logp"])
def test_nonfinite_old_or_rollout_is_rejected_and_counted_on_every_path(name, field):
    config = ALGORITHMS[name]
    batch = _batch()
    batch[field][1, 0] = NAN
    (loss, metrics), grad = _value_and_grad(batch, config)
    uses = field == "rollout_logp" or name not in ("bypass_ppo", "reinforce_is")
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    if not uses:  # the loss never reads it
        return
    (want, _), _ = _value_and_grad(_without_row(batch, 1), config)
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    assert np.all(np.asarray(grad)[1] == 0)
    assert float(metrics["mis_nonfinite_seq_fraction"]) == pytest.approx(1 / 3)


def test_ppo_with_mismatch_metrics_rejects_a_nonfinite_old_logp():
    loss, metrics = opj.policy_loss(
        jnp.array([[-1.0, -1.0]]),
        jnp.array([[NAN, -1.0]]),
        jnp.array([[-1.0, -1.0]]),
        jnp.array([1.0]),
        jnp.array([[1, 1]]),
        opj.LossConfig(get_mismatch_metrics=True),
    )
    assert float(loss) == 0.0 and float(metrics["mis_nonfinite_seq_fraction"]) == 1.0


def test_ois_is_not_computed_from_the_clamped_ratio():
    d = np.float32(22.437)  # exp(22.437) ≈ 5.55e9, beyond the ±20 clamp (4.85e8)
    config = opj.LossConfig(algorithm="ppo", get_mismatch_metrics=True)
    _, metrics = opj.policy_loss(
        jnp.array([[0.0, -1.0]]),
        jnp.array([[-d, -1.0]]),
        jnp.zeros((1, 2)),
        jnp.ones(1),
        jnp.ones((1, 2), bool),
        config,
    )
    assert float(metrics["ois"]) == pytest.approx((math.exp(d) + 1) / 2, rel=1e-5)


def _correction_metrics(old, rollout, jit):
    cfg = opj.CorrectionConfig(use_tis=True)
    fn = lambda o, b: opj.compute_correction(o, b, jnp.ones(o.shape, bool), cfg).metrics  # noqa: E731
    return (jax.jit(fn) if jit else fn)(jnp.asarray(old), jnp.asarray(rollout))


@pytest.mark.heavy
@pytest.mark.parametrize("jit", [True, False])
def test_metrics_saturate_finitely_and_alike_under_jit(jit):
    cap = math.exp(opj.METRIC_LOG_CAP)
    m = _correction_metrics(np.array([[-1.0, 99.0]]), np.array([[-1.0, -1.0]]), jit)  # δ = 100
    assert all(np.isfinite(float(v)) for v in m.values())
    assert float(m["mis_k3_kl"]) == pytest.approx((cap - 101) / 2, rel=1e-5)
    m = _correction_metrics(np.array([[-104.0]]), np.array([[-104.0]]), jit)
    assert float(m["mis_training_ppl"]) == pytest.approx(cap, rel=1e-5)
    assert float(m["mis_rollout_ppl"]) == pytest.approx(cap, rel=1e-5)
    _, lm = opj.policy_loss(
        jnp.zeros((1, 1)),
        jnp.array([[99.0]]),
        jnp.array([[-1.0]]),
        jnp.ones(1),
        jnp.ones((1, 1), bool),
        opj.LossConfig(algorithm="decoupled_ppo", correction=opj.VanillaTIS()),
    )
    assert float(lm["tis"]) == pytest.approx(cap, rel=1e-5)
    assert float(lm["tis_abs"]) == pytest.approx(cap, rel=1e-5)


def test_metrics_jit_equals_eager_near_float32_max():
    old = np.array([[60.0, -80.0, 0.0]], np.float32)
    rollout = np.array([[-30.0, 10.0, 0.0]], np.float32)
    a, b = _correction_metrics(old, rollout, True), _correction_metrics(old, rollout, False)
    for key in a:
        assert np.isfinite(float(a[key])), key
        np.testing.assert_allclose(float(a[key]), float(b[key]), rtol=1e-6, err_msg=key)


@pytest.mark.parametrize("delta", [1e-10, -1e-10, 1e-6, -3e-4, 0.05, -0.099, 0.1, 0.7, -2.0])
def test_k3_and_chi2_without_cancellation(delta):
    m = _correction_metrics(np.array([[delta]], np.float32), np.zeros((1, 1), np.float32), False)
    d = float(np.float32(delta))
    k3 = math.expm1(d) - d
    assert float(m["mis_k3_kl"]) >= 0
    assert float(m["mis_k3_kl"]) == pytest.approx(k3, rel=1e-5, abs=1e-30)
    assert float(m["mis_chi2_token"]) == pytest.approx(math.expm1(2 * d), rel=1e-5, abs=1e-30)
    assert float(m["mis_chi2_seq"]) == pytest.approx(math.expm1(2 * d), rel=1e-5, abs=1e-30)


# Tiers: each case calls the library eagerly eight times (~3.5 s of CPU on one device);
# the fast tier runs int32, the full suite every dtype.
@pytest.mark.heavy
@pytest.mark.parametrize(
    "value, dtype",
    [
        (2, np.int32),
        pytest.param(255, np.uint8, marks=pytest.mark.slow),
        pytest.param(7, np.int8, marks=pytest.mark.slow),
    ],
)
def test_integer_mask_values_are_membership_only(value, dtype):
    rng = np.random.default_rng(0)
    old = rng.normal(-1, 0.3, (2, 5)).astype(np.float32)
    rollout = old + rng.normal(0, 0.2, (2, 5)).astype(np.float32)
    logp = old + 0.05
    ones = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    big = ones.astype(dtype) * dtype(value)
    cfg = opj.CorrectionConfig(use_tis=True, tis_level="sequence", tis_upper_bound=1e6)
    # Eagerly an integer mask other than 0/1 is refused; under jit, where its
    # values are not read, an entry > 0 is membership with weight 1.
    with pytest.raises(ValueError, match="mask is an integer mask holding"):
        opj.compute_correction(old, rollout, big, cfg)
    correct = jax.jit(opj.compute_correction, static_argnames="config")
    loss = jax.jit(opj.policy_loss, static_argnames="config")
    for mask_a, mask_b in ((ones, big),):
        a = correct(old, rollout, mask_a, config=cfg)
        b = correct(old, rollout, mask_b, config=cfg)
        np.testing.assert_array_equal(a.weights, b.weights)
        np.testing.assert_array_equal(a.mask, b.mask)
        for key in a.metrics:
            assert float(a.metrics[key]) == float(b.metrics[key]), key
        for aggregation in ("sequence_sum", "token_mean", "sequence_mean"):
            lcfg = opj.LossConfig(
                algorithm="decoupled_ppo", correction=cfg, aggregation=aggregation
            )
            la, _ = loss(logp, old, rollout, np.ones(2), mask_a, config=lcfg)
            lb, _ = loss(logp, old, rollout, np.ones(2), mask_b, config=lcfg)
            assert float(la) == float(lb), aggregation


@pytest.mark.heavy
def test_correction_result_shape_is_checked():
    cfg = opj.LossConfig(algorithm="decoupled_ppo", correction=opj.CorrectionConfig(use_tis=True))
    x = jnp.zeros((3, 4))
    res = opj.compute_correction(x[:1], x[:1], jnp.ones((1, 4), bool), cfg.correction)
    with pytest.raises(ValueError, match="correction_result"):
        opj.policy_loss(x, x, x, jnp.ones(3), jnp.ones((3, 4), bool), cfg, correction_result=res)
    res = opj.compute_correction(x, x, jnp.ones((3, 4), bool), cfg.correction)
    with pytest.raises(ValueError, match="correction_result"):
        opj.policy_loss(
            x[:2], x[:2], x[:2], jnp.ones(2), jnp.ones((2, 4), bool), cfg, correction_result=res
        )


def test_preset_mis_is_the_shipped_file():
    from importlib import resources

    shipped = resources.files("offpolicy_jax") / "configs" / "mis.yaml"
    assert opj.CorrectionConfig.preset("mis") == opj.CorrectionConfig.from_yaml(shipped)
    with pytest.raises(ValueError, match="preset"):
        opj.CorrectionConfig.preset("nope")


def test_reinforce_is_metrics_hold_no_nan():
    batch = _batch()
    (_, metrics), _ = _value_and_grad(batch, ALGORITHMS["reinforce_is"])
    assert all(np.isfinite(float(v)) for v in metrics.values())
