"""TRL's ``vespo`` and ``luspo`` surrogates and VAPO's positive-example NLL (NeMo-RL's
``positive_example_nll_weight``) against the NumPy oracle ``policy_losses_reference_trl``:
values and gradients (ragged, NaN padding, both advantage signs, at the kinks), through
``policy_loss`` with corrections and aggregations, their metrics; hypothesis properties
(padding garbage, jit == eager, pooled == full batch, packed == one sequence per row,
finite gradients, all-masked -> 0) and the validation of every new key."""

from __future__ import annotations

import functools
import itertools

import grouped_cases
import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as mis_ref
import packing_cases as pc
import policy_losses_reference as ref
import policy_losses_reference_trl as trl_ref
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import examples, ragged_batches
from test_policy_losses import TIS_RS, _jit_loss, _run_oracle_group, batch, policy_batch

import offpolicy_jax as opj
from offpolicy_jax._src.losses import policy_losses as pl

VESPO_HP = dict(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)  # TRL's defaults
VESPO_KEYS = {f"vespo_{k}": v for k, v in VESPO_HP.items()}
LUSPO_HP = dict(clip_eps=0.2, clip_eps_high=0.28)
RTOL, ATOL = 2e-5, 2e-6


def jax_vespo(theta, d, adv, valid, weights=None, **hp):
    """``pl.vespo`` with the sequence log-weight summed along the row (one sequence a row)."""
    x = pl.safe_log_ratio(theta, d, valid)
    w = None if weights is None else jnp.where(valid, weights, 1.0)
    terms = pl.vespo_log_weight_terms(x, w)
    seq = jnp.sum(jnp.where(valid, terms, 0.0), -1, keepdims=True)
    return pl.vespo(theta, seq, adv, valid, **{**VESPO_HP, **hp})


def jax_luspo(theta, d, adv, valid, **hp):
    x = pl.safe_log_ratio(theta, d, valid)
    n = jnp.sum(jnp.where(valid, 1.0, 0.0), -1, keepdims=True)
    mean = jnp.sum(x, -1, keepdims=True) / jnp.maximum(n, 1.0)
    return pl.luspo(theta, mean, n, adv, valid, **{**LUSPO_HP, **hp})


def _check(f, expected, theta, valid):
    """Value and VJP of ``f(θ).loss`` against the oracle; finite, 0 at padding."""
    loss, vjp = jax.vjp(lambda th: f(th).loss, jnp.asarray(theta))
    cot = np.random.default_rng(1).normal(size=np.shape(expected.loss)).astype(np.float32)
    (grad,) = vjp(jnp.asarray(cot))
    np.testing.assert_allclose(loss, expected.loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, expected.vjp(cot), rtol=RTOL, atol=ATOL)
    assert np.all(np.isfinite(np.asarray(grad))) and np.all(np.asarray(grad)[~valid] == 0)
    return np.asarray(loss), np.asarray(grad)


