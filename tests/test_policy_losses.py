"""The surrogates of ``policy_losses`` against the NumPy oracle: values, gradients (also at
their kinks), garbage at invalid positions, empty batches; and their configuration."""

from __future__ import annotations

import functools
import itertools

import grouped_cases
import jax
import jax.numpy as jnp
import numpy as np
import policy_losses_reference as ref
import pytest
from jax.test_util import check_grads, check_vjp

import offpolicy_jax as opj
from offpolicy_jax._src.losses import policy_losses as pl

EPS, EPS_HIGH = 0.2, 0.28
HYPER = {
    "gspo": dict(clip_eps=EPS, clip_eps_high=EPS_HIGH, token_level=False),
    "gspo_token": dict(clip_eps=EPS, clip_eps_high=EPS_HIGH, token_level=True),
    "cispo": dict(clip_eps=EPS, clip_eps_high=EPS_HIGH),
    "gmpo": dict(clip_eps=EPS, clip_eps_high=EPS_HIGH),
    "sapo": dict(tau_pos=1.0, tau_neg=1.05),
    "gpg": {},
    "dppo_tv": dict(divergence="tv", clip_eps=EPS, clip_eps_high=EPS_HIGH, ratio_cap=3.0),
    "dppo_kl": dict(divergence="kl", clip_eps=EPS, clip_eps_high=EPS_HIGH, ratio_cap=3.0),
    "dro": dict(beta=0.1),
}
SURROGATES = tuple(HYPER)


def _seq_mean(values, valid):
    n = jnp.sum(jnp.where(valid, 1.0, 0.0), -1, keepdims=True)
    return jnp.sum(jnp.where(valid, values, 0.0), -1, keepdims=True) / jnp.maximum(n, 1.0)


def jax_loss(name, theta, d, adv, valid, weights=None):
    """Per-token ``ℓ`` (``[B, T]``; GMPO: per sequence ``[B]``) and its clip indicators."""
    hp = HYPER[name]
    if name in ("gspo", "gspo_token"):
        seq = _seq_mean(pl.safe_log_ratio(theta, d, valid), valid)
        return pl.gspo(theta, seq, adv, valid, **hp)
    if name == "gmpo":
        x = pl.gmpo_token_log_ratio(theta, d, adv, valid, **hp)
        log_w = None if weights is None else _seq_mean(pl.gmpo_log_weight(weights), valid)[:, 0]
        value = pl.gmpo_sequence_loss(
            _seq_mean(x.loss, valid)[:, 0], _seq_mean(adv, valid)[:, 0], log_w
        )
        return pl.SurrogateTerms(value, x.clipped, x.clipped_lower)
    if name == "gpg":
        return pl.gpg(theta, adv, valid)
    fn = {"cispo": pl.cispo, "sapo": pl.sapo, "dro": pl.dro}.get(name, pl.dppo)
    return fn(theta, d, adv, valid, **hp)


def numpy_loss(name, theta, d, adv, valid, weights=None):
    hp = dict(HYPER[name])
    if name in ("gspo", "gspo_token"):
        return ref.gspo(theta, d, adv, valid, **hp)
    if name == "gmpo":
        return ref.gmpo(theta, d, adv, valid, weights=weights, **hp)
    if name == "gpg":
        return ref.gpg(theta, adv, valid)
    fn = {"cispo": ref.cispo, "sapo": ref.sapo, "dro": ref.dro}.get(name, ref.dppo)
    return fn(theta, d, adv, valid, **hp)


def batch(seed, *, spread=0.4, garbage=True, per_sequence_adv=True):
    """Ragged ``[6, 9]`` batch: log-probs < 0, an empty row, NaN/inf garbage in padding."""
    rng = np.random.default_rng(seed)
    b, t = 6, 9
    lengths = np.array([9, 5, 1, 0, 7, 3])
    valid = np.arange(t)[None, :] < lengths[:, None]
    d = -rng.uniform(0.05, 3.0, (b, t))
    theta = d + rng.uniform(-spread, spread, (b, t))
    theta = np.minimum(theta, -1e-3)
    adv = rng.normal(size=(b, 1)) * np.ones((1, t)) if per_sequence_adv else rng.normal(size=(b, t))
    adv[0, 0] = 0.0 if not per_sequence_adv else adv[0, 0]
    if garbage:
        pads = ~valid
        junk = np.array([np.nan, np.inf, -np.inf, 1e30])
        theta = np.where(pads, junk[np.arange(b * t).reshape(b, t) % 4], theta)
        d = np.where(pads, junk[(np.arange(b * t).reshape(b, t) + 1) % 4], d)
        adv = np.where(pads, junk[(np.arange(b * t).reshape(b, t) + 2) % 4], adv)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    return f32(theta), f32(d), f32(adv), valid


def _compare(name, theta, d, adv, valid, weights=None, rtol=2e-5, atol=2e-6):
    expected = numpy_loss(name, theta, d, adv, valid, weights)
    adv_clean = np.where(valid, adv, 0.0).astype(np.float32)
    w = None if weights is None else jnp.asarray(weights)

    def f(th):
        return jax_loss(name, th, jnp.asarray(d), jnp.asarray(adv_clean), jnp.asarray(valid), w)

    terms, vjp = jax.vjp(lambda th: f(th).loss, jnp.asarray(theta))
    got = f(jnp.asarray(theta))
    cot = np.random.default_rng(1).normal(size=np.shape(expected.loss)).astype(np.float32)
    (grad,) = vjp(jnp.asarray(cot))
    np.testing.assert_allclose(terms, expected.loss, rtol=rtol, atol=atol)
    np.testing.assert_allclose(grad, expected.vjp(cot), rtol=rtol, atol=atol)
    assert np.all(np.isfinite(np.asarray(grad)))
    for key in ("clipped", "clipped_lower"):
        if getattr(expected, key) is not None:
            mine = getattr(got, key)
            np.testing.assert_array_equal(np.asarray(mine) & valid, getattr(expected, key) & valid)
    return terms, grad


@pytest.mark.parametrize("name", SURROGATES)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("spread", [0.05, 0.5, 3.0])
def test_value_and_gradient_match_numpy(name, seed, spread):
    _compare(name, *batch(seed, spread=spread))


@pytest.mark.parametrize("name", SURROGATES)
def test_per_token_advantages(name):
    _compare(name, *batch(7, per_sequence_adv=False))


def test_gmpo_folds_is_weights_in_as_geometric_mean():
    theta, d, adv, valid = batch(3)
    weights = np.where(valid, np.random.default_rng(0).uniform(0.0, 2.0, valid.shape), 0.0)
    _compare("gmpo", theta, d, adv, valid, weights=weights.astype(np.float32))


@pytest.mark.parametrize("name", SURROGATES)
def test_garbage_at_invalid_positions_changes_nothing(name):
    theta, d, adv, valid = batch(4, garbage=True)
    clean = [np.where(valid, a, v).astype(np.float32) for a, v in ((theta, -1.0), (d, -1.0))]
    adv_clean = np.where(valid, adv, 0.0).astype(np.float32)
    loss_g, grad_g = _compare(name, theta, d, adv, valid)
    loss_c, grad_c = _compare(name, clean[0], clean[1], adv_clean, valid)
    sel = valid if np.ndim(loss_g) == 2 else np.ones(np.shape(loss_g), bool)
    np.testing.assert_array_equal(np.asarray(loss_g)[sel], np.asarray(loss_c)[sel])
    np.testing.assert_array_equal(np.asarray(grad_g), np.asarray(grad_c))
    assert np.all(np.asarray(grad_g)[~valid] == 0)


@pytest.mark.parametrize("name", SURROGATES)
def test_all_invalid_gives_zero_loss_and_zero_gradient(name):
    theta, d, adv, _ = batch(5)
    valid = np.zeros(theta.shape, bool)
    adv = np.zeros_like(adv)

    def total(th):
        return jnp.sum(jax_loss(name, th, jnp.asarray(d), jnp.asarray(adv), valid).loss)

    value, grad = jax.value_and_grad(total)(jnp.asarray(theta))
    assert float(value) == 0.0
    np.testing.assert_array_equal(np.asarray(grad), 0.0)


