"""One reduction path: packed rows of any layout exact, long rows within float32 rounding.

Every backend runs the same reductions (a row's columns stacked into one sum and one
min; a packed pass's into one scatter-add and one scatter-min, and one gather back to
the tokens). These tests pin what that path must
give against float64 NumPy references: ``pack_sequences`` rows of many short responses
after a prompt equal the unpacked batch, the promise argument that let a faster path
take such rows wrongly is gone, and sums over rows of 1k-8k tokens are within float32
rounding of their exact values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import policy_losses_reference_trl as trl_ref
import pytest

import offpolicy_jax as opj
from offpolicy_jax import reduction as _reduce

NAMES = ("logp", "old_logp", "rollout_logp", "advantages", "mask")
GEO_RS = "mis_rs_seq_mean_k1_seq_fraction"


def _short_responses(seed: int, count: int = 40) -> list[dict[str, np.ndarray]]:
    """Sequences of a prompt (mask 0) and a response of 1-40 tokens (mask 1)."""
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(count):
        prompt, response = int(rng.integers(4, 24)), int(rng.integers(1, 41))
        n = prompt + response
        old = -rng.exponential(1.0, n)
        seqs.append(
            {
                "logp": old + rng.normal(0.0, 0.05, n),
                "old_logp": old,
                "rollout_logp": old + rng.normal(0.0, 0.02, n),
                "advantages": np.full(n, rng.normal()),
                "mask": np.r_[np.zeros(prompt), np.ones(response)],
            }
        )
    return [{k: v.astype(np.float32) for k, v in s.items()} for s in seqs]


def _padded(seqs):
    length = max(len(s["mask"]) for s in seqs)
    return {k: np.stack([np.pad(s[k], (0, length - len(s[k]))) for s in seqs]) for k in NAMES}


def _geo_rs_seq_fraction(seqs) -> float:
    """float64: the share of sequences whose mean log-ratio (old − rollout over the
    response) leaves verl's geometric band [log 0.999, log 1.001]."""
    rejected = []
    for s in seqs:
        valid = s["mask"] > 0
        mean = np.mean(s["old_logp"][valid].astype(np.float64) - s["rollout_logp"][valid])
        rejected.append(not np.log(0.999) <= mean <= np.log(1.001))
    return float(np.mean(rejected))


# More seeds only in the whole suite: each packs a new layout (~7 s of CPU).
@pytest.mark.heavy
@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.slow) for s in (1, 2))])
def test_packed_short_responses_equal_the_unpacked_batch(seed):
    """``pack_sequences`` rows of 128 tokens, 8 segments, responses of 1-40 tokens after
    a prompt, the ``decoupled_geo_rs_token_tis`` preset: the packed loss, its gradient
    and the geometric rejection share equal the unpacked batch's (and the share equals
    its float64 value)."""
    seqs = _short_responses(seed)
    packed = opj.pack_sequences(seqs, 128, max_segments=8)
    assert packed.num_segments == 8 and packed.segment_ids.shape[-1] == 128
    config = opj.LossConfig(
        algorithm="decoupled_ppo",
        correction=opj.CorrectionConfig.preset("decoupled_geo_rs_token_tis"),
    )
    ids, k = jnp.asarray(packed.segment_ids), packed.num_segments

    def packed_loss(logp, *rest):
        return opj.policy_loss(logp, *rest, config, segment_ids=ids, num_segments=k)

    def padded_loss(logp, *rest):
        return opj.policy_loss(logp, *rest, config)

    step = jax.value_and_grad(packed_loss, has_aux=True)
    (loss, metrics), grad = jax.jit(step)(*(jnp.asarray(packed.arrays[n]) for n in NAMES))
    padded = _padded(seqs)
    (want, want_metrics), want_grad = jax.jit(jax.value_and_grad(padded_loss, has_aux=True))(
        *(jnp.asarray(padded[n]) for n in NAMES)
    )
    np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
    grad, want_grad = np.asarray(grad), np.asarray(want_grad)
    for i, s in enumerate(seqs):  # each sequence's tokens, where the packing put them
        n, row, start = len(s["mask"]), packed.rows[i], packed.starts[i]
        np.testing.assert_allclose(
            grad[row, start : start + n], want_grad[i, :n], rtol=1e-5, atol=1e-7
        )
    share = _geo_rs_seq_fraction(seqs)
    assert 0.0 < share < 1.0  # both kinds of sequence in the batch
    np.testing.assert_allclose(metrics[GEO_RS], share, rtol=1e-6)
    np.testing.assert_allclose(want_metrics[GEO_RS], share, rtol=1e-6)
    for key, value in want_metrics.items():
        np.testing.assert_allclose(metrics[key], value, rtol=2e-5, atol=1e-6, err_msg=key)
    correction = opj.compute_correction(
        *(jnp.asarray(packed.arrays[n]) for n in NAMES[1:3]),
        jnp.asarray(packed.arrays["mask"]),
        config.correction,
        segment_ids=ids,
        num_segments=k,
    )
    np.testing.assert_allclose(correction.metrics[GEO_RS], share, rtol=1e-6)