# --------------------------------------------------------------------------- VESPO


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("spread", [0.05, 0.5, 8.0])
@pytest.mark.parametrize("per_sequence_adv", [True, False])
def test_vespo_value_and_gradient_match_numpy(seed, spread, per_sequence_adv):
    theta, d, adv, valid = batch(seed, spread=spread, per_sequence_adv=per_sequence_adv)
    adv0 = np.where(valid, adv, 0.0).astype(np.float32)
    want = trl_ref.vespo(theta, d, adv, valid, **VESPO_HP)
    got = jax_vespo(jnp.asarray(theta), d, adv0, valid)
    _check(lambda th: jax_vespo(th, d, adv0, valid), want.terms, theta, valid)
    np.testing.assert_allclose(np.where(valid, got.phi, 0), want.phi * valid, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(np.asarray(got.clamped) & valid, want.clamped & valid)
    if spread == 8.0:  # long sequences' Σx leave [log 1e-8, 20]: the clamps are exercised
        assert (want.clamped & valid).any()


def test_vespo_folds_is_weights_into_the_sequence_weight():
    theta, d, adv, valid = batch(3, spread=0.3)
    rng = np.random.default_rng(0)
    weights = np.where(valid, rng.uniform(0.0, 2.5, valid.shape), np.nan).astype(np.float32)
    weights[0, 2] = 0.0  # log 0 -> log 1e-8: the sequence's φ all but vanishes (TRL)
    adv0 = np.where(valid, adv, 0.0).astype(np.float32)
    want = trl_ref.vespo(theta, d, adv, valid, weights=weights, **VESPO_HP)
    _check(lambda th: jax_vespo(th, d, adv0, valid, weights), want.terms, theta, valid)
    assert want.phi[0, 0] < 1e-6


def test_vespo_phi_at_its_landmarks():
    """``φ(1) = 1`` for both signs, the kernel's maximum at ``W = k/λ``, the advantage's
    sign picks (k, λ) with A = 0 on the positive side, and the clamps of log W."""

    def phi(log_w, a, **hp):
        adv = jnp.full((1, 1), a, jnp.float32)
        return float(
            pl.vespo(adv, jnp.float32(log_w), adv, adv == adv, **{**VESPO_HP, **hp}).phi[0, 0]
        )

    assert phi(0.0, 1.0) == 1.0 and phi(0.0, -1.0) == 1.0
    k, lam = 2.0, 3.0
    peak = np.exp(lam) * (k / lam) ** k * np.exp(-k)  # φ(k/λ) = e^λ (k/λ)^k e^{-k}
    np.testing.assert_allclose(phi(np.log(k / lam), 1.0), peak, rtol=1e-6)
    assert phi(np.log(k / lam) + 1e-2, 1.0) < phi(np.log(k / lam), 1.0)
    assert phi(np.log(k / lam) - 1e-2, 1.0) < phi(np.log(k / lam), 1.0)
    # A = 0 uses (k_pos, λ_pos); A < 0 (k_neg, λ_neg): different values at W = 2.
    np.testing.assert_allclose(phi(np.log(2.0), 0.0), np.exp(3 + 2 * np.log(2) - 6), rtol=1e-6)
    np.testing.assert_allclose(phi(np.log(2.0), -1.0), np.exp(2 + 3 * np.log(2) - 4), rtol=1e-6)
    # The clamps: log W beyond 20 acts as 20, below log 1e-8 as log 1e-8 (φ ≈ 0 there).
    assert phi(25.0, -1.0) == phi(20.0, -1.0) == 0.0  # e^{λ(1 − e^20)} underflows to 0
    assert phi(-30.0, 1.0) == phi(pl.VESPO_LOG_WEIGHT_MIN, 1.0) > 0.0
    # TRL floors λ at 1e-4 (a config cannot go below, see the validation test).
    assert phi(np.log(2.0), 1.0, lambda_pos=1e-9) == phi(np.log(2.0), 1.0, lambda_pos=1e-4)


def test_vespo_clamp_indicator_includes_its_bounds():
    one = jnp.ones((1, 3), jnp.float32)
    bounds = jnp.array([[np.float32(pl.VESPO_LOG_WEIGHT_MIN), 20.0, 0.0]], jnp.float32)
    assert not np.asarray(pl.vespo(-one, bounds, one, one > 0, **VESPO_HP).clamped).any()
    beyond = jnp.array([[np.nextafter(np.float32(pl.VESPO_LOG_WEIGHT_MIN), -np.inf), 20.5, 0.0]])
    assert np.asarray(pl.vespo(-one, beyond, one, one > 0, **VESPO_HP).clamped).tolist() == [
        [True, True, False]
    ]


def test_vespo_gradient_is_the_reweighted_reinforce_gradient():
    """``φ`` carries no gradient: ∂ℓ/∂θ = −φ·A, both signs, even where W moves with θ."""
    theta, d, adv, valid = batch(5, spread=0.5, garbage=False, per_sequence_adv=False)
    out = jax_vespo(jnp.asarray(theta), d, adv, valid)
    grad = jax.grad(lambda th: jnp.sum(jax_vespo(th, d, adv, valid).loss))(jnp.asarray(theta))
    np.testing.assert_allclose(grad, np.where(valid, -np.asarray(out.phi) * adv, 0), rtol=1e-6)
    assert (adv[valid] > 0).any() and (adv[valid] < 0).any()


# --------------------------------------------------------------------------- LUSPO


@pytest.mark.heavy
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("spread", [0.05, 0.5, 3.0])
@pytest.mark.parametrize("per_sequence_adv", [True, False])
def test_luspo_value_and_gradient_match_numpy(seed, spread, per_sequence_adv):
    theta, d, adv, valid = batch(seed, spread=spread, per_sequence_adv=per_sequence_adv)
    adv0 = np.where(valid, adv, 0.0).astype(np.float32)
    want = trl_ref.luspo(theta, d, adv, valid, **LUSPO_HP)
    got = jax_luspo(jnp.asarray(theta), d, adv0, valid)
    _check(lambda th: jax_luspo(th, d, adv0, valid), want, theta, valid)
    np.testing.assert_array_equal(np.asarray(got.clipped) & valid, want.clipped & valid)


def test_luspo_is_gspo_times_the_length():
    """LUSPO's loss is GSPO's times |y|, so averaged once per sequence its per-token
    gradient is −A·s·∇θ_t, undivided by the length (where no clip binds)."""
    theta, d, adv, valid = batch(6, spread=0.01, garbage=False)
    n = valid.sum(-1, keepdims=True)
    x = pl.safe_log_ratio(jnp.asarray(theta), d, valid)
    mean = jnp.sum(x, -1, keepdims=True) / np.maximum(n, 1)
    gspo = pl.gspo(theta, mean, adv, valid, clip_eps=0.2, clip_eps_high=0.28)
    luspo = jax_luspo(jnp.asarray(theta), d, adv, valid)
    np.testing.assert_allclose(luspo.loss, n * np.asarray(gspo.loss), rtol=1e-6)

    def row_mean(th):
        per_token = jax_luspo(th, d, adv, valid).loss
        return jnp.sum(jnp.where(valid, per_token, 0.0) / np.maximum(n, 1)) / valid.shape[0]

    grad = jax.grad(row_mean)(jnp.asarray(theta))
    s = np.exp(np.asarray(mean))
    np.testing.assert_allclose(grad, np.where(valid, -adv * s / valid.shape[0], 0), rtol=1e-5)


def test_luspo_kink_at_the_clip_bound_passes_the_unclipped_gradient():
    one = np.ones((1, 1), np.float32)

    def grad(theta, a, **hp):  # one token, d = 0: mean x = θ, s = e^θ, |y| = 1
        def f(th):
            return jnp.sum(jax_luspo(th, 0 * one, a * one, one > 0, **hp).loss)

        return np.asarray(jax.grad(f)(jnp.asarray(np.float32(theta) * one)))

    s = np.float32(jnp.exp(jnp.float32(0.25)))
    at = float(s - np.float32(1))  # exact in float32 (Sterbenz)
    np.testing.assert_allclose(grad(0.25, 1.0, clip_eps_high=at), -s * one, rtol=1e-6)
    np.testing.assert_array_equal(grad(0.25, 1.0, clip_eps_high=at * 0.99), 0.0)
    # A < 0 at the lower bound 1 − ε = s: the tie passes −A·s; strictly below: clipped.
    s = np.float32(jnp.exp(jnp.float32(-0.5)))
    at = float(np.float32(1) - s)
    np.testing.assert_allclose(grad(-0.5, -1.0, clip_eps=at), s * one, rtol=1e-6)
    np.testing.assert_array_equal(grad(-0.5, -1.0, clip_eps=at * 0.99), 0.0)


# --------------------------------------------------------------------------- both, NLL


@pytest.mark.parametrize("name", ["vespo", "luspo", "nll"])
def test_garbage_and_all_invalid(name):
    theta, d, adv, valid = batch(4, garbage=True)
    rewards = np.where(valid.any(-1), [1.0, -1.0, 2.0, np.nan, 0.0, 0.5], np.nan)
    fns = {
        "vespo": lambda th, dd, a, v: jax_vespo(th, dd, a, v),
        "luspo": lambda th, dd, a, v: jax_luspo(th, dd, a, v),
        "nll": lambda th, dd, a, v: opj.SurrogateTerms(
            pl.positive_example_nll(th, jnp.asarray(rewards)[:, None] > 0, v)
        ),
    }
    fn = fns[name]
    adv0 = np.where(valid, adv, 0.0).astype(np.float32)
    clean = [np.where(valid, a, -1.0).astype(np.float32) for a in (theta, d)]

    def value_and_grad(th, dd, v, a):
        return jax.value_and_grad(lambda t: jnp.sum(fn(t, dd, a, v).loss))(jnp.asarray(th))

    got, want = value_and_grad(theta, d, valid, adv0), value_and_grad(*clean, valid, adv0)
    assert float(got[0]) == float(want[0]) and np.isfinite(float(got[0]))
    np.testing.assert_array_equal(got[1], want[1])
    if name == "nll":
        expected = trl_ref.positive_nll(theta, rewards, valid)
        np.testing.assert_allclose(fn(jnp.asarray(theta), d, adv0, valid).loss, expected.loss)
        np.testing.assert_allclose(got[1], expected.vjp(np.ones(theta.shape)), rtol=1e-6)
    none = np.zeros_like(valid)
    value, grad = value_and_grad(theta, d, none, 0 * adv0)
    assert float(value) == 0.0
    np.testing.assert_array_equal(grad, 0.0)


# --------------------------------------------------------------------------- through policy_loss


def trl_config(name, aggregation, algorithm="decoupled_ppo", **extra):
    correction = opj.CorrectionConfig(**TIS_RS) if algorithm == "decoupled_ppo" else None
    hyper = {"vespo": VESPO_KEYS, "luspo": LUSPO_HP, "gpg": {}}[name]
    return opj.LossConfig(
        algorithm=algorithm,
        correction=correction,
        policy_loss=name,
        aggregation=aggregation,
        **hyper,
        **extra,
    )


def _seq_metric(values, m, reduction):
    """A per-token metric over ``m'``, reduced like ``pg_clipfrac``."""
    n = m.sum(-1)
    if reduction == "token":
        return (values * m).sum() / max(n.sum(), 1.0)
    keep = n > 0
    return ((values * m).sum(-1)[keep] / n[keep]).mean() if keep.any() else 0.0


def numpy_trl_loss(config, theta, old, rollout, adv, valid, rewards=None):
    """Loss, gradient and metrics from the oracles: correction, surrogate, NLL, aggregation."""
    weighted = config.algorithm == "decoupled_ppo"
    if weighted:
        w, m, _ = mis_ref.correction(old, rollout, valid, **TIS_RS)
        w = np.where(m > 0, w, 0.0)
    else:
        w, m = np.ones(valid.shape), valid.astype(np.float64)
    d = rollout if config.algorithm == "bypass_ppo" else old
    kept, den = m > 0, valid.astype(np.float64) if config.rejected_in_denominator else m
    metrics = {}
    if config.policy_loss == "vespo":
        out = trl_ref.vespo(
            theta, d, adv, kept, weights=w if weighted else None, mask=m, **VESPO_HP
        )
        terms, per_token, factor = out.terms, out.terms.loss, 1.0
        metrics["vespo_phi"] = _seq_metric(out.phi, m, config.metric_reduction)
        metrics["vespo_clipfrac"] = _seq_metric(out.clamped, m, config.metric_reduction)
    else:
        fn = trl_ref.luspo if config.policy_loss == "luspo" else None
        terms = fn(theta, d, adv, kept, mask=m, **LUSPO_HP) if fn else ref.gpg(theta, adv, kept)
        per_token, factor = w * terms.loss, w
    value, agg_w = ref.aggregate(per_token, m, den, config.aggregation)
    grad = terms.vjp(agg_w * factor)
    metrics["pg_loss"] = value
    if rewards is not None:
        nll = trl_ref.positive_nll(theta, rewards, valid)
        nll_value, nll_w = ref.aggregate(nll.loss, m, den, config.aggregation)
        mu = config.positive_example_nll_weight
        value, grad = value + mu * nll_value, grad + mu * nll.vjp(nll_w)
        metrics["nll_loss"] = nll_value
    return value, grad, metrics


def _oracle_prepared(params):
    name = params["name"]
    theta, old, rollout, adv, valid = policy_batch(21)
    if name == "vespo":  # some sequences on each side of W = 1, and a few at the clamps
        theta = np.where(valid, theta + np.float32(0.2) * np.sign(adv), theta).astype(np.float32)
    config = trl_config(name, params["aggregation"], params["algorithm"], **params["extra"])
    rewards = None
    if config.positive_example_nll_weight:
        # row 3 is empty: its NaN reward is never read
        rewards = np.array([1.0, -0.5, 0.0, np.nan, 0.25, 2.0], np.float32)
    return config, (theta, old, rollout, adv, valid, rewards)


ORACLE_CASES = [
    ("vespo", "token_mean", "decoupled_ppo", dict(rejected_in_denominator=True)),  # = TRL
    ("vespo", "sequence_mean", "bypass_ppo", {}),
    ("vespo", "row_mean", "ppo", dict(metric_reduction="token")),
    ("luspo", "row_mean", "decoupled_ppo", {}),  # = TRL
    ("luspo", "sequence_mean", "ppo", {}),
    ("luspo", "token_mean", "bypass_ppo", dict(rejected_in_denominator=True)),
    ("gpg", "token_mean", "decoupled_ppo", dict(positive_example_nll_weight=0.1)),
    ("vespo", "sequence_sum", "decoupled_ppo", dict(positive_example_nll_weight=0.3)),
    ("luspo", "sequence_mean", "ppo", dict(positive_example_nll_weight=0.05)),
]
SLOW_ORACLE_CASES = [
    pytest.param(name, aggregation, algorithm, {}, marks=pytest.mark.slow)
    for name, aggregation, algorithm in itertools.product(
        ("vespo", "luspo"),
        ("token_mean", "sequence_mean", "sequence_sum", "sequence_sum_norm", "token_sum"),
        ("ppo", "bypass_ppo", "decoupled_ppo"),
    )
]


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("name", "aggregation", "algorithm", "extra"), ORACLE_CASES + SLOW_ORACLE_CASES
)
def test_policy_loss_matches_the_oracles(name, aggregation, algorithm, extra, request):
    config, args = _oracle_prepared(request.node.callspec.params)
    theta, old, rollout, adv, valid, rewards = args
    (loss, metrics), grad = grouped_cases.result(request.node, _oracle_prepared, _run_oracle_group)
    value, want_grad, want = numpy_trl_loss(config, theta, old, rollout, adv, valid, rewards)
    np.testing.assert_allclose(float(loss), value, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=RTOL, atol=ATOL)
    assert np.all(np.asarray(grad)[~valid] == 0)
    for key, v in want.items():
        np.testing.assert_allclose(float(metrics[key]), v, rtol=RTOL, atol=ATOL, err_msg=key)
    assert ("pg_clipfrac" in metrics) == (name == "luspo")
    assert ("vespo_phi" in metrics) == (name == "vespo")


