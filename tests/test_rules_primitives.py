"""The per-token formulas of the field's rejection rules (criteria.py) against the
independent NumPy reference (numpy_reference_rules.py): ragged lengths, NaN in padding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference_rules as ref
import pytest

from offpolicy_jax._src.correction import criteria, ratios


def _batch(seed, b=6, t=12, scale=0.5):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, t + 1, size=b)
    lengths[0] = t
    lengths[1] = 0 if b > 2 else lengths[1]
    m = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    o = rng.normal(-1.0, 0.5, (b, t)).astype(np.float32)
    b_ = (o + rng.normal(0, scale, (b, t))).astype(np.float32)
    o = np.where(m > 0, o, np.nan).astype(np.float32)  # NaN in padding must not leak
    b_ = np.where(m > 0, b_, np.nan).astype(np.float32)
    return o, b_, m


def _m2po_keep(o, b, m, tau):
    valid = jnp.asarray(m) > 0
    delta = jnp.where(valid, jnp.asarray(o) - jnp.asarray(b), 0.0)
    cut = jax.jit(criteria.m2po_cutoff, static_argnums=2)(delta * delta, valid, tau)
    return np.asarray(~valid | (delta * delta <= cut)), float(cut)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tau", [0.01, 0.1, 0.3, 5.0])
def test_m2po_matches_sorting_reference(seed, tau):
    o, b, m = _batch(seed)
    keep, cut = _m2po_keep(o, b, m, tau)
    delta = np.where(m > 0, o.astype(np.float64) - b, 0.0)
    want = ref.m2po_keep(np.where(m > 0, o - b, 0.0).astype(np.float32), m, tau)
    np.testing.assert_array_equal(keep, want)
    kept = (m > 0) & keep
    if kept.any():
        assert (delta[kept] ** 2).mean() <= tau * (1 + 1e-5)
    assert np.isfinite(cut) or keep.all()


def test_m2po_ties_leave_together_and_empty_batch():
    delta = np.array([[0.1, 0.5, 0.5, 0.5, 0.1]], np.float32)
    m = np.ones_like(delta)
    keep, _ = _m2po_keep(delta, np.zeros_like(delta), m, 0.05)
    np.testing.assert_array_equal(keep, [[True, False, False, False, True]])
    np.testing.assert_array_equal(keep, ref.m2po_keep(delta, m, 0.05))
    keep, cut = _m2po_keep(delta, np.zeros_like(delta), np.zeros_like(m), 0.05)
    assert keep.all() and cut == np.inf


@pytest.mark.parametrize("seed", range(4))
def test_seq_logprob_error_matches_reference(seed):
    o, b, m = _batch(seed, scale=0.3)
    valid = m > 0
    delta = jnp.where(valid, o - b, 0.0)
    tok = jnp.where(valid, criteria.mult_prob_error(delta), 0.0)
    count = m.sum(-1)
    per_seq = np.asarray(tok.sum(-1)) / np.maximum(count, 1)
    want = ref.seq_mult_prob_error(np.where(valid, o - b, 0.0), m)
    np.testing.assert_allclose(per_seq, want, rtol=1e-5)
    for thr in (1.05, 1.2, 2.0):
        np.testing.assert_array_equal(
            per_seq <= thr, ref.seq_logprob_error_keep(np.where(valid, o - b, 0.0), m, thr)
        )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("delta_opsm", [0.01, 0.1, 1.0])
def test_opsm_matches_reference(seed, delta_opsm):
    o, b, m = _batch(seed, scale=0.4)
    rng = np.random.default_rng(100 + seed)
    theta = np.where(m > 0, o + rng.normal(0, 0.2, o.shape), np.nan).astype(np.float32)
    adv = np.broadcast_to(rng.normal(0, 1, (o.shape[0], 1)), o.shape).astype(np.float32)
    valid = m > 0
    count = np.maximum(m.sum(-1), 1)
    ratio = np.where(valid, b - theta, 0.0).sum(-1) / count
    mean_adv = np.where(valid, adv, 0.0).sum(-1) / count
    got = np.asarray(criteria.opsm_keep(jnp.asarray(ratio), jnp.asarray(mean_adv), delta_opsm))
    want = ref.opsm_keep(theta, b, adv, m, delta_opsm)
    np.testing.assert_array_equal(got | (m.sum(-1) == 0), want)


def test_probability_metrics_match_reference():
    o, b, m = _batch(0)
    valid = m > 0
    o0, b0 = np.where(valid, o, -1.0), np.where(valid, b, -1.0)
    js = np.asarray(criteria.js_divergence(jnp.asarray(o0), jnp.asarray(b0)))
    np.testing.assert_allclose(
        js, ref.js_divergence(o0.astype(np.float64), b0), rtol=1e-4, atol=1e-7
    )
    assert (js >= -1e-7).all() and np.allclose(
        criteria.js_divergence(jnp.asarray(o0), jnp.asarray(o0)), 0, atol=1e-7
    )
    d = o0 - b0
    np.testing.assert_allclose(
        criteria.mult_prob_error(jnp.asarray(d)), ref.mult_prob_error(d), rtol=1e-6
    )
    w = np.abs(d) + 0.1
    got = criteria.effective_sample_size(
        jnp.sum(jnp.where(valid, w, 0)), jnp.sum(jnp.where(valid, w * w, 0)), jnp.sum(m)
    )
    np.testing.assert_allclose(float(got), ref.ess(w, m), rtol=1e-5)
    assert (
        float(criteria.effective_sample_size(jnp.float32(0), jnp.float32(0), jnp.float32(0))) == 0.0
    )


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_statistics_match_reference(estimator):
    d = np.linspace(-30, 30, 121).astype(np.float32)
    np.testing.assert_allclose(
        criteria.kl_statistic(jnp.asarray(d), estimator),
        ref.token_statistic(d.astype(np.float64), estimator),
        rtol=1e-5,
    )


def _log_grid() -> np.ndarray:
    """±10⁻⁸ … ±60 on a log grid (both series/direct branches and the cap)."""
    mags = np.logspace(-8, np.log10(60.0), 4001)
    return np.concatenate([-mags[::-1], [0.0], mags]).astype(np.float32)


def test_exp_minus_one_forms_are_accurate_to_a_few_ulp():
    # ratios.k3 (a series near 0), metric_expm1 (expm1) and probability_errors
    # (log1p of 2 sinh², sinh from expm1) are written for accuracy: a few ulp everywhere.
    x = _log_grid()
    xd = np.minimum(x.astype(np.float64), ratios.METRIC_LOG_CAP)
    k3 = np.asarray(ratios.k3(jnp.asarray(x)), np.float64)
    k3_ref = np.where(np.abs(xd) < 1e-3, xd**2 / 2 + xd**3 / 6 + xd**4 / 24, np.expm1(xd) - xd)
    assert (k3 >= 0).all()
    np.testing.assert_allclose(k3, k3_ref, rtol=2e-6, atol=0)
    expm1 = np.asarray(ratios.metric_expm1(jnp.asarray(x)), np.float64)
    np.testing.assert_allclose(expm1, np.expm1(xd), rtol=2e-6, atol=0)
    mult, js = (np.asarray(a, np.float64) for a in criteria.probability_errors(jnp.asarray(x)))
    y = np.minimum(np.abs(x.astype(np.float64)), criteria.MULT_PROB_LOG_CAP) / 2
    js_ref = np.where(y < 1e-3, y**2 / 2 - y**4 / 12, np.log(np.cosh(y)))
    np.testing.assert_allclose(js, js_ref, rtol=2e-6, atol=0)
    np.testing.assert_allclose(mult, np.exp(2 * y), rtol=1e-6)
