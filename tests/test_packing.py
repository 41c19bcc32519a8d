"""Packed sequences (docs/semantics.md §10): the host packer, the segment reductions,
and packed == one-per-row.

The oracle is always the one-sequence-per-row layout: :mod:`packing_cases` unpacks a
packed batch with ``unpack_sequences`` and runs the unpacked code there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import packing_cases as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import examples

import offpolicy_jax as opj
from offpolicy_jax import reduction as _reduce
from offpolicy_jax.interop.packing import segment_positions
from offpolicy_jax.reduction import MeshAxes

# --------------------------------------------------------------------------- host packer


def _sequences(lengths, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        out.append(
            {
                "logp": rng.normal(size=n).astype(np.float32),
                "mask": rng.random(n) > 0.3,
                "tag": np.full(n, i, np.int64),
            }
        )
    return out


@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=20),
    length=st.integers(12, 30),
    max_segments=st.none() | st.integers(1, 5),
    sort=st.booleans(),
)
def test_pack_unpack_round_trip(lengths, length, max_segments, sort):
    seqs = _sequences(lengths)
    packed = opj.pack_sequences(seqs, length, max_segments=max_segments, sort=sort, pad_value=-1)
    ids, k = packed.segment_ids, packed.num_segments
    assert ids.dtype == np.int32 and ids.shape == packed.arrays["logp"].shape
    assert ids.shape[1] == length
    if max_segments is not None:
        assert k == max_segments
    assert ids.max(initial=0) <= k
    # every sequence is where the placement says, contiguous, positions 0..n-1
    for i, seq in enumerate(seqs):
        r, s, start, n = (
            packed.rows[i],
            packed.segments[i],
            packed.starts[i],
            lengths[i],
        )
        assert (ids[r] == s).sum() == n
        np.testing.assert_array_equal(packed.arrays["tag"][r, start : start + n], i)
        np.testing.assert_array_equal(packed.arrays["logp"][r, start : start + n], seq["logp"])
        np.testing.assert_array_equal(packed.segment_positions[r, start : start + n], np.arange(n))
    assert (packed.arrays["tag"][ids == 0] == -1).all()  # padding filled with pad_value
    np.testing.assert_array_equal(packed.segment_positions, segment_positions(ids))
    # the inverse: sequence i at [rows[i], segments[i] - 1], left-aligned
    back = opj.unpack_sequences(packed.arrays, ids, k, fill=0)
    for i, seq in enumerate(seqs):
        row = back["logp"][packed.rows[i], packed.segments[i] - 1]
        np.testing.assert_array_equal(row[: lengths[i]], seq["logp"])
        assert (row[lengths[i] :] == 0).all()
        got_mask = back["mask"][packed.rows[i], packed.segments[i] - 1]
        assert got_mask.dtype == bool and not got_mask[lengths[i] :].any()


@given(lengths=st.lists(st.integers(1, 10), min_size=1, max_size=15), sort=st.booleans())
def test_first_fit(lengths, sort):
    """Replaying the placement: each sequence went to the first row with room then."""
    length, cap = 16, 3
    packed = opj.pack_sequences(_sequences(lengths), length, max_segments=cap, sort=sort)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i]) if sort else range(len(lengths))
    loads, counts = [], []
    for i in order:
        fits = [r for r in range(len(loads)) if loads[r] + lengths[i] <= length and counts[r] < cap]
        expected = fits[0] if fits else len(loads)
        if not fits:
            loads.append(0)
            counts.append(0)
        assert packed.rows[i] == expected
        loads[expected] += lengths[i]
        counts[expected] += 1
        assert packed.segments[i] == counts[expected]


def test_pack_tuples_num_rows_and_errors():
    seqs = [
        (np.ones(3, np.float32), np.ones(3, bool)),
        (np.ones(2, np.float32), np.ones(2, bool)),
    ]
    packed = opj.pack_sequences(seqs, 4, num_rows=3)
    assert isinstance(packed.arrays, tuple) and packed.arrays[0].shape == (3, 4)
    assert packed.num_segments == 1 and (packed.segment_ids[2] == 0).all()
    back = opj.unpack_sequences(packed.arrays, packed.segment_ids, 1, length=3)
    assert isinstance(back, tuple) and back[0].shape == (3, 1, 3)
    with pytest.raises(ValueError, match="num_rows"):
        opj.pack_sequences(seqs, 4, num_rows=1)
    with pytest.raises(ValueError, match=r"sequences\[0\] has 3 tokens"):
        opj.pack_sequences(seqs, 2)
    with pytest.raises(ValueError, match=r"sequences\[1\]"):
        opj.pack_sequences([{"a": np.ones(2)}, {"b": np.ones(2)}], 4)
    with pytest.raises(ValueError, match=r"sequences\[0\] arrays"):
        opj.pack_sequences([{"a": np.ones(2), "b": np.ones(3)}], 4)
    with pytest.raises(TypeError, match=r"sequences\[0\]"):
        opj.pack_sequences([np.ones(2)], 4)
    with pytest.raises(ValueError, match="max_segments"):
        opj.pack_sequences(seqs, 4, max_segments=0)
    with pytest.raises(ValueError, match="length"):
        opj.unpack_sequences(packed.arrays, packed.segment_ids, 1, length=2)
    with pytest.raises(TypeError, match="segment_ids"):
        opj.unpack_sequences(packed.arrays, packed.segment_ids.astype(float), 1)


# --------------------------------------------------------------------------- segment reductions

OPS = ("sum", "min", "max")


def _expected(op, value, population, ids, k):
    inside = (population > 0) & (ids == k)
    if op == "sum":
        return np.where(inside, value * population, 0.0).sum(-1)
    fill = np.inf if op == "min" else -np.inf
    x = np.where(inside, value, fill)
    return x.min(-1, initial=fill) if op == "min" else x.max(-1, initial=fill)


@pytest.mark.parametrize("shape", [(6, 64), (2, 3, 40), (5, 13), (3, 0), (64, 256)])
@pytest.mark.parametrize("n", [1, 3, 8, 20])
@pytest.mark.parametrize("num_segments", [1, 3, 8])
def test_segment_reduce_matches_numpy(shape, n, num_segments):
    rng = np.random.default_rng(n * 100 + shape[-1] + num_segments)
    population = np.where(rng.random(shape) < 0.7, rng.choice([1.0, 0.5, 2.0], shape), 0.0)
    population = population.astype(np.float32)
    values = rng.normal(size=(n, *shape)).astype(np.float32)
    ids = rng.integers(-1, num_segments + 2, size=shape).astype(np.int32)  # out-of-range = padding
    padding = (ids < 1) | (ids > num_segments)
    # 0 on padding, as every population of the library (segment_reduce's contract)
    population = np.where(padding, 0.0, population).astype(np.float32)
    values[:, (population == 0) | padding] = np.nan

    def fn(values, population, ids):
        columns = {f"c{i}": _reduce.Column(OPS[i % 3], values[i], population) for i in range(n)}
        return _reduce.segment_reduce(columns, ids, num_segments, MeshAxes())

    got = jax.jit(fn)(values, population, ids)
    for i in range(n):
        want = np.stack(
            [
                _expected(OPS[i % 3], values[i], population, ids, k)
                for k in range(1, num_segments + 1)
            ],
            -1,
        )
        assert got[f"c{i}"].shape == (*shape[:-1], num_segments)
        np.testing.assert_allclose(got[f"c{i}"], want, rtol=1e-5, atol=1e-5, err_msg=f"c{i}")


def _gather(values, ids, fill=0.0):
    padded = np.concatenate([np.full((*values.shape[:-1], 1), fill), values], -1)
    inside = (ids >= 1) & (ids <= values.shape[-1])
    return np.take_along_axis(padded, np.where(inside, ids, 0), -1)


def test_segment_sum_gradient_is_the_gather():
    rng = np.random.default_rng(0)
    shape, num_segments = (4, 3, 37), 5
    x = rng.normal(size=shape).astype(np.float32)
    population = (rng.random(shape) < 0.8).astype(np.float32)
    ids = rng.integers(0, num_segments + 2, size=shape).astype(np.int32)
    cot = rng.normal(size=(*shape[:-1], num_segments)).astype(np.float32)

    def sums(x):
        columns = {"s": _reduce.total(x, population), "n": _reduce.count(population)}
        return _reduce.segment_reduce(columns, ids, num_segments, MeshAxes())["s"]

    grad = jax.jit(jax.grad(lambda x: jnp.sum(sums(x) * cot)))(x)
    np.testing.assert_allclose(grad, _gather(cot, ids) * population, rtol=1e-6)
    # forward mode, and under vmap
    tangent = rng.normal(size=shape).astype(np.float32)
    _, jvp = jax.jvp(sums, (x,), (tangent,))
    want = np.stack(
        [np.where(ids == k, tangent * population, 0).sum(-1) for k in range(1, num_segments + 1)],
        -1,
    )
    np.testing.assert_allclose(jvp, want, rtol=1e-5, atol=1e-5)

    def sums_of(x, population, ids):
        columns = {"s": _reduce.total(x, population)}
        return _reduce.segment_reduce(columns, ids, num_segments, MeshAxes())["s"]

    vmapped = jax.vmap(sums_of)(x, population, ids)
    np.testing.assert_allclose(vmapped, sums(x), rtol=1e-5, atol=1e-6)
    # the backward stores nothing [..., K, T]-sized: one elementwise pass
    hlo = jax.jit(jax.grad(lambda x: jnp.sum(sums(x) * cot))).lower(x).compile().as_text()
    assert f"{num_segments},{shape[-1]}]" not in hlo.replace(" ", "")


def test_segment_broadcast():
    rng = np.random.default_rng(1)
    values = rng.normal(size=(3, 4)).astype(np.float32)
    ids = rng.integers(-1, 6, size=(3, 9)).astype(np.int32)
    got = jax.jit(_reduce.segment_broadcast, static_argnums=2)(values, ids, -7.0)
    np.testing.assert_array_equal(got, _gather(values, ids, -7.0).astype(np.float32))
    flags = values > 0
    np.testing.assert_array_equal(
        _reduce.segment_broadcast(flags, ids, False),
        _gather(flags, ids, False).astype(bool),
    )
    cot = rng.normal(size=ids.shape).astype(np.float32)
    grad = jax.grad(lambda v: jnp.sum(_reduce.segment_broadcast(v, ids) * cot))(values)
    want = np.stack([np.where(ids == k, cot, 0).sum(-1) for k in range(1, 5)], -1)
    np.testing.assert_allclose(grad, want, rtol=1e-6)


def test_check_segments_errors():
    shape = (2, 5)
    ids = np.ones(shape, np.int32)
    assert _reduce.check_segments(None, None, shape) is None
    with pytest.raises(ValueError, match="without num_segments"):
        _reduce.check_segments(ids, None, shape)
    with pytest.raises(ValueError, match="without segment_ids"):
        _reduce.check_segments(None, 3, shape)
    with pytest.raises(TypeError, match="segment_ids must be an integer"):
        _reduce.check_segments(ids.astype(np.float32), 3, shape)
    with pytest.raises(TypeError, match="segment_ids must be an integer"):
        _reduce.check_segments(ids.astype(bool), 3, shape)
    with pytest.raises(ValueError, match="segment_ids has shape"):
        _reduce.check_segments(ids[:, :4], 3, shape)
    with pytest.raises(TypeError, match="num_segments must be a static Python int"):
        _reduce.check_segments(ids, 3.0, shape)
    with pytest.raises(TypeError, match="num_segments must be a static Python int"):
        _reduce.check_segments(ids, jnp.int32(3), shape)
    with pytest.raises(ValueError, match="num_segments must be >= 1"):
        _reduce.check_segments(ids, 0, shape)
    assert _reduce.check_segments(ids.astype(np.int64), np.int64(3), shape).dtype == jnp.int32


# --------------------------------------------------------------------------- the harness


@pytest.mark.heavy
@given(seed=st.integers(0, 2**31 - 1))
def test_harness_per_sequence_reductions(seed):
    """Per-(row, segment) statistics on the packed batch == per-row ones on the unpacked."""
    k = 4
    batch = pc.packed_batch(seed, num_segments=k, garbage=False)
    flat = pc.unpack(batch, k)

    def stats(old, rollout, mask, layout):
        valid = mask > 0
        delta = jnp.where(valid, old - rollout, 0.0)
        sums = layout.reduce(
            {
                "delta": _reduce.total(delta, mask),
                "count": _reduce.count(mask),
                "min": _reduce.minimum(delta, mask),
            }
        )
        geo = _reduce.seq_mean_of_values(
            _reduce.safe_divide(sums["delta"], sums["count"]), sums["count"], "sequence"
        )
        low = _reduce.seq_mean_of_values(sums["min"], sums["count"], "token")
        means = layout.batch_means({"geo": geo, "low": low})
        # a per-sequence value broadcast back to the tokens
        back = jnp.where(valid, layout.broadcast(sums["delta"]), 0.0)
        return means["geo"].value(), means["low"].value(), back

    ids = jnp.asarray(batch["segment_ids"])
    packed = _reduce.Packed(MeshAxes(), ids, k)
    mask = _reduce.only_segments(packed, jnp.asarray(batch["mask"], jnp.float32))
    got = stats(batch["old_logp"], batch["rollout_logp"], mask, packed)
    want = stats(
        flat["old_logp"],
        flat["rollout_logp"],
        flat["mask"].astype(np.float32),
        _reduce.Rows(),
    )
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        got[2], pc.repack(np.asarray(want[2]), batch["segment_ids"], k), rtol=1e-6
    )


# --------------------------------------------------------------------------- public API
# Packed == one-per-row for compute_correction and policy_loss: every correction
# config of strategies.py (every level, mode, RS level, veto, batch norm), every
# algorithm, aggregation and metric reduction, one jitted program per layout.

K = pc.NUM_SEGMENTS


def _loss_configs():
    import mesh_cases as mc

    configs = {name: config for name, (config, _) in mc.LOSSES.items()}
    for algorithm in ("ppo", "bypass_ppo", "decoupled_ppo", "reinforce_is"):
        for aggregation in ("sequence_mean", "token_mean", "sequence_sum"):
            correction = None
            if algorithm in ("decoupled_ppo", "reinforce_is"):
                correction = mc.CORRECTIONS["sequence_mask_rs_geometric"]
            configs[f"{algorithm}/{aggregation}"] = opj.LossConfig(
                algorithm=algorithm,
                correction=correction,
                aggregation=aggregation,
                get_mismatch_metrics=True,
                rejected_in_denominator=aggregation == "token_mean",
            )
    return configs


def _surrogate_configs():
    """Every ``policy_loss`` surrogate with a correction, every aggregation, KL and entropy."""
    import mesh_cases as mc

    return {name: config for name, (config, _) in mc.SURROGATE_LOSSES.items()}


@functools.cache
def _jitted_evaluate(corrections, losses, packed):
    """``packing_cases.evaluate`` jitted once per (configs, layout): the tests that share their configs
    and shapes (seeds of one size, repeated Hypothesis draws) share its compiled programs.
    ``corrections`` and ``losses`` are ``(name, config)`` tuples (configs are hashable)."""
    corrections, losses = dict(corrections), dict(losses)
    if packed:
        return jax.jit(lambda b, s: pc.evaluate(b, corrections, losses, s))
    return jax.jit(lambda b: pc.evaluate(b, corrections, losses))


def _packed_equals(batch, corrections, losses):
    """``packing_cases.evaluate`` of the packed batch and of its sequences one per row (repacked)."""
    key = (tuple(corrections.items()), tuple(losses.items()))
    got = _jitted_evaluate(*key, packed=True)(batch, batch["segment_ids"])
    return got, _one_per_row(batch, corrections, losses)


def _one_per_row(batch, corrections, losses):
    flat = pc.unpack(batch, K)
    key = (tuple(corrections.items()), tuple(losses.items()))
    got = _jitted_evaluate(*key, packed=False)(flat)
    return jax.tree.map(
        lambda x: pc.repack(x, batch["segment_ids"], K) if np.ndim(x) == 2 else np.asarray(x),
        got,
    )


def _assert_matches(got, want, segment_ids):
    padding = np.asarray(segment_ids) == 0
    assert got.keys() == want.keys()
    for name in want:
        assert got[name]["metrics"].keys() == want[name]["metrics"].keys(), name
        for key, w in want[name].items():
            if key == "metrics":
                for metric, value in w.items():
                    np.testing.assert_allclose(
                        np.asarray(got[name]["metrics"][metric]),
                        value,
                        rtol=1e-5,
                        atol=1e-6,
                        err_msg=f"{name} {metric}",
                    )
                continue
            g = np.asarray(got[name][key])
            assert g.dtype == np.float32, (name, key)
            if g.ndim == 2:
                assert np.all(g[padding] == 0), f"{name} {key}: padding is not 0"
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"{name} {key}")


def _corrections():
    """Every TIS level x mode x RS level (none / token / sequence / geometric), with
    batch normalisation and the veto (none, 1e-4, 0.05) cycling through them, and the
    metrics-only config: every value of every key, every pair of level, mode and RS
    level (the full product of strategies.py is 217 configs, too many to compile)."""
    import itertools

    from strategies import ALL_CORRECTION_CONFIGS

    configs = {}
    for i, (level, mode, rs) in enumerate(
        itertools.product(
            ("token", "sequence", "geometric"),
            ("truncate", "clip", "mask"),
            (None, "token", "sequence", "geometric"),
        )
    ):
        configs[f"{level}/{mode}/rs={rs}"] = next(
            c
            for c in ALL_CORRECTION_CONFIGS
            if c.use_tis
            and (c.tis_level, c.tis_mode) == (level, mode)
            and (c.rs_level if c.use_rs else None) == rs
            and c.tis_batch_normalize == bool(i % 2)
            and c.rs_veto_threshold == (None, 1e-4, 0.05)[i % 3]
        )
    configs["metrics_only"] = opj.CorrectionConfig(use_tis=False)
    return configs


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0])
def test_every_correction_config_packed_equals_one_per_row(seed):
    batch = pc.packed_batch(seed, rows=6, length=24, num_segments=K)
    corrections = _corrections()
    got, want = _packed_equals(batch, corrections, {})
    _assert_matches(got, want, batch["segment_ids"])


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3])
def test_every_algorithm_packed_equals_one_per_row(seed):
    batch = pc.packed_batch(seed, rows=6, length=24, num_segments=K)
    losses = _loss_configs()
    got, want = _packed_equals(batch, {}, losses)
    _assert_matches(got, want, batch["segment_ids"])


@pytest.mark.slow
@pytest.mark.parametrize("seed", [4])
def test_every_surrogate_packed_equals_one_per_row(seed):
    """GSPO (its sequence ratio), GMPO (its geometric means), CISPO, SAPO, GPG, DPPO, DRO
    with corrections, every aggregation, the KL and entropy terms: value, metrics and
    gradient of the packed batch == one sequence per row."""
    batch = pc.packed_batch(seed, rows=6, length=24, num_segments=K)
    losses = _surrogate_configs()
    got, want = _packed_equals(batch, {}, losses)
    _assert_matches(got, want, batch["segment_ids"])


# Tiers: the test above compiles all 18 surrogate configs into two programs (~1 s of CPU
# per config); the fast tier runs this subset of it: a sequence-ratio (GSPO), a
# geometric-mean (GMPO) and a token-level surrogate with the KL and entropy terms, and a
# bypass one with rejection and the row mean.
CORE_SURROGATES = (
    "decoupled_gspo_sequence_mean",
    "decoupled_gmpo_sequence_sum_norm",
    "decoupled_cispo_kl_k3_off_policy_entropy",
    "bypass_sapo_rejection_row_mean",
)


@pytest.mark.heavy
@pytest.mark.parametrize("seed", [4])
def test_core_surrogates_packed_equal_one_per_row(seed):
    batch = pc.packed_batch(seed, rows=6, length=24, num_segments=K)
    losses = {name: _surrogate_configs()[name] for name in CORE_SURROGATES}
    got, want = _packed_equals(batch, {}, losses)
    _assert_matches(got, want, batch["segment_ids"])


@pytest.mark.slow
@settings(max_examples=examples(10))
@given(
    seed=st.integers(0, 2**31 - 1),
    config=st.sampled_from(sorted(_corrections().items())),
    loss=st.sampled_from(sorted({**_loss_configs(), **_surrogate_configs()}.items())),
)
def test_random_packed_batches_equal_one_per_row(seed, config, loss):
    batch = pc.packed_batch(seed, rows=5, length=19, num_segments=K)
    corrections, losses = dict([config]), dict([loss])
    got, want = _packed_equals(batch, corrections, losses)
    _assert_matches(got, want, batch["segment_ids"])


def test_padding_is_never_trained_on_whatever_the_mask_says():
    batch = pc.packed_batch(7, num_segments=K, garbage=False)
    mask = np.ones_like(batch["mask"])  # padding claims to be trained on
    config = opj.LossConfig(algorithm="ppo")

    def loss(logp, ids):
        return opj.policy_loss(
            logp,
            batch["old_logp"],
            None,
            batch["advantages"],
            mask,
            config,
            segment_ids=ids,
            num_segments=K,
        )[0]

    grad = jax.jit(jax.grad(loss))(batch["logp"], batch["segment_ids"])
    assert np.all(np.asarray(grad)[batch["segment_ids"] == 0] == 0)
    res = jax.jit(
        lambda ids: opj.compute_correction(
            batch["old_logp"],
            batch["rollout_logp"],
            mask,
            opj.CorrectionConfig(use_tis=True),
            segment_ids=ids,
            num_segments=K,
        )
    )(batch["segment_ids"])
    assert np.all(np.asarray(res.mask)[batch["segment_ids"] == 0] == 0)


def test_packed_argument_errors():
    batch = pc.packed_batch(0, num_segments=K)
    args = (
        batch["old_logp"],
        batch["rollout_logp"],
        batch["mask"],
        opj.CorrectionConfig(),
    )
    ids = batch["segment_ids"]
    with pytest.raises(ValueError, match="without num_segments"):
        opj.compute_correction(*args, segment_ids=ids)
    with pytest.raises(ValueError, match="without segment_ids"):
        opj.compute_correction(*args, num_segments=K)
    with pytest.raises(TypeError, match="segment_ids must be an integer"):
        opj.compute_correction(*args, segment_ids=ids.astype(np.float32), num_segments=K)
    with pytest.raises(ValueError, match="segment_ids has shape"):
        opj.compute_correction(*args, segment_ids=ids[:, :-1], num_segments=K)
    config = opj.LossConfig(algorithm="ppo")
    loss_args = (batch["logp"], batch["old_logp"], None)
    with pytest.raises(ValueError, match="advantages"):
        opj.policy_loss(
            *loss_args,
            batch["advantages"][:, 0],
            batch["mask"],
            config,
            segment_ids=ids,
            num_segments=K,
        )
    with pytest.raises(ValueError, match="without num_segments"):
        opj.policy_loss(*loss_args, batch["advantages"], batch["mask"], config, segment_ids=ids)
    with pytest.raises(TypeError, match="num_segments must be a static"):
        jax.jit(
            lambda k: opj.policy_loss(
                *loss_args,
                batch["advantages"],
                batch["mask"],
                config,
                segment_ids=ids,
                num_segments=k,
            )
        )(K)


# --------------------------------------------------------------------------- sharded


def _mesh(axis_type):
    from jax.sharding import AxisType  # noqa: F401  (the caller passes one)

    return jax.make_mesh(
        (2, 4),
        ("data", "seq"),
        axis_types=(axis_type,) * 2,
        devices=jax.devices("cpu")[:8],
    )


def _sharded_configs():
    import mesh_cases as mc

    losses = {k: c for k, (c, _) in mc.LOSSES.items() if k in mc.CORE_LOSSES}
    losses["vanilla"] = mc.LOSSES["decoupled_vanilla_tis"][0]
    # per-sequence surrogates whose sequences cross token shards, row_mean, KL + entropy
    for name in (
        "decoupled_gspo_sequence_mean",
        "decoupled_gmpo_sequence_sum_norm",
        "bypass_sapo_rejection_row_mean",
        "decoupled_cispo_kl_k3_off_policy_entropy",
    ):
        losses[name] = mc.SURROGATE_LOSSES[name][0]
    corrections = {k: mc.CORRECTIONS[k] for k in mc.FULL_CORRECTIONS}
    return corrections, losses


@pytest.mark.slow
@pytest.mark.multi_device
@pytest.mark.parametrize("path", ["shard_map", "jit"])
def test_sharded_packed_equals_unsharded(path):
    """8 devices, ``P('data', 'seq')``: sequences cross token-shard boundaries."""
    import mesh_cases as mc
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    batch = pc.packed_batch(11, rows=8, length=32, num_segments=K)
    # a long sequence that spans every token shard of row 0
    batch["segment_ids"][0] = np.where(np.arange(32) < 30, 1, 0)
    corrections, losses = _sharded_configs()
    want = mc.to_numpy(
        jax.jit(lambda b, s: pc.evaluate(b, corrections, losses, s))(batch, batch["segment_ids"])
    )
    mesh = _mesh(AxisType.Explicit)
    spec = P("data", "seq")
    with jax.set_mesh(mesh):
        arrays = {k: jax.device_put(v, NamedSharding(mesh, spec)) for k, v in batch.items()}
        ids = arrays["segment_ids"]
        if path == "shard_map":
            axes = opj.MeshAxes(batch="data", token="seq")

            def body(b, s):
                return pc.evaluate(b, corrections, losses, s, axis_names=axes)

            shapes = jax.eval_shape(
                lambda b, s: pc.evaluate(b, corrections, losses, s), arrays, ids
            )
            fn = jax.jit(
                jax.shard_map(
                    body,
                    mesh=mesh,
                    in_specs=(spec, spec),
                    out_specs=mc.output_specs(shapes, spec),
                )
            )
        else:
            fn = jax.jit(lambda b, s: pc.evaluate(b, corrections, losses, s))
        got = mc.to_numpy(fn(arrays, ids))
    _assert_matches(got, want, batch["segment_ids"])


@pytest.mark.slow
@pytest.mark.multi_device
@pytest.mark.parametrize("path", ["shard_map", "jit"])
def test_packed_hlo_moves_no_token_data(path):
    """Only ``[B_local, K]`` per-segment partials and scalars cross devices."""
    import mesh_cases as mc
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    rows, length, k = 8, 512, 8
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 120, size=(rows * 6,))
    seqs = [
        dict(
            logp=rng.normal(-1, 0.3, n).astype(np.float32),
            old_logp=rng.normal(-1, 0.3, n).astype(np.float32),
            rollout_logp=rng.normal(-1, 0.3, n).astype(np.float32),
            advantages=rng.normal(size=n).astype(np.float32),
            mask=np.ones(n, bool),
        )
        for n in lengths
    ]
    packed = opj.pack_sequences(seqs, length, max_segments=k, num_rows=rows)
    correction = opj.CorrectionConfig(
        use_tis=True,
        tis_level="geometric",
        tis_mode="mask",
        tis_lower_bound=0.05,
        tis_upper_bound=20.0,
        tis_batch_normalize=True,
        use_rs=True,
        rs_level="sequence",
        rs_lower_bound=0.1,
        rs_upper_bound=10.0,
        rs_veto_threshold=1e-4,
    )
    config = opj.LossConfig(
        algorithm="decoupled_ppo", correction=correction, get_mismatch_metrics=True
    )
    mesh = _mesh(AxisType.Explicit)
    spec = P("data", "seq")

    def step(a, ids, axis_names=None):
        def loss_fn(logp):
            return opj.policy_loss(
                logp,
                a["old_logp"],
                a["rollout_logp"],
                a["advantages"],
                a["mask"],
                config,
                axis_names=axis_names,
                segment_ids=ids,
                num_segments=k,
            )

        (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(a["logp"])
        res = opj.compute_correction(
            a["old_logp"],
            a["rollout_logp"],
            a["mask"],
            correction,
            axis_names=axis_names,
            segment_ids=ids,
            num_segments=k,
        )
        return loss, metrics, grad, res.weights, res.mask, res.metrics

    with jax.set_mesh(mesh):
        arrays = {
            key: jax.device_put(v, NamedSharding(mesh, spec)) for key, v in packed.arrays.items()
        }
        ids = jax.device_put(packed.segment_ids, NamedSharding(mesh, spec))
        if path == "shard_map":
            shapes = jax.eval_shape(step, arrays, ids)
            axes = opj.MeshAxes(batch="data", token="seq")
            fn = jax.jit(
                jax.shard_map(
                    lambda a, s: step(a, s, axes),
                    mesh=mesh,
                    in_specs=(spec, spec),
                    out_specs=mc.output_specs(shapes, spec),
                )
            )
        else:
            fn = jax.jit(step)
        collectives = mc.hlo_collectives(mc.compiled_text(fn, arrays, ids))
    print(f"\n[packed / {path}]\n{mc.summarize_collectives(collectives)}")
    assert collectives
    local = length // 4
    for c in collectives:
        for shape in c["shapes"]:
            assert int(np.prod(shape)) < local, c["line"][:300]
            assert local not in shape and length not in shape, c["line"][:300]


@pytest.mark.heavy
def test_docs_packed_example_runs():
    import doc_pages

    page = doc_pages.DOCS / "guide" / "packing.md"
    blocks = doc_pages.marked_blocks("packed-example", page)
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(blocks[0], str(page), "exec"), namespace)  # noqa: S102 - our own docs
    assert np.isfinite(float(namespace["loss"]))
    assert namespace["packed"].segment_ids.max() <= 4


def test_without_segment_ids_the_program_is_unchanged():
    """No ``segment_ids``: the jaxpr is the one-sequence-per-row program, with no trace
    of the packed layout (and passing ``None`` explicitly is the same call)."""
    batch = pc.unpack(pc.packed_batch(3, num_segments=K), K)
    correction = opj.CorrectionConfig(
        use_tis=True,
        tis_level="geometric",
        use_rs=True,
        rs_level="sequence",
        rs_lower_bound=0.5,
        rs_upper_bound=2.0,
        rs_veto_threshold=1e-3,
        tis_batch_normalize=True,
    )
    config = opj.LossConfig(algorithm="decoupled_ppo", correction=correction)
    names = ("logp", "old_logp", "rollout_logp", "advantages", "mask")

    def loss(*arrays, **packed):
        return jax.value_and_grad(lambda lp: opj.policy_loss(lp, *arrays[1:], config, **packed)[0])(
            arrays[0]
        )

    def corr(*arrays, **packed):
        return opj.compute_correction(*arrays[1:4], correction, **packed)

    args = tuple(batch[k] for k in names)
    for fn in (loss, corr):
        plain = str(jax.make_jaxpr(fn)(*args))
        explicit = str(
            jax.make_jaxpr(lambda *a, fn=fn: fn(*a, segment_ids=None, num_segments=None))(*args)
        )
        assert plain == explicit
        packed = str(
            jax.make_jaxpr(
                lambda *a, fn=fn: fn(*a, segment_ids=np.ones(a[0].shape, np.int32), num_segments=2)
            )(*args)
        )
        # the per-segment scatters and the gathers back to tokens: packed rows only
        assert "scatter" in packed and "scatter" not in plain
        assert "gather" in packed and "gather" not in plain