def test_nll_selects_by_reward_not_advantage_and_reports_only_with_rewards():
    theta, old, rollout, adv, valid = policy_batch(22)
    rows = valid.shape[0]
    config = trl_config("gpg", "token_mean", "ppo", positive_example_nll_weight=0.5)
    rewards = np.where(np.arange(rows) % 2 == 0, 1.0, 0.0).astype(np.float32)
    (_, m_pos), _ = _jit_loss(config)(theta, old, rollout, adv, valid, rewards)
    (_, m_adv), _ = _jit_loss(config)(theta, old, rollout, adv, valid, adv[:, 0])
    nll = trl_ref.positive_nll(theta, rewards, valid)
    np.testing.assert_allclose(
        float(m_pos["nll_loss"]), ref.aggregate(nll.loss, valid, valid, "token_mean")[0], rtol=RTOL
    )
    assert float(m_pos["nll_loss"]) != float(m_adv["nll_loss"])
    # weight 0: rewards only add the metric; without rewards there is no nll_loss at all
    metric_only = trl_config("gpg", "token_mean", "ppo")
    (loss, m), _ = _jit_loss(metric_only)(theta, old, rollout, adv, valid, rewards)
    (loss_plain, m_plain), _ = _jit_loss(metric_only)(theta, old, rollout, adv, valid)
    assert float(loss) == float(loss_plain) and "nll_loss" in m and "nll_loss" not in m_plain
    assert float(m["nll_loss"]) == float(m_pos["nll_loss"])


