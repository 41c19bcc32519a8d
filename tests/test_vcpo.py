"""VCPO's pure parts (offpolicy_jax/_src/vcpo.py) against independent NumPy references.

The ESS learning-rate factor (a port of the authors' ``_optimizer_step_with_buffer``),
the per-sequence ESS and the off-policy optimal baseline (a float64 port of their
``compute_opob_baseline``): ragged groups, NaN / inf garbage outside ``where``,
non-finite entries inside it, magnitudes that overflow a naive float32 evaluation,
jit == eager, and the sharded forms against the unsharded ones. The optax transform
is tested in tests/test_optax.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import strategies
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from jax.sharding import PartitionSpec as P

import offpolicy_jax as opj

# ----------------------------------------------------------------------- references


def lr_scale_reference(ess: float, base: float, rule: str) -> np.float32:
    """The authors' factor: ``min(1, ess / max(base, 1e-8))``, then ``** 0.5`` for sqrt;
    plus this library's documented rule that a non-finite or non-positive ESS is 0."""
    ess32 = np.float32(ess)
    ratio = ess32 / np.maximum(np.float32(base), np.float32(1e-8))
    if not (np.isfinite(ratio) and ratio > 0):
        return np.float32(0.0)
    scale = np.minimum(ratio, np.float32(1.0))
    return np.sqrt(scale) if rule == "sqrt" else scale


def ess_reference(log_w: np.ndarray, where: np.ndarray) -> float:
    """``(Σ w)² / (n Σ w²)`` in float64 over the counted sequences (in ``where``, log-weight
    not NaN or +inf; −inf is a weight 0); 0 without a counted non-zero weight."""
    log_w = np.asarray(log_w, np.float64)
    counted = where & ~np.isnan(log_w) & (log_w < np.inf)
    if not counted.any() or np.all(log_w[counted] == -np.inf):
        return 0.0
    x = log_w[counted]
    w = np.exp(x - x.max())  # float64 exp of the raw weights would overflow at e^710
    return float(w.sum() ** 2 / (counted.sum() * (w * w).sum()))


def opob_reference(r, g2, log_w, where, *, norm_by_std=False):
    """Per group (rows): ``b = Σ W R / Σ W``, ``W = w² ‖g‖²`` (float64, exact formula,
    0 when Σ W = 0), and ``A = (R − b) / σ`` (σ the population std, only if > 1e-8)."""
    r, g2 = np.asarray(r, np.float64), np.asarray(g2, np.float64)
    log_w = np.zeros_like(r) if log_w is None else np.asarray(log_w, np.float64)
    baselines, advantages = np.zeros(r.shape[0]), np.zeros_like(r)
    for i in range(r.shape[0]):
        ok = where[i] & np.isfinite(r[i]) & np.isfinite(g2[i]) & (g2[i] >= 0)
        ok &= ~np.isnan(log_w[i]) & (log_w[i] < np.inf)
        if not ok.any():
            continue
        # W = w² g² can overflow even float64 (w = e^400), so in log space.
        log_big = np.full(r.shape[1], -np.inf)
        with np.errstate(divide="ignore"):
            log_big[ok] = np.log(g2[i][ok]) + 2 * log_w[i][ok]
        if np.isfinite(log_big.max()):
            big = np.exp(log_big - log_big.max())
            baselines[i] = (big[ok] * r[i][ok]).sum() / big[ok].sum()
        a = r[i][ok] - baselines[i]
        if norm_by_std:
            std = r[i][ok].std()
            if std > 1e-8:
                a = a / std
        advantages[i][ok] = a
    return baselines, advantages


def authors_opob(rewards, grad_norms, seq_is, eps=1e-8) -> float:
    """A transcription of compute_opob_baseline + get_weighted_mean (mit-han-lab/vcpo
    c7f030f, recipe/fully_async_policy/staleness_utils.py), agg_mode="mean"."""
    numer = denom = 0.0
    for value, norm, ratio in zip(rewards, grad_norms, seq_is, strict=True):
        weight = norm**2 * ratio**2
        numer += float(value) * weight
        denom += weight
    return numer / (denom + eps)


# ----------------------------------------------------------------------- ESS factor