def _away_from_kinks(name, seed):
    """A batch whose ratios stay clear of every clip boundary (for finite differences)."""
    rng = np.random.default_rng(seed)
    valid = np.ones((3, 5), bool)
    d = -rng.uniform(0.5, 2.0, valid.shape)
    # log-ratios in (−0.1, 0.1): inside every clip range, far from the TV/KL regions'
    # boundaries for DPPO, and far from GSPO's and k3's caps.
    theta = d + rng.uniform(-0.1, 0.1, valid.shape)
    adv = rng.normal(size=(3, 1)) * np.ones((1, 5))
    return theta, d, adv, valid


# Surrogates whose value is their own objective. GSPO-token, CISPO and DPPO hold a factor
# at stop-gradient (the token ratio, the clipped ratio, the truncated ratio and region): their
# value moves with it but their gradient does not, so finite differences do not apply;
# their gradients are checked against the oracle above and below.
VALUE_CONSISTENT = ("gspo", "gmpo", "sapo", "gpg", "dro")


# Tiers: second-order finite differences in float64 (~1.5 s of CPU each); the fast tier
# checks a sequence-ratio (GSPO) and a geometric (GMPO) surrogate, the full suite all
# five. test_value_and_gradient_match_numpy checks every surrogate's VJP in the fast tier.
@pytest.mark.heavy
@pytest.mark.parametrize(
    "name",
    [
        n if n in ("gspo", "gmpo") else pytest.param(n, marks=pytest.mark.slow)
        for n in VALUE_CONSISTENT
    ],
)
def test_check_grads_away_from_kinks(name):
    theta, d, adv, valid = _away_from_kinks(name, 0)
    with jax.enable_x64(True):

        def total(th):
            return jnp.sum(jax_loss(name, th, jnp.asarray(d), jnp.asarray(adv), valid).loss)

        # Compiled once per transform: eager dispatch would compile each primitive for
        # each of check_grads' jvp/vjp/second-order traces.
        check_grads(jax.jit(total), (jnp.asarray(theta),), order=2, modes=("fwd", "rev"), eps=1e-4)


@pytest.mark.parametrize("spread", [0.05, 0.5])
def test_gspo_token_gradient_equals_gspo_for_sequence_advantages(spread):
    """GSPO paper: with one advantage per sequence, GSPO-token's gradient is GSPO's."""
    theta, d, adv, valid = batch(8, spread=spread, garbage=False)

    def total(name):
        def f(th):
            terms = jax_loss(name, th, jnp.asarray(d), jnp.asarray(adv), valid)
            n = jnp.maximum(jnp.sum(valid, -1, keepdims=True), 1)
            return jnp.sum(jnp.where(valid, terms.loss, 0.0) / n)

        return jax.grad(f)(jnp.asarray(theta))

    np.testing.assert_allclose(total("gspo_token"), total("gspo"), rtol=1e-5, atol=1e-7)


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["gspo"])
def test_check_grads_gspo_outside_the_clip_range(name):
    """Clipped sequences: the gradient is exactly 0, and finite differences agree."""
    theta, d, adv, valid = _away_from_kinks(name, 1)
    theta = theta + 0.5  # every sequence ratio ≈ e^0.5, above 1 + ε_high
    with jax.enable_x64(True):

        def total(th):
            return jnp.sum(jax_loss(name, th, jnp.asarray(d), jnp.asarray(adv), valid).loss)

        check_grads(total, (jnp.asarray(theta),), order=1, modes=("rev",), eps=1e-4)


# --------------------------------------------------------------------------- kinks


def _grad_at(name, theta, d, adv, valid, **hp):
    hyper = {**HYPER[name], **hp}

    def total(th):
        if name in ("gspo", "gspo_token"):
            seq = _seq_mean(pl.safe_log_ratio(th, d, valid), valid)
            return jnp.sum(pl.gspo(th, seq, adv, valid, **hyper).loss)
        if name == "gmpo":
            return jnp.sum(pl.gmpo_token_log_ratio(th, d, adv, valid, **hyper).loss)
        fn = {"cispo": pl.cispo, "sapo": pl.sapo, "dro": pl.dro}.get(name, pl.dppo)
        return jnp.sum(fn(th, d, adv, valid, **hyper).loss)

    return np.asarray(jax.grad(total)(jnp.asarray(theta, jnp.float32)))


def test_gspo_kink_at_the_upper_clip_bound_passes_the_unclipped_gradient():
    # One token, d = 0: log s = θ exactly, and ε_high = s − 1 exactly in float32.
    theta = np.float32(0.25)
    s = np.exp(np.float32(theta))
    eps_high = float(s - np.float32(1))
    one = np.ones((1, 1), np.float32)
    for name in ("gspo", "gspo_token"):
        grad = _grad_at(name, theta * one, 0 * one, one, one > 0, clip_eps_high=eps_high)
        np.testing.assert_allclose(grad, -s * one, rtol=1e-6)  # −A·s: unclipped at the tie
        grad = _grad_at(name, theta * one, 0 * one, one, one > 0, clip_eps_high=eps_high * 0.99)
        np.testing.assert_array_equal(grad, 0.0)  # strictly outside: clipped


def test_gspo_log_ratio_cap_passes_the_gradient_at_ten():
    one = np.ones((1, 1), np.float32)
    for theta, expected in ((10.0, -np.exp(10.0)), (10.5, 0.0)):
        # A < 0 so that the unclipped branch is active however large s is.
        grad = _grad_at("gspo_token", theta * one, 0 * one, -one, one > 0)
        np.testing.assert_allclose(grad, -expected * one, rtol=1e-5)


def test_gmpo_kinks_at_the_log_space_bounds():
    one = np.ones((1, 2), np.float32)
    valid = one > 0
    # x = ε_high exactly with A > 0 and x = −ε exactly with A < 0: both pass the gradient.
    theta = np.array([[EPS_HIGH, -EPS]], np.float32)
    adv = np.array([[1.0, -1.0]], np.float32)
    np.testing.assert_array_equal(_grad_at("gmpo", theta, 0 * one, adv, valid), one)
    theta_out = np.array([[np.nextafter(np.float32(EPS_HIGH), 1), -0.3]], np.float32)
    np.testing.assert_array_equal(_grad_at("gmpo", theta_out, 0 * one, adv, valid), 0 * one)
    # The other side is never clipped: A > 0 with x far below −ε, A < 0 far above ε_high.
    theta_free = np.array([[-5.0, 5.0]], np.float32)
    np.testing.assert_array_equal(_grad_at("gmpo", theta_free, 0 * one, adv, valid), one)
    # A = 0: the token contributes 0 and no gradient.
    np.testing.assert_array_equal(_grad_at("gmpo", theta, 0 * one, 0 * adv, valid), 0 * one)


def test_dppo_trust_region_includes_its_boundary():
    theta, d = np.float32(-0.5), np.float32(-0.7)
    gap = np.float32(jnp.exp(theta) - jnp.exp(d))  # p − q in float32, as XLA computes it
    one = np.ones((1, 1), np.float32)
    args = (theta * one, d * one, one, one > 0)
    ratio = np.float32(jnp.exp(theta - d))
    grad = _grad_at("dppo_tv", *args, clip_eps_high=float(gap))
    np.testing.assert_allclose(grad, -ratio * one, rtol=1e-6)  # inside: −A·sg(r)
    grad = _grad_at("dppo_tv", *args, clip_eps_high=float(np.nextafter(gap, np.float32(0))))
    np.testing.assert_array_equal(grad, 0.0)  # just outside: dropped
    # Ratio cap: the weight is min(r, C), and only weights (no kink in the gradient's form).
    grad = _grad_at("dppo_tv", *args, clip_eps_high=1.0, ratio_cap=1.1)
    np.testing.assert_allclose(grad, -1.1 * one, rtol=1e-6)


def test_cispo_weight_is_stop_gradient_and_clipped():
    one = np.ones((1, 1), np.float32)
    for theta, weight in ((0.0, 1.0), (2.0, 1 + EPS_HIGH), (-2.0, 1 - EPS)):
        grad = _grad_at("cispo", (theta - 1.0) * one, -1.0 * one, one, one > 0)
        np.testing.assert_allclose(grad, -weight * one, rtol=1e-6)


def test_sapo_gradient_at_ratio_one_is_the_on_policy_gradient():
    one = np.ones((1, 2), np.float32)
    adv = np.array([[1.5, -0.5]], np.float32)
    grad = _grad_at("sapo", -one, -one, adv, one > 0)
    np.testing.assert_allclose(grad, -adv, rtol=1e-6)  # (4/τ)·σ'(0)·τ = 1


