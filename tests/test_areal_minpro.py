"""AReaL's rejection grid (``CorrectionConfig.rejection_sampling``) and MinPRO's level
(``tis_level`` / ``rs_level`` ``"minpro"``) against the independent NumPy reference
(numpy_reference_rules.areal_rejection / minpro_log_ratio, written from AReaL's
``apply_rejection_sampling`` and the paper's ``min_{i<t} ρ_i · ρ_t``): the whole grid,
values at the bounds, ragged lengths, NaN/inf padding, packed rows, jit == eager,
pooled micro-batches == the full batch, and the loss MinPRO's paper writes."""

from __future__ import annotations

import functools
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import numpy_reference_rules as rules_ref
import packing_cases as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from strategies import examples, ragged_batches

import offpolicy_jax as opj
from offpolicy_jax import reduction as _reduce
from offpolicy_jax._src.correction.stages import pool
from offpolicy_jax._src.reduction import scan

correct = jax.jit(opj.compute_correction, static_argnames=("config", "reduction"))

# Bounds per metric: one-sided and two-sided, each attained exactly by some token of
# the batches below (log-ratios are multiples of 1/16): ratio 1 = e^0, k1 ±4/16,
# k2 ½(8/16)² = 1/8.
BOUNDS = {
    "ratio": ((None, 2.0), (1.0, 1.5)),
    "kl_k1": ((None, 0.25), (-0.25, 0.25)),
    "kl_k2": ((None, 0.125), (0.0078125, 0.125)),
    "kl_k3": ((None, 0.05), (0.001, 0.05)),
}


def _grid() -> dict[str, dict]:
    """Every cell of AReaL's grid: level x action x metric x agg x (one-, two-sided)."""
    out = {}
    for level, action, metric, agg in itertools.product(
        ("token", "sequence"), ("mask", "clamp"), tuple(BOUNDS), ("sum", "mean", "max")
    ):
        if (action == "clamp" and metric != "ratio") or (level == "token" and agg != "mean"):
            continue
        for lower, upper in BOUNDS[metric]:
            sided = "one" if lower is None else "two"
            name = f"{level}/{action}/{metric}/{agg}/{sided}"
            out[name] = dict(
                level=level, action=action, metric=metric, agg=agg, lower=lower, upper=upper
            )
    return out


GRID = _grid()
FAST_GRID = (
    "token/mask/ratio/mean/two",
    "token/clamp/ratio/mean/one",
    "sequence/clamp/ratio/sum/two",
    "sequence/mask/kl_k3/max/one",
)

MINPRO = {
    f"minpro/{mode}/rs={rs}": opj.CorrectionConfig(
        use_tis=True,
        tis_level="minpro",
        tis_mode=mode,
        tis_lower_bound=0.6,
        tis_upper_bound=1.7,
        tis_batch_normalize=mode == "band",  # a batch statistic: not in the pooling test
        use_rs=rs is not None,
        rs_level=rs or "token",
        rs_lower_bound=0.3,
        rs_upper_bound=3.0,
    )
    for mode, rs in itertools.product(
        ("truncate", "clip", "mask", "band", "none"), (None, "minpro", "geometric")
    )
}
MINPRO["token_tis/rs=minpro_veto"] = opj.CorrectionConfig(
    use_tis=True, use_rs=True, rs_level="minpro", rs_veto_threshold=1e-3
)


def areal(name: str, **extra) -> opj.CorrectionConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # agg at the token level (AReaL warns)
        return opj.CorrectionConfig(
            use_tis=True, tis_mode="none", rejection_sampling=GRID[name], **extra
        )


def fixed_batch(seed: int = 3):
    """Ragged rows (an empty and a one-token one), a hole, spikes past ±20 (the clamp),
    a sequence whose ``exp(Σ δ)`` overflows float32, garbage where masked."""
    rng = np.random.default_rng(seed)
    lengths = np.array([11, 0, 1, 7, 4, 11])
    mask = np.arange(11)[None, :] < lengths[:, None]
    mask[3, 2] = False
    old = (rng.integers(-96, 0, mask.shape) / 16).astype(np.float32)
    delta = (rng.integers(-10, 11, mask.shape) / 16).astype(np.float32)
    # Row 3 sums past 88: exp(Σ δ) is inf in float32 (rejected by every upper bound).
    delta[0, 3], delta[5, 4], delta[3, 5], delta[3, 6] = 25.0, -30.0, 45.0, 45.0
    delta[4, :4] = (0.0, 0.25, -0.25, 0.5)  # exactly on the bounds of BOUNDS
    return {
        "old_logp": np.where(mask, old, np.nan).astype(np.float32),
        "rollout_logp": np.where(mask, old - delta, np.inf).astype(np.float32),
        "mask": mask.astype(np.float32),
    }