ESS_VALUES = (0.0, 1e-30, 0.01, 0.25, 0.5, 0.999, 1.0, 1.0000001, 3.0, -0.5)
ESS_VALUES += (math.nan, math.inf, -math.inf)


@pytest.mark.parametrize("rule", ["sqrt", "linear"])
@pytest.mark.parametrize("base", [1.0, 0.5, 2.0, 1e-9])
def test_ess_learning_rate_scale_matches_the_authors_rule(rule, base):
    fn = jax.jit(
        functools.partial(opj.ess_learning_rate_scale, base_ess_ratio=base, scaling_rule=rule)
    )
    ess = jnp.asarray(ESS_VALUES, jnp.float32)
    got = np.asarray(fn(ess))
    want = np.array([lr_scale_reference(e, base, rule) for e in ESS_VALUES], np.float32)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(
        np.asarray(opj.ess_learning_rate_scale(ess, base_ess_ratio=base, scaling_rule=rule)), got
    )
    assert np.all((got >= 0) & (got <= 1))


def test_ess_learning_rate_scale_edge_values():
    assert float(opj.ess_learning_rate_scale(0.0)) == 0.0  # empty / fully rejected batch
    assert float(opj.ess_learning_rate_scale(math.nan)) == 0.0
    assert float(opj.ess_learning_rate_scale(1.0)) == 1.0
    assert float(opj.ess_learning_rate_scale(0.81)) == np.sqrt(np.float32(0.81))
    # A traced base (optax.inject_hyperparams) is floored like the authors' max(·, 1e-8).
    traced = jax.jit(lambda b: opj.ess_learning_rate_scale(0.5, base_ess_ratio=b))
    assert float(traced(jnp.float32(0.0))) == 1.0
    assert float(traced(jnp.float32(math.nan))) == 0.0
    grad = jax.grad(lambda e: opj.ess_learning_rate_scale(e))(0.3)
    assert float(grad) == 0.0  # a statistic: no gradient


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scaling_rule": "cubic"}, "scaling_rule"),
        ({"base_ess_ratio": 0.0}, "base_ess_ratio"),
        ({"base_ess_ratio": -1.0}, "base_ess_ratio"),
        ({"base_ess_ratio": math.nan}, "base_ess_ratio"),
        ({"base_ess_ratio": math.inf}, "base_ess_ratio"),
        ({"base_ess_ratio": 1e-40}, "base_ess_ratio"),  # a float32 subnormal
        ({"base_ess_ratio": "1.0"}, "base_ess_ratio"),
        ({"base_ess_ratio": True}, "base_ess_ratio"),
    ],
)
def test_ess_learning_rate_scale_rejects_bad_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        opj.ess_learning_rate_scale(0.5, **kwargs)


@pytest.mark.heavy
def test_the_factor_of_pooled_mis_ess_parts_is_the_full_batch_factor():
    """Micro-batches: the summed ``mis_ess`` parts give the full batch's ESS, exactly."""
    rng = np.random.default_rng(3)
    old = rng.normal(-1.0, 0.5, (6, 9)).astype(np.float32)
    rollout = (old + rng.normal(0, 0.4, old.shape)).astype(np.float32)
    mask = np.arange(9)[None] < np.array([[9], [4], [0], [7], [1], [9]])
    adv = rng.normal(size=6).astype(np.float32)
    config = opj.LossConfig(
        algorithm="decoupled_ppo", correction=opj.CorrectionConfig.preset("mis")
    )
    # Each micro-batch's own correction: its ESS sums do not depend on the batch
    # normaliser, so they pool to the full batch's. Equal halves: one compilation.
    parts_fn = jax.jit(lambda *arrays: opj.policy_loss_parts(*arrays, config)[1]["mis_ess"])
    parts = None
    for rows in (slice(0, 3), slice(3, 6)):
        half = parts_fn(old[rows], old[rows], rollout[rows], adv[rows], mask[rows])
        parts = half if parts is None else parts + half
    _, full = opj.policy_loss(old, old, rollout, adv, mask, config)
    assert isinstance(parts, opj.MeanParts)
    np.testing.assert_allclose(parts.value(), full["mis_ess"], rtol=1e-6)
    np.testing.assert_allclose(
        opj.ess_learning_rate_scale(parts), opj.ess_learning_rate_scale(full["mis_ess"]), rtol=1e-6
    )