def test_clamped_ratio_passes_the_gradient_at_plus_minus_twenty():
    x = jnp.array([-20.0, 20.0, -20.5, 20.5], jnp.float32)
    grad = jax.grad(lambda v: jnp.sum(pl.clamped_ratio(v)))(x)
    np.testing.assert_allclose(grad[:2], np.exp([-20.0, 20.0]), rtol=1e-6)
    np.testing.assert_array_equal(grad[2:], 0.0)


# --------------------------------------------------------------------------- KL


@pytest.mark.parametrize("estimator", pl.KL_ESTIMATORS)
@pytest.mark.parametrize("off_policy", [False, True])
@pytest.mark.parametrize("spread", [0.1, 2.0, 25.0])
def test_kl_estimators_match_numpy(estimator, off_policy, spread):
    theta, d, _, valid = batch(11, spread=0.3)
    ref_logp = np.where(
        valid, theta + np.random.default_rng(2).uniform(-spread, spread, theta.shape), np.nan
    )
    ref_logp = ref_logp.astype(np.float32)
    expected = ref.kl(theta, ref_logp, valid, estimator=estimator, d=d if off_policy else None)

    def f(th):
        if off_policy:
            return pl.off_policy_kl_estimate(th, ref_logp, d, valid, estimator=estimator)
        return pl.kl_estimate(th, ref_logp, valid, estimator=estimator)

    value, vjp = jax.vjp(f, jnp.asarray(theta))
    cot = np.random.default_rng(3).normal(size=theta.shape).astype(np.float32)
    np.testing.assert_allclose(value, expected.loss, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(vjp(jnp.asarray(cot))[0], expected.vjp(cot), rtol=2e-5, atol=2e-6)


def test_off_policy_kl_gradient_is_unbiased_for_k3():
    """E_{π_d}[∇(r·k3)] = ∇KL(π_θ‖π_ref) over a small categorical distribution."""
    logits = jnp.array([0.3, -0.2, 1.0, -1.5])
    ref_logits = jnp.array([0.0, 0.5, 0.2, -0.3])
    old_logits = jnp.array([0.1, 0.1, 0.7, -1.0])
    lp = lambda z: jax.nn.log_softmax(z)  # noqa: E731
    valid = jnp.ones(4, bool)

    def expected_estimate(z):
        theta = lp(z)
        per = pl.off_policy_kl_estimate(
            theta, lp(ref_logits), lp(old_logits), valid, estimator="k3"
        )
        return jnp.sum(jnp.exp(lp(old_logits)) * per)  # E over samples from π_d

    def true_kl(z):
        return jnp.sum(jnp.exp(lp(z)) * (lp(z) - lp(ref_logits)))

    np.testing.assert_allclose(expected_estimate(logits), true_kl(logits), rtol=1e-5)
    np.testing.assert_allclose(
        jax.grad(expected_estimate)(logits), jax.grad(true_kl)(logits), rtol=1e-4, atol=1e-6
    )


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(policy_loss="gspoo"), "did you mean 'gspo'"),
        (dict(policy_loss="cispo", tau_pos=1.0), "tau_pos"),
        (dict(policy_loss="gpg", dual_clip_c=3.0), "dual_clip_c"),
        (dict(policy_loss="sapo", clip_eps_high=0.3), "clip_eps_high"),
        (dict(policy_loss="dro", dro_beta=-0.1), "dro_beta"),
        (dict(policy_loss="dppo_tv", dppo_ratio_cap=0.0), "dppo_ratio_cap"),
        (dict(policy_loss="sapo", tau_neg="x"), "tau_neg"),
        (dict(aggregation="token_sum", loss_scale_factor=4), "loss_scale_factor"),
        (dict(aggregation="seq-mean-token-sum"), "aggregation"),
        (dict(kl_estimator="low_var_kl"), "kl_estimator"),
        (dict(kl_coef=-1.0), "kl_coef"),
        (dict(entropy_coef=float("nan")), "entropy_coef"),
        (dict(kl_off_policy="yes"), "kl_off_policy"),
        (
            dict(algorithm="reinforce_is", correction=opj.VanillaTIS(), policy_loss="cispo"),
            "reinforce_is",
        ),
    ],
)
def test_loss_config_rejects_bad_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        opj.LossConfig(**kwargs)


def test_loss_config_resolves_defaults_and_is_hashable():
    cfg = opj.LossConfig(policy_loss="sapo", tau_neg=2.0, kl_coef=0.01, kl_estimator="k2")
    assert (cfg.tau_pos, cfg.tau_neg) == (1.0, 2.0)  # the registered params' defaults
    assert opj.LossConfig(policy_loss="dro").dro_beta == 0.1
    assert opj.LossConfig(policy_loss="dppo_kl").dppo_ratio_cap == 20.0
    hash(cfg)
    assert cfg == opj.LossConfig(policy_loss="sapo", tau_neg=2, kl_coef=0.01, kl_estimator="k2")


def test_from_dict_names_unknown_keys():
    with pytest.raises(ValueError, match="did you mean 'tau_pos'"):
        opj.LossConfig.from_dict({"policy_loss": "sapo", "tau_pso": 1.0})
    cfg = opj.LossConfig.from_dict({"policy_loss": "gspo", "clip_eps": 3e-4})
    assert cfg.policy_loss == "gspo"


# --------------------------------------------------------------------------- from_verl

VERL_ACTOR = dict(
    clip_ratio=0.2,
    clip_ratio_low=0.2,
    clip_ratio_high=0.28,
    clip_ratio_c=3.0,
    tau_pos=1.0,
    tau_neg=1.05,
    dro_beta=0.1,
)
NO_CORRECTION = dict(rollout_is=None, rollout_rs=None, rollout_is_threshold=2.0)


@pytest.mark.parametrize(
    ("loss_mode", "agg_mode", "policy_loss", "aggregation"),
    [
        ("vanilla", "token-mean", "ppo_clip", "token_mean"),
        ("vanilla", "seq-mean-token-sum", "ppo_clip", "sequence_sum"),
        ("vanilla", "seq-mean-token-mean", "ppo_clip", "sequence_mean"),
        ("vanilla", "seq-mean-token-sum-norm", "ppo_clip", "sequence_sum_norm"),
        ("vanilla", "token-sum", "ppo_clip", "token_sum"),
        ("gspo", "token-mean", "gspo_token", "sequence_mean"),
        ("sapo", "token-sum", "sapo", "sequence_mean"),
        ("geo_mean", "token-mean", "gmpo", "row_mean"),
        ("cispo", "token-mean", "cispo", "token_mean"),
        ("gpg", "seq-mean-token-sum", "gpg", "sequence_sum"),
        ("dppo_tv", "token-mean", "dppo_tv", "token_mean"),
        ("dppo_kl", "token-mean", "dppo_kl", "token_mean"),
        ("dro", "token-mean", "dro", "token_mean"),
    ],
)
def test_from_verl_maps_loss_and_aggregation_modes(loss_mode, agg_mode, policy_loss, aggregation):
    actor = {**VERL_ACTOR, "loss_mode": loss_mode, "loss_agg_mode": agg_mode}
    cfg = opj.LossConfig.from_verl({**NO_CORRECTION, "bypass_mode": False}, actor)
    assert (cfg.algorithm, cfg.policy_loss, cfg.aggregation) == ("ppo", policy_loss, aggregation)
    # clip_ratio_low is the clip range of the surrogates that have one (not sapo, gpg, dro).
    assert cfg.clip_eps == (None if loss_mode in ("sapo", "gpg", "dro") else 0.2)
    assert cfg.dual_clip_c == (3.0 if loss_mode == "vanilla" else None)
    assert cfg.dppo_ratio_cap == (3.0 if loss_mode.startswith("dppo") else None)
    if loss_mode == "sapo":
        assert (cfg.tau_pos, cfg.tau_neg) == (1.0, 1.05)
    if loss_mode == "dro":
        assert cfg.dro_beta == 0.1
    assert not cfg.rejected_in_denominator


def test_from_verl_bypass_replaces_loss_mode_like_verl():
    rc = {**NO_CORRECTION, "bypass_mode": True}
    actor = {**VERL_ACTOR, "loss_mode": "gspo", "loss_agg_mode": "seq-mean-token-sum"}
    cfg = opj.LossConfig.from_verl({**rc, "loss_type": "ppo_clip"}, actor)
    assert (cfg.algorithm, cfg.policy_loss, cfg.aggregation) == (
        "bypass_ppo",
        "ppo_clip",
        "sequence_sum",
    )
    assert cfg.dual_clip_c == 3.0
    cfg = opj.LossConfig.from_verl({**rc, "loss_type": "reinforce"}, actor)
    assert (cfg.algorithm, cfg.policy_loss) == ("bypass_ppo", "gpg")