def assert_matches_reference(batch, config, reduction, jit=True):
    fn = correct if jit else opj.compute_correction
    res = fn(
        batch["old_logp"], batch["rollout_logp"], batch["mask"], config=config, reduction=reduction
    )
    w, m, metrics = ref.correction(
        batch["old_logp"],
        batch["rollout_logp"],
        batch["mask"],
        reduction=reduction,
        **config.to_dict(),
    )
    np.testing.assert_array_equal(np.asarray(res.mask), m)
    np.testing.assert_allclose(np.asarray(res.weights), w, rtol=1e-5, atol=1e-6)
    assert set(res.metrics) == set(metrics)
    for key, value in metrics.items():
        got = float(res.metrics[key])
        assert np.isfinite(got), key
        np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-5, err_msg=key)


# ----------------------------------------------------------------- the whole grid


@pytest.mark.heavy
@pytest.mark.parametrize(
    "name", [n if n in FAST_GRID else pytest.param(n, marks=pytest.mark.slow) for n in GRID]
)
def test_areal_grid_matches_numpy_reference(name):
    for reduction in ("sequence", "token"):
        assert_matches_reference(fixed_batch(), areal(name), reduction, jit=False)


@pytest.mark.parametrize(
    "name", [n if "clamp" in n else pytest.param(n, marks=pytest.mark.slow) for n in MINPRO]
)
def test_minpro_levels_match_numpy_reference(name):
    for reduction in ("sequence", "token"):
        assert_matches_reference(fixed_batch(), MINPRO[name], reduction, jit=False)


@pytest.mark.slow
@settings(max_examples=examples(30))
@given(
    batch=ragged_batches(),
    name=st.sampled_from(sorted(GRID) + sorted(MINPRO)),
    reduction=st.sampled_from(["sequence", "token"]),
)
def test_grid_and_minpro_match_reference_on_ragged_batches(batch, name, reduction):
    config = areal(name) if name in GRID else MINPRO[name]
    assert_matches_reference(batch, config, reduction)


@pytest.mark.heavy
def test_areal_values_at_the_bounds_are_kept():
    """Bounds are inclusive (AReaL's ``lower <= metric <= upper``), per token and per
    sequence, for every metric; one ulp beyond a bound is rejected."""
    o = np.zeros((1, 4), np.float32)
    d = np.array([[0.0, 0.25, -0.25, 0.5]], np.float32)
    m = np.ones((1, 4), np.float32)
    cases = {  # metric, lower, upper -> tokens kept
        ("ratio", 1.0, 1.5): [True, True, False, False],
        ("kl_k1", -0.25, 0.25): [True, True, True, False],
        ("kl_k2", 0.0, 0.125): [True, True, True, True],
        ("kl_k2", 0.0, float(np.nextafter(np.float32(0.125), 0, dtype=np.float32))): [
            True,
            True,
            True,
            False,
        ],
    }
    for (metric, lower, upper), kept in cases.items():
        block = dict(level="token", metric=metric, lower=lower, upper=upper)
        res = opj.compute_correction(o, o - d, m, opj.CorrectionConfig.from_areal(block))
        assert np.asarray(res.mask, bool)[0].tolist() == kept, (metric, lower, upper)
    # Per sequence: Σ δ = 0.5 = upper of kl_k1 (kept), 0.5 + 1/16 is not.
    for extra, kept in ((0.0, True), (0.0625, False)):
        seq = np.array([[0.25, 0.25 + extra, 0.0, 0.0]], np.float32)
        block = dict(level="sequence", metric="kl_k1", agg="sum", upper=0.5)
        res = opj.compute_correction(o, o - seq, m, opj.CorrectionConfig.from_areal(block))
        assert bool(np.asarray(res.mask).all()) == kept


