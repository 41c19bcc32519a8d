"""prime-rl's losses (``prime_dppo``, ``ipo``, ``kpop``) and INTELLECT-2's ``two_sided_clip``: values,
gradients and masks against the NumPy oracle (ragged, NaN-padded, exactly at the thresholds
and kinks, both advantage signs), against prime-rl's own normalisation, hypothesis
properties (padding garbage, jit == eager, pooled == full batch, packed == one per row,
finite gradients, all masked -> 0), the configuration and the demo's rows."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import packing_cases as pc
import policy_losses_reference as ref
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import examples, ragged_batches

import offpolicy_jax as opj
from offpolicy_jax._src.losses import policy_losses as pl

# Not prime-rl's defaults, so that a swapped or ignored hyperparameter shows.
TERMS_HYPER = {
    "prime_dppo": dict(dppo_mask_low=0.15, dppo_mask_high=0.25, adv_tau=0.8, kl_tau=0.05),
    "ipo": dict(ipo_threshold=0.12, adv_tau=1.3, kl_tau=0.02),
    "two_sided_clip": dict(clip_eps=0.2, clip_eps_high=0.28, delta=2.0),
    "kpop": dict(kpop_threshold=0.03, adv_tau=1.3, kl_tau=0.02),
}
NAMES = tuple(TERMS_HYPER)
JAX_TERMS = {
    "prime_dppo": pl.prime_dppo,
    "ipo": pl.ipo,
    "two_sided_clip": pl.two_sided_clip,
    "kpop": pl.kpop,
}
NUMPY_TERMS = {
    "prime_dppo": ref.prime_dppo,
    "ipo": ref.ipo,
    "two_sided_clip": ref.two_sided_clip,
    "kpop": ref.kpop,
}
# The same as LossConfig keywords; tight enough that every mask binds on the small
# log-probs of strategies.py and packing_cases.py.
CONFIG_HYPER = {
    "prime_dppo": dict(dppo_mask_low=0.05, dppo_mask_high=0.03, adv_tau=0.8, kl_tau=0.05),
    "ipo": dict(ipo_threshold=0.04, adv_tau=1.3, kl_tau=0.02),
    "two_sided_clip": dict(clip_eps=0.2, clip_eps_high=0.1, clamp_log_prob_coef=1.3),
    "kpop": dict(kpop_threshold=0.003, adv_tau=1.3, kl_tau=0.02),
}


def batch(seed, *, spread=0.4, garbage=True):
    """Ragged ``[6, 9]`` probabilities in (0, 1): an empty row, a length-1 row, advantages
    of both signs and exact zeros, NaN / ±inf / 1e30 in the padding."""
    rng = np.random.default_rng(seed)
    lengths = np.array([9, 5, 1, 0, 7, 3])
    valid = np.arange(9)[None, :] < lengths[:, None]
    q = rng.uniform(0.02, 0.98, valid.shape)
    p = np.clip(q + rng.uniform(-spread, spread, valid.shape), 1e-3, 0.999)
    theta, d = np.log(p), np.log(q)
    adv = rng.normal(size=valid.shape) * (rng.random(valid.shape) > 0.15)
    if garbage:
        junk = np.array([np.nan, np.inf, -np.inf, 1e30])[np.arange(valid.size) % 4]
        junk = junk.reshape(valid.shape)
        theta, d = np.where(valid, theta, junk), np.where(valid, d, junk[::-1])
        adv = np.where(valid, adv, junk)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    return f32(theta), f32(d), f32(adv), valid


def _jax_terms(name, theta, d, adv, valid):
    adv = jnp.where(valid, adv, 0.0)  # as SurrogateInput.advantages
    return JAX_TERMS[name](theta, jnp.asarray(d), adv, jnp.asarray(valid), **TERMS_HYPER[name])


def _masks(terms):
    if isinstance(terms, (pl.ProbabilityMasks, ref.MaskTerms)):
        return {"masked": terms.masked, "high": terms.masked_high, "low": terms.masked_low}
    return {"clipped": terms.clipped, "clipped_lower": terms.clipped_lower}


def _compare(name, theta, d, adv, valid):
    expected = NUMPY_TERMS[name](theta, d, adv, valid, **TERMS_HYPER[name])
    got = _jax_terms(name, jnp.asarray(theta), d, adv, valid)
    loss, vjp = jax.vjp(lambda th: _jax_terms(name, th, d, adv, valid).loss, jnp.asarray(theta))
    cot = np.random.default_rng(1).normal(size=theta.shape).astype(np.float32)
    (grad,) = vjp(jnp.asarray(cot))
    np.testing.assert_allclose(np.asarray(loss)[valid], expected.loss[valid], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(grad, expected.vjp(cot), rtol=2e-5, atol=2e-6)
    assert np.all(np.isfinite(np.asarray(grad))) and np.all(np.asarray(grad)[~valid] == 0)
    for key, want in _masks(expected).items():
        if want is not None:
            np.testing.assert_array_equal(np.asarray(_masks(got)[key]) & valid, want & valid, key)
    return np.asarray(loss), np.asarray(grad), expected


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("spread", [0.05, 0.4, 0.9])
def test_terms_match_numpy(name, seed, spread):
    _, _, expected = _compare(name, *batch(seed, spread=spread))
    if spread == 0.9:  # not vacuous: every mask binds somewhere, on both advantage signs
        for key, value in _masks(expected).items():
            assert value is None or value.any(), key


@pytest.mark.parametrize("name", NAMES)
def test_padding_garbage_changes_no_term(name):
    theta, d, adv, valid = batch(4, spread=0.6)
    clean = [np.where(valid, x, -1.0).astype(np.float32) for x in (theta, d)]
    dirty_loss, dirty_grad, _ = _compare(name, theta, d, adv, valid)
    clean_loss, clean_grad, _ = _compare(name, *clean, np.where(valid, adv, 0.0), valid)
    np.testing.assert_array_equal(dirty_loss[valid], clean_loss[valid])
    np.testing.assert_array_equal(dirty_grad, clean_grad)


# --------------------------------------------------------------------------- thresholds


def _one_token(name, theta, d, adv, **hyper):
    """Loss, gradient and masks of one token (``θ``, ``d``, ``A``), in float32."""
    args = [jnp.full((1, 1), v, jnp.float32) for v in (theta, d, adv)]
    valid = jnp.ones((1, 1), bool)
    fn = functools.partial(JAX_TERMS[name], **{**TERMS_HYPER[name], **hyper})
    value, grad = jax.value_and_grad(lambda th: fn(th, args[1], args[2], valid).loss.sum())(args[0])
    masks = {k: None if v is None else bool(v[0, 0]) for k, v in _masks(fn(*args, valid)).items()}
    return float(value), float(grad[0, 0]), masks


def _gap(theta, d):
    """``e^θ − e^d`` in float32, as XLA computes it."""
    return np.float32(jnp.exp(jnp.float32(theta)) - jnp.exp(jnp.float32(d)))


def test_prime_dppo_keeps_a_token_exactly_at_either_threshold():
    theta, d = -0.5, -0.7  # Δp > 0: the upper threshold binds where A > 0
    gap = _gap(theta, d)
    kl = dict(kl_tau=0.0, adv_tau=1.0)
    r = float(np.exp(np.float32(theta) - np.float32(d)))
    _, grad, masks = _one_token("prime_dppo", theta, d, 2.0, dppo_mask_high=float(gap), **kl)
    assert not masks["masked"] and not masks["high"]
    np.testing.assert_allclose(grad, -2.0 * r, rtol=1e-6)  # kept: −A·r
    below = float(np.nextafter(gap, np.float32(0)))
    value, grad, masks = _one_token("prime_dppo", theta, d, 2.0, dppo_mask_high=below, **kl)
    assert masks["masked"] and masks["high"] and not masks["low"]
    assert (value, grad) == (0.0, 0.0)
    # The same token with A < 0 is never masked by the upper threshold.
    _, grad, masks = _one_token("prime_dppo", theta, d, -2.0, dppo_mask_high=below, **kl)
    assert not masks["masked"] and grad == pytest.approx(2.0 * r, rel=1e-6)
    # Δp < 0: the lower threshold binds where A < 0, and exactly at it the token stays.
    gap = _gap(d, theta)
    _, _, masks = _one_token("prime_dppo", d, theta, -1.0, dppo_mask_low=float(-gap), **kl)
    assert not masks["masked"]
    lower = float(np.nextafter(-gap, np.float32(0)))
    _, grad, masks = _one_token("prime_dppo", d, theta, -1.0, dppo_mask_low=lower, **kl)
    assert masks["masked"] and masks["low"] and not masks["high"] and grad == 0.0
    _, _, masks = _one_token("prime_dppo", d, theta, 1.0, dppo_mask_low=lower, **kl)
    assert not masks["masked"]


def test_prime_dppo_a_zero_advantage_counts_as_masked_low_side_only_in_is_masked():
    """prime-rl: ``is_masked = where(A > 0, high, low)`` but ``is_masked_low`` needs A < 0."""
    value, grad, masks = _one_token("prime_dppo", -1.0, -0.2, 0.0, kl_tau=0.0)
    assert masks == {"masked": True, "high": False, "low": False}
    assert (value, grad) == (0.0, 0.0)


def test_masked_tokens_keep_the_kl_term_and_its_gradient():
    theta, d = -0.2, -1.5  # Δp ≈ 0.6: masked by both losses
    x = float(np.float32(theta) - np.float32(d))
    for name in ("prime_dppo", "ipo", "kpop"):
        value, grad, masks = _one_token(name, theta, d, 1.0, kl_tau=0.3)
        assert masks["masked"]
        np.testing.assert_allclose(value, 0.3 * x * x, rtol=1e-6)
        np.testing.assert_allclose(grad, 0.6 * x, rtol=1e-6)


def test_ipo_threshold_is_symmetric_and_inclusive():
    theta, d = -0.5, -0.7
    gap = _gap(theta, d)
    for t, dd in ((theta, d), (d, theta)):  # Δp = ±gap
        for adv in (1.0, -1.0, 0.0):
            _, _, masks = _one_token("ipo", t, dd, adv, ipo_threshold=float(gap))
            assert not masks["masked"]
            below = float(np.nextafter(gap, np.float32(0)))
            _, grad, masks = _one_token("ipo", t, dd, adv, ipo_threshold=below, kl_tau=0.0)
            assert masks["masked"] and grad == 0.0


def test_two_sided_clip_bound_and_its_kinks():
    delta = float(np.exp(np.float32(1.0)))  # r = e^(θ − d) = δ exactly at θ − d = 1
    hyper = dict(delta=delta)
    # A < 0 exactly at r = δ: the clamp passes the gradient (−A·r), the bound does not bind.
    value, grad, masks = _one_token("two_sided_clip", 0.0, -1.0, -1.0, **hyper)
    np.testing.assert_allclose((value, grad), (delta, delta), rtol=1e-6)
    assert masks == {"clipped": False, "clipped_lower": False}
    # Beyond δ: the loss is bounded at δ·|A| with zero gradient.
    value, grad, masks = _one_token("two_sided_clip", 0.5, -1.0, -1.5, **hyper)
    np.testing.assert_allclose(value, 1.5 * delta, rtol=1e-6)
    assert grad == 0.0 and masks == {"clipped": False, "clipped_lower": True}
    # A > 0 beyond δ (> 1 + ε_h): PPO's clip, −(1 + ε_h)·A, zero gradient.
    value, grad, masks = _one_token("two_sided_clip", 0.5, -1.0, 2.0, **hyper)
    np.testing.assert_allclose(value, -2.0 * 1.28, rtol=1e-6)
    assert grad == 0.0 and masks == {"clipped": True, "clipped_lower": False}
    # A < 0 below 1 − ε: clipped, constant −(1 − ε)·A.
    value, grad, masks = _one_token("two_sided_clip", -1.0, 0.0, -1.0, **hyper)
    np.testing.assert_allclose(value, 0.8, rtol=1e-6)
    assert grad == 0.0 and masks["clipped"]


def test_two_sided_clip_is_ppo_dual_clip_with_c_delta():
    theta, old, adv, valid = batch(9, spread=0.9, garbage=False)
    rollout = old - 0.1
    for algorithm in ("ppo", "bypass_ppo"):
        kw = dict(algorithm=algorithm, clip_eps_high=0.28, aggregation="token_mean")
        mine = opj.LossConfig(policy_loss="two_sided_clip", clamp_log_prob_coef=2.0, **kw)
        ppo = opj.LossConfig(policy_loss="ppo_clip", dual_clip_c=2.0, **kw)
        old_ = None if algorithm == "bypass_ppo" else old
        (a, ma), ga = _value_and_grad(mine)(theta, old_, rollout, adv, valid)
        (b, mb), gb = _value_and_grad(ppo)(theta, old_, rollout, adv, valid)
        assert float(a) == float(b) and ma.keys() == mb.keys()
        np.testing.assert_array_equal(np.asarray(ga), np.asarray(gb))
        assert 0 < float(ma["pg_clipfrac_lower"]) == float(mb["pg_clipfrac_lower"])


# --------------------------------------------------------------------------- policy_loss


@functools.cache
def _value_and_grad(config):
    def f(lp, old, rollout, adv, mask, **kw):
        return opj.policy_loss(lp, old, rollout, adv, mask, config, **kw)

    return jax.jit(jax.value_and_grad(f, has_aux=True))


def _config(name, algorithm="bypass_ppo", **extra):
    hyper = {k: v for k, v in TERMS_HYPER[name].items() if k != "delta"}
    if name == "two_sided_clip":
        hyper["clamp_log_prob_coef"] = TERMS_HYPER[name]["delta"]
    return opj.LossConfig(
        algorithm=algorithm, policy_loss=name, aggregation="token_mean", **hyper, **extra
    )


@pytest.mark.parametrize("name", ["prime_dppo", "ipo", "kpop"])
@pytest.mark.parametrize("algorithm", ["bypass_ppo", "ppo"])
def test_policy_loss_is_prime_rls_loss(name, algorithm):
    """prime-rl's ``compute_loss``: ``Σ ℓ / N`` with N the loss tokens, masked ones included
    (token_mean), and its per-sample mask shares (metric_reduction="sequence"). In
    bypass_ppo the inference engine is π_rollout; in ppo the ratio's π_old plays it."""
    theta, d, adv, valid = batch(3, spread=0.5)
    other = np.where(valid, d - 0.3, np.nan).astype(np.float32)
    old, rollout = (None, d) if algorithm == "bypass_ppo" else (d, other)
    (loss, metrics), grad = _value_and_grad(_config(name, algorithm))(
        theta, old, rollout, adv, valid
    )
    value, want_grad, want = ref.prime_rl_loss(
        theta, d, adv, valid, NUMPY_TERMS[name], **TERMS_HYPER[name]
    )
    np.testing.assert_allclose(float(loss), value, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=2e-5, atol=2e-7)
    for key, value in want.items():
        np.testing.assert_allclose(float(metrics[key]), value, rtol=1e-6, err_msg=key)
    assert {k for k in metrics if k.startswith("is_masked")} == set(want)
    assert "pg_clipfrac" not in metrics


