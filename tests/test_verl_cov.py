"""Clip-Cov and KL-Cov (Cui et al. 2025; verl's loss modes ``clip_cov`` / ``kl_cov``).

* verl parity: ``tests/fixtures/verl_cov/`` holds verl's own loss and gradient on ragged
  batches (``benchmarks/verl_cov_fixtures.py`` ran ``compute_policy_loss_clip_cov`` /
  ``_kl_cov`` of verl b178a3c with torch, clip_cov's random choice forced to the tokens
  this library draws with the case's key);
* a NumPy reference (float64) of the selection and the loss: ragged rows, NaN padding,
  a sequence with a non-finite log π_θ, ties, ``k`` beyond the candidates, no candidate,
  a fully masked batch (0 loss, 0 gradient);
* jit == eager, finite gradients, the key (required by clip_cov, a trace-time error),
  the hyperparameters' validation, packed == padded, and (slow, 8 CPU devices)
  ``shard_map`` with ``axis_names`` == the unsharded call.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import packing_cases as pc
import pytest

import offpolicy_jax as opj
from offpolicy_jax._src.losses import covariance

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "verl_cov"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
FAST_CASES = {"clip_cov_seq_mean_token_sum_norm_k_over_candidates", "kl_cov_token_mean"}


def _parity_params():
    return [
        pytest.param(c, id=c["name"], marks=() if c["name"] in FAST_CASES else pytest.mark.slow)
        for c in MANIFEST["cases"]
    ]


def _loss_and_grad(config, logp, old, adv, mask, key=None, **kwargs):
    def loss_fn(lp):
        return opj.policy_loss(lp, old, None, adv, mask, config, key=key, **kwargs)

    return jax.value_and_grad(loss_fn, has_aux=True)(logp)


# --------------------------------------------------------------------------- verl parity


def test_fixtures_are_small_and_complete():
    names = {c["name"] for c in MANIFEST["cases"]}
    assert {n.split("_")[0] for n in names} == {"clip", "kl"}
    size = sum(p.stat().st_size for p in FIXTURES.iterdir())
    assert size < 200_000, size
    for case in MANIFEST["cases"]:
        assert case["selected"] > 1, case["name"]  # several tokens, not just the floor 1
        assert "verl_metrics" in case, case["name"]


@pytest.mark.parametrize("case", _parity_params())
def test_verl_parity(case):
    """Loss, gradient w.r.t. log π_θ and verl's metrics, on verl's own outputs."""
    with np.load(FIXTURES / case["file"]) as data:
        a = {k: data[k] for k in data.files}
    config = opj.LossConfig.from_verl({}, case["actor"])
    # No rollout log-probs here (the correction only reports metrics); verl's token means.
    config = dataclasses.replace(config, correction=None, metric_reduction="token")
    if config.aggregation == "sequence_sum_norm":
        # The fixtures' verl (b178a3c, Jan 2026) has seq-mean-token-sum-norm = Σ_seq Σ_t ℓ / T
        # (its seq-mean denominator was reverted in 78014a2); later verl (verl-project/verl,
        # e.g. 018f23b, and the verl pack's 1dda039b9c) divides the seq-mean by T, as this
        # library's sequence_sum_norm does. H = T / #sequences makes the two equal here; the
        # two losses' own functions are the same in both verl versions.
        rows = int(np.sum(a["response_mask"].sum(-1) > 0))
        scale = a["response_mask"].shape[-1] / rows
        config = dataclasses.replace(config, loss_scale_factor=scale)
    key = jax.random.key(case["key"])
    args = (a["log_prob"], a["old_log_prob"], a["advantages"], a["response_mask"])
    (loss, metrics), grad = jax.jit(functools.partial(_loss_and_grad, config, key=key))(*args)
    np.testing.assert_allclose(float(loss), float(a["verl_loss"]), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), a["verl_grad"], rtol=1e-5, atol=1e-8)
    verl = case["verl_metrics"]
    if config.policy_loss == "clip_cov":
        np.testing.assert_allclose(float(metrics["ppo_kl"]), verl["actor/ppo_kl"], atol=1e-6)
        np.testing.assert_allclose(float(metrics["pg_clipfrac"]), verl["actor/pg_clipfrac"])
    else:  # verl's actor/ppo_kl of kl_cov is mean |log r|: ppo_kl_abs here
        np.testing.assert_allclose(float(metrics["ppo_kl_abs"]), verl["actor/ppo_kl"], rtol=1e-6)
        n = float(a["response_mask"].sum())
        assert round(float(metrics["kl_cov_frac"]) * n) == case["selected"]


# --------------------------------------------------------------------------- NumPy reference


def _fmix32(h: np.ndarray) -> np.ndarray:
    h = h.astype(np.uint64)  # uint32 arithmetic, wrapped by hand
    m = np.uint64(0xFFFFFFFF)
    h = ((h ^ (h >> np.uint64(16))) * np.uint64(0x7FEB352D)) & m
    h = ((h ^ (h >> np.uint64(15))) * np.uint64(0x846CA68B)) & m
    return h ^ (h >> np.uint64(16))


def _priorities(key_seed: int, size: int) -> np.ndarray:
    """The documented priorities of flat positions ``j``: ``fmix32(fmix32(j) ^ seed) >> 8``,
    ``seed = bits(key)`` (uint32), in NumPy."""
    seed = np.uint64(int(jax.random.bits(jax.random.key(key_seed), (), jnp.uint32)))
    return _fmix32(_fmix32(np.arange(size, dtype=np.uint64)) ^ seed) >> np.uint64(8)


def reference(logp, old, adv, mask, config, key_seed=0):
    """Loss and gradient (float64) of clip_cov / kl_cov, token_mean or sequence_mean."""
    logp, old, adv = (np.asarray(v, np.float64) for v in (logp, old, adv))
    valid = np.asarray(mask) > 0
    pop = valid & np.all(np.isfinite(logp) | ~valid, axis=-1, keepdims=True)
    n = int(pop.sum())
    a, t = np.where(pop, adv, 0.0), np.where(pop, logp, 0.0)
    cov = np.where(pop, (a - a.sum() / max(n, 1)) * (t - t.sum() / max(n, 1)), 0.0)
    with np.errstate(invalid="ignore"):  # inf - inf where masked
        x = np.where(pop, logp - old, 0.0)
    r = np.exp(x)
    flat = np.flatnonzero(pop.reshape(-1))
    p = config.params
    if config.policy_loss == "clip_cov":
        eps, high = p.clip_eps, p.upper_clip_eps
        pg1, pg2 = -a * r, -a * np.clip(r, 1 - eps, 1 + high)
        clipped = pg2 > pg1
        cand = pop & ~clipped & (cov > p.clip_cov_lb) & (cov < p.clip_cov_ub)
        k = max(int(p.clip_cov_ratio * n), 1)
        prio = _priorities(key_seed, pop.size)
        order = sorted(np.flatnonzero(cand.reshape(-1)), key=lambda i: (prio[i], i))
        sel = np.isin(np.arange(pop.size), order[:k]).reshape(pop.shape)
        loss = np.where(sel, 0.0, np.maximum(pg1, pg2))
        dloss = np.where(sel | clipped, 0.0, -a * r)
    else:
        k = max(1, int(n * p.kl_cov_ratio)) if n else 0
        order = sorted(flat, key=lambda i: (-cov.reshape(-1)[i], i))
        sel = np.isin(np.arange(pop.size), order[:k]).reshape(pop.shape)
        loss = -a * r + np.where(sel, p.ppo_kl_coef * np.abs(x), 0.0)
        dloss = -a * r + np.where(sel, p.ppo_kl_coef * np.sign(x), 0.0)
    if config.aggregation == "token_mean":
        scale = np.where(pop, 1.0 / max(n, 1), 0.0)
    else:  # sequence_mean: each non-empty row once
        per_row = pop.sum(-1, keepdims=True)
        rows = max(int((per_row > 0).sum()), 1)
        scale = np.where(pop, 1.0 / (np.maximum(per_row, 1) * rows), 0.0)
    return float(np.sum(np.where(pop, loss, 0.0) * scale)), dloss * scale, sel


def _batch(seed, shape=(6, 20), lengths=(20, 0, 1, 13, 20, 7), levels=None):
    """Ragged rows (an empty and a one-token row), NaN / inf where masked."""
    rng = np.random.default_rng(seed)
    mask = np.arange(shape[1])[None, :] < np.asarray(lengths)[:, None]
    # Multiples of 1/8: exact sums; the covariances' rounding cannot reorder distinct ones.
    old = rng.integers(-24, -2, shape) / 8.0
    logp = old + rng.integers(-3, 4, shape) / 8.0
    adv = rng.integers(-16, 17, shape) / 8.0
    if levels is not None:  # few distinct values: many equal covariances
        logp, adv = old * 0 + rng.choice(levels, shape), rng.choice(levels, shape)
    for arr in (old, logp, adv):
        arr[~mask] = rng.choice([np.nan, np.inf, -np.inf], int((~mask).sum()))
    f32 = np.float32
    return logp.astype(f32), old.astype(f32), adv.astype(f32), mask.astype(f32)


CLIP = dict(policy_loss="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=0.01, clip_cov_ub=4.0)
KL = dict(policy_loss="kl_cov", kl_cov_ratio=0.2, ppo_kl_coef=0.5)
REFERENCE_CASES = {
    "clip_cov_ragged_nan_padding": (CLIP, {}),
    "kl_cov_ragged_nan_padding": ({**KL, "aggregation": "sequence_mean"}, {}),
    # θ non-finite at a valid token: the sequence leaves the loss and the selection.
    "clip_cov_nan_logp_sequence": ({**CLIP, "aggregation": "sequence_mean"}, {"nan": True}),
    "kl_cov_ties": (KL, {"levels": (-1.0, 0.0, 1.0)}),
    "clip_cov_ties": (CLIP, {"levels": (-1.0, 0.0, 1.0)}),
    "clip_cov_k_over_candidates": ({**CLIP, "clip_cov_ratio": 1.0, "clip_cov_lb": 1.0}, {}),
    "clip_cov_no_candidate": ({**CLIP, "clip_cov_lb": 1e6, "clip_cov_ub": 2e6}, {}),
}


# The fast tier runs three of them (~2 s of compilation each); the full run all.
FAST_REFERENCE = {"clip_cov_ragged_nan_padding", "kl_cov_ragged_nan_padding", "kl_cov_ties"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=() if n in FAST_REFERENCE else pytest.mark.slow)
        for n in REFERENCE_CASES
    ],
)
def test_numpy_reference(name):
    fields, extra = REFERENCE_CASES[name]
    config = opj.LossConfig(algorithm="ppo", clip_eps=0.1, **fields)
    logp, old, adv, mask = _batch(3, levels=extra.get("levels"))
    if extra.get("nan"):
        logp[3, 4] = np.nan
    want_loss, want_grad, selected = reference(logp, old, adv, mask, config, key_seed=5)
    if name == "clip_cov_no_candidate":
        assert not selected.any()
    elif name == "clip_cov_k_over_candidates":
        assert 0 < selected.sum() < int(mask.sum())
    else:
        assert selected.sum() > 1
    (loss, _), grad = jax.jit(functools.partial(_loss_and_grad, config, key=jax.random.key(5)))(
        logp, old, adv, mask
    )
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("fields", [CLIP, KL], ids=["clip_cov", "kl_cov"])
def test_fully_masked_batch_gives_zero_loss_and_zero_grad(fields):
    logp, old, adv, mask = _batch(1)
    config = opj.LossConfig(algorithm="ppo", **fields)
    step = jax.jit(functools.partial(_loss_and_grad, config, key=jax.random.key(0)))
    (loss, metrics), grad = step(logp, old, adv, np.zeros_like(mask))
    assert float(loss) == 0.0
    assert np.all(np.asarray(grad) == 0.0)
    assert all(np.isfinite(float(v)) for v in metrics.values())


@pytest.mark.heavy
@pytest.mark.parametrize(
    "fields",
    [pytest.param(CLIP, id="clip_cov", marks=pytest.mark.slow), pytest.param(KL, id="kl_cov")],
)
def test_jit_equals_eager_and_gradients_are_finite(fields):
    """Eager runs op by op (~10 s of CPU cold): the fast tier runs kl_cov only."""
    logp, old, adv, mask = _batch(2)
    config = opj.LossConfig(algorithm="ppo", **fields)
    step = functools.partial(_loss_and_grad, config, key=jax.random.key(3))
    (loss, metrics), grad = step(logp, old, adv, mask)
    (jloss, jmetrics), jgrad = jax.jit(step)(logp, old, adv, mask)
    np.testing.assert_allclose(float(jloss), float(loss), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(jgrad), np.asarray(grad), rtol=1e-6, atol=1e-8)
    for k in metrics:
        np.testing.assert_allclose(float(jmetrics[k]), float(metrics[k]), atol=1e-7, err_msg=k)
    assert np.all(np.isfinite(np.asarray(grad)))
    assert np.all(np.asarray(grad)[np.asarray(mask) == 0] == 0.0)


def test_clip_cov_key_decides_the_tokens_and_is_required():
    logp, old, adv, mask = _batch(4)
    config = opj.LossConfig(algorithm="ppo", **{**CLIP, "clip_cov_ratio": 0.1})
    step = jax.jit(lambda lp, key: _loss_and_grad(config, lp, old, adv, mask, key=key)[1])
    same = [np.asarray(step(logp, jax.random.key(0))) for _ in range(2)]
    np.testing.assert_array_equal(same[0], same[1])
    other = np.asarray(step(logp, jax.random.key(1)))
    assert not np.array_equal(same[0], other)
    # a raw uint32[2] key is accepted as well
    raw = np.asarray(step(logp, jax.random.key_data(jax.random.key(0))))
    np.testing.assert_array_equal(raw, same[0])
    with pytest.raises(ValueError, match="policy_loss='clip_cov'.*key=jax.random.key"):
        jax.jit(lambda lp: _loss_and_grad(config, lp, old, adv, mask)[0][0])(logp)
    # kl_cov is deterministic: no key needed
    kl = opj.LossConfig(algorithm="ppo", **KL)
    assert np.isfinite(float(_loss_and_grad(kl, logp, old, adv, mask)[0][0]))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"policy_loss": "clip_cov", "clip_cov_ratio": 0.0}, "clip_cov_ratio must be in"),
        ({"policy_loss": "clip_cov", "clip_cov_ratio": 1.5}, "clip_cov_ratio must be in"),
        ({"policy_loss": "clip_cov", "clip_cov_lb": 5.0}, "clip_cov_lb must be < "),
        ({"policy_loss": "clip_cov", "clip_cov_ub": "x"}, "clip_cov_ub must be a number"),
        ({"policy_loss": "clip_cov", "clip_eps": 1.0}, "clip_eps must be in"),
        ({"policy_loss": "kl_cov", "kl_cov_ratio": -0.1}, "kl_cov_ratio must be in"),
        ({"policy_loss": "kl_cov", "ppo_kl_coef": -1.0}, "ppo_kl_coef must be a number >= 0"),
        ({"policy_loss": "kl_cov", "clip_cov_ratio": 0.1}, "hyperparameter of policy_loss"),
    ],
)
def test_hyperparameters_are_validated_naming_the_key(fields, message):
    with pytest.raises(ValueError, match=message):
        opj.LossConfig(**fields)


def test_defaults_are_verls():
    clip = opj.LossConfig(policy_loss="clip_cov")
    assert (clip.clip_cov_ratio, clip.clip_cov_lb, clip.clip_cov_ub) == (0.0002, 1.0, 5.0)
    kl = opj.LossConfig(policy_loss="kl_cov")
    assert (kl.kl_cov_ratio, kl.ppo_kl_coef) == (0.0002, 0.1)
    assert opj.LossConfig.from_yaml(clip.to_yaml()) == clip


@pytest.mark.parametrize("ratio", [0.0002, 0.07, 0.1, 0.29, 0.7, 1.0])
def test_selection_count_is_pythons_float64_product(ratio):
    """``max(int(ratio·n), 1)`` for every ``n`` (0.7·10 is 7.0 in float64, 6.99... exact)."""
    size = 3000
    ns = np.arange(size + 1)
    got = jax.jit(jax.vmap(lambda n: covariance.selection_count(ratio, n, size)))(ns)
    want = [max(int(ratio * int(n)), 1) for n in ns]
    np.testing.assert_array_equal(np.asarray(got), want)


def test_clip_cov_choice_is_a_uniformly_random_subset():
    """Over many keys each candidate is chosen with frequency ≈ k / #candidates, exactly
    ``min(k, #candidates)`` at a time (candidates spread over the batch, gaps between)."""
    rng = np.random.default_rng(0)
    candidates = jnp.asarray(rng.random((8, 64)) < 0.3)
    count, n, ratio = int(candidates.sum()), 400.0, 0.02  # k = 8
    select = jax.jit(
        jax.vmap(lambda key: covariance.select_random(candidates, n, ratio, key, opj.MeshAxes()))
    )
    chosen = np.asarray(select(jax.random.split(jax.random.key(1), 4000)))
    assert np.all(chosen.sum(axis=(1, 2)) == 8)
    assert not np.any(chosen & ~np.asarray(candidates))
    freq = chosen.mean(0)[np.asarray(candidates)]
    # binomial(4000, p = 8 / count): sd ≈ 0.004 at p ≈ 0.05; 5 sd, loose
    np.testing.assert_allclose(freq, 8 / count, atol=0.025)
    assert abs(freq.mean() - 8 / count) < 1e-9  # 8 a draw, every draw


def test_kl_cov_non_finite_covariance_ranks_lowest_among_members():
    """NaN / −inf covariances rank below every finite member (as the lowest finite
    float32, ties by position) but above non-members; +inf ranks highest."""
    inf, nan = np.inf, np.nan
    cov = jnp.asarray([[nan, 1.0, -inf, 5.0, 2.0, inf, -0.0, 0.0]], jnp.float32)
    members = jnp.asarray([[1, 1, 1, 1, 1, 1, 0, 1]], bool)
    pick = jax.jit(lambda n: covariance.select_top(cov, members, n, 1.0, opj.MeshAxes()))
    got = [np.flatnonzero(np.asarray(pick(jnp.float32(k)))[0]).tolist() for k in (1, 5, 6, 7)]
    assert got == [[5], [1, 3, 4, 5, 7], [0, 1, 3, 4, 5, 7], [0, 1, 2, 3, 4, 5, 7]]


# --------------------------------------------------------------------------- layouts


@pytest.mark.heavy
def test_packed_equals_padded():
    """Selection is token-level over the call's tokens: packing sequences (in order) into
    rows picks the same tokens, so value, metrics and gradient are those of one
    sequence per row. Clip-Cov's random choice depends on the layout (priorities by
    flat position): here ``k`` (ratio 1) covers every candidate, so it cannot differ."""
    batch = pc.packed_batch(11, rows=6, length=24, num_segments=3)
    keys = ("logp", "old_logp", "advantages", "mask")
    flat = pc.unpack(batch, 3)
    for fields in ({**CLIP, "clip_cov_ratio": 1.0}, KL):
        config = opj.LossConfig(algorithm="ppo", **fields)
        step = functools.partial(_loss_and_grad, config, key=jax.random.key(2))
        (want, want_metrics), want_grad = jax.jit(step)(*(flat[k] for k in keys))
        packed = functools.partial(step, num_segments=3)
        (got, metrics), grad = jax.jit(lambda *a, f=packed: f(*a[:4], segment_ids=a[4]))(
            *(batch[k] for k in keys), batch["segment_ids"]
        )
        np.testing.assert_allclose(float(got), float(want), rtol=1e-5, atol=1e-7)
        for k in want_metrics:
            np.testing.assert_allclose(float(metrics[k]), float(want_metrics[k]), rtol=1e-5)
        repacked = pc.repack(np.asarray(want_grad), batch["segment_ids"], 3)
        np.testing.assert_allclose(np.asarray(grad), repacked, rtol=1e-5, atol=1e-7)
        assert float(metrics.get("pg_clipfrac", metrics.get("kl_cov_frac"))) > 0


def test_vmap_selects_per_example():
    """Under ``vmap`` each example is its own call: its own means and selection."""
    logp, old, adv, mask = _batch(6)
    config = opj.LossConfig(algorithm="ppo", **KL)
    step = functools.partial(_loss_and_grad, config)
    halves = (np.stack([v[:3], v[3:]]) for v in (logp, old, adv, mask))
    (loss, _), grad = jax.jit(jax.vmap(step))(*halves)
    for i, rows in enumerate((slice(0, 3), slice(3, 6))):
        (want, _), want_grad = jax.jit(step)(logp[rows], old[rows], adv[rows], mask[rows])
        np.testing.assert_allclose(float(loss[i]), float(want), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(grad[i]), np.asarray(want_grad), rtol=1e-6)


def _mesh(shape, names):
    from jax.sharding import AxisType

    devices = jax.devices("cpu")[:8]
    if len(devices) < 8:
        pytest.skip("needs 8 CPU devices (tests/conftest.py sets JAX_NUM_CPU_DEVICES=8)")
    return jax.make_mesh(
        shape, names, axis_types=(AxisType.Explicit,) * len(names), devices=devices
    )


@pytest.mark.slow
@pytest.mark.multi_device
@pytest.mark.parametrize(
    ("shape", "names", "axes"),
    [
        ((2, 4), ("data", "seq"), opj.MeshAxes(batch="data", token="seq")),
        ((8,), ("seq",), opj.MeshAxes(token="seq")),
        ((8,), ("data",), "data"),
    ],
    ids=["data2_seq4", "seq8", "data8"],
)
def test_shard_map_equals_unsharded(shape, names, axes):
    """``shard_map`` with ``axis_names`` (global means and ranks, each device its block)
    and ``jit`` on arrays sharded in their type (explicit mesh) == the unsharded call."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh(shape, names)
    spec = P(*names) if len(names) == 2 else (P(None, "seq") if names == ("seq",) else P("data"))
    logp, old, adv, mask = _batch(8, shape=(8, 32), lengths=(32, 0, 1, 29, 17, 32, 5, 30))
    for fields in (CLIP, KL):
        config = opj.LossConfig(algorithm="ppo", aggregation="sequence_mean", **fields)

        def step(lp, o, a, m, axis_names=None, config=config):
            return _loss_and_grad(config, lp, o, a, m, key=jax.random.key(9), axis_names=axis_names)

        (want, want_metrics), want_grad = jax.jit(step)(logp, old, adv, mask)
        sharded = jax.shard_map(
            functools.partial(step, axis_names=axes),
            mesh=mesh,
            in_specs=(spec,) * 4,
            out_specs=((P(), P()), spec),
        )
        with jax.set_mesh(mesh):
            arrays = [jax.device_put(v, NamedSharding(mesh, spec)) for v in (logp, old, adv, mask)]
            results = [jax.jit(sharded)(*arrays), jax.jit(step)(*arrays)]  # + explicit jit
        for (got, metrics), grad in results:
            np.testing.assert_allclose(float(got), float(want), rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-7)
            for k in want_metrics:
                np.testing.assert_allclose(float(metrics[k]), float(want_metrics[k]), rtol=1e-5)