def test_nll_non_finite_reward_at_a_valid_token_rejects_its_sequence():
    theta, old, rollout, adv, valid = policy_batch(23, garbage=False)
    config = trl_config("gpg", "sequence_mean", "ppo", positive_example_nll_weight=0.1)
    rewards = np.ones(valid.shape[0], np.float32)
    bad = rewards.copy()
    bad[0] = np.nan
    (loss, m), grad = _jit_loss(config)(theta, old, rollout, adv, valid, bad)
    assert float(m["pg_nonfinite_seq_fraction"]) > 0 and np.all(np.asarray(grad)[0] == 0)
    keep = valid.copy()
    keep[0] = False
    (want, _), want_grad = _jit_loss(config)(theta, old, rollout, adv, keep, rewards)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-8)


def test_trl_normalisations_map_to_aggregations():
    """TRL's vespo: Σ ℓ·m / num_items_in_batch (every completion token); luspo:
    ``(per_token_loss * mask.sum(1)).mean()`` over the rows, empty ones included."""
    theta, old, rollout, adv, valid = policy_batch(24, garbage=False)
    valid[2] = False  # an empty row: TRL's .mean() still counts it
    trl = trl_ref.vespo(theta, old, adv, valid, **VESPO_HP).terms.loss
    trl_vespo = (trl * valid).sum() / valid.sum()
    gspo = ref.gspo(theta, old, adv, valid, clip_eps=0.2, clip_eps_high=0.28, token_level=False)
    trl_luspo = (gspo.loss[:, 0] * valid.sum(-1)).mean()
    for name, aggregation, want in (
        ("vespo", "token_mean", trl_vespo),
        ("luspo", "row_mean", trl_luspo),
    ):
        config = trl_config(name, aggregation, "ppo")
        (loss, _), _ = _jit_loss(config)(theta, old, rollout, adv, valid)
        np.testing.assert_allclose(float(loss), want, rtol=RTOL)