def test_areal_semantics_by_hand():
    """AReaL's own choices, each written out: mask keeps the unbounded ratio; a
    sequence-level ``clamp`` with ``agg: sum`` clamps the geometric-mean weight only where
    the product leaves the bounds; kl_k3 is ``e^{-δ} − 1 + δ``; clamp defaults lower to 0."""
    o = np.zeros((2, 3), np.float32)
    d = np.log(np.array([[3.0, 1.0, 1.0], [1.2, 1.2, 1.2]], np.float32))
    m = np.ones((2, 3), np.float32)
    # token mask, upper 5: the ratio 3 is kept with weight 3 (no truncation).
    res = opj.compute_correction(o, o - d, m, opj.CorrectionConfig.from_areal({"upper": 5.0}))
    np.testing.assert_allclose(np.asarray(res.weights)[0], [3.0, 1.0, 1.0], rtol=1e-6)
    # sequence clamp, sum, upper 1.5: row 0 has product 3 > 1.5 -> its geometric mean
    # 3^(1/3) = 1.442 < 1.5 stays; row 1 has product 1.728 > 1.5 and mean 1.2 stays too.
    block = dict(level="sequence", action="clamp", agg="sum", upper=1.5)
    res = opj.compute_correction(o, o - d, m, opj.CorrectionConfig.from_areal(block))
    np.testing.assert_allclose(np.asarray(res.weights)[:, 0], [3 ** (1 / 3), 1.2], rtol=1e-6)
    assert float(res.metrics["mis_rs_areal_filtered_fraction"]) == 0.0
    assert float(res.metrics["mis_rs_areal_fraction_high"]) == 1.0
    # ... with upper 1.1 both leave: clipped to 1.1.
    block["upper"] = 1.1
    res = opj.compute_correction(o, o - d, m, opj.CorrectionConfig.from_areal(block))
    np.testing.assert_allclose(np.asarray(res.weights), 1.1, rtol=1e-6)
    assert float(res.metrics["mis_rs_areal_filtered_fraction"]) == 1.0
    # kl_k3 of δ = log 3: e^{-δ} − 1 + δ = 1/3 − 1 + log 3 = 0.4319 (verl's k3 would give
    # e^δ − 1 − δ = 0.9014).
    block = dict(metric="kl_k3", upper=0.5)
    res = opj.compute_correction(o, o - d, m, opj.CorrectionConfig.from_areal(block))
    assert float(res.metrics["mis_rs_areal_max"]) == pytest.approx(1 / 3 - 1 + np.log(3), 1e-6)
    assert bool(np.asarray(res.mask).all())
    # token clamp without a lower bound clips at [0, upper]: min(w, U), like truncate.
    block = dict(action="clamp", upper=2.0)
    res = opj.compute_correction(o, o - d, m, opj.CorrectionConfig.from_areal(block))
    np.testing.assert_allclose(np.asarray(res.weights)[0], [2.0, 1.0, 1.0], rtol=1e-6)
    assert float(res.metrics["mis_rs_areal_filtered_fraction"]) == pytest.approx(1 / 6)


def test_areal_everything_rejected_gives_zeros_and_finite_metrics():
    o = jnp.zeros((2, 5))
    config = opj.CorrectionConfig.from_areal({"metric": "kl_k2", "upper": 1e-9})
    res = correct(o, o + 0.5, jnp.ones((2, 5)), config=config)
    assert float(res.mask.sum()) == 0 and float(res.weights.sum()) == 0
    assert all(np.isfinite(float(v)) for v in res.metrics.values())


# ----------------------------------------------------------------------------- MinPRO


def test_minpro_by_hand():
    """``w_t = min_{s<t} ρ_s · ρ_t`` over the earlier *valid* tokens (a hole is skipped,
    the first token has ``ρ̲ = 1``), then bounded like any level."""
    ratios = np.array([[1.0, 3.0, 0.5, 1.0, 2.0], [0.8, 9.0, 1.25, 1.0, 1.0]], np.float32)
    m = np.array([[1, 1, 1, 1, 1], [1, 0, 1, 1, 0]], np.float32)
    o = np.zeros_like(ratios)
    config = opj.CorrectionConfig(use_tis=True, tis_level="minpro", tis_upper_bound=100.0)
    res = opj.compute_correction(o, o - np.log(ratios), m, config)
    want = [[1.0, 3.0, 0.5, 0.5, 1.0], [0.8, 0.0, 1.0, 0.8, 0.0]]
    np.testing.assert_allclose(np.asarray(res.weights), want, rtol=1e-6)
    np.testing.assert_allclose(float(res.metrics["mis_minpro_prefix_ratio_min"]), 0.5, rtol=1e-6)
    # prefix factors of the valid tokens: [1, 1, 1, .5, .5] and [1, .8, .8]
    assert float(res.metrics["mis_minpro_prefix_fraction_low"]) == pytest.approx(
        (2 / 5 + 2 / 3) / 2, rel=1e-6
    )


