"""Regressions: one test per failure mode that RL frameworks have shipped and later fixed.

Each test is named after the failure it guards against.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import offpolicy_jax as opj

MASK_MODE = opj.CorrectionConfig(use_tis=True, tis_mode="mask", tis_batch_normalize=True)


def _batch(seed=0, batch=4, length=8):
    rng = np.random.default_rng(seed)
    old = -rng.uniform(0.5, 3.0, size=(batch, length)).astype(np.float32)
    logp = (old + rng.uniform(-0.1, 0.1, size=old.shape)).astype(np.float32)
    rollout = (old + rng.uniform(-0.2, 0.2, size=old.shape)).astype(np.float32)
    adv = rng.standard_normal(old.shape).astype(np.float32)
    lengths = np.array([8, 3, 5, 6])[:batch]
    mask = (np.arange(length)[None] < lengths[:, None]).astype(np.float32)
    return logp, old, rollout, adv, mask


def _value_and_grad(config, *args):
    return jax.value_and_grad(lambda lp: opj.policy_loss(lp, *args, config), has_aux=True)


def test_every_token_rejected_crash_or_nan():
    logp, old, rollout, adv, mask = _batch()
    rollout = old + 3.0  # every ratio e^-3: outside [0.5, 2], all rejected
    for aggregation in ("sequence_mean", "token_mean", "sequence_sum"):
        config = opj.LossConfig(
            algorithm="decoupled_ppo", correction=MASK_MODE, aggregation=aggregation
        )
        (loss, metrics), grad = jax.jit(_value_and_grad(config, old, rollout, adv, mask))(logp)
        assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0)
        assert all(np.isfinite(float(v)) for v in metrics.values())
        assert float(metrics["mis_tis_mask_fraction_low"]) == 1.0


@pytest.mark.parametrize("algorithm", ["bypass_ppo", "reinforce_is"])
def test_is_weight_carries_gradient_in_bypass_or_reinforce_mode(algorithm):
    logp, _, rollout, adv, mask = _batch()
    correction = opj.CorrectionConfig(use_tis=True) if algorithm == "reinforce_is" else None
    config = opj.LossConfig(algorithm=algorithm, correction=correction, aggregation="token_mean")
    grad = jax.jit(jax.grad(lambda lp: opj.policy_loss(lp, None, rollout, adv, mask, config)[0]))(
        logp
    )
    if algorithm == "reinforce_is":
        # d/dθ [−sg(w)·A·θ] = −w·A: a weight with gradient would add −A·θ·dw/dθ.
        w = np.minimum(np.exp(logp - rollout), 2.0)
        want = -w * adv * mask / mask.sum()
    else:
        # The PPO ratio π_θ/π_rollout is the only θ-dependence: −r·A where the
        # unclipped branch is active, 0 where the clipped one is.
        r = np.exp(logp - rollout)
        clipped = -np.clip(r, 0.8, 1.2) * adv > -r * adv
        want = np.where(clipped, 0.0, -r * adv) * mask / mask.sum()
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "mode, key", [("truncate", "mis_tis_truncate_fraction"), ("clip", "mis_tis_clip_fraction_high")]
)
def test_exceedance_fraction_computed_from_already_clamped_weights(mode, key):
    old = np.array([[np.log(4.0), 0.0, 0.0, 0.0]], np.float32)  # one ratio of 4 > U = 2
    res = opj.compute_correction(
        old,
        np.zeros_like(old),
        np.ones_like(old),
        opj.CorrectionConfig(use_tis=True, tis_mode=mode),
        reduction="token",
    )
    assert float(res.metrics[key]) == 0.25  # from the raw ratios, not min(ρ, U) (always 0)
    assert float(np.asarray(res.weights).max()) == 2.0


def test_fully_masked_sequences_counted_in_a_denominator():
    logp, old, rollout, adv, mask = _batch()
    padded = [
        np.concatenate([x, np.full((3, 8), np.nan, np.float32)]) for x in (logp, old, rollout, adv)
    ]
    padded_mask = np.concatenate([mask, np.zeros((3, 8), np.float32)])
    config = opj.LossConfig(algorithm="decoupled_ppo", correction=MASK_MODE)
    loss_fn = jax.jit(lambda *args: opj.policy_loss(*args, config))
    loss, metrics = loss_fn(logp, old, rollout, adv, mask)
    loss_p, metrics_p = loss_fn(*padded, padded_mask)
    np.testing.assert_allclose(float(loss_p), float(loss), rtol=1e-6)
    for key in metrics:
        np.testing.assert_allclose(
            float(metrics_p[key]), float(metrics[key]), rtol=1e-6, err_msg=key
        )


@pytest.mark.heavy
def test_nan_rollout_logprobs_turn_the_loss_into_nan():
    logp, old, rollout, adv, mask = _batch()
    rollout[1, 1] = np.nan  # a valid token of sequence 1
    rollout[2, 7] = np.nan  # padding
    for correction in (MASK_MODE, opj.VanillaTIS()):
        config = opj.LossConfig(algorithm="decoupled_ppo", correction=correction)
        (loss, metrics), grad = _value_and_grad(config, old, rollout, adv, mask)(logp)
        assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad)))
        # The sequence with the NaN is rejected, not silently trained on.
        assert np.all(np.asarray(grad)[1] == 0)
        assert all(np.isfinite(float(v)) for v in metrics.values())


@pytest.mark.parametrize(
    "config",
    [
        opj.LossConfig(algorithm="decoupled_ppo", correction=MASK_MODE),
        opj.LossConfig(algorithm="decoupled_ppo", correction=opj.VanillaTIS()),
        opj.LossConfig(algorithm="bypass_ppo"),
        opj.LossConfig(algorithm="reinforce_is", correction=MASK_MODE),
        opj.LossConfig(algorithm="ppo", get_mismatch_metrics=True),
    ],
    ids=lambda c: f"{c.algorithm}-{type(c.correction).__name__}",
)
def test_correction_silently_does_nothing_without_rollout_logprobs(config):
    logp, old, _, adv, mask = _batch()
    with pytest.raises(ValueError, match="rollout_logp is required"):
        opj.policy_loss(logp, old, None, adv, mask, config)


def test_rollout_ratio_applied_twice_in_bypass_mode():
    logp, old, rollout, adv, mask = _batch()
    bypass = opj.LossConfig(algorithm="bypass_ppo", get_mismatch_metrics=True)
    # Bypass PPO *is* PPO with π_rollout as the old policy: one ratio π_θ/π_rollout.
    once = opj.policy_loss(logp, old, rollout, adv, mask, bypass)[0]
    as_ppo = opj.policy_loss(logp, rollout, None, adv, mask, opj.LossConfig(algorithm="ppo"))[0]
    assert float(once) == float(as_ppo)
    # An IS weight π_old/π_rollout on top would apply the rollout ratio a second time.
    with pytest.raises(ValueError, match="reinforce_is"):
        opj.LossConfig(algorithm="bypass_ppo", correction=opj.CorrectionConfig(use_tis=True))


@pytest.mark.heavy
def test_per_micro_batch_normalisation_biases_the_pooled_loss():
    logp, old, rollout, adv, mask = _batch()
    rollout[:2] -= 0.5  # the first micro-batch has larger ratios than the second
    correction = opj.CorrectionConfig(use_tis=True, tis_upper_bound=3.0, tis_batch_normalize=True)
    config = opj.LossConfig(
        algorithm="decoupled_ppo", correction=correction, aggregation="token_mean"
    )
    full = float(opj.policy_loss(logp, old, rollout, adv, mask, config)[0])
    halves = (slice(0, 2), slice(2, 4))

    def pooled(precompute):
        total = None
        for rows in halves:
            result = None
            if precompute:
                whole = opj.compute_correction(old, rollout, mask, correction)
                result = opj.CorrectionResult(whole.weights[rows], whole.mask[rows], {})
            parts, _ = opj.policy_loss_parts(
                logp[rows],
                old[rows],
                rollout[rows],
                adv[rows],
                mask[rows],
                config,
                correction_result=result,
            )
            total = parts if total is None else opj.pool_metric_parts(total, parts)
        return float(total.value())

    assert abs(pooled(precompute=False) - full) > 1e-3  # the bug, reproduced
    np.testing.assert_allclose(pooled(precompute=True), full, rtol=1e-6)  # the fix


def test_max_count_one_clamp_under_scales_fractional_masks():
    # One sequence whose mask weights sum to 0.5: the per-token mean must divide
    # by 0.5, not by max(0.5, 1) = 1.
    logp = np.array([[-1.0, -2.0]], np.float32)
    adv = np.array([[1.0, 1.0]], np.float32)
    mask = np.array([[0.25, 0.25]], np.float32)
    for aggregation in ("sequence_mean", "token_mean"):
        config = opj.LossConfig(algorithm="ppo", aggregation=aggregation)
        loss = opj.policy_loss(logp, logp, None, adv, mask, config)[0]
        assert float(loss) == -1.0  # r = 1: ℓ = −A = −1 on every token
    geo = opj.CorrectionConfig(use_tis=True, tis_level="geometric", tis_upper_bound=10.0)
    res = opj.compute_correction(np.log([[4.0, 4.0]]), np.zeros((1, 2)), mask, geo)
    np.testing.assert_allclose(np.asarray(res.weights) / mask, 4.0, rtol=1e-6)


def test_sequence_product_weight_collapses_on_long_sequences():
    length = 4096
    rng = np.random.default_rng(0)
    delta = (-0.01 + 0.002 * rng.standard_normal((1, length))).astype(np.float32)  # Σδ ≈ −41
    old, rollout, mask = delta, np.zeros_like(delta), np.ones_like(delta)
    product = opj.compute_correction(
        old,
        rollout,
        mask,
        opj.CorrectionConfig(
            use_tis=True,
            tis_level="sequence",
            tis_mode="clip",
            tis_lower_bound=1e-30,
            tis_upper_bound=2.0,
        ),
    )
    geometric = opj.compute_correction(
        old,
        rollout,
        mask,
        opj.CorrectionConfig(
            use_tis=True,
            tis_level="geometric",
            tis_mode="clip",
            tis_lower_bound=0.5,
            tis_upper_bound=2.0,
        ),
    )
    assert float(product.weights[0, 0]) <= np.exp(-20.0) * 1.0001  # collapsed to the e^-20 floor
    np.testing.assert_allclose(float(geometric.weights[0, 0]), np.exp(delta.mean()), rtol=1e-4)
    assert 0.9 < float(geometric.weights[0, 0]) < 1.0  # O(1)