# --------------------------------------------------------------------------- properties

_TOKEN_RS = opj.CorrectionConfig(**TIS_RS)  # no batch normalisation: micro-batches pool
PROPERTY_CONFIGS = [
    opj.LossConfig(
        algorithm="decoupled_ppo",
        correction=_TOKEN_RS,
        policy_loss="vespo",
        aggregation="token_mean",
        rejected_in_denominator=True,
    ),
    opj.LossConfig(
        algorithm="bypass_ppo",
        policy_loss="vespo",
        positive_example_nll_weight=0.1,
        vespo_k_neg=5.0,
        metric_reduction="token",
    ),
    opj.LossConfig(
        algorithm="decoupled_ppo",
        correction=opj.VanillaTIS(0.5, 1.5),
        policy_loss="luspo",
        aggregation="row_mean",
        clip_eps=2e-3,
        clip_eps_high=2.5e-3,
    ),
    opj.LossConfig(
        algorithm="ppo",
        policy_loss="luspo",
        aggregation="sequence_sum",
        positive_example_nll_weight=0.2,
    ),
    opj.LossConfig(
        algorithm="decoupled_ppo",
        correction=_TOKEN_RS,
        aggregation="token_mean",
        positive_example_nll_weight=0.1,
    ),
]
property_configs = st.sampled_from(PROPERTY_CONFIGS)