def test_from_verl_regularisers_and_ignored_actor_keys():
    actor = {
        "loss_mode": "vanilla",
        "use_kl_loss": True,
        "kl_loss_coef": 0.01,
        "kl_loss_type": "mse",
        "entropy_coeff": 0.001,
        "ppo_mini_batch_size": 256,
        "optim": {"lr": 1e-6},
        "policy_loss": {"loss_mode": "vanilla", "clip_cov_ratio": 0.0002},
        "loss_agg_mode": "seq-mean-token-sum-norm",
        "loss_scale_factor": 4096,
    }
    cfg = opj.LossConfig.from_verl({}, actor)
    assert (cfg.kl_coef, cfg.kl_estimator, cfg.entropy_coef) == (0.01, "k2", 0.001)
    assert cfg.loss_scale_factor == 4096
    assert (
        opj.LossConfig.from_verl(None, {"policy_loss": {"loss_mode": "cispo"}}).policy_loss
        == "cispo"
    )
    assert opj.LossConfig.from_verl(None, None) == opj.LossConfig.from_verl({}, {})


def test_from_verl_clip_cov_and_kl_cov_read_the_policy_loss_block():
    policy = {
        "loss_mode": "clip_cov",
        "clip_cov_ratio": 0.05,
        "clip_cov_lb": 0.5,
        "clip_cov_ub": 4.0,
        "kl_cov_ratio": 0.3,  # another loss's key: accepted and ignored, as verl does
        "ppo_kl_coef": 0.2,
    }
    actor = {"clip_ratio_low": 0.1, "clip_ratio_high": 0.28, "policy_loss": policy}
    cfg = opj.LossConfig.from_verl({}, actor)
    assert (cfg.algorithm, cfg.policy_loss, cfg.aggregation) == ("ppo", "clip_cov", "token_mean")
    assert (cfg.clip_cov_ratio, cfg.clip_cov_lb, cfg.clip_cov_ub) == (0.05, 0.5, 4.0)
    assert (cfg.clip_eps, cfg.clip_eps_high) == (0.1, 0.28)
    cfg = opj.LossConfig.from_verl({}, {"loss_mode": "clip_cov"})
    assert (cfg.clip_cov_ratio, cfg.clip_cov_lb, cfg.clip_cov_ub) == (0.0002, 1.0, 5.0)

    actor = {
        "policy_loss": {**policy, "loss_mode": "kl_cov"},
        "loss_agg_mode": "seq-mean-token-sum",
    }
    cfg = opj.LossConfig.from_verl({}, actor)
    assert (cfg.policy_loss, cfg.aggregation) == ("kl_cov", "sequence_sum")
    assert (cfg.kl_cov_ratio, cfg.ppo_kl_coef) == (0.3, 0.2)
    # verl's config default is 0.1; its function's fallback for an explicit null is 1.0.
    assert opj.LossConfig.from_verl({}, {"loss_mode": "kl_cov"}).ppo_kl_coef == 0.1
    null = {"loss_mode": "kl_cov", "policy_loss": {"ppo_kl_coef": None}}
    assert opj.LossConfig.from_verl({}, null).ppo_kl_coef == 1.0


@pytest.mark.parametrize(
    ("rc", "actor", "message"),
    [
        ({}, {"clip_ratio_hgh": 0.3}, "did you mean 'clip_ratio_high'"),
        ({}, {"loss_mode": "clip-cov"}, "actor.loss_mode"),
        ({}, {"loss_mode": "clip_cov", "policy_loss": {"clip_cov_ratio": 0}}, "clip_cov_ratio"),
        ({}, {"policy_loss": {"loss_mode": "kl_cov", "kl_cov_ratio": 2}}, "kl_cov_ratio"),
        ({}, {"loss_mode": "clip_cov", "policy_loss": {"clip_cov_lb": 5.0}}, "clip_cov_lb"),
        ({}, {"loss_agg_mode": "seq-mean"}, "actor.loss_agg_mode"),
        ({}, {"use_kl_loss": True, "kl_loss_type": "k3+"}, "actor.kl_loss_type"),
        ({}, {"clip_ratio_c": 1.0}, "actor.clip_ratio_c"),
        ({}, {"loss_mode": "gspo", "policy_loss": {"loss_mode": "cispo"}}, "contradicts"),
        ({"bypass_mode": True, "loss_type": "reinforc"}, {}, "loss_type"),
        ({"bypass_mode": "yes"}, {}, "bypass_mode"),
        ({}, ["loss_mode"], "actor must be a mapping"),
    ],
)
def test_from_verl_errors_name_the_verl_key(rc, actor, message):
    with pytest.raises(ValueError, match=message):
        opj.LossConfig.from_verl(rc, actor)


def test_every_verl_surrogate_has_a_native_name():
    from offpolicy_jax import config
    from offpolicy_jax._src.losses import registry
    from offpolicy_jax.interop import verl

    assert set(verl._VERL_LOSS_MODES.values()) <= set(registry.names())
    assert set(verl._VERL_AGGREGATIONS.values()) <= set(config.AGGREGATIONS)
    for a, b in itertools.combinations(registry.names(), 2):
        assert a != b


# --------------------------------------------------------------------------- through policy_loss

import numpy_reference as mis_ref  # noqa: E402  (the correction oracle)

AGGREGATIONS = (
    "token_mean",
    "sequence_mean",
    "sequence_sum",
    "sequence_sum_norm",
    "token_sum",
    "row_mean",
)
# Token-level truncated IS at 2 with token rejection outside [0.5, 2]: weights and a
# smaller final mask (the rejected tokens leave the loss).
TIS_RS = dict(use_tis=True, use_rs=True, tis_upper_bound=2.0, rs_lower_bound=0.5)
POLICY_LOSS_HYPER = {
    "gspo": dict(clip_eps_high=EPS_HIGH),
    "gspo_token": dict(clip_eps_high=EPS_HIGH),
    "cispo": dict(clip_eps_high=EPS_HIGH),
    "gmpo": dict(clip_eps_high=EPS_HIGH),
    "sapo": dict(tau_pos=1.0, tau_neg=1.05),
    "gpg": {},
    "dppo_tv": dict(clip_eps_high=EPS_HIGH, dppo_ratio_cap=3.0),
    "dppo_kl": dict(clip_eps_high=EPS_HIGH, dppo_ratio_cap=3.0),
    "dro": dict(dro_beta=0.1),
}


def loss_config(name, aggregation="token_mean", algorithm="decoupled_ppo", **extra):
    correction = opj.CorrectionConfig(**TIS_RS) if algorithm == "decoupled_ppo" else None
    return opj.LossConfig(
        algorithm=algorithm,
        correction=correction,
        policy_loss=name,
        aggregation=aggregation,
        clip_eps=EPS,
        **POLICY_LOSS_HYPER[name],
        **extra,
    )


def policy_batch(seed, garbage=True):
    theta, old, adv, valid = batch(seed, spread=0.5, garbage=garbage)
    rng = np.random.default_rng(seed + 100)
    rollout = np.where(valid, old + rng.normal(0, 0.6, old.shape), np.nan).astype(np.float32)
    return theta, old, rollout, adv, valid


def numpy_policy_loss(name, config, theta, old, rollout, adv, valid):
    """The loss and its gradient from the two oracles: correction, then surrogate."""
    if config.algorithm == "decoupled_ppo":
        w, m_final, _ = mis_ref.correction(old, rollout, valid, **TIS_RS)
        w = np.where(m_final > 0, w, 0.0)
    else:
        w, m_final = np.ones(valid.shape), valid.astype(np.float64)
    d = rollout if config.algorithm == "bypass_ppo" else old
    kept = m_final > 0
    terms = numpy_loss(name, theta, d, adv, kept, weights=w if name == "gmpo" else None)
    scale = config.loss_scale_factor
    if name == "gmpo":
        per_token = np.broadcast_to(terms.loss[:, None], valid.shape)
        value, agg_w = ref.aggregate(per_token, m_final, m_final, config.aggregation, scale)
        return value, terms.vjp(agg_w.sum(-1))
    per_token = w * terms.loss
    value, agg_w = ref.aggregate(per_token, m_final, m_final, config.aggregation, scale)
    return value, terms.vjp(agg_w * w)