# ----------------------------------------------------------------------- sequence ESS


def test_sequence_ess_matches_numpy_on_ragged_garbage_padded_batches():
    rng = np.random.default_rng(0)
    log_w = rng.normal(0, 1.5, (4, 6)).astype(np.float32)
    where = rng.random((4, 6)) > 0.3
    junk = rng.choice(strategies.GARBAGE, size=log_w.shape).astype(np.float32)
    padded = np.where(where, log_w, junk)
    padded[0, 0], where[0, 0] = np.nan, True  # a non-finite value inside `where`: not counted
    got = jax.jit(lambda x, m: opj.sequence_ess(x, where=m))(padded, where)
    np.testing.assert_allclose(got, ess_reference(padded, where), rtol=2e-6)
    assert float(opj.sequence_ess(padded, where=where)) == float(got)


@pytest.mark.parametrize(
    ("log_w", "want"),
    [
        ([0.0, 0.0, 0.0], 1.0),  # on-policy: every weight 1
        ([5.0], 1.0),  # one sequence
        ([100.0, 0.0, 0.0, 0.0], 0.25),  # e^100 overflows float32; one weight dominates
        ([-100.0, -100.0], 1.0),  # e^-100 underflows float32
        ([88.0, 88.0, -88.0, -88.0], 0.5),
        ([], 0.0),  # an empty batch
        ([np.nan, np.inf], 0.0),  # NaN, +inf: not counted
        ([0.0, -np.inf], 0.5),  # a weight of 0 counts: (1)² / (2 · 1)
        ([-np.inf, -np.inf], 0.0),  # only zero weights
    ],
)
def test_sequence_ess_edge_cases(log_w, want):
    got = float(opj.sequence_ess(jnp.asarray(log_w, jnp.float32).reshape(-1)))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)
    assert math.isfinite(got)


def test_sequence_ess_is_mis_ess_for_sequence_weights_of_equal_lengths():
    """The docs' claim: with untruncated sequence-level weights, no rejection and
    equal lengths, the library's token-weighted ``mis_ess`` is the paper's ``ρ_ess``."""
    rng = np.random.default_rng(1)
    old = rng.normal(-1.0, 0.3, (5, 7)).astype(np.float32)
    rollout = (old + rng.normal(0, 0.2, old.shape)).astype(np.float32)
    mask = np.ones(old.shape, bool)
    correction = opj.CorrectionConfig(use_tis=True, tis_level="sequence", tis_upper_bound=1e6)
    result = opj.compute_correction(old, rollout, mask, correction)
    seq_log_w = np.sum(np.where(mask, old - rollout, 0.0), axis=-1)
    np.testing.assert_allclose(opj.sequence_ess(seq_log_w), result.metrics["mis_ess"], rtol=2e-6)


@settings(max_examples=strategies.examples(20))
@given(
    hnp.arrays(np.int16, (3, 5), elements=st.integers(-320, 320)),
    hnp.arrays(np.bool_, (3, 5)),
    strategies.garbage((3, 5)),
)
def test_sequence_ess_ignores_padding_and_lies_in_0_1(sixteenths, where, junk):
    log_w = (sixteenths / 16.0).astype(np.float32)
    got = float(opj.sequence_ess(np.where(where, log_w, junk), where=where))
    assert 0.0 <= got <= 1.0 + 1e-6
    assert got == float(opj.sequence_ess(np.where(where, log_w, 0.0), where=where))
    np.testing.assert_allclose(got, ess_reference(log_w, where), rtol=5e-6)


# ----------------------------------------------------------------------- OPOB


def _groups(seed: int = 0, groups: int = 5, size: int = 6):
    """Ragged groups (an empty one, a one-response one), garbage outside ``where``."""
    rng = np.random.default_rng(seed)
    shape = (groups, size)
    rewards = rng.integers(0, 2, shape).astype(np.float32)  # 0/1 verifiable rewards
    rewards[:, 0] += rng.normal(0, 0.3, groups).astype(np.float32)
    g2 = rng.lognormal(2.0, 1.0, shape).astype(np.float32)
    log_w = rng.normal(0.0, 0.8, shape).astype(np.float32)
    where = np.arange(size)[None] < np.array([[6], [3], [0], [1], [5]])[:groups]
    junk = rng.choice(strategies.GARBAGE, size=shape).astype(np.float32)
    return {
        "returns": np.where(where, rewards, junk),
        "grad_sq_norms": np.where(where, g2, np.roll(junk, 1)),
        "log_weights": np.where(where, log_w, np.roll(junk, 2)),
        "where": where,
    }