def _inputs(b, config):
    """Positional arrays and ``rewards`` (per token, garbage in the padding) for a batch."""
    rewards = b["advantages"] if config.positive_example_nll_weight else None
    return (b["logp"], b["old_logp"], b["rollout_logp"], b["advantages"], b["mask"]), rewards


def _clean(b):
    keep = b["mask"] > 0
    return {
        k: (
            np.where(keep, v, 0.0).astype(np.float32)
            if v.dtype == np.float32 and k != "mask"
            else v
        )
        for k, v in b.items()
    }


@pytest.mark.heavy
@settings(max_examples=examples(15))
@given(b=ragged_batches(), config=property_configs)
def test_padding_garbage_never_leaks_and_gradients_are_finite(b, config):
    args, rewards = _inputs(b, config)
    (loss, metrics), grad = _jit_loss(config)(*args, rewards)
    clean_args, clean_rewards = _inputs(_clean(b), config)
    (loss_c, metrics_c), grad_c = _jit_loss(config)(*clean_args, clean_rewards)
    assert float(loss) == float(loss_c) and np.isfinite(float(loss))
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(grad_c))
    assert np.all(np.isfinite(np.asarray(grad))) and np.all(np.asarray(grad)[b["mask"] == 0] == 0)
    for key in metrics:
        assert float(metrics[key]) == float(metrics_c[key]), key
        assert np.isfinite(float(metrics[key])), key