@pytest.mark.parametrize("name", NAMES)
def test_decoupled_ppo_weights_the_whole_per_token_loss(name):
    """``w = π_old/π_rollout`` (VanillaTIS) multiplies ℓ, the KL term included, as prime-rl's
    ``loss_weights`` multiply its per-token loss; ratio and masks are against π_old."""
    theta, old, adv, valid = batch(5, spread=0.5)
    rollout = np.where(valid, old + 0.2 * np.sin(np.arange(old.size)).reshape(old.shape), np.nan)
    rollout = rollout.astype(np.float32)
    tis = opj.VanillaTIS(clip_low=0.0, clip=1.1)
    (loss, _), grad = _value_and_grad(_config(name, "decoupled_ppo", correction=tis))(
        theta, old, rollout, adv, valid
    )
    with np.errstate(invalid="ignore"):
        w = np.where(valid, np.clip(np.exp(np.float64(old) - rollout), 0.0, 1.1), 0.0)
    terms = NUMPY_TERMS[name](theta, old, adv, valid, **TERMS_HYPER[name])
    value, agg_w = ref.aggregate(w * terms.loss, valid, valid, "token_mean")
    np.testing.assert_allclose(float(loss), value, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(grad), terms.vjp(agg_w * w), rtol=2e-5, atol=2e-7)


