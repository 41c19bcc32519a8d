"""The pipeline's units on their own: ratios, stages, rejection, normalisation, reductions."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from offpolicy_jax import reduction as _reduce
from offpolicy_jax._src.correction import bounds, ratios, rejection, stages
from offpolicy_jax.reduction import MeanParts, MeshAxes, Rows

DELTA = jnp.array([[0.5, -1.0, 2.0], [0.25, 0.0, 0.0]])
MASK = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_log_ratio_is_zero_where_invalid():
    out = ratios.log_ratio(
        jnp.array([1.0, jnp.nan]), jnp.array([0.5, 2.0]), jnp.array([True, False])
    )
    np.testing.assert_array_equal(out, [0.5, 0.0])


def _tokens(old, rollout, mask, reduction="sequence"):
    old, rollout = jnp.asarray(old, jnp.float32), jnp.asarray(rollout, jnp.float32)
    mask = jnp.asarray(mask, jnp.float32)
    delta = ratios.log_ratio(old, rollout, mask > 0)
    return stages.Tokens(old, rollout, delta, mask, Rows(), reduction)


def _run(chain, old, rollout, mask, *, normalize_how=None, reduction="sequence"):
    t = _tokens(old, rollout, mask, reduction)
    w, final, parts = stages.run(chain, t, weight_stats=True, batch_normalize=normalize_how)
    return w, final, {k: float(v.value()) for k, v in parts.items()}


@pytest.mark.parametrize(
    "level, want",
    [
        ("token", [[math.exp(0.5), math.exp(-1.0), 1.0], [math.exp(0.25), 1.0, 1.0]]),
        ("sequence", [math.exp(-0.5), math.exp(0.25)]),  # one value per sequence
        ("geometric", [math.exp(-0.25), math.exp(0.25)]),
    ],
)
def test_level_ratio(level, want):
    t = _tokens(DELTA, jnp.zeros_like(DELTA), MASK)
    sums = Rows().reduce({"delta": _reduce.total(t.delta, MASK), "count": _reduce.count(MASK)})
    out = stages.level_ratio(level, t, sums)
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_level_ratio_rejects_unknown_level():
    t = _tokens(DELTA, jnp.zeros_like(DELTA), MASK)
    with pytest.raises(ValueError, match="level"):
        stages.level_ratio("seq", t, {"delta": jnp.zeros(2), "count": jnp.ones(2)})


def test_clamped_exp_bounds_the_exponent():
    out = ratios.clamped_exp(jnp.array([-100.0, 0.0, 100.0]))
    np.testing.assert_allclose(out, [math.exp(-20), 1.0, math.exp(20)], rtol=1e-6)


def test_bounds_modes():
    w = jnp.array([0.1, 0.5, 1.0, 2.0, 5.0])
    np.testing.assert_allclose(bounds.apply_mode(w, "truncate", 0.5, 2.0)[0], [0.1, 0.5, 1, 2, 2])
    np.testing.assert_allclose(bounds.apply_mode(w, "clip", 0.5, 2.0)[0], [0.5, 0.5, 1, 2, 2])
    kept, keep = bounds.apply_mode(w, "mask", 0.5, 2.0)
    np.testing.assert_array_equal(keep, [False, True, True, True, False])  # inclusive bounds
    np.testing.assert_allclose(kept, [0.0, 0.5, 1.0, 2.0, 0.0])
    np.testing.assert_allclose(bounds.apply_mode(w, "band", 0.5, 2.0)[0], [0, 0.5, 1, 2, 0])
    np.testing.assert_allclose(bounds.apply_mode(w, "none", 0.5, 2.0)[0], [1, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="mode"):
        bounds.apply_mode(w, "bogus", 0.5, 2.0)


def test_rejection_sampling_inclusive():
    ratio = np.array([[0.49, 0.5, 2.0, 2.01]], np.float32)
    _, final, metrics = _run(
        [rejection.rejection_sampling("token", 0.5, 2.0)],
        np.log(ratio),
        np.zeros((1, 4)),
        np.ones((1, 4)),
    )
    np.testing.assert_array_equal(final, [[0, 1, 1, 0]])
    assert metrics["mis_rs_mask_fraction_low"] == 0.25
    assert metrics["mis_rs_mask_fraction_high"] == 0.25


def test_veto_is_strict_and_ignores_masked_tokens():
    threshold = 1e-4
    log_t = np.float32(math.log(threshold))
    delta = np.array([[0.0, log_t], [0.0, log_t - 1.0], [log_t - 5.0, 0.0]], np.float32)
    mask = np.array([[1.0, 1.0], [1.0, 1.0], [0.0, 1.0]])
    _, final, metrics = _run([rejection.Veto(threshold)], delta, np.zeros_like(delta), mask)
    np.testing.assert_array_equal(final, [[1, 1], [0, 0], [0, 1]])
    assert metrics["mis_rs_catastrophic_seq_fraction"] == pytest.approx(1 / 3)
    assert metrics["mis_rs_catastrophic_token_fraction"] == pytest.approx(0.5 / 3)


def test_nonfinite_sequences_leave_every_population():
    old = np.array([[0.0, np.nan], [np.inf, 0.0], [0.0, 0.0]], np.float32)
    mask = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    _, final, metrics = _run([], old, np.zeros_like(old), mask)
    np.testing.assert_array_equal(final, [[1, 0], [0, 0], [1, 1]])
    assert metrics["mis_nonfinite_seq_fraction"] == pytest.approx(1 / 3)


def test_a_new_bounded_criterion_per_sequence_mean():
    """The extension point: a per-token statistic, a per-sequence mean, an upper bound."""
    k3 = stages.Bounded(
        "k3_seq_mean", None, 0.1, statistic=lambda t: ratios.k3(t.delta), aggregate="mean"
    )
    delta = np.array([[0.0, 0.1], [1.0, 0.0]], np.float32)
    _, final, metrics = _run([k3], delta, np.zeros_like(delta), np.ones((2, 2)))
    np.testing.assert_array_equal(final, [[1, 1], [0, 0]])
    assert metrics["k3_seq_mean_fraction_high"] == 0.5


def test_batch_normalize_token_and_sequence():
    w = np.array([[1.0, 3.0, 100.0], [2.0, 0.0, 0.0]], np.float32)
    m = np.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    tis = bounds.TISWeights("token", "truncate", 0.0, 1000.0)
    out, _, metrics = _run([tis], np.log(w), np.zeros_like(w), m, normalize_how="token")
    assert metrics["mis_batch_norm_factor"] == pytest.approx(2.0)
    np.testing.assert_allclose(np.asarray(out)[m > 0], [0.5, 1.5, 1.0], rtol=1e-6)
    _, _, metrics = _run([tis], np.log(w), np.zeros_like(w), m, normalize_how="sequence")
    assert metrics["mis_batch_norm_factor"] == pytest.approx(2.0)  # mean of per-sequence means
    out, _, metrics = _run([tis], np.log(w), np.zeros_like(w), 0 * m, normalize_how="token")
    assert metrics["mis_batch_norm_factor"] == 1.0 and not np.asarray(out).any()


def test_reductions_sequence_vs_token_and_empty_population():
    x = jnp.array([[1.0, 3.0, jnp.nan], [10.0, jnp.inf, 0.0], [5.0, 5.0, 5.0]])
    m = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])

    def mean(x, m, how):
        sums = Rows().reduce({"s": _reduce.total(x, m), "n": _reduce.count(m)})
        terms = _reduce.seq_mean(sums["s"], sums["n"], how)
        return float(Rows().batch_means({"x": terms})["x"].value())

    assert mean(x, m, "sequence") == 6.0  # (2 + 10) / 2
    assert mean(x, m, "token") == np.float32(14.0 / 3)
    assert mean(x, jnp.zeros_like(m), "token") == 0.0
    per_seq, counts = jnp.array([7.0, jnp.nan, 1.0]), jnp.array([2.0, 0.0, 0.0])
    for how in ("sequence", "token"):
        terms = _reduce.seq_mean_of_values(per_seq, counts, how)
        assert float(Rows().batch_means({"x": terms})["x"].value()) == 7.0


def test_mean_parts_pool_exactly_and_stay_one_type():
    a = MeanParts(jnp.float32(3.0), jnp.float32(2.0))
    b = MeanParts(jnp.float32(1.0), jnp.float32(2.0))
    assert isinstance(a + b, MeanParts) and float((a + b).value()) == 1.0
    pooled = jax.tree.map(jnp.add, a, b)
    assert isinstance(pooled, MeanParts) and float(pooled.value()) == 1.0
    assert float(jax.jit(lambda p: p.value())(a)) == 1.5
    # An empty mean (0, 0) is 0; a pure sum (token_sum) is written with denominator 0.
    assert float(MeanParts(jnp.float32(0.0), jnp.float32(0.0)).value()) == 0.0
    assert float(MeanParts(jnp.float32(3.0), jnp.float32(0.0)).value()) == 3.0
    import offpolicy_jax as opj

    assert opj.LossParts is MeanParts


def test_safe_divide_has_finite_gradient_at_zero_denominator():
    g = jax.grad(lambda n: _reduce.safe_divide(n, jnp.float32(0.0)))(jnp.float32(1.0))
    assert float(g) == 0.0


def test_as_mesh_axes_forms():
    assert _reduce.as_mesh_axes(None) == MeshAxes()
    assert _reduce.as_mesh_axes("data") == MeshAxes(batch=("data",))
    assert _reduce.as_mesh_axes(("data", "fsdp")) == MeshAxes(batch=("data", "fsdp"))
    assert _reduce.as_mesh_axes({"batch": "data", "token": "seq"}) == MeshAxes("data", "seq")
    with pytest.raises(ValueError, match="unknown keys"):
        _reduce.as_mesh_axes({"data": "x"})
    with pytest.raises(ValueError, match="both"):
        MeshAxes(batch="x", token="x")
    with pytest.raises(TypeError, match="axis_names"):
        _reduce.as_mesh_axes(3)