def test_the_contiguous_segments_promise_is_gone():
    """No argument lets a caller promise a layout: every packed call is exact for any
    ids (a broken promise gave silently wrong losses)."""
    seqs = _short_responses(0, count=8)
    packed = opj.pack_sequences(seqs, 128, max_segments=8)
    arrays = [jnp.asarray(packed.arrays[n]) for n in NAMES]
    config = opj.LossConfig(
        algorithm="decoupled_ppo",
        correction=opj.CorrectionConfig.preset("decoupled_geo_rs_token_tis"),
    )
    packing = {"segment_ids": packed.segment_ids, "num_segments": packed.num_segments}
    for entry in (opj.policy_loss, opj.policy_loss_parts, opj.policy_loss_terms):
        with pytest.raises(TypeError, match="contiguous_segments"):
            entry(*arrays, config, **packing, contiguous_segments=True)
    with pytest.raises(TypeError, match="contiguous_segments"):
        opj.compute_correction(
            *arrays[1:3], arrays[4], config.correction, **packing, contiguous_segments=True
        )
    assert not hasattr(_reduce, "contiguous_rows")


# ------------------------------------------------------------------- long rows, float64


# A sum of n float32 terms taken as a tree errs by about log2(n) roundings of 2^-24 in
# the worst case and a few in practice; the bound below is 4 of them, relative to the
# sum of the terms' magnitudes. A sum accumulated sequentially over a long row (or
# over chunks of a few tokens, then rows of chunk sums) errs 10-100x more.
ROUNDINGS = 4 * 2.0**-24