def test_bypass_without_rollout_logp_is_a_clear_error():
    theta, d, adv, valid = batch(6)
    with pytest.raises(ValueError, match="rollout_logp is required"):
        opj.policy_loss(theta, None, None, adv, valid, _config("prime_dppo"))


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["prime_dppo", "ipo", "kpop"])
def test_every_token_masked_gives_zero_without_the_kl_term(name):
    """All tokens outside the trust region (Δp ≈ 0.6) and kl_tau = 0: loss 0, zero gradient,
    every token counted as masked; the tokens stay in the denominator (masked ≠ rejected)."""
    theta, d, adv, valid = batch(7, spread=0.1)
    theta = np.where(valid, np.log(0.95), theta).astype(np.float32)
    d = np.where(valid, np.log(0.3), d).astype(np.float32)
    adv = np.where(valid, np.abs(adv) + 0.5, adv).astype(np.float32)  # A > 0 everywhere
    config = opj.LossConfig(algorithm="bypass_ppo", policy_loss=name, kl_tau=0.0)
    (loss, metrics), grad = _value_and_grad(config)(theta, None, d, adv, valid)
    assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0.0)
    assert float(metrics["is_masked"]) == 1.0
    with_kl = dataclasses.replace(config, kl_tau=0.5)
    (loss, _), grad = _value_and_grad(with_kl)(theta, None, d, adv, valid)
    x = np.log(0.95) - np.log(0.3)
    np.testing.assert_allclose(float(loss), 0.5 * x * x, rtol=1e-5)  # the mean over all tokens