@pytest.mark.slow
@settings(max_examples=examples(5))
@given(b=ragged_batches(), config=property_configs)
def test_jit_equals_eager(b, config):
    args, rewards = _inputs(b, config)
    eager = jax.value_and_grad(
        lambda lp: opj.policy_loss(lp, *args[1:], config, rewards=rewards), has_aux=True
    )(args[0])
    (loss, metrics), grad = _jit_loss(config)(*args, rewards)
    np.testing.assert_allclose(float(loss), float(eager[0][0]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(eager[1]), rtol=1e-5, atol=1e-6)
    for key in metrics:
        np.testing.assert_allclose(
            float(metrics[key]), float(eager[0][1][key]), rtol=1e-6, atol=1e-6
        )


@pytest.mark.heavy
def test_jit_equals_eager_once():
    """The fast tier's jit == eager check: one fixed batch, VESPO with the NLL and LUSPO
    with weights (eager runs op by op: seconds a call; the property above does the rest)."""
    theta, old, rollout, adv, valid = policy_batch(25)
    for config in PROPERTY_CONFIGS[1:3]:
        rewards = adv if config.positive_example_nll_weight else None
        eager = opj.policy_loss(theta, old, rollout, adv, valid, config, rewards=rewards)
        (loss, metrics), _ = _jit_loss(config)(theta, old, rollout, adv, valid, rewards)
        np.testing.assert_allclose(float(loss), float(eager[0]), rtol=1e-6, atol=1e-7)
        assert metrics.keys() == eager[1].keys()


@functools.cache
def _jit_parts(config):
    def numerator(lp, old, rollout, adv, mask, rewards):
        parts, metrics = opj.policy_loss_parts(lp, old, rollout, adv, mask, config, rewards=rewards)
        return parts.numerator, (parts.denominator, metrics)

    return jax.jit(jax.value_and_grad(numerator, has_aux=True))


@pytest.mark.heavy
@settings(max_examples=examples(15))
@given(b=ragged_batches(batch=6), config=property_configs, data=st.data())
def test_micro_batches_pool_to_the_full_batch(b, config, data):
    cuts = sorted(data.draw(st.sets(st.integers(1, 5), min_size=1, max_size=3)))
    args, rewards = _inputs(b, config)
    (full_loss, full_metrics), full_grad = _jit_loss(config)(*args, rewards)
    num, den, grads, pooled = 0.0, 0.0, [], None
    for start, stop in itertools.pairwise([0, *cuts, 6]):
        rows = slice(start, stop)
        part_rewards = None if rewards is None else rewards[rows]
        (n, (d, metrics)), g = _jit_parts(config)(*(x[rows] for x in args), part_rewards)
        num, den = num + n, den + d
        grads.append(g)
        pooled = metrics if pooled is None else opj.pool_metric_parts(pooled, metrics)
    np.testing.assert_allclose(
        float(opj.LossParts(num, den).value()), float(full_loss), rtol=1e-5, atol=1e-6
    )
    grad = np.concatenate(grads) / (float(den) or 1.0)
    np.testing.assert_allclose(grad, np.asarray(full_grad), rtol=1e-5, atol=1e-6)
    pooled = opj.finalize_metrics(pooled)
    assert pooled.keys() == full_metrics.keys()
    for key in pooled:
        np.testing.assert_allclose(
            float(pooled[key]), float(full_metrics[key]), rtol=1e-5, atol=1e-5, err_msg=key
        )


K = 4


def _packed_loss(config, batch, segments=None):
    packed = {} if segments is None else {"segment_ids": segments, "num_segments": K}
    rewards = batch["advantages"] if config.positive_example_nll_weight else None

    def loss(lp):
        return opj.policy_loss(
            lp,
            batch["old_logp"],
            batch["rollout_logp"],
            batch["advantages"],
            batch["mask"],
            config,
            rewards=rewards,
            **packed,
        )

    return jax.value_and_grad(loss, has_aux=True)(batch["logp"])


@pytest.mark.heavy
@settings(max_examples=examples(6))
@given(seed=st.integers(0, 2**16), config=property_configs)
def test_packed_equals_one_sequence_per_row(seed, config):
    """Several sequences per row (``segment_ids``): VESPO's and LUSPO's per-sequence
    sums, the NLL's rewards and every metric equal the one-sequence-per-row call."""
    b = pc.packed_batch(seed, rows=4, length=24, num_segments=K)
    if config.aggregation == "row_mean":  # row_mean counts row slots: pin it to sequences
        config = opj.LossConfig(**{**config.__dict__, "aggregation": "sequence_mean"})
    (loss, metrics), grad = jax.jit(functools.partial(_packed_loss, config))(b, b["segment_ids"])
    flat = pc.unpack(b, K)
    (want, want_metrics), want_grad = jax.jit(functools.partial(_packed_loss, config))(flat)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5, atol=1e-6)
    repacked = pc.repack(np.asarray(want_grad), b["segment_ids"], K)
    np.testing.assert_allclose(np.asarray(grad), repacked, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(grad)[b["segment_ids"] == 0] == 0)
    for key in want_metrics:
        np.testing.assert_allclose(
            float(metrics[key]), float(want_metrics[key]), rtol=1e-5, atol=1e-6, err_msg=key
        )