@pytest.mark.heavy
def test_minpro_reinforce_is_is_the_papers_objective():
    """arXiv:2601.22718: ``J = 1/Σ|o| Σ_t sg[clip(ρ̲_t ρ_t, 1 − ε_l, 1 + ε_h)] Â_t log π_θ``
    with ``ρ_t = π_θ / π_old`` is REINFORCE-IS (weights from ``sg(θ)`` / π_rollout, the
    rollout being π_old) at the minpro level with clip bounds and token_mean: value and
    gradient against the formula written with NumPy."""
    rng = np.random.default_rng(5)
    shape = (4, 9)
    m = (np.arange(9)[None, :] < np.array([9, 3, 1, 6])[:, None]) & (rng.random(shape) > 0.1)
    m[:, 0] = True
    rollout = (rng.integers(-64, 0, shape) / 16).astype(np.float32)
    theta = (rollout + rng.integers(-6, 7, shape) / 16).astype(np.float32)
    adv = (rng.integers(-8, 9, shape) / 8).astype(np.float32)
    eps_low, eps_high = 0.2, 0.28
    config = opj.LossConfig(
        algorithm="reinforce_is",
        correction=opj.CorrectionConfig(
            use_tis=True,
            tis_level="minpro",
            tis_mode="clip",
            tis_lower_bound=1 - eps_low,
            tis_upper_bound=1 + eps_high,
        ),
        aggregation="token_mean",
    )

    def loss(lp):
        return opj.policy_loss(lp, None, rollout, adv, m, config)[0]

    value, grad = jax.value_and_grad(loss)(theta)
    delta = np.where(m, theta.astype(np.float64) - rollout, 0.0)
    w = np.clip(np.exp(rules_ref.minpro_log_ratio(delta, m)), 1 - eps_low, 1 + eps_high)
    n = m.sum()
    np.testing.assert_allclose(float(value), -(w * adv * theta)[m].sum() / n, rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(grad), np.where(m, -w * adv / n, 0.0), rtol=1e-5, atol=1e-7
    )


# ------------------------------------------------------------------------- properties

PROPERTY_CONFIGS = {
    "areal/sequence/mask/kl_k1/sum/two": areal("sequence/mask/kl_k1/sum/two"),
    "areal/sequence/clamp/ratio/max/two": areal("sequence/clamp/ratio/max/two"),
    "areal/token/mask/kl_k3/mean/one": areal("token/mask/kl_k3/mean/one"),
    "minpro/clip/rs=minpro": MINPRO["minpro/clip/rs=minpro"],
    "minpro/mask/rs=geometric": MINPRO["minpro/mask/rs=geometric"],
}


def _clean(batch):
    valid = batch["mask"] > 0
    keys = ("old_logp", "rollout_logp")
    return {**batch, **{k: np.where(valid, batch[k], -1.0).astype(np.float32) for k in keys}}


@pytest.mark.slow
@settings(max_examples=examples(15))
@given(
    batch=ragged_batches(),
    name=st.sampled_from(sorted(PROPERTY_CONFIGS)),
    reduction=st.sampled_from(["sequence", "token"]),
)
def test_garbage_invariance_and_jit_equals_eager(batch, name, reduction):
    config = PROPERTY_CONFIGS[name]
    args = (batch["old_logp"], batch["rollout_logp"], batch["mask"])
    jitted = correct(*args, config=config, reduction=reduction)
    clean = _clean(batch)
    cleaned = correct(
        clean["old_logp"], clean["rollout_logp"], clean["mask"], config=config, reduction=reduction
    )
    eager = opj.compute_correction(*args, config, reduction=reduction)
    for other in (cleaned, eager):
        np.testing.assert_array_equal(np.asarray(jitted.mask), np.asarray(other.mask))
        np.testing.assert_allclose(np.asarray(jitted.weights), np.asarray(other.weights), rtol=1e-6)
        for key in jitted.metrics:
            np.testing.assert_allclose(
                float(jitted.metrics[key]),
                float(other.metrics[key]),
                rtol=1e-6,
                atol=1e-7,
                err_msg=key,
            )