@pytest.mark.heavy
@pytest.mark.parametrize("name", NAMES)
def test_empty_and_fully_rejected_batches_give_zero(name):
    theta, d, adv, valid = batch(8)
    rejection = opj.CorrectionConfig(use_tis=True, use_rs=True, rs_lower_bound=0.5)
    config = _config(name, "decoupled_ppo", correction=rejection)
    far = np.where(valid, d + 5.0, np.nan).astype(np.float32)  # every ratio e^-5: rejected
    for mask, rollout in ((np.zeros_like(valid), d), (valid, far)):
        (loss, metrics), grad = _value_and_grad(config)(theta, d, rollout, adv, mask)
        assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0.0)
        assert all(np.isfinite(float(v)) for v in metrics.values())


# --------------------------------------------------------------------------- properties

PROPERTY_CONFIGS = [
    opj.LossConfig(algorithm="bypass_ppo", policy_loss="prime_dppo", aggregation="token_mean"),
    opj.LossConfig(algorithm="bypass_ppo", policy_loss="prime_dppo", **CONFIG_HYPER["prime_dppo"]),
    opj.LossConfig(
        algorithm="ppo",
        policy_loss="ipo",
        aggregation="sequence_sum",
        metric_reduction="token",
        **CONFIG_HYPER["ipo"],
    ),
    opj.LossConfig(
        algorithm="decoupled_ppo",
        correction=opj.CorrectionConfig(use_tis=True, use_rs=True, rs_lower_bound=0.5),
        policy_loss="two_sided_clip",
        **CONFIG_HYPER["two_sided_clip"],
    ),
    opj.LossConfig(
        algorithm="decoupled_ppo",
        correction=opj.VanillaTIS(clip_low=0.5, clip=1.5),
        policy_loss="prime_dppo",
        aggregation="row_mean",
        rejected_in_denominator=True,
        **CONFIG_HYPER["prime_dppo"],
    ),
]
property_configs = st.sampled_from(PROPERTY_CONFIGS)