@pytest.mark.parametrize("length", [1024, 4096, 8191])
def test_token_sum_is_within_float32_rounding(length):
    rng = np.random.default_rng(length)
    x = rng.random((1, length)).astype(np.float32)  # positive: |Σ x| = Σ |x|
    mask = np.ones((1, length), bool)
    mask[0, -5:] = False
    want = np.where(mask, x.astype(np.float64), 0.0).sum()
    got = opj.aggregate(jnp.asarray(x), jnp.asarray(mask), jnp.asarray(mask), "token_sum")
    np.testing.assert_allclose(float(got.value()), want, rtol=ROUNDINGS)
    # packed: the same tokens as two sequences a row
    ids = np.where(mask, 1 + (np.arange(length) >= length // 3), 0).astype(np.int32)
    packed = opj.aggregate(
        jnp.asarray(x),
        jnp.asarray(mask),
        jnp.asarray(mask),
        "token_sum",
        segment_ids=jnp.asarray(ids),
        num_segments=2,
    )
    np.testing.assert_allclose(float(packed.value()), want, rtol=ROUNDINGS)


@pytest.mark.parametrize("length", [2048, 4096, 8192])
def test_mis_kl_is_within_float32_rounding(length):
    rng = np.random.default_rng(length)
    old = (-rng.exponential(1.0, (1, length))).astype(np.float32)
    rollout = (old + rng.normal(0.05, 0.02, (1, length))).astype(np.float32)
    mask = np.ones((1, length), bool)
    res = opj.compute_correction(old, rollout, mask, opj.CorrectionConfig())
    delta = rollout.astype(np.float64) - old  # exact: both are float32
    np.testing.assert_allclose(float(res.metrics["mis_kl"]), delta.mean(), rtol=ROUNDINGS)


def test_luspo_loss_at_4096_tokens_is_within_float32_rounding():
    length = 4096
    rng = np.random.default_rng(5)
    old = (-rng.exponential(1.0, (1, length))).astype(np.float32)
    logp = (old + rng.normal(0.01, 0.02, (1, length))).astype(np.float32)
    adv = np.ones((1, length), np.float32)
    mask = np.ones((1, length), bool)
    config = opj.LossConfig(algorithm="ppo", policy_loss="luspo", aggregation="token_mean")
    loss, _ = jax.jit(lambda lp: opj.policy_loss(lp, old, None, adv, mask, config))(logp)
    terms = trl_ref.luspo(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.2)
    want = np.where(mask, terms.loss, 0.0).sum() / mask.sum()
    # the loss is n·exp(mean): the mean's rounding, times the few of exp, n and the mean
    np.testing.assert_allclose(float(loss), want, rtol=2 * ROUNDINGS)


def test_a_rows_columns_are_two_reductions_each_its_own_rows():
    """Sums, minima and maxima of one pass are one stacked sum and one stacked min over
    the tokens, and each result is its own column's reduction (an empty row: 0, +inf,
    -inf)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 257)).astype(np.float32)
    y = rng.exponential(size=(4, 257)).astype(np.float32)
    mask = rng.random((4, 257)) < 0.7
    mask[2] = False  # an empty row

    def reduce(x, y, population):
        return _reduce.Rows().reduce(
            {
                "n": _reduce.count(population),
                "x": _reduce.total(x, population),
                "y": _reduce.total(y * y, population),
                "low": _reduce.count_where(x < -1.0, population),
                "min_x": _reduce.minimum(x, population),
                "max_x": _reduce.maximum(x, population),
                "max_y": _reduce.maximum(y, population),
            }
        )

    args = (jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask, jnp.float32))
    hlo = jax.jit(reduce).lower(*args).as_text()
    assert hlo.count("stablehlo.reduce") == 2
    got = jax.jit(reduce)(*args)
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    sums = {"n": np.ones_like(x64), "x": x64, "y": y64 * y64, "low": 1.0 * (x64 < -1.0)}
    for key, value in sums.items():
        want = np.where(mask, value, 0.0).sum(-1)
        np.testing.assert_allclose(got[key], want, rtol=ROUNDINGS * 16, atol=1e-6)
    np.testing.assert_array_equal(got["min_x"], np.where(mask, x, np.inf).min(-1))
    np.testing.assert_array_equal(got["max_x"], np.where(mask, x, -np.inf).max(-1))
    np.testing.assert_array_equal(got["max_y"], np.where(mask, y, -np.inf).max(-1))


def _packed_reduce(x, y, population, ids, num_segments, copies):
    """``copies`` sums, minima and maxima of each kind over packed rows, one pass."""
    columns = {}
    for i in range(copies):
        scaled = x * (i + 1)
        columns[f"n{i}"] = _reduce.count(population * (i + 1))
        columns[f"x{i}"] = _reduce.total(scaled, population)
        columns[f"y{i}"] = _reduce.total(y * y + i, population)
        columns[f"min_x{i}"] = _reduce.minimum(scaled, population)
        columns[f"max_x{i}"] = _reduce.maximum(scaled, population)
        columns[f"max_y{i}"] = _reduce.maximum(y + i, population)
    return _reduce.segment_reduce(columns, ids, num_segments, _reduce.MeshAxes())


def _ops(fn, *args) -> dict[str, int]:
    hlo = jax.jit(fn).lower(*args).as_text()
    return {op: hlo.count(f'"stablehlo.{op}"(') for op in ("scatter", "gather")}


@pytest.mark.parametrize("copies", [1, 4])
def test_a_packed_pass_is_two_scatters_and_its_gradient_no_gather(copies):
    """Packed rows: the sums of one pass are one scatter-add and its minima and maxima
    one scatter-min, however many columns there are; the sums' gradient gathers nothing
    (a broadcast of per-segment values to the tokens is one gather). Each result is its own
    column's reduction over its own segment (ids of any layout, out-of-range ids are
    padding, an empty segment gives 0, +inf, -inf)."""
    rng = np.random.default_rng(7)
    shape, k = (3, 300), 5
    x = rng.normal(size=shape).astype(np.float32)
    y = rng.exponential(size=shape).astype(np.float32)
    ids = rng.integers(-1, k + 2, size=shape).astype(np.int32)
    ids[ids == 3] = 2  # segment 3 is empty
    population = np.where((ids >= 1) & (ids <= k) & (rng.random(shape) < 0.8), 1.0, 0.0)
    args = (jnp.asarray(x), jnp.asarray(y), jnp.asarray(population, jnp.float32), ids)

    def reduce(x, y, population, ids):
        return _packed_reduce(x, y, population, ids, k, copies)

    assert _ops(reduce, *args) == {"scatter": 2, "gather": 0}

    def loss(x, y, population, ids):
        out = reduce(x, y, population, ids)
        spread = _reduce.segment_broadcast(out["x0"] * out["y0"], ids)
        sums = sum(jnp.sum(v) for name, v in out.items() if name[0] in "xy")
        return sums + jnp.sum(spread * x)

    # the sums' scatter, the broadcast's one gather and its transpose (a per-segment sum);
    # the sums' cotangents reach their tokens without a gather, and the minima and maxima,
    # which the loss does not read, are gone
    assert _ops(jax.grad(loss), *args) == {"scatter": 2, "gather": 1}
    got = jax.jit(reduce)(*args)
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    for i in range(copies):
        sums = {
            f"n{i}": np.full(shape, i + 1.0),
            f"x{i}": x64 * (i + 1),
            f"y{i}": y64 * y64 + i,
        }
        extremes = {f"min_x{i}": x64 * (i + 1), f"max_x{i}": x64 * (i + 1), f"max_y{i}": y64 + i}
        for s in range(1, k + 1):
            inside = (ids == s) & (population > 0)
            for key, value in sums.items():
                want = np.where(inside, value, 0.0).sum(-1)
                np.testing.assert_allclose(got[key][:, s - 1], want, rtol=1e-5, atol=1e-4)
            for key, value in extremes.items():
                fill = np.inf if key.startswith("min") else -np.inf
                pick = np.where(inside, value, fill)
                want = pick.min(-1) if key.startswith("min") else pick.max(-1)
                np.testing.assert_allclose(got[key][:, s - 1], want, rtol=1e-6)
    assert np.all(np.asarray(got["n0"])[:, 2] == 0)
    assert np.all(np.isposinf(got["min_x0"][:, 2])) and np.all(np.isneginf(got["max_y0"][:, 2]))
    # d/dx: (i + 1) p_t from each x_i sum, and from sum_t spread_t x_t the token's own
    # segment's spread plus y0 of its segment times the sum of x over that segment
    grad = np.asarray(jax.jit(jax.grad(loss))(*args), np.float64)
    seg = np.where((ids >= 1) & (ids <= k), ids, 0)
    x0 = np.pad(np.asarray(got["x0"], np.float64), [(0, 0), (1, 0)])
    y0 = np.pad(np.asarray(got["y0"], np.float64), [(0, 0), (1, 0)])
    seg_x = np.stack([np.where(seg == s, x64, 0.0).sum(-1) for s in range(k + 1)], -1)
    mine = lambda v: np.take_along_axis(v, seg, -1)  # noqa: E731
    want = copies * (copies + 1) / 2 * population + mine(x0 * y0)
    want += np.where(seg > 0, mine(y0) * mine(seg_x) * population, 0.0)
    np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-4)


@pytest.mark.heavy
@pytest.mark.parametrize("num_segments", [3, 70])
def test_packed_sums_gradient_and_tangent_past_the_select_limit(num_segments):
    """A per-segment sum's gradient is its segment's cotangent at every token (0 on
    padding) and its forward-mode tangent the per-segment sum of the tangents, both up
    to 64 segments (selects on the ids) and past them (a gather)."""
    rng = np.random.default_rng(num_segments)
    shape = (2, 3, 400)
    x = rng.normal(size=shape).astype(np.float32)
    ids = rng.integers(-1, num_segments + 2, size=shape).astype(np.int32)
    population = np.where(rng.random(shape) < 0.8, 1.0, 0.0).astype(np.float32)
    population = np.where((ids >= 1) & (ids <= num_segments), population, 0.0)
    cot = rng.normal(size=(*shape[:-1], num_segments)).astype(np.float32)

    def sums(x):
        columns = {"s": _reduce.total(x, population), "m": _reduce.maximum(x, population)}
        return _reduce.segment_reduce(columns, ids, num_segments, _reduce.MeshAxes())["s"]

    grad = jax.jit(jax.grad(lambda x: jnp.sum(sums(x) * cot)))(x)
    padded = np.concatenate([np.zeros((*shape[:-1], 1)), cot], -1)
    inside = (ids >= 1) & (ids <= num_segments)
    want = np.take_along_axis(padded, np.where(inside, ids, 0), -1) * population
    np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-7)
    tangent = rng.normal(size=shape).astype(np.float32)
    _, jvp = jax.jvp(sums, (x,), (tangent,))
    want = np.stack(
        [
            (np.where(ids == k, tangent * population, 0.0)).sum(-1)
            for k in range(1, num_segments + 1)
        ],
        -1,
    )
    np.testing.assert_allclose(jvp, want, rtol=1e-5, atol=1e-5)