@pytest.mark.parametrize(
    "name",
    [
        n if n == "areal/sequence/clamp/ratio/max/two" else pytest.param(n, marks=pytest.mark.slow)
        for n in sorted(PROPERTY_CONFIGS)
    ],
)
@pytest.mark.heavy
def test_micro_batches_pool_to_the_full_batch(name):
    """Every decision is per token or per sequence: the loss parts and metric parts of
    micro-batches (an empty row and a one-token row included) pool exactly."""
    batch = fixed_batch(7)
    rng = np.random.default_rng(7)
    logp = np.where(
        batch["mask"] > 0, batch["old_logp"] + rng.integers(-4, 5, batch["mask"].shape) / 16, 0.0
    )
    logp = logp.astype(np.float32)
    adv = (rng.integers(-8, 9, batch["mask"].shape) / 8).astype(np.float32)
    config = opj.LossConfig(
        algorithm="decoupled_ppo",
        correction=PROPERTY_CONFIGS[name],
        aggregation="token_mean",
        rejected_in_denominator="areal" in name,
    )
    args = (batch["old_logp"], batch["rollout_logp"], adv, batch["mask"])

    @jax.jit
    def parts(lp, old, rollout, a, mask):
        loss_parts, metrics = opj.policy_loss_parts(lp, old, rollout, a, mask, config)
        return loss_parts, metrics

    full_parts, full_metrics = parts(logp, *args)
    num, den, pooled = 0.0, 0.0, None
    for rows in (slice(0, 1), slice(1, 3), slice(3, 6)):
        p, metrics = parts(logp[rows], *(x[rows] for x in args))
        num, den = num + p.numerator, den + p.denominator
        pooled = metrics if pooled is None else pool(pooled, metrics)
    np.testing.assert_allclose(float(num / den), float(full_parts.value()), rtol=1e-6)
    got, want = opj.finalize_metrics(pooled), opj.finalize_metrics(full_metrics)
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.slow
def test_gradients_finite_and_vmap_equals_loop():
    batch = fixed_batch(9)
    config = opj.LossConfig(
        algorithm="reinforce_is", correction=PROPERTY_CONFIGS["minpro/clip/rs=minpro"]
    )
    adv = np.ones_like(batch["mask"])

    def loss(lp):
        return opj.policy_loss(lp, None, batch["rollout_logp"], adv, batch["mask"], config)[0]

    grad = jax.grad(loss)(np.where(batch["mask"] > 0, batch["old_logp"], 0.0).astype(np.float32))
    assert np.all(np.isfinite(np.asarray(grad)))
    cfg = PROPERTY_CONFIGS["areal/sequence/clamp/ratio/max/two"]
    stacked = {k: np.stack([v, v[::-1]]) for k, v in batch.items()}
    out = jax.vmap(lambda o, b, m: opj.compute_correction(o, b, m, cfg).weights)(
        stacked["old_logp"], stacked["rollout_logp"], stacked["mask"]
    )
    for i in range(2):
        want = opj.compute_correction(
            stacked["old_logp"][i], stacked["rollout_logp"][i], stacked["mask"][i], cfg
        )
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(want.weights), rtol=1e-6)


# ---------------------------------------------------------------------------- packed

K = 4


def _packed_eval(batch, corrections, segments=None):
    packed = {} if segments is None else {"segment_ids": segments, "num_segments": K}
    out = {}
    for name, config in corrections.items():
        for reduction in ("sequence", "token"):
            res = opj.compute_correction(
                batch["old_logp"],
                batch["rollout_logp"],
                batch["mask"],
                config,
                reduction=reduction,
                **packed,
            )
            out[f"{name}/{reduction}"] = dict(w=res.weights, m=res.mask, metrics=res.metrics)
    return out


@functools.cache
def _jitted_eval(corrections, packed):
    """``_packed_eval`` jitted once per (configs, layout), so that seeds of one shape share
    the compiled programs; ``corrections`` is a ``(name, config)`` tuple."""
    corrections = dict(corrections)
    if packed:
        return jax.jit(lambda b, s: _packed_eval(b, corrections, s))
    return jax.jit(lambda b: _packed_eval(b, corrections))


def _assert_packed_equals_one_per_row(batch, corrections):
    flat = pc.unpack(batch, K)
    flat = {k: v for k, v in flat.items() if k in ("old_logp", "rollout_logp", "mask")}
    want = _jitted_eval(tuple(corrections.items()), packed=False)(flat)
    got = _jitted_eval(tuple(corrections.items()), packed=True)(batch, batch["segment_ids"])
    ids = batch["segment_ids"]
    for name, w in want.items():
        g = got[name]
        for key in ("w", "m"):
            np.testing.assert_allclose(
                np.asarray(g[key]),
                pc.repack(np.asarray(w[key]), ids, K),
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"{name} {key}",
            )
            assert np.all(np.asarray(g[key])[ids == 0] == 0), name
        for metric, value in w["metrics"].items():
            np.testing.assert_allclose(
                float(g["metrics"][metric]),
                float(value),
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"{name} {metric}",
            )


PACKED_CONFIGS = {
    "areal_seq_mask_k2_max": areal("sequence/mask/kl_k2/max/two"),
    "areal_seq_clamp_ratio_mean": areal("sequence/clamp/ratio/mean/one"),
    "areal_token_mask_k1": areal("token/mask/kl_k1/mean/two"),
    "minpro_truncate_rs_minpro": MINPRO["minpro/truncate/rs=minpro"],
}


@pytest.mark.heavy
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_packed_rows_equal_one_sequence_per_row(seed):
    """docs/semantics.md §10: the grid's sequences and MinPRO's prefixes are per (row,
    segment): the prefix scan restarts at every segment and skips prompt tokens, holes
    and padding (whose mask may say 1)."""
    batch = pc.packed_batch(seed, rows=6, length=24, num_segments=K)
    _assert_packed_equals_one_per_row(batch, PACKED_CONFIGS)