def _args(b, config):
    old = None if config.algorithm == "bypass_ppo" else b["old_logp"]
    return (b["logp"], old, b["rollout_logp"], b["advantages"], b["mask"])


@pytest.mark.heavy
@settings(max_examples=examples(15))
@given(data=ragged_batches(), config=property_configs)
def test_garbage_jit_eager_and_finite_gradients(data, config):
    """Padding garbage changes nothing; jit == eager; every gradient is finite and 0 on
    the padding."""
    args = _args(data, config)
    (loss, metrics), grad = _value_and_grad(config)(*args)
    mask = data["mask"] > 0
    clean = [None if a is None else np.where(mask, a, -1.0).astype(np.float32) for a in args[:4]]
    (loss_c, metrics_c), grad_c = _value_and_grad(config)(*clean, data["mask"])
    assert float(loss) == float(loss_c)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(grad_c))
    assert metrics.keys() == metrics_c.keys()
    for key in metrics:
        assert float(metrics[key]) == float(metrics_c[key]), key
    assert np.all(np.isfinite(np.asarray(grad))) and np.all(np.asarray(grad)[~mask] == 0)

    def f(lp):
        return opj.policy_loss(lp, *args[1:], config)

    (loss_e, metrics_e), grad_e = jax.value_and_grad(f, has_aux=True)(args[0])
    np.testing.assert_allclose(float(loss_e), float(loss), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad_e), np.asarray(grad), rtol=1e-5, atol=1e-7)
    for key in metrics:
        np.testing.assert_allclose(float(metrics_e[key]), float(metrics[key]), rtol=1e-6)


