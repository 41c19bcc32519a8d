"""``_reduce.Rows.reduce``: the per-sequence reductions against NumPy.

Every reduction of the library goes through ``Rows.reduce``; reducing many columns
together must give the same numbers, gradients and NaN-safety as reducing each
column on its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest

import offpolicy_jax as opj
from offpolicy_jax import reduction as _reduce
from offpolicy_jax.reduction import MeshAxes

OPS = ("sum", "min", "max")


def _inputs(rng, shape, n):
    population = np.where(rng.random(shape) < 0.7, rng.choice([1.0, 0.5, 2.0], shape), 0.0)
    values = rng.normal(size=(n, *shape))
    values[:, population == 0] = np.nan  # garbage outside the population never leaks
    return values.astype(np.float32), population.astype(np.float32)


def _reduced(values, population):
    columns = {
        f"c{i}": _reduce.Column(OPS[i % 3], values[i], population) for i in range(len(values))
    }
    return _reduce.Rows(MeshAxes()).reduce(columns)


def _expected(op, value, population):
    inside = population > 0
    if op == "sum":
        return np.where(inside, value * population, 0.0).sum(-1)
    fill = np.inf if op == "min" else -np.inf
    x = np.where(inside, value, fill)
    return x.min(-1, initial=fill) if op == "min" else x.max(-1, initial=fill)


# Rows of 0 to 1031 tokens, lengths that no power of two divides among them.
@pytest.mark.parametrize(
    "shape", [(6, 64), (2, 3, 40), (5, 13), (4, 4), (3, 0), (64, 256), (64, 257), (16, 1031)]
)
@pytest.mark.parametrize("n", [1, 3, 8, 20])
def test_matches_plain_reductions(shape, n):
    rng = np.random.default_rng(n * 100 + shape[-1])
    values, population = _inputs(rng, shape, n)
    got = jax.jit(_reduced)(values, population)
    for i in range(n):
        want = _expected(OPS[i % 3], values[i], population)
        assert got[f"c{i}"].shape == shape[:-1]
        np.testing.assert_allclose(got[f"c{i}"], want, rtol=1e-5, atol=1e-5, err_msg=f"c{i}")


def test_broadcast_values_and_counts():
    population = jnp.asarray([[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    per_seq = jnp.asarray([[2.0], [3.0]])
    got = _reduce.Rows().reduce(
        {
            "n": _reduce.count(population),
            "hits": _reduce.count_where(jnp.arange(4) >= 2, population),
            "per_seq": _reduce.total(per_seq, population),
            "scalar": _reduce.total(1.5, population),
        },
    )
    np.testing.assert_array_equal(got["n"], [3.0, 0.0])
    np.testing.assert_array_equal(got["hits"], [1.0, 0.0])
    np.testing.assert_array_equal(got["per_seq"], [6.0, 0.0])
    np.testing.assert_array_equal(got["scalar"], [4.5, 0.0])


@pytest.mark.heavy
def test_gradient_matches_plain_sums():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 32)), jnp.float32)
    population = jnp.asarray(rng.random((4, 32)) < 0.6, jnp.float32)
    scale = jnp.arange(1.0, 5.0)

    def fused(x):
        sums = _reduce.Rows().reduce(
            {
                "a": _reduce.total(jnp.sin(x), population),
                "b": _reduce.total(x * x, population),
                "m": _reduce.maximum(x, population),
            },
        )
        return jnp.sum(scale * sums["a"] + sums["b"] ** 2 + sums["m"])

    def plain(x):
        a = jnp.sum(jnp.sin(x) * population, -1)
        b = jnp.sum(x * x * population, -1)
        m = jnp.max(jnp.where(population > 0, x, -jnp.inf), -1)
        return jnp.sum(scale * a + b**2 + m)

    np.testing.assert_allclose(jax.grad(fused)(x), jax.grad(plain)(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        jax.jit(jax.grad(fused))(x), jax.grad(plain)(x), rtol=1e-5, atol=1e-6
    )


def test_vmap():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(3, 5, 24)), jnp.float32)
    population = jnp.ones((3, 5, 24), jnp.float32)

    def sums(x, p):
        out = _reduce.Rows().reduce(
            {"s": _reduce.total(x, p), "n": _reduce.count(p), "lo": _reduce.minimum(x, p)},
        )
        return out["s"], out["n"], out["lo"]

    batched = jax.vmap(sums)(x, population)
    direct = sums(x, population)
    for b, d in zip(batched, direct, strict=True):
        np.testing.assert_allclose(b, d, rtol=1e-6)


def _ragged(rng, batch, length):
    lengths = rng.integers(1, length + 1, batch)
    lengths[:2] = (0, length)  # an empty and a full sequence
    mask = np.arange(length)[None, :] < lengths[:, None]
    old = -rng.exponential(1.0, (batch, length))
    rollout = old + rng.normal(0.0, 0.3, (batch, length))
    rollout[2, 3] = old[2, 3] + 12.0  # a catastrophic token: vetoes sequence 2
    rollout[3, 0] = np.nan  # a non-finite valid token: rejects sequence 3
    logp = old + rng.normal(0.0, 0.1, (batch, length))
    adv = rng.normal(size=(batch, length))
    garbage = ~mask
    for x in (old, rollout, logp, adv):
        x[garbage] = rng.choice([np.nan, np.inf, -np.inf, 1e30], garbage.sum())
    f32 = np.float32
    return logp.astype(f32), old.astype(f32), rollout.astype(f32), adv.astype(f32), mask


@pytest.mark.heavy
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_fast_path_policy_loss_matches_numpy_reference(level):
    """A batch of 64 x 256 tokens with every kind of garbage, against the NumPy oracle."""
    rng = np.random.default_rng(7)
    logp, old, rollout, adv, mask = _ragged(rng, 64, 256)
    correction = opj.CorrectionConfig(
        use_tis=True,
        tis_level=level,
        tis_mode="truncate",
        tis_lower_bound=0.5,
        tis_upper_bound=2.0,
        tis_batch_normalize=True,
        use_rs=True,
        rs_level="token",
        rs_veto_threshold=1e-4,
    )
    config = opj.LossConfig(
        algorithm="decoupled_ppo", correction=correction, get_mismatch_metrics=True
    )

    def loss(lp):
        return opj.policy_loss(lp, old, rollout, adv, mask, config)

    (value, metrics), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(logp)
    want_value, want_grad, want_metrics = ref.policy_loss(
        logp,
        old,
        rollout,
        adv,
        mask,
        algorithm="decoupled_ppo",
        correction=correction.to_dict(),
        get_mismatch_metrics=True,
    )
    np.testing.assert_allclose(value, want_value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)
    assert set(want_metrics) <= set(metrics)
    for key, want in want_metrics.items():
        np.testing.assert_allclose(metrics[key], want, rtol=1e-4, atol=1e-5, err_msg=key)


@pytest.mark.heavy
def test_custom_derivatives_keep_forward_mode_and_second_order():
    """Rows.reduce and the PPO surrogate define their derivatives; jvp, grad and HVP agree."""
    rng = np.random.default_rng(3)
    logp, old, rollout, adv, mask = _ragged(rng, 8, 64)
    config = opj.LossConfig(
        algorithm="decoupled_ppo",
        correction=opj.CorrectionConfig(
            use_tis=True, use_rs=True, rs_veto_threshold=1e-4, tis_batch_normalize=True
        ),
    )

    def loss(lp):
        return opj.policy_loss(lp, old, rollout, adv, mask, config)[0]

    direction = jnp.asarray(rng.normal(size=logp.shape), jnp.float32)
    # Each transform compiled whole: eager dispatch would compile every primitive of the
    # pipeline on its own (seconds), and the rules under test are the same under jit.
    grad = jax.jit(jax.grad(loss))(logp)
    _, forward = jax.jit(lambda x, v: jax.jvp(loss, (x,), (v,)))(logp, direction)
    np.testing.assert_allclose(forward, jnp.vdot(grad, direction), rtol=1e-4, atol=1e-6)
    hvp = jax.jit(lambda x, v: jax.jvp(jax.grad(loss), (x,), (v,))[1])(logp, direction)
    assert hvp.shape == logp.shape and bool(jnp.all(jnp.isfinite(hvp)))


@pytest.mark.heavy
@pytest.mark.parametrize("packed", [False, True])
def test_a_column_asked_again_is_reduced_once(monkeypatch, packed):
    """A layout reduces each distinct column (same op, same arrays) once per call: the
    loss asks again for the counts the correction's passes took."""

    rng = np.random.default_rng(4)
    values, population = _inputs(rng, (4, 64), 2)
    ids = jnp.asarray(np.repeat(np.array([[1, 2]], np.int32), 32, axis=-1).repeat(4, 0))

    def new_layout():
        return _reduce.Packed(MeshAxes(), ids, 2) if packed else _reduce.Rows(MeshAxes())

    layout = new_layout()
    asked = []
    plain = type(layout).reduce_columns

    def recording(self, columns):
        asked.append(sorted(columns))
        return plain(self, columns)

    x, p = jnp.asarray(values[0]), jnp.asarray(population)
    with monkeypatch.context() as patch:
        patch.setattr(type(layout), "reduce_columns", recording)
        first = layout.reduce({"n": _reduce.count(p), "s": _reduce.total(x, p)})
        again = layout.reduce(
            {"count": _reduce.count(p), "sum": _reduce.total(x, p), "max": _reduce.maximum(x, p)}
        )
        assert asked == [["n", "s"], ["max"]]
        assert again["count"] is first["n"] and again["sum"] is first["s"]
        # another array, even of equal values, is another column; so is another layout
        layout.reduce({"copy": _reduce.total(x + 0.0, p), "scaled": _reduce.count(p * 1)})
        assert asked[-1] == ["copy", "scaled"]
        new_layout().reduce({"n": _reduce.count(p)})
        assert asked[-1] == ["n"]
    alone = new_layout().reduce({"max": _reduce.maximum(x, p), "n": _reduce.count(p)})
    np.testing.assert_array_equal(again["max"], alone["max"])
    np.testing.assert_array_equal(again["count"], alone["n"])


def _concatenate_sizes(jaxpr) -> list[int]:
    """The operand counts of every ``concatenate`` / ``stack`` in ``jaxpr`` and its sub-jaxprs."""
    sizes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("concatenate", "stack"):
            sizes.append(len(eqn.invars))
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr
                if hasattr(inner, "eqns"):
                    sizes += _concatenate_sizes(inner)
    return sizes


def test_at_most_eight_columns_are_stacked_together():
    """XLA:CPU fuses a concatenate of at most 8 operands into the kernel that makes them
    (a 9th leaves each operand a kernel and the stack a copy): many columns of one kind
    are stacked eight or fewer at a time, each result still its own column's."""
    rng = np.random.default_rng(7)
    values, population = _inputs(rng, (4, 32), 20)  # 7 sums, 13 minima and maxima
    sizes = _concatenate_sizes(jax.make_jaxpr(_reduced)(values, population).jaxpr)
    assert sizes and max(sizes) <= 8, sizes
    got = jax.jit(_reduced)(values, population)
    for i in range(20):
        want = _expected(OPS[i % 3], values[i], population)
        np.testing.assert_allclose(got[f"c{i}"], want, rtol=1e-5, atol=1e-5, err_msg=f"c{i}")