@pytest.mark.slow
def test_packed_minpro_with_interleaved_segment_ids():
    """A segment need not be one run of tokens: the prefix of a token is the earlier
    tokens with its id (ids 1, 2, 1, 2, ... in a row)."""
    batch = pc.packed_batch(2, rows=4, length=12, num_segments=K, spikes=False)
    ids = np.zeros((4, 12), np.int32)
    ids[0] = [1, 2, 1, 2, 1, 2, 3, 1, 3, 0, 2, 1]
    ids[1] = [2, 2, 1, 1, 2, 1, 0, 0, 4, 4, 1, 4]
    ids[2] = 1
    batch["segment_ids"] = ids
    _assert_packed_equals_one_per_row(batch, {"minpro": MINPRO["minpro/clip/rs=minpro"]})


# ------------------------------------------------------------------------------ scan


# Module-level programs: the drawn examples of one shape share their compiled program.
_rows_exclusive_min = jax.jit(lambda v, p: _reduce.Rows().exclusive_min(v, p))
_packed_exclusive_min = jax.jit(
    lambda v, p, i: _reduce.Packed(opj.MeshAxes(), i, 3).exclusive_min(v, p)
)


@pytest.mark.slow
@settings(max_examples=examples(40))
@given(
    data=st.data(),
    shape=st.tuples(st.integers(1, 3), st.integers(1, 17)),
)
def test_exclusive_min_matches_loops(data, shape):
    values = data.draw(hnp.arrays(np.float32, shape, elements=st.integers(-20, 20).map(float)))
    ids = data.draw(hnp.arrays(np.int32, shape, elements=st.integers(0, 3)))
    population = data.draw(hnp.arrays(np.float32, shape, elements=st.sampled_from([0.0, 0.5, 1.0])))
    population = np.where(ids > 0, population, 0.0).astype(np.float32)
    rows = _rows_exclusive_min(values, population)
    np.testing.assert_array_equal(np.asarray(rows), rules_ref.minpro_prefix_min(values, population))
    got = np.asarray(_packed_exclusive_min(values, population, ids))
    want = np.full(shape, np.inf)
    for r, t in np.ndindex(*shape):
        earlier = (ids[r, :t] == ids[r, t]) & (population[r, :t] > 0)
        if earlier.any():
            want[r, t] = values[r, :t][earlier].min()
    np.testing.assert_array_equal(got, want)


@pytest.mark.heavy
def test_exclusive_min_by_hand_and_cached_per_call():
    layout = _reduce.Rows()
    x, p = jnp.arange(4.0), jnp.ones(4)
    assert layout.exclusive_min(x, p) is layout.exclusive_min(x, p)
    assert scan.exclusive_min_rows(jnp.array([[3.0, 1.0, 2.0]])).tolist() == [[np.inf, 3.0, 1.0]]
    ids = jnp.array([[2, 1, 2, 1, 0, 2]], jnp.int32)
    values = jnp.array([[5.0, 4.0, 3.0, 6.0, -9.0, 7.0]])
    got = scan.exclusive_min_segments(values, ids).tolist()
    assert got == [[np.inf, np.inf, 5.0, 4.0, np.inf, 3.0]]


# ---------------------------------------------------------------------------- config


def test_config_round_trips_yaml_dict_and_hash():
    config = areal("sequence/clamp/ratio/max/two")
    assert opj.CorrectionConfig.from_dict(config.to_dict()) == config
    text = config.to_yaml()
    assert "rejection_sampling:" in text and "action: clamp" in text
    loaded = opj.CorrectionConfig.from_yaml(text)
    assert loaded == config and hash(loaded) == hash(config)
    assert isinstance(loaded.rejection_sampling, opj.RejectionSamplingConfig)
    minpro = MINPRO["minpro/mask/rs=minpro"]
    assert opj.CorrectionConfig.from_yaml(minpro.to_yaml()) == minpro
    yaml_text = """
use_tis: true
tis_mode: none
rejection_sampling: {level: sequence, action: mask, metric: kl_k3, agg: max, upper: 0.5}
"""
    cfg = opj.CorrectionConfig.from_yaml(yaml_text)
    assert cfg.rejection_sampling == opj.RejectionSamplingConfig(
        level="sequence", metric="kl_k3", agg="max", upper=0.5
    )