@functools.cache
def _numerator(config):
    def f(lp, old, rollout, adv, mask):
        parts, metrics = opj.policy_loss_parts(lp, old, rollout, adv, mask, config)
        return parts.numerator, (parts.denominator, metrics)

    return jax.jit(jax.value_and_grad(f, has_aux=True))


@pytest.mark.heavy
@settings(max_examples=examples(15))
@given(data=ragged_batches(), config=property_configs, cut=st.integers(1, 4))
def test_micro_batches_pool_to_the_full_batch(data, config, cut):
    if isinstance(config.correction, opj.CorrectionConfig):
        config = dataclasses.replace(config, correction=opj.VanillaTIS(0.5, 1.5))
    args = _args(data, config)
    (full, full_metrics), full_grad = _value_and_grad(config)(*args)
    num, den, grads, pooled = 0.0, 0.0, [], None
    for rows in (slice(0, cut), slice(cut, None)):
        part = [None if a is None else a[rows] for a in args]
        (n, (d, metrics)), g = _numerator(config)(*part)
        num, den = num + n, den + d
        grads.append(np.asarray(g))
        pooled = metrics if pooled is None else opj.pool_metric_parts(pooled, metrics)
    np.testing.assert_allclose(
        float(opj.LossParts(num, den).value()), float(full), rtol=1e-5, atol=1e-6
    )
    grad = opj.LossParts(np.concatenate(grads), den).value()
    np.testing.assert_allclose(grad, np.asarray(full_grad), rtol=1e-5, atol=1e-7)
    pooled = opj.finalize_metrics(pooled)
    assert pooled.keys() == full_metrics.keys()
    for key, value in full_metrics.items():
        np.testing.assert_allclose(pooled[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


K = 4


@functools.cache
def _packed_value_and_grad(config, packed: bool):
    def f(lp, old, rollout, adv, mask, ids):
        extra = dict(segment_ids=ids, num_segments=K) if packed else {}
        return opj.policy_loss(lp, old, rollout, adv, mask, config, **extra)

    return jax.jit(jax.value_and_grad(f, has_aux=True))


@pytest.mark.heavy
@pytest.mark.parametrize("config", PROPERTY_CONFIGS, ids=lambda c: c.policy_loss)
@pytest.mark.parametrize("seed", [0, 3])
def test_packed_equals_one_sequence_per_row(config, seed):
    b = pc.packed_batch(seed, rows=5, length=21, num_segments=K)
    keys = ("logp", "old_logp", "rollout_logp", "advantages", "mask")
    old = config.algorithm == "bypass_ppo"
    packed = [None if (k == "old_logp" and old) else b[k] for k in keys]
    (loss, metrics), grad = _packed_value_and_grad(config, True)(*packed, b["segment_ids"])
    flat = pc.unpack(b, K)
    rows = [None if (k == "old_logp" and old) else flat[k] for k in keys]
    (want, want_metrics), want_grad = _packed_value_and_grad(config, False)(*rows, None)
    # (row_mean counts row slots: R·K (row, segment) pairs packed, R·K rows unpacked.)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(grad), pc.repack(np.asarray(want_grad), b["segment_ids"], K), atol=1e-6
    )
    assert metrics.keys() == want_metrics.keys()
    for key, value in want_metrics.items():
        np.testing.assert_allclose(float(metrics[key]), float(value), rtol=1e-5, err_msg=key)


# --------------------------------------------------------------------------- configuration


def test_defaults_are_the_home_systems():
    assert (
        opj.LossConfig(policy_loss="prime_dppo").params
        == opj.LossConfig(
            policy_loss="prime_dppo",
            dppo_mask_low=0.2,
            dppo_mask_high=0.2,
            adv_tau=1.0,
            kl_tau=1e-3,
        ).params
    )
    ipo = opj.LossConfig(policy_loss="ipo")
    assert (ipo.ipo_threshold, ipo.adv_tau, ipo.kl_tau) == (0.1, 1.0, 1e-3)
    two = opj.LossConfig(policy_loss="two_sided_clip")
    assert (two.clamp_log_prob_coef, two.clip_eps, two.upper_clip_eps) == (4.0, 0.2, 0.2)
    cfg = opj.LossConfig.from_dict(
        {"algorithm": "bypass_ppo", "policy_loss": "prime_dppo", "kl_tau": "1e-2"}
    )
    assert cfg.kl_tau == 0.01 and opj.LossConfig.from_dict(cfg.to_dict()) == cfg
    hash(cfg)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(policy_loss="prime_dppo", dppo_mask_low=-0.1), "LossConfig.dppo_mask_low"),
        (dict(policy_loss="prime_dppo", dppo_mask_high=float("nan")), "dppo_mask_high"),
        (dict(policy_loss="prime_dppo", kl_tau=1e39), "LossConfig.kl_tau"),
        (dict(policy_loss="prime_dppo", adv_tau="x"), "LossConfig.adv_tau"),
        (dict(policy_loss="ipo", ipo_threshold=-1), "LossConfig.ipo_threshold"),
        (dict(policy_loss="ipo", dppo_mask_low=0.1), "dppo_mask_low"),
        (dict(policy_loss="prime_dppo", ipo_threshold=0.1), "ipo_threshold"),
        (dict(policy_loss="ppo_clip", kl_tau=0.1), "kl_tau"),
        (dict(policy_loss="two_sided_clip", clamp_log_prob_coef=1.2), "clamp_log_prob_coef"),
        (
            dict(policy_loss="two_sided_clip", clip_eps_high=0.5, clamp_log_prob_coef=1.5),
            "1 \\+ clip_eps_high",
        ),
        (dict(policy_loss="two_sided_clip", dual_clip_c=3.0), "dual_clip_c"),
    ],
)
def test_bad_hyperparameters_name_their_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        opj.LossConfig(**kwargs)


@pytest.mark.parametrize(
    ("name", "policy_loss", "changed"),
    [
        ("bypass_ppo/prime_dppo", "prime_dppo", {}),
        ("bypass_ppo/ipo/ipo_threshold=0.05", "ipo", {"ipo_threshold": 0.05}),
        (
            "bypass_ppo/policy_loss=prime_dppo/dppo_mask_high=0.1/kl_tau=0",
            "prime_dppo",
            {"dppo_mask_high": 0.1, "kl_tau": 0.0},
        ),
        ("decoupled_ppo+mis/two_sided_clip", "two_sided_clip", {"clamp_log_prob_coef": 4.0}),
    ],
)
def test_demo_rows_build_their_loss_config(name, policy_loss, changed):
    from offpolicy_jax.demo import train

    algo = train.row(name)
    base = train.ALGORITHMS[name.split("/")[0]].loss
    assert algo.loss.policy_loss == policy_loss
    assert (algo.loss.algorithm, algo.loss.correction) == (base.algorithm, base.correction)
    for key, value in changed.items():
        assert getattr(algo.loss, key) == value
    with pytest.raises(ValueError, match="clamp_log_prob_coef"):
        train.row("bypass_ppo/two_sided_clip/clamp_log_prob_coef=1.1")