@pytest.mark.parametrize("use_weights", [True, False])
@pytest.mark.parametrize("norm_by_std", [False, True])
def test_opob_matches_numpy_on_ragged_garbage_padded_groups(use_weights, norm_by_std):
    d = _groups()
    log_w = d["log_weights"] if use_weights else None
    want_b, want_a = opob_reference(
        d["returns"], d["grad_sq_norms"], log_w, d["where"], norm_by_std=norm_by_std
    )
    kwargs = dict(log_weights=log_w, where=d["where"])
    baseline = jax.jit(functools.partial(opj.opob_baseline, **kwargs))
    advantages = jax.jit(functools.partial(opj.opob_advantages, norm_by_std=norm_by_std, **kwargs))
    b = baseline(d["returns"], d["grad_sq_norms"])
    a = advantages(d["returns"], d["grad_sq_norms"])
    np.testing.assert_allclose(b, want_b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(a, want_a, rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(a)[~d["where"]] == 0)
    eager = opj.opob_advantages(d["returns"], d["grad_sq_norms"], norm_by_std=norm_by_std, **kwargs)
    np.testing.assert_array_equal(eager, a)


def test_opob_agrees_with_the_authors_weighted_mean():
    d = _groups(seed=4, groups=1)
    r, g2, log_w = (d[k][0] for k in ("returns", "grad_sq_norms", "log_weights"))
    want = authors_opob(r, np.sqrt(g2.astype(np.float64)), np.exp(log_w.astype(np.float64)))
    np.testing.assert_allclose(opj.opob_baseline(r, g2, log_weights=log_w), want, rtol=1e-6)


INF = math.inf


@pytest.mark.parametrize(
    ("returns", "g2", "log_w", "want"),
    [
        ([1.0, 0.0], [3.0, 1.0], None, 0.75),
        ([1.0, 0.0], [0.0, 0.0], None, 0.0),  # no weight at all: 0, not NaN
        ([1.0, 0.0], [1e30, 1e30], [46.0, 46.0], 0.5),  # W = e^92 · 1e30 overflows float32
        # Equal W = e^23 from opposite extremes (e^92 alone overflows float32).
        ([1.0, 0.0], [math.exp(-69.0), math.exp(69.0)], [46.0, -23.0], 0.5),
        ([1.0, 0.0], [1e-30, 1e-30], [-23.0, -23.0], 0.5),  # W underflows float32
        ([1.0, 0.0, 3.0], [1.0, 1.0, 1.0], [200.0, -50.0, 0.0], 1.0),  # one W dominates
        ([1.0, 0.0, 5.0], [1.0, 1.0, np.nan], None, 0.5),  # a NaN norm: not counted
        ([1.0, 0.0, 5.0], [1.0, 1.0, -1.0], None, 0.5),  # a negative squared norm
        ([1.0, 0.0, 5.0], [1.0, 1.0, 1.0], [0.0, 0.0, np.nan], 0.5),  # a NaN log-weight
        ([1.0, 0.0, 5.0], [1.0, 1.0, 1.0], [0.0, 0.0, INF], 0.5),  # an infinite weight
        ([1.0, 0.0, 5.0], [1.0, 1.0, 1.0], [0.0, 0.0, -INF], 0.5),  # weight 0
        ([2.0, 7.0], [4.0, 9.0], [-INF, -INF], 0.0),  # every weight 0
    ],
)
def test_opob_baseline_edge_cases(returns, g2, log_w, want):
    got = opj.opob_baseline(
        jnp.asarray(returns, jnp.float32),
        jnp.asarray(g2, jnp.float32),
        log_weights=None if log_w is None else jnp.asarray(log_w, jnp.float32),
    )
    np.testing.assert_allclose(got, want, rtol=2e-6)
    assert np.isfinite(got)


def test_opob_is_invariant_to_the_scale_of_the_weights_and_norms():
    d = _groups(seed=2)
    args = (d["returns"], d["grad_sq_norms"])
    base = opj.opob_baseline(*args, log_weights=d["log_weights"], where=d["where"])
    scaled = opj.opob_baseline(
        d["returns"], d["grad_sq_norms"] * 1e6, log_weights=d["log_weights"] - 7, where=d["where"]
    )
    np.testing.assert_allclose(scaled, base, rtol=2e-6)


def test_opob_std_normalisation_skips_constant_groups():
    r = jnp.array([[1.0, 1.0, 1.0], [0.0, 1.0, 2.0]])
    a = opj.opob_advantages(r, jnp.ones(3), norm_by_std=True)
    np.testing.assert_allclose(a[0], 0.0)  # σ = 0: (R − b) = 0, no division
    np.testing.assert_allclose(a[1], np.array([-1.0, 0.0, 1.0]) / np.std([0.0, 1.0, 2.0]))


def test_opob_has_no_gradient_and_rejects_scalars():
    d = _groups(seed=5)
    grad = jax.grad(
        lambda r: jnp.sum(opj.opob_advantages(r, d["grad_sq_norms"], where=d["where"]))
    )(d["returns"])
    assert np.all(np.asarray(grad) == 0)
    with pytest.raises(ValueError, match="at least one axis"):
        opj.opob_baseline(1.0, 2.0)
    with pytest.raises(ValueError, match="do not broadcast"):
        opj.opob_baseline(jnp.ones(3), jnp.ones(4))


@settings(max_examples=strategies.examples(20))
@given(
    hnp.arrays(np.int16, (2, 4), elements=st.integers(-32, 32)),
    hnp.arrays(np.int16, (2, 4), elements=st.integers(0, 64)),
    hnp.arrays(np.int16, (2, 4), elements=st.integers(-48, 48)),
    hnp.arrays(np.bool_, (2, 4)),
    strategies.garbage((2, 4)),
    st.booleans(),
)
def test_opob_ignores_padding(r16, g16, logw16, where, junk, norm_by_std):
    r, g2, log_w = r16 / 16.0, g16 / 16.0, logw16 / 16.0
    clean = opj.opob_advantages(r, g2, log_weights=log_w, where=where, norm_by_std=norm_by_std)
    dirty = opj.opob_advantages(
        np.where(where, r, junk),
        np.where(where, g2, junk),
        log_weights=np.where(where, log_w, junk),
        where=where,
        norm_by_std=norm_by_std,
    )
    np.testing.assert_array_equal(dirty, clean)
    _, want = opob_reference(r, g2, log_w, where, norm_by_std=norm_by_std)
    np.testing.assert_allclose(clean, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------- sharded


def _data_mesh():
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (the full suite runs on 8 CPU devices)")
    return jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


@pytest.mark.multi_device
@pytest.mark.slow
@pytest.mark.parametrize("axes", ["data", opj.MeshAxes(batch="data")])
def test_sharded_ess_and_minibatch_opob_match_unsharded(axes):
    """``scope: minibatch``: the batch is one group split over data-parallel devices."""
    mesh = _data_mesh()
    d = _groups(seed=7, groups=4, size=4)  # 16 sequences, some padding, 4 per device
    flat = {k: v.reshape(-1) for k, v in d.items()}

    def stats(r, g2, log_w, where, axis_names=None):
        kwargs = dict(log_weights=log_w, where=where, axis_names=axis_names)
        return (
            opj.opob_baseline(r, g2, **kwargs),
            opj.opob_advantages(r, g2, norm_by_std=True, **kwargs),
            opj.sequence_ess(log_w, where=where, axis_names=axis_names),
        )

    args = (flat["returns"], flat["grad_sq_norms"], flat["log_weights"], flat["where"])
    want = jax.jit(stats)(*args)
    with jax.set_mesh(mesh):
        sharded = jax.jit(
            jax.shard_map(
                functools.partial(stats, axis_names=axes),
                mesh=mesh,
                in_specs=(P("data"),) * 4,
                out_specs=(P(), P("data"), P()),
            )
        )
        got = sharded(*(jax.device_put(a, jax.NamedSharding(mesh, P("data"))) for a in args))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)