def test_from_areal_reads_arealss_keys_and_defaults():
    cfg = opj.CorrectionConfig.from_areal({})
    assert (cfg.use_tis, cfg.tis_mode) == (True, "none")
    assert cfg.rejection_sampling == opj.RejectionSamplingConfig(
        level="token", action="mask", metric="ratio", agg="mean", upper=5.0, lower=None
    )
    assert opj.CorrectionConfig.from_areal(None) == opj.CorrectionConfig()
    clamp = opj.CorrectionConfig.from_areal({"action": "clamp", "upper": "2.0"})
    assert clamp.rejection_sampling.upper == 2.0 and clamp.rejection_sampling.lower is None
    assert clamp.rejection_sampling.clamp_lower == 0.0  # AReaL's default, not stored


BAD_BLOCKS = [
    ({"level": "seq"}, r"rejection_sampling\.level must be one of .*did you mean 'sequence'"),
    ({"action": "truncate"}, r"rejection_sampling\.action must be one of"),
    ({"metric": "kl_k4"}, r"rejection_sampling\.metric must be one of"),
    ({"agg": "min", "level": "sequence"}, r"rejection_sampling\.agg must be one of"),
    ({"lower": 3.0, "upper": 2.0}, r"lower \(3\.0\) cannot be greater than upper"),
    ({"upper": 1.0}, r"rejection_sampling\.upper must be > 1\.0 for metric='ratio'"),
    ({"lower": 0.0, "upper": 2.0}, r"rejection_sampling\.lower must be > 0 for metric='ratio'"),
    (
        {"metric": "kl_k2", "upper": 0.0},
        r"rejection_sampling\.upper must be > 0 for metric='kl_k2'",
    ),
    ({"metric": "kl_k3", "upper": -1.0}, r"rejection_sampling\.upper must be > 0"),
    ({"metric": "kl_k1", "action": "clamp"}, r"action='clamp' only supports metric='ratio'"),
    ({"upper": 1e39}, r"rejection_sampling\.upper.*float32"),
    ({"metric": "kl_k1", "upper": 1e-40}, r"rejection_sampling\.upper.*float32"),
    ({"upper": "2_0"}, r"rejection_sampling\.upper must be a number"),
    (
        {"uper": 2.0},
        r"unknown CorrectionConfig\.rejection_sampling key 'uper'.*did you mean 'upper'",
    ),
]


@pytest.mark.parametrize(("block", "match"), BAD_BLOCKS)
def test_bad_blocks_raise_naming_the_key(block, match):
    with pytest.raises(ValueError, match=match):
        opj.CorrectionConfig.from_areal(block)


def test_block_needs_use_tis_and_tis_mode_none_and_a_mapping():
    with pytest.raises(ValueError, match=r"rejection_sampling reweights .* use_tis is false"):
        opj.CorrectionConfig(rejection_sampling={"upper": 2.0})
    with pytest.raises(
        ValueError, match=r"rejection_sampling brings AReaL's own IS weight.*tis_mode"
    ):
        opj.CorrectionConfig(use_tis=True, rejection_sampling={"upper": 2.0})
    with pytest.raises(ValueError, match=r"rejection_sampling must be a mapping"):
        opj.CorrectionConfig.from_areal([("upper", 2.0)])
    with pytest.raises(ValueError, match=r"rejection_sampling must be a RejectionSamplingConfig"):
        opj.CorrectionConfig(use_tis=True, tis_mode="none", rejection_sampling=2.0)
    with pytest.raises(ValueError, match=r"tis_level must be one of .*'minpro'"):
        opj.CorrectionConfig(tis_level="min_pro")


@pytest.mark.heavy
def test_token_level_agg_warns_as_areal_does():
    with pytest.warns(
        UserWarning, match=r"rejection_sampling\.agg='max' is ignored when level='token'"
    ):
        cfg = opj.CorrectionConfig.from_areal({"agg": "max"})
    # ... and is ignored: the same weights as agg: mean.
    batch = fixed_batch()
    a = opj.compute_correction(batch["old_logp"], batch["rollout_logp"], batch["mask"], cfg)
    b = opj.compute_correction(
        batch["old_logp"], batch["rollout_logp"], batch["mask"], opj.CorrectionConfig.from_areal({})
    )
    np.testing.assert_array_equal(np.asarray(a.weights), np.asarray(b.weights))


# ------------------------------------------------------------- AReaL's loss, ported


