"""The primitives on their own: ratios, bounds, rejection, normalisation, reductions."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from offpolicy_jax import _reduce, bounds, normalize, ratios, rejection
from offpolicy_jax._reduce import MeanParts, MeshAxes

DELTA = jnp.array([[0.5, -1.0, 2.0], [0.25, 0.0, 0.0]])
MASK = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_log_ratio_is_zero_where_invalid():
    out = ratios.log_ratio(
        jnp.array([1.0, jnp.nan]), jnp.array([0.5, 2.0]), jnp.array([True, False])
    )
    np.testing.assert_array_equal(out, [0.5, 0.0])


@pytest.mark.parametrize(
    "level, want",
    [
        ("token", [[0.5, -1.0, 0.0], [0.25, 0.0, 0.0]]),
        ("sequence", [[-0.5], [0.25]]),  # one value per sequence, broadcastable to [B, T]
        ("geometric", [[-0.25], [0.25]]),
    ],
)
def test_aggregate_level(level, want):
    delta = jnp.where(MASK > 0, DELTA, 0.0)
    out = ratios.aggregate_level(delta, MASK, level)
    np.testing.assert_allclose(out, want)
    assert out.shape == np.shape(want)


def test_aggregate_level_rejects_unknown_level():
    with pytest.raises(ValueError, match="level"):
        ratios.aggregate_level(DELTA, MASK, "seq")


def test_clamped_exp_bounds_the_exponent():
    out = ratios.clamped_exp(jnp.array([-100.0, 0.0, 100.0]))
    np.testing.assert_allclose(out, [math.exp(-20), 1.0, math.exp(20)], rtol=1e-6)


def test_bounds_modes():
    w = jnp.array([0.1, 0.5, 1.0, 2.0, 5.0])
    np.testing.assert_allclose(bounds.truncate(w, 2.0), [0.1, 0.5, 1.0, 2.0, 2.0])
    np.testing.assert_allclose(bounds.clip(w, 0.5, 2.0), [0.5, 0.5, 1.0, 2.0, 2.0])
    kept, keep = bounds.apply_mode(w, "mask", 0.5, 2.0)
    np.testing.assert_array_equal(keep, [False, True, True, True, False])  # inclusive bounds
    np.testing.assert_allclose(kept, [0.0, 0.5, 1.0, 2.0, 0.0])
    with pytest.raises(ValueError, match="mode"):
        bounds.apply_mode(w, "icepop", 0.5, 2.0)


def test_rejection_keep_inclusive():
    np.testing.assert_array_equal(
        rejection.rejection_keep(jnp.array([0.49, 0.5, 2.0, 2.01]), 0.5, 2.0),
        [False, True, True, False],
    )


def test_veto_is_strict_and_ignores_masked_tokens():
    threshold = 1e-4
    log_t = np.float32(math.log(threshold))
    delta = jnp.array([[0.0, log_t], [0.0, log_t - 1.0], [log_t - 5.0, 0.0]])
    mask = jnp.array([[1.0, 1.0], [1.0, 1.0], [0.0, 1.0]])
    catastrophic, keep = rejection.veto(delta, mask, threshold)
    np.testing.assert_array_equal(catastrophic, [[False, False], [False, True], [False, False]])
    np.testing.assert_array_equal(keep[:, 0], [True, False, True])


def test_finite_sequences():
    logp = jnp.array([[0.0, jnp.nan], [jnp.inf, 0.0], [0.0, 0.0]])
    mask = jnp.array([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    np.testing.assert_array_equal(rejection.finite_sequences(mask, logp)[:, 0], [True, False, True])


def test_batch_normalize_token_and_sequence():
    w = jnp.array([[1.0, 3.0, 100.0], [2.0, 0.0, 0.0]])
    m = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    out, mu = normalize.batch_normalize(w, m, "token")
    assert float(mu) == 2.0
    np.testing.assert_allclose(out[m > 0], [0.5, 1.5, 1.0])
    out, mu = normalize.batch_normalize(w, m, "sequence")
    assert float(mu) == 2.0  # mean of per-sequence means (2 and 2)
    out, mu = normalize.batch_normalize(w, jnp.zeros_like(m), "token")
    assert float(mu) == 1.0 and np.array_equal(out, w)


def test_reductions_sequence_vs_token_and_empty_population():
    x = jnp.array([[1.0, 3.0, jnp.nan], [10.0, jnp.inf, 0.0], [5.0, 5.0, 5.0]])
    m = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    axes = MeshAxes()
    assert float(_reduce.reduce_mean(x, m, "sequence", axes)) == 6.0  # (2 + 10) / 2
    assert float(_reduce.reduce_mean(x, m, "token", axes)) == np.float32(14.0 / 3)
    assert float(_reduce.reduce_mean(x, jnp.zeros_like(m), "token", axes)) == 0.0
    per_seq = jnp.array([[7.0], [jnp.nan], [1.0]])
    m2 = m.at[1].set(0.0)
    assert float(_reduce.reduce_mean(per_seq, m2, "sequence", axes)) == 7.0
    assert float(_reduce.reduce_mean(per_seq, m2, "token", axes)) == 7.0


def test_mean_parts_pool_exactly():
    x = jnp.arange(12.0).reshape(4, 3)
    m = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], jnp.float32)
    for reduction in ("sequence", "token"):
        whole = _reduce.mean_parts(x, m, reduction, MeshAxes())
        halves = _reduce.mean_parts(x[:2], m[:2], reduction, MeshAxes()) + _reduce.mean_parts(
            x[2:], m[2:], reduction, MeshAxes()
        )
        assert float(halves.value()) == float(whole.value())
    assert float(MeanParts(jnp.float32(3.0), jnp.float32(0.0)).value()) == 0.0


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