def _loss_and_grad(config):
    def f(lp, old, rollout, adv, mask, rewards=None, **kw):
        return opj.policy_loss(lp, old, rollout, adv, mask, config, rewards=rewards, **kw)

    return jax.value_and_grad(f, has_aux=True)


# Cached by config (frozen, hashable): the tests that share a config share its compiled
# program instead of compiling it again.
@functools.cache
def _jit_loss(config):
    return jax.jit(_loss_and_grad(config))


# The oracle cases of one chunk and input signature in one program
# (tests/grouped_cases.py): a program's fixed cost is paid once for the group. Also the
# TRL oracles' (test_trl_losses.py), whose arguments end with the rewards.
@functools.partial(jax.jit, static_argnums=1)
def _oracle_group(args, configs):
    return [_loss_and_grad(c)(*a) for a, c in zip(args, configs, strict=True)]


def _oracle_prepared(params):
    config = loss_config(params["name"], params["aggregation"], params["algorithm"])
    return config, policy_batch(21)


def _run_oracle_group(prepared):
    configs, args = zip(*prepared, strict=True)
    return _oracle_group(list(args), tuple(configs))


# Every surrogate in every mode; every aggregation with the per-sequence surrogates and
# one per-token one (the full product is the slow variant).
ORACLE_CASES = [
    (name, "token_mean", algorithm)
    for name in SURROGATES
    for algorithm in ("ppo", "bypass_ppo", "decoupled_ppo")
] + [
    (name, aggregation, "decoupled_ppo")
    for name in ("gspo", "gmpo", "dppo_kl")
    for aggregation in AGGREGATIONS[1:]
]
SLOW_ORACLE_CASES = [
    pytest.param(*case, marks=pytest.mark.slow)
    for case in itertools.product(SURROGATES, AGGREGATIONS, ("ppo", "bypass_ppo", "decoupled_ppo"))
    if case not in ORACLE_CASES
]


@pytest.mark.parametrize(("name", "aggregation", "algorithm"), ORACLE_CASES + SLOW_ORACLE_CASES)
def test_policy_loss_matches_the_oracles(name, aggregation, algorithm, request):
    config, (theta, old, rollout, adv, valid) = _oracle_prepared(request.node.callspec.params)
    (loss, metrics), grad = grouped_cases.result(request.node, _oracle_prepared, _run_oracle_group)
    value, expected_grad = numpy_policy_loss(name, config, theta, old, rollout, adv, valid)
    np.testing.assert_allclose(float(loss), value, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=2e-5, atol=2e-6)
    assert np.all(np.asarray(grad)[~valid] == 0)
    np.testing.assert_allclose(float(metrics["pg_loss"]), value, rtol=2e-5, atol=2e-6)
    assert "ppo_kl" in metrics


def test_sequence_sum_norm_divides_by_the_padded_length_or_the_scale():
    theta, old, rollout, adv, valid = policy_batch(22)
    base = _jit_loss(loss_config("cispo", "sequence_sum", "ppo"))(theta, old, rollout, adv, valid)
    for scale, divisor in ((None, theta.shape[-1]), (4096.0, 4096.0)):
        config = loss_config("cispo", "sequence_sum_norm", "ppo", loss_scale_factor=scale)
        (loss, _), grad = _jit_loss(config)(theta, old, rollout, adv, valid)
        np.testing.assert_allclose(float(loss), float(base[0][0]) / divisor, rtol=1e-6)
        np.testing.assert_allclose(grad, np.asarray(base[1]) / divisor, rtol=1e-6, atol=1e-12)


def test_row_mean_counts_empty_rows_and_sequence_mean_does_not():
    theta, old, rollout, adv, valid = policy_batch(23)
    seq = _jit_loss(loss_config("gmpo", "sequence_mean", "ppo"))(theta, old, rollout, adv, valid)
    row = _jit_loss(loss_config("gmpo", "row_mean", "ppo"))(theta, old, rollout, adv, valid)
    nonempty, rows = valid.any(-1).sum(), valid.shape[0]
    np.testing.assert_allclose(float(row[0][0]) * rows, float(seq[0][0]) * nonempty, rtol=1e-6)