def _areal_loss_port(logprobs, proximal, old, advantages, loss_mask, rs, eps, eps_high, c_clip):
    """AReaL's ``ppo_actor_loss_fn`` with ``apply_rejection_sampling`` (2D padded path,
    ``importance_sampling_level="token"``), ported line by line to ``jnp`` from
    ``areal/utils/functional/functional.py`` (commit 4aef98d8); ``loss_mask`` is bool."""
    loss_mask_count = jnp.maximum(loss_mask.sum(), 1)
    log_ratio = jax.lax.stop_gradient(proximal) - jax.lax.stop_gradient(old)
    log_ratio = jnp.where(jnp.isfinite(log_ratio), log_ratio, 0.0)
    metric = {
        "ratio": jnp.exp(log_ratio),
        "kl_k1": log_ratio,
        "kl_k2": log_ratio**2 / 2.0,
        "kl_k3": jnp.exp(-log_ratio) - 1 + log_ratio,
    }[rs["metric"]]
    behave = jnp.exp(log_ratio)
    lower, upper = rs.get("lower"), rs["upper"]

    def check(x):
        return (x >= lower) & (x <= upper) if lower is not None else x <= upper

    if rs["level"] == "sequence":
        use_log = rs["metric"] == "ratio"
        agg_values = log_ratio if use_log else metric
        masked = jnp.where(loss_mask, agg_values, 0.0)
        count = jnp.maximum(loss_mask.sum(-1, keepdims=True), 1)
        if use_log:
            behave = jnp.broadcast_to(
                jnp.exp(masked.sum(-1, keepdims=True) / count), log_ratio.shape
            )
        if rs["agg"] == "sum":
            seq = masked.sum(-1, keepdims=True)
        elif rs["agg"] == "mean":
            seq = masked.sum(-1, keepdims=True) / count
        else:
            seq = jnp.where(loss_mask, agg_values, -jnp.inf).max(-1, keepdims=True)
            seq = jnp.where(loss_mask.sum(-1, keepdims=True) == 0, 0.0, seq)
        seq_metric = jnp.exp(seq) if use_log else seq
        inside = jnp.broadcast_to(check(seq_metric), loss_mask.shape)
        if rs["action"] == "clamp":
            lo = 0.0 if lower is None else lower
            behave = jnp.where(~inside, jnp.clip(behave, lo, upper), behave)
    else:
        inside = check(metric)
        if rs["action"] == "clamp":
            behave = jnp.clip(behave, 0.0 if lower is None else lower, upper)
    if rs["action"] == "mask":
        loss_mask = loss_mask & inside
    behave = jnp.where(loss_mask, behave, 0.0)
    ratio = jnp.where(loss_mask, jnp.exp(logprobs - proximal), 0.0)
    clipped = jnp.clip(ratio, 1.0 - eps, 1.0 + eps_high)
    pg_loss = jnp.maximum(-advantages * ratio, -advantages * clipped)
    pg_loss = jnp.minimum(pg_loss, jnp.sign(advantages) * c_clip * advantages)
    pg_loss = pg_loss * behave
    return jnp.where(loss_mask, pg_loss, 0.0).sum() / loss_mask_count


@pytest.mark.heavy
@pytest.mark.parametrize(
    "name",
    [
        n
        if n in ("token/mask/ratio/mean/two", "sequence/clamp/ratio/sum/two")
        else pytest.param(n, marks=pytest.mark.slow)
        for n in GRID
    ],
)
def test_decoupled_loss_matches_a_port_of_areals_loss(name):
    """``CorrectionConfig.from_areal`` in ``LossConfig(decoupled_ppo, token_mean,
    rejected_in_denominator=True)`` with AReaL's ``eps_clip`` / ``eps_clip_higher`` /
    ``c_clip``: AReaL's loss value and gradient (docs/coming_from.md)."""
    rng = np.random.default_rng(13)
    shape = (5, 10)
    mask = np.arange(10)[None, :] < np.array([10, 0, 1, 6, 8])[:, None]
    mask &= rng.random(shape) > 0.1
    old = (rng.integers(-64, 0, shape) / 16).astype(np.float32)  # AReaL's old_logprobs
    prox = (old + rng.integers(-8, 9, shape) / 16).astype(np.float32)  # proximal_logprobs
    theta = (prox + rng.integers(-5, 6, shape) / 16).astype(np.float32)
    adv = (rng.integers(-16, 17, shape) / 8).astype(np.float32)
    eps, eps_high, c_clip = 0.2, 0.28, 3.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        correction = opj.CorrectionConfig.from_areal(GRID[name])
    config = opj.LossConfig(
        algorithm="decoupled_ppo",
        correction=correction,
        clip_eps=eps,
        clip_eps_high=eps_high,
        dual_clip_c=c_clip,
        aggregation="token_mean",
        rejected_in_denominator=True,
    )
    got, got_grad = jax.jit(
        jax.value_and_grad(lambda lp: opj.policy_loss(lp, prox, old, adv, mask, config)[0])
    )(theta)
    want, want_grad = jax.jit(
        jax.value_and_grad(
            lambda lp: _areal_loss_port(
                lp, prox, old, adv, jnp.asarray(mask), GRID[name], eps, eps_high, c_clip
            )
        )
    )(theta)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got_grad), np.asarray(want_grad), rtol=1e-5, atol=1e-7)