@pytest.mark.parametrize("config", PROPERTY_CONFIGS[:4])
@pytest.mark.parametrize("how", ["empty", "rejected"])
def test_all_masked_gives_zero_loss_and_zero_gradient(config, how):
    theta, old, rollout, adv, valid = policy_batch(26)
    if how == "empty":
        valid = np.zeros_like(valid)
    else:  # every token rejected: π_old/π_rollout = e^-30, below the RS bound 0.5
        rollout = np.where(valid, old + 30.0, rollout).astype(np.float32)
        if config.algorithm != "decoupled_ppo" or isinstance(config.correction, opj.VanillaTIS):
            valid = np.zeros_like(valid)
    rewards = adv if config.positive_example_nll_weight else None
    (loss, metrics), grad = _jit_loss(config)(theta, old, rollout, adv, valid, rewards)
    assert float(loss) == 0.0
    np.testing.assert_array_equal(np.asarray(grad), 0.0)
    assert all(np.isfinite(float(v)) for v in metrics.values())


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(policy_loss="vespo", vespo_k_pos=-1.0), "LossConfig.vespo_k_pos must be"),
        (dict(policy_loss="vespo", vespo_k_neg=float("nan")), "LossConfig.vespo_k_neg"),
        (dict(policy_loss="vespo", vespo_k_neg=1e39), "LossConfig.vespo_k_neg"),
        (dict(policy_loss="vespo", vespo_k_pos=1e-46), "LossConfig.vespo_k_pos"),
        (dict(policy_loss="vespo", vespo_lambda_pos=0.0), "LossConfig.vespo_lambda_pos must be"),
        (dict(policy_loss="vespo", vespo_lambda_neg=-2.0), "LossConfig.vespo_lambda_neg"),
        (dict(policy_loss="vespo", vespo_lambda_neg=1e-46), "LossConfig.vespo_lambda_neg"),
        (dict(policy_loss="vespo", vespo_lambda_pos="x"), "LossConfig.vespo_lambda_pos"),
        (dict(policy_loss="vespo", vespo_k_pos=True), "LossConfig.vespo_k_pos"),
        (dict(policy_loss="luspo", vespo_k_pos=2.0), "vespo_k_pos"),
        (dict(policy_loss="vespo", clip_eps_high=0.3), "clip_eps_high"),
        (dict(policy_loss="luspo", clip_eps=1.5), "clip_eps"),
        (dict(policy_loss="luspo", clip_eps_high=-0.1), "clip_eps_high"),
        (dict(positive_example_nll_weight=-0.1), "LossConfig.positive_example_nll_weight"),
        (dict(positive_example_nll_weight=float("inf")), "LossConfig.positive_example_nll_weight"),
        (dict(positive_example_nll_weight=1e39), "LossConfig.positive_example_nll_weight"),
        (dict(positive_example_nll_weight="a lot"), "LossConfig.positive_example_nll_weight"),
    ],
)
def test_new_keys_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        opj.LossConfig(**kwargs)


def test_defaults_are_trls_and_keys_round_trip():
    cfg = opj.LossConfig(policy_loss="vespo")
    assert (cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg) == (
        2.0,
        3.0,
        3.0,
        2.0,
    )
    assert (opj.LossConfig(policy_loss="luspo").clip_eps, cfg.positive_example_nll_weight) == (
        0.2,
        0.0,
    )
    tuned = opj.LossConfig(
        policy_loss="vespo",
        vespo_k_neg="4",
        aggregation="token_mean",
        positive_example_nll_weight=0.1,
    )
    assert tuned.vespo_k_neg == 4.0 and hash(tuned)
    assert opj.LossConfig.from_dict(tuned.to_dict()) == tuned
    assert opj.LossConfig.from_yaml(tuned.to_yaml()) == tuned
    assert opj.LossConfig(policy_loss="vespo", vespo_k_pos=0).vespo_k_pos == 0.0  # φ = e^{λ(1−W)}


def test_rewards_are_checked():
    theta, old, rollout, adv, valid = policy_batch(27, garbage=False)
    config = trl_config("gpg", "token_mean", "ppo", positive_example_nll_weight=0.1)
    with pytest.raises(
        ValueError, match="rewards is required: LossConfig.positive_example_nll_weight"
    ):
        opj.policy_loss(theta, old, rollout, adv, valid, config)
    with pytest.raises(ValueError, match="rewards has shape"):
        opj.policy_loss(theta, old, rollout, adv, valid, config, rewards=np.ones(3))
    with pytest.raises(TypeError, match="rewards must be a numeric array"):
        opj.policy_loss(theta, old, rollout, adv, valid, config, rewards=np.ones(6, bool))
    ids = np.where(valid, 1, 0).astype(np.int32)
    with pytest.raises(ValueError, match="with segment_ids, per token"):
        opj.policy_loss(
            theta,
            old,
            rollout,
            adv,
            valid,
            config,
            rewards=np.ones(6),
            segment_ids=ids,
            num_segments=1,
        )