@pytest.mark.parametrize("name", ["ppo_clip", *SURROGATES])
def test_dual_clip_and_clip_fractions_are_reported(name):
    theta, old, rollout, adv, valid = policy_batch(24)
    if name == "ppo_clip":
        config = opj.LossConfig(clip_eps_high=0.28, dual_clip_c=3.0)
    else:
        config = loss_config(name, algorithm="ppo")
    _, metrics = opj.policy_loss(theta, old, rollout, adv, valid, config)
    expected = {
        "ppo_clip": {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"},
        "gmpo": {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"},
        "dppo_tv": {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"},
        "dppo_kl": {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"},
        "gspo": {"pg_clipfrac", "ppo_kl"},
        "gspo_token": {"pg_clipfrac", "ppo_kl"},
        "cispo": {"pg_clipfrac", "ppo_kl"},
    }.get(name, {"ppo_kl"})
    assert expected <= set(metrics), set(metrics)
    assert not ({"pg_clipfrac", "pg_clipfrac_lower"} - expected) & set(metrics)
    for key in expected:
        assert 0.0 <= float(metrics[key]) <= 1.0 or key == "ppo_kl"


def test_pg_clipfrac_lower_counts_the_dual_clip_floor():
    # A < 0 and r = e^2 > c = 3: the floor −c·A is active on every token.
    valid = np.ones((2, 3), bool)
    old = np.full(valid.shape, -2.0, np.float32)
    theta = old + np.float32(2.0)
    adv = -np.ones(valid.shape, np.float32)
    config = opj.LossConfig(dual_clip_c=3.0)
    _, metrics = opj.policy_loss(theta, old, None, adv, valid, config)
    assert float(metrics["pg_clipfrac_lower"]) == 1.0
    _, metrics = opj.policy_loss(theta, old, None, -adv, valid, config)
    assert float(metrics["pg_clipfrac_lower"]) == 0.0


COVERAGE = [(name, "sequence_mean") for name in SURROGATES] + [
    ("gmpo", aggregation) for aggregation in AGGREGATIONS if aggregation != "sequence_mean"
]


# Tiers: the empty-batch and micro-batch checks compile two or more programs per case
# (~3 s of CPU). The fast tier runs a sequence-level (gspo), a geometric (gmpo) and a
# token-level (cispo) surrogate; the other surrogates and gmpo's other aggregations run in
# the full suite. The fast tier keeps the aggregation-wide checks of the same behaviours:
# the empty-batch property of tests/test_campaign.py and the micro-batch pooling property
# of tests/test_losses.py, over every algorithm and aggregation.
FAST_KINDS = (("gspo", "sequence_mean"), ("gmpo", "sequence_mean"), ("cispo", "sequence_mean"))
TIERED_COVERAGE = [
    case if case in FAST_KINDS else pytest.param(*case, marks=pytest.mark.slow) for case in COVERAGE
]


@pytest.mark.parametrize(("name", "aggregation"), TIERED_COVERAGE)
def test_empty_and_fully_rejected_batches_give_zero(name, aggregation):
    theta, old, rollout, adv, valid = policy_batch(25)
    config = loss_config(name, aggregation)
    empty = np.zeros_like(valid)
    (loss, metrics), grad = _jit_loss(config)(theta, old, rollout, adv, empty)
    assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0.0)
    assert all(np.isfinite(float(v)) for v in metrics.values())
    far = np.where(valid, old + 5.0, np.nan).astype(np.float32)  # every ratio e^-5: rejected
    (loss, metrics), grad = _jit_loss(config)(theta, old, far, adv, valid)
    assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0.0)
    assert all(np.isfinite(float(v)) for v in metrics.values())


# Tiers: the end-to-end garbage check compiles two programs per surrogate (~2.5 s of
# CPU); the fast tier runs a sequence-level (gspo) and a geometric (gmpo) surrogate, and
# test_garbage_at_invalid_positions_changes_nothing checks every surrogate's terms.
@pytest.mark.parametrize(
    "name",
    [n if n in ("gspo", "gmpo") else pytest.param(n, marks=pytest.mark.slow) for n in SURROGATES],
)
def test_policy_loss_ignores_padding_garbage(name):
    theta, old, rollout, adv, valid = policy_batch(26, garbage=True)
    clean = [np.where(valid, x, -1.0).astype(np.float32) for x in (theta, old, rollout)]
    config = loss_config(name, "sequence_mean")
    (loss_g, _), grad_g = _jit_loss(config)(theta, old, rollout, adv, valid)
    (loss_c, _), grad_c = _jit_loss(config)(*clean, np.where(valid, adv, 0.0), valid)
    assert float(loss_g) == float(loss_c)
    np.testing.assert_array_equal(np.asarray(grad_g), np.asarray(grad_c))


@pytest.mark.heavy
@pytest.mark.parametrize(("name", "aggregation"), TIERED_COVERAGE)
def test_micro_batches_pool_to_the_full_batch(name, aggregation):
    theta, old, rollout, adv, valid = policy_batch(27)
    config = loss_config(name, aggregation)
    full = opj.compute_correction(old, rollout, valid, config.correction)
    (full_loss, full_metrics), full_grad = _jit_loss(config)(theta, old, rollout, adv, valid)
    num, den, grads, pooled = 0.0, 0.0, [], None
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        given = opj.CorrectionResult(full.weights[rows], full.mask[rows], {})

        def numerator(lp, rows=rows, given=given):
            parts, metrics = opj.policy_loss_parts(
                lp,
                old[rows],
                rollout[rows],
                adv[rows],
                valid[rows],
                config,
                correction_result=given,
            )
            return parts.numerator, (parts.denominator, metrics)

        (n, (d, metrics)), g = jax.jit(jax.value_and_grad(numerator, has_aux=True))(theta[rows])
        num, den = num + n, den + d
        grads.append(np.asarray(g))
        pooled = metrics if pooled is None else opj.pool_metric_parts(pooled, metrics)
    np.testing.assert_allclose(
        float(opj.LossParts(num, den).value()), float(full_loss), rtol=1e-5, atol=1e-6
    )
    grad = opj.LossParts(np.concatenate(grads), den).value()
    np.testing.assert_allclose(grad, np.asarray(full_grad), rtol=1e-5, atol=1e-7)
    pooled = opj.finalize_metrics(pooled)
    for key in ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        if key in pooled:
            np.testing.assert_allclose(
                pooled[key], full_metrics[key], rtol=1e-5, atol=1e-6, err_msg=key
            )


# --------------------------------------------------------------------------- KL and entropy


@pytest.mark.heavy
@pytest.mark.parametrize("estimator", pl.KL_ESTIMATORS)
@pytest.mark.parametrize("off_policy", [False, True])
@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_kl_term_matches_numpy(estimator, off_policy, aggregation):
    theta, old, rollout, adv, valid = policy_batch(28)
    rng = np.random.default_rng(5)
    ref_logp = np.where(valid, theta + rng.normal(0, 0.7, theta.shape), np.inf).astype(np.float32)
    coef = 0.05
    base_config = loss_config("cispo", aggregation)
    config = loss_config(
        "cispo", aggregation, kl_coef=coef, kl_estimator=estimator, kl_off_policy=off_policy
    )
    (loss, metrics), grad = _jit_loss(config)(theta, old, rollout, adv, valid, ref_logp=ref_logp)
    (base, _), base_grad = _jit_loss(base_config)(theta, old, rollout, adv, valid)
    _, m_final, _ = mis_ref.correction(old, rollout, valid, **TIS_RS)
    kl = ref.kl(theta, ref_logp, m_final > 0, estimator=estimator, d=old if off_policy else None)
    kl_value, agg_w = ref.aggregate(kl.loss, m_final, m_final, aggregation)
    np.testing.assert_allclose(float(metrics["kl_loss"]), kl_value, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(float(loss), float(base) + coef * kl_value, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(
        np.asarray(grad), np.asarray(base_grad) + coef * kl.vjp(agg_w), rtol=2e-5, atol=2e-6
    )
    np.testing.assert_allclose(float(metrics["pg_loss"]), float(base), rtol=1e-6, atol=1e-7)


def test_entropy_bonus_and_its_gradient():
    theta, old, rollout, adv, valid = policy_batch(29)
    entropy = np.where(valid, np.random.default_rng(6).uniform(0, 3, theta.shape), np.nan)
    entropy = entropy.astype(np.float32)
    config = loss_config("gpg", "token_mean", entropy_coef=0.01)
    base = opj.policy_loss(theta, old, rollout, adv, valid, loss_config("gpg", "token_mean"))[0]

    def f(ent):
        return opj.policy_loss(theta, old, rollout, adv, valid, config, entropy=ent)[0]

    loss, grad_entropy = jax.value_and_grad(f)(entropy)
    _, m_final, _ = mis_ref.correction(old, rollout, valid, **TIS_RS)
    h, agg_w = ref.aggregate(entropy, m_final, m_final, "token_mean")
    np.testing.assert_allclose(float(loss), float(base) - 0.01 * h, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(grad_entropy), -0.01 * agg_w, rtol=2e-5, atol=1e-9)
    metrics = opj.policy_loss(theta, old, rollout, adv, valid, config, entropy=entropy)[1]
    np.testing.assert_allclose(float(metrics["entropy"]), h, rtol=2e-5)


def test_regularisers_need_their_inputs():
    theta, old, rollout, adv, valid = policy_batch(30)
    with pytest.raises(ValueError, match="ref_logp is required"):
        opj.policy_loss(theta, old, rollout, adv, valid, loss_config("gpg", kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy is required"):
        opj.policy_loss(theta, old, rollout, adv, valid, loss_config("gpg", entropy_coef=0.1))
    with pytest.raises(ValueError, match="ref_logp"):
        opj.policy_loss(theta, old, rollout, adv, valid, loss_config("gpg"), ref_logp=theta[:, :3])


# --------------------------------------------------------------------------- every surrogate
# Gradients of the stop-gradient surrogates against
# finite differences of the objective they estimate, the remaining kinks, and empty /
# garbage / micro-batched inputs with the KL and entropy terms switched on.


def _masked(values, valid):
    return jnp.where(valid, values, 0.0)


@pytest.mark.parametrize("name", ["cispo", "dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("seed", [0, 1])
def test_truncated_is_gradients_are_the_ratio_objectives_gradient(name, seed):
    """Away from every clip bound, trust-region boundary and cap, CISPO's ``−sg(clip(r))·A·θ``
    and DPPO's ``−sg(min(r, C))·A·θ`` (inside the region) have the gradient of the
    ratio objective ``−A·r``: the VJP of the surrogate against finite differences of
    ``−A·e^{θ−d}`` (``check_vjp``, float64)."""
    theta, d, adv, valid = _away_from_kinks(name, seed)
    with jax.enable_x64(True):
        d_, adv_ = jnp.asarray(d), jnp.asarray(adv)

        def objective(th):
            return _masked(-adv_ * jnp.exp(th - d_), valid)

        def surrogate_vjp(th):
            _, vjp = jax.vjp(lambda t: jax_loss(name, t, d_, adv_, valid).loss, th)
            return objective(th), vjp

        terms = jax_loss(name, jnp.asarray(theta), d_, adv_, valid)
        assert not np.any(np.asarray(terms.clipped) & valid)  # really away from the kinks
        check_vjp(objective, surrogate_vjp, (jnp.asarray(theta),), eps=1e-5, atol=1e-7, rtol=1e-7)


@pytest.mark.heavy
@pytest.mark.parametrize("spread", [0.05, 0.5])
def test_gspo_token_gradient_is_the_gspo_objectives_gradient(spread):
    """GSPO-token's VJP (sequence advantages, each sequence's tokens averaged) against
    finite differences of GSPO's own sequence objective, inside and outside the clip."""
    theta, d, adv, valid = batch(12, spread=spread, garbage=False)
    n = np.maximum(valid.sum(-1), 1)
    with jax.enable_x64(True):
        d_, adv_ = jnp.asarray(d, jnp.float64), jnp.asarray(adv, jnp.float64)

        def per_sequence(name, th):
            return jnp.sum(_masked(jax_loss(name, th, d_, adv_, valid).loss, valid), -1) / n

        def surrogate_vjp(th):
            _, vjp = jax.vjp(functools.partial(per_sequence, "gspo_token"), th)
            return per_sequence("gspo", th), vjp

        check_vjp(
            functools.partial(per_sequence, "gspo"),
            surrogate_vjp,
            (jnp.asarray(theta, jnp.float64),),
            eps=1e-6,
            atol=1e-6,
            rtol=1e-6,
        )


def test_gspo_kink_at_the_lower_clip_bound_passes_the_unclipped_gradient():
    # A < 0, d = 0, one token: log s = θ and 1 − ε = s exactly in float32.
    theta = np.float32(-0.25)
    s = np.exp(np.float32(theta))
    eps = float(np.float32(1) - s)
    one = np.ones((1, 1), np.float32)
    for name in ("gspo", "gspo_token"):
        grad = _grad_at(name, theta * one, 0 * one, -one, one > 0, clip_eps=eps)
        np.testing.assert_allclose(grad, s * one, rtol=1e-6)  # −A·s with A = −1
        grad = _grad_at(name, theta * one, 0 * one, -one, one > 0, clip_eps=eps * 0.99)
        np.testing.assert_array_equal(grad, 0.0)  # below 1 − ε with A < 0: clipped


def test_dppo_kl_trust_region_includes_its_boundary():
    """Binary KL exactly at δ_high (A > 0, p > q) keeps the token; one ulp less drops it."""
    theta, d = np.float32(-0.5), np.float32(-0.7)
    th, old = jnp.float32(theta), jnp.float32(d)
    p, q = jnp.exp(th), jnp.exp(old)
    # the same float32 operations as policy_losses.dppo
    binary_kl = np.float32(
        q * (old - th) + (1 - q) * jnp.log((1.0 - q + pl.DPPO_KL_EPS) / (1.0 - p + pl.DPPO_KL_EPS))
    )
    assert binary_kl > 0
    one = np.ones((1, 1), np.float32)
    args = (theta * one, d * one, one, one > 0)
    ratio = np.float32(jnp.exp(th - old))
    grad = _grad_at("dppo_kl", *args, clip_eps_high=float(binary_kl))
    np.testing.assert_allclose(grad, -ratio * one, rtol=1e-6)
    grad = _grad_at("dppo_kl", *args, clip_eps_high=float(np.nextafter(binary_kl, np.float32(0))))
    np.testing.assert_array_equal(grad, 0.0)
    # p ≤ q with A > 0 is always inside, however large the divergence.
    grad = _grad_at("dppo_kl", d * one, theta * one, one, one > 0, clip_eps_high=1e-6)
    np.testing.assert_allclose(grad, -np.float32(jnp.exp(old - th)) * one, rtol=1e-6)


def test_gmpo_sequence_log_ratio_clamp_passes_the_gradient_at_twenty():
    """GMPO clamps the mean clipped log-ratio to [−20, 20]: full gradient at −20, none below."""
    one = np.ones((1, 1), np.float32)
    valid = one > 0
    for x, expected in ((-20.0, np.exp(-20.0)), (-20.5, 0.0)):

        def loss(th):
            terms = pl.gmpo_token_log_ratio(
                th, 0 * one, one, valid, clip_eps=0.2, clip_eps_high=0.2
            )
            return jnp.sum(pl.gmpo_sequence_loss(terms.loss[:, 0], jnp.ones(1)))

        grad = jax.grad(loss)(jnp.asarray(x * one))
        np.testing.assert_allclose(grad, -expected * one, rtol=1e-5)


def test_k3_cap_at_ten_has_the_analytic_gradient_on_both_sides():
    """k3 = e^u − u − 1 (u = ref − θ) is capped at 10: below the cap the gradient is
    ``1 − e^u``, above it 0 (and the value 10)."""
    ref_logp = np.zeros((1, 2), np.float32)
    valid = np.ones((1, 2), bool)
    # u = 2.5 gives k3 ≈ 8.68 < 10; u = 2.7 gives ≈ 11.18 > 10
    theta = np.array([[-2.5, -2.7]], np.float32)

    def total(th):
        return jnp.sum(pl.kl_estimate(th, ref_logp, valid, estimator="k3"))

    value = pl.kl_estimate(jnp.asarray(theta), ref_logp, valid, estimator="k3")
    u = np.float64(-theta[0])
    np.testing.assert_allclose(value[0, 0], np.exp(u[0]) - u[0] - 1, rtol=1e-5)
    assert float(value[0, 1]) == pl.K3_MAX
    grad = np.asarray(jax.grad(total)(jnp.asarray(theta)))
    np.testing.assert_allclose(grad[0, 0], 1 - np.exp(u[0]), rtol=1e-5)
    assert grad[0, 1] == 0.0


def _regularised(name, aggregation, algorithm="decoupled_ppo", **extra):
    kl = dict(kl_coef=0.05, kl_estimator="k3", kl_off_policy=True, entropy_coef=0.01)
    return loss_config(name, aggregation, algorithm, **{**kl, **extra})


def _regulariser_inputs(seed, valid, theta, garbage=True):
    rng = np.random.default_rng(seed)
    ref_logp = theta + rng.normal(0, 0.5, theta.shape)
    entropy = rng.uniform(0, 2, theta.shape)
    if garbage:
        junk = np.array([np.nan, np.inf, -np.inf, 1e30])[np.arange(theta.size) % 4]
        ref_logp = np.where(valid, ref_logp, junk.reshape(theta.shape))
        entropy = np.where(valid, entropy, junk[::-1].reshape(theta.shape))
    return ref_logp.astype(np.float32), entropy.astype(np.float32)


@functools.cache
def _jit_loss_and_entropy_grad(config):
    """Loss, metrics and the gradients w.r.t. ``logp`` and ``entropy``."""

    def f(lp, ent, old, rollout, adv, mask, ref_logp):
        return opj.policy_loss(lp, old, rollout, adv, mask, config, ref_logp=ref_logp, entropy=ent)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))


REGULARISED_CASES = [
    (name, AGGREGATIONS[i % len(AGGREGATIONS)]) for i, name in enumerate(SURROGATES)
]


def _regularised_tier(first):
    """REGULARISED_CASES with every third case from ``first`` on in the fast tier.

    Tiers: each case compiles one or more programs with the KL and entropy terms (1 to
    3 s of CPU). The three tests below keep the cases from 0, 1 and 2, so that the fast
    tier still runs every surrogate and every aggregation once with both terms on; each
    test runs every case in the full suite.
    """
    return [
        case if i % 3 == first else pytest.param(*case, marks=pytest.mark.slow)
        for i, case in enumerate(REGULARISED_CASES)
    ]


@pytest.mark.heavy
@pytest.mark.parametrize(("name", "aggregation"), _regularised_tier(2))
def test_empty_and_rejected_batches_give_zero_with_kl_and_entropy(name, aggregation):
    theta, old, rollout, adv, valid = policy_batch(31)
    ref_logp, entropy = _regulariser_inputs(31, valid, theta)
    fn = _jit_loss_and_entropy_grad(_regularised(name, aggregation))
    empty = np.zeros_like(valid)
    far = np.where(valid, old + 5.0, np.nan).astype(np.float32)  # every token rejected
    for mask, roll in ((empty, rollout), (valid, far)):
        (loss, metrics), (grad, grad_entropy) = fn(theta, entropy, old, roll, adv, mask, ref_logp)
        assert float(loss) == 0.0, name
        assert np.all(np.asarray(grad) == 0.0) and np.all(np.asarray(grad_entropy) == 0.0)
        assert all(np.isfinite(float(v)) for v in metrics.values()), metrics
        assert float(metrics["kl_loss"]) == 0.0 and float(metrics["entropy"]) == 0.0


@pytest.mark.heavy
@pytest.mark.parametrize(("name", "aggregation"), _regularised_tier(1))
def test_padding_garbage_never_leaks_with_kl_and_entropy(name, aggregation):
    """NaN / ±inf / 1e30 in every input (ref_logp and entropy too) where the mask is 0."""
    theta, old, rollout, adv, valid = policy_batch(32, garbage=True)
    ref_logp, entropy = _regulariser_inputs(32, valid, theta, garbage=True)
    fn = _jit_loss_and_entropy_grad(_regularised(name, aggregation))
    dirty = fn(theta, entropy, old, rollout, adv, valid, ref_logp)
    clean = [np.where(valid, x, -1.0).astype(np.float32) for x in (theta, old, rollout, ref_logp)]
    clean_entropy = np.where(valid, entropy, 0.5).astype(np.float32)
    tidy = fn(
        clean[0], clean_entropy, clean[1], clean[2], np.where(valid, adv, 0.0), valid, clean[3]
    )
    assert float(dirty[0][0]) == float(tidy[0][0])
    for key, value in dirty[0][1].items():
        assert float(value) == float(tidy[0][1][key]), key
    for got, want in zip(dirty[1], tidy[1], strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert np.all(np.asarray(got)[~valid] == 0)


@pytest.mark.heavy
@pytest.mark.parametrize(("name", "aggregation"), _regularised_tier(0))
def test_micro_batches_pool_to_the_full_batch_with_kl_and_entropy(name, aggregation):
    theta, old, rollout, adv, valid = policy_batch(33)
    ref_logp, entropy = _regulariser_inputs(33, valid, theta)
    config = _regularised(name, aggregation)
    full = opj.compute_correction(old, rollout, valid, config.correction)
    (full_loss, full_metrics), (full_grad, _) = _jit_loss_and_entropy_grad(config)(
        theta, entropy, old, rollout, adv, valid, ref_logp
    )

    def numerator(lp, old, rollout, adv, mask, ref_logp, entropy, given):
        parts, metrics = opj.policy_loss_parts(
            lp,
            old,
            rollout,
            adv,
            mask,
            config,
            correction_result=given,
            ref_logp=ref_logp,
            entropy=entropy,
        )
        return parts.numerator, (parts.denominator, metrics)

    step = jax.jit(jax.value_and_grad(numerator, has_aux=True))
    num, den, grads, pooled = 0.0, 0.0, [], None
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        given = opj.CorrectionResult(full.weights[rows], full.mask[rows], {})
        args = (theta, old, rollout, adv, valid, ref_logp, entropy)
        (n, (d, metrics)), g = step(*(x[rows] for x in args), given)
        num, den = num + n, den + d
        grads.append(np.asarray(g))
        pooled = metrics if pooled is None else opj.pool_metric_parts(pooled, metrics)
    np.testing.assert_allclose(
        float(opj.LossParts(num, den).value()), float(full_loss), rtol=1e-5, atol=1e-6
    )
    grad = opj.LossParts(np.concatenate(grads), den).value()
    np.testing.assert_allclose(grad, np.asarray(full_grad), rtol=1e-5, atol=1e-7)
    pooled = opj.finalize_metrics(pooled)
    for key in ("pg_loss", "kl_loss", "entropy", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        if key in full_metrics:
            np.testing.assert_allclose(
                pooled[key], full_metrics[key], rtol=1e-5, atol=1e-6, err_msg=key
            )


@pytest.mark.heavy
@pytest.mark.parametrize("estimator", pl.KL_ESTIMATORS)
@pytest.mark.parametrize("off_policy", [False, True])
@pytest.mark.parametrize(
    "aggregation", ["sequence_sum", "sequence_sum_norm", "token_sum", "row_mean"]
)
def test_kl_term_in_bypass_mode_matches_numpy(estimator, off_policy, aggregation):
    """Bypass mode: the off-policy weighting uses π_θ/π_rollout; the other aggregations."""
    theta, old, rollout, adv, valid = policy_batch(34)
    rng = np.random.default_rng(7)
    ref_logp = np.where(valid, theta + rng.normal(0, 0.7, theta.shape), -np.inf)
    ref_logp = ref_logp.astype(np.float32)
    coef = 0.2
    kw = dict(kl_coef=coef, kl_estimator=estimator, kl_off_policy=off_policy)
    config = loss_config("gpg", aggregation, "bypass_ppo", **kw)
    (loss, metrics), grad = _jit_loss(config)(theta, None, rollout, adv, valid, ref_logp=ref_logp)
    (base, _), base_grad = _jit_loss(loss_config("gpg", aggregation, "bypass_ppo"))(
        theta, None, rollout, adv, valid
    )
    kl = ref.kl(theta, ref_logp, valid, estimator=estimator, d=rollout if off_policy else None)
    m = valid.astype(np.float64)
    kl_value, agg_w = ref.aggregate(kl.loss, m, m, aggregation)
    np.testing.assert_allclose(float(metrics["kl_loss"]), kl_value, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(float(loss), float(base) + coef * kl_value, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(
        np.asarray(grad), np.asarray(base_grad) + coef * kl.vjp(agg_w), rtol=2e-5, atol=2e-6
    )


@pytest.mark.heavy
@pytest.mark.parametrize("name", VALUE_CONSISTENT)
@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_sum_norm"])
def test_check_grads_through_policy_loss_away_from_kinks(name, aggregation):
    """The whole pipeline (correction weights and rejection, fused reduction, aggregation)
    in float32: ``check_grads`` of ``policy_loss`` w.r.t. ``logp`` for the surrogates whose
    value is their objective (the IS weights depend on π_old / π_rollout only)."""
    theta, d, adv, valid = _away_from_kinks(name, 2)
    rollout = d + np.random.default_rng(3).uniform(-0.3, 0.3, d.shape)
    f32 = [np.asarray(x, np.float32) for x in (theta, d, rollout, adv)]
    config = loss_config(name, aggregation)

    def loss(lp):
        return opj.policy_loss(lp, f32[1], f32[2], f32[3], valid, config)[0]

    check_grads(
        jax.jit(loss),
        (jnp.asarray(f32[0]),),
        order=1,
        modes=("rev",),
        eps=1e-2,
        atol=2e-3,
        rtol=2e-3,
    )


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("name", "aggregation"),
    [
        case
        if case[0] in ("gspo", "gmpo", "dppo_kl")
        else pytest.param(*case, marks=pytest.mark.slow)
        for case in REGULARISED_CASES
    ],
)
def test_vmap_over_batches_equals_a_loop(name, aggregation):
    """``jax.vmap`` of the loss and its gradient over a stack of batches (KL and entropy on)."""
    stacks = [policy_batch(40 + i) for i in range(3)]
    regs = [_regulariser_inputs(40 + i, s[4], s[0]) for i, s in enumerate(stacks)]
    config = _regularised(name, aggregation)

    def one(lp, old, rollout, adv, mask, ref_logp, entropy):
        def f(x):
            return opj.policy_loss(
                x, old, rollout, adv, mask, config, ref_logp=ref_logp, entropy=entropy
            )

        return jax.value_and_grad(f, has_aux=True)(lp)

    args = [
        np.stack(x)
        for x in zip(*[(*s, *r) for s, r in zip(stacks, regs, strict=True)], strict=True)
    ]
    (loss, metrics), grad = jax.jit(jax.vmap(one))(*args)
    for i in range(3):
        (want, want_metrics), want_grad = jax.jit(one)(*(a[i] for a in args))
        np.testing.assert_allclose(loss[i], want, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(grad[i], want_grad, rtol=1e-6, atol=1e-7)
        for key, value in want_metrics.items():
            np.testing.assert_allclose(metrics[key][i], value, rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize(("bad", "value"), [("ref_logp", np.nan), ("entropy", -np.inf)])
def test_non_finite_regulariser_input_at_a_valid_token_rejects_its_sequence(bad, value):
    """Regression: a NaN / -inf ``ref_logp`` or ``entropy`` at a valid token used to be read
    as 0, silently dropping that token's KL / entropy term. Like a non-finite θ (§0) it now
    removes its sequence and is counted by ``pg_nonfinite_seq_fraction``."""
    theta, old, rollout, adv, valid = policy_batch(35)
    ref_logp, entropy = _regulariser_inputs(35, valid, theta)
    inputs = {"ref_logp": ref_logp, "entropy": entropy}
    row = 4  # 7 valid tokens
    inputs[bad] = inputs[bad].copy()
    inputs[bad][row, 2] = value
    config = _regularised("gspo", "sequence_mean")
    (loss, metrics), grad = _jit_loss(config)(theta, old, rollout, adv, valid, **inputs)
    without = valid.copy()
    without[row] = False
    clean = dict(ref_logp=ref_logp, entropy=entropy)
    (want, want_metrics), want_grad = _jit_loss(config)(theta, old, rollout, adv, without, **clean)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-6, atol=1e-9)
    for key in ("kl_loss", "entropy", "pg_loss"):
        np.testing.assert_allclose(float(metrics[key]), float(want_metrics[key]), rtol=1e-6)
    nonempty = valid.any(-1).sum()
    np.testing.assert_allclose(float(metrics["pg_nonfinite_seq_fraction"]), 1 / nonempty)
    # As a metric-only input (coefficient 0) it changes nothing in the loss.
    metric_only = loss_config("gspo", "sequence_mean")
    (plain, _), plain_grad = _jit_loss(metric_only)(theta, old, rollout, adv, valid)
    (seen, _), seen_grad = _jit_loss(metric_only)(theta, old, rollout, adv, valid, **inputs)
    assert float(seen) == float(plain)
    np.testing.assert_array_equal(np.asarray(seen_grad), np.asarray(plain_grad))
