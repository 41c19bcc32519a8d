"""Asynchronous RL in compute_correction: versions, staleness, partial rollouts,
non-finite rollout log-probs (docs/guide/async.md).

* A NumPy reference, sequence by sequence from the definitions, of the staleness rule
  (token and sequence level), the partial-rollout prefix mask, ``nonfinite_rollout``
  and their metrics, on ragged batches with NaN / ±inf garbage in the padding;
* packed rows give the same result as one sequence per row;
* ``mis_staleness_max`` pools with ``max`` over micro-batches (``stages.Extreme``), the other
  metrics exactly as ``MeanParts``;
* shard_map over data and token axes equals the unsharded call;
* errors name the missing or malformed argument.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import offpolicy_jax as opj
from offpolicy_jax import reduction
from offpolicy_jax._src.correction import compute as correction
from offpolicy_jax._src.correction import stages, staleness

GARBAGE = (np.nan, np.inf, -np.inf, 1e30)


def np_async(old, rollout, mask, versions, current, cfg, reduction="sequence"):
    """float64 (final mask, weights, metrics) from the definitions; tis_mode "truncate"."""
    mask = np.asarray(mask) > 0
    old, rollout = np.array(old, np.float64), np.array(rollout, np.float64)
    filled = np.zeros_like(mask)
    if cfg.nonfinite_rollout == "neutral":
        filled = mask & ~np.isfinite(rollout) & np.isfinite(old)
        rollout = np.where(filled, old, rollout)
    finite = np.where(mask, np.isfinite(old) & np.isfinite(rollout), True).all(axis=-1)
    valid = mask & finite[:, None]
    age = (current - np.asarray(versions)).astype(np.float64)
    # A negative version (AReaL's −1) is no generation version: no age, never compared.
    aged = valid & (np.asarray(versions) >= 0)
    keep = valid.copy()
    seq_stale = np.zeros(len(mask), bool)
    if cfg.max_weight_staleness is not None:
        stale = aged & (age > cfg.max_weight_staleness)
        seq_stale = stale.any(axis=-1)
        keep &= ~(seq_stale[:, None] if cfg.staleness_level == "sequence" else stale)
    newest = np.where(aged, versions, np.iinfo(np.int64).min).max(axis=-1)
    oldest = np.where(aged, versions, np.iinfo(np.int64).max).min(axis=-1)
    prefix = aged & (versions < newest[:, None])
    if cfg.mask_offpolicy_in_partial_rollout:
        keep &= ~prefix
    with np.errstate(invalid="ignore"):  # inf − inf in the garbage, never selected
        delta = np.where(valid, old - rollout, 0.0)
    weights = np.where(keep, np.minimum(np.exp(np.clip(delta, -20, 20)), cfg.tis_upper_bound), 0.0)

    n = valid.sum(axis=-1)
    some = n > 0

    def mean(token_values, population=valid):
        values = np.where(population, token_values, 0.0)
        count = population.sum(axis=-1)
        if reduction == "token":
            return values.sum() / max(count.sum(), 1)
        per_seq = values.sum(axis=-1)[count > 0] / count[count > 0]
        return per_seq.mean() if per_seq.size else 0.0

    def seq_mean(per_seq_values):
        if reduction == "token":
            return (per_seq_values * n)[some].sum() / max(n.sum(), 1)
        return per_seq_values[some].mean() if some.any() else 0.0

    metrics = {
        "mis_staleness_mean": mean(age, aged),
        "mis_staleness_max": np.where(aged, age, -np.inf).max() if aged.any() else 0.0,
    }
    if cfg.max_weight_staleness is not None:
        metrics["mis_staleness_fraction_high"] = mean(stale)
        metrics["mis_staleness_seq_fraction"] = seq_mean(seq_stale.astype(float))
    if cfg.mask_offpolicy_in_partial_rollout:
        metrics["mis_offpolicy_prefix_fraction"] = mean(prefix)
        metrics["mis_offpolicy_prefix_seq_fraction"] = seq_mean((oldest < newest).astype(float))
    if cfg.nonfinite_rollout == "neutral":
        metrics["mis_nonfinite_rollout_token_fraction"] = mean(filled)
    return keep.astype(float), weights, metrics


@st.composite
def async_batches(draw):
    batch = draw(st.integers(1, 5))
    length = draw(st.integers(1, 9))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = (batch, length)
    lengths = rng.integers(0, length + 1, size=batch)  # ragged, some empty
    mask = (np.arange(length) < lengths[:, None]) & (rng.random(shape) > 0.1)
    old = rng.normal(-1.2, 0.5, shape)
    rollout = old + rng.normal(0, 0.3, shape)
    current = int(rng.integers(3, 9))
    # Partial rollouts: each sequence starts at some version and may move up mid-way.
    start = current - rng.integers(0, 5, size=batch)
    bumps = (rng.random(shape) < 0.2).cumsum(axis=-1)
    versions = np.minimum(start[:, None] + bumps, current)
    if draw(st.booleans()):  # a non-finite rollout log-prob at a valid token
        rows, cols = np.nonzero(mask)
        if rows.size:
            i = rng.integers(rows.size)
            rollout[rows[i], cols[i]] = rng.choice([np.nan, -np.inf])
    hole = ~mask
    old[hole] = rng.choice(GARBAGE, size=int(hole.sum()))
    rollout[hole] = rng.choice(GARBAGE, size=int(hole.sum()))
    versions = np.where(hole, rng.integers(-(2**20), 2**20, size=shape), versions)
    cfg = opj.CorrectionConfig(
        use_tis=True,
        max_weight_staleness=draw(st.none() | st.integers(0, 4)),
        staleness_level=draw(st.sampled_from(["sequence", "token"])),
        mask_offpolicy_in_partial_rollout=draw(st.booleans()),
        nonfinite_rollout=draw(st.sampled_from(["reject", "neutral"])),
    )
    reduction = draw(st.sampled_from(["sequence", "token"]))
    return old, rollout, mask, versions, current, cfg, reduction


@pytest.mark.heavy
@given(async_batches())
def test_async_rules_match_numpy_reference(case):
    old, rollout, mask, versions, current, cfg, reduction = case
    res = jax.jit(
        lambda o, b, m, v, c: opj.compute_correction(
            o, b, m, cfg, reduction=reduction, versions=v, current_version=c
        )
    )(jnp.asarray(old, jnp.float32), jnp.asarray(rollout, jnp.float32), mask, versions, current)
    keep, weights, metrics = np_async(
        np.asarray(old, np.float32),
        np.asarray(rollout, np.float32),
        mask,
        versions,
        current,
        cfg,
        reduction,
    )
    np.testing.assert_array_equal(res.mask, keep)
    np.testing.assert_allclose(res.weights, weights, rtol=1e-6, atol=1e-6)
    for key, want in metrics.items():
        np.testing.assert_allclose(res.metrics[key], want, rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.heavy
def test_versions_leave_the_default_rules_alone_and_neutral_is_ratio_one():
    old = jnp.log(jnp.array([[0.5, 0.9, 0.2], [0.4, 0.4, 0.1]]))
    rollout = jnp.log(jnp.array([[0.5, 0.3, 0.2], [0.4, 0.5, 0.9]])).at[0, 1].set(jnp.nan)
    mask = jnp.array([[1, 1, 1], [1, 1, 0]], bool)
    cfg = opj.CorrectionConfig(use_tis=True)
    plain = opj.compute_correction(old, rollout, mask, cfg)
    versioned = opj.compute_correction(
        old, rollout, mask, cfg, versions=jnp.ones((2, 3), int), current_version=3
    )
    np.testing.assert_array_equal(plain.weights, versioned.weights)
    assert float(versioned.metrics["mis_staleness_mean"]) == 2.0
    assert set(versioned.metrics) - set(plain.metrics) == {
        "mis_staleness_mean",
        "mis_staleness_max",
    }
    # reject (default): the sequence with the NaN leaves; neutral: that token has ratio 1.
    assert float(plain.mask[0].sum()) == 0
    neutral = opj.compute_correction(
        old, rollout, mask, opj.CorrectionConfig(use_tis=True, nonfinite_rollout="neutral")
    )
    np.testing.assert_allclose(neutral.weights[0], [1.0, 1.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(
        neutral.metrics["mis_nonfinite_rollout_token_fraction"], 1 / 6, rtol=1e-6
    )
    np.testing.assert_allclose(neutral.metrics["mis_nonfinite_seq_fraction"], 0.0)


def _packed_case(seed=0):
    rng = np.random.default_rng(seed)
    lengths = [5, 3, 0, 7, 2, 4]
    current = 6
    seqs = []
    for length in lengths:
        old = rng.normal(-1.0, 0.4, length).astype(np.float32)
        versions = np.minimum(
            current - rng.integers(0, 4) + (rng.random(length) < 0.3).cumsum(), current
        )
        seqs.append(
            dict(
                old=old,
                rollout=(old + rng.normal(0, 0.3, length)).astype(np.float32),
                mask=(rng.random(length) > 0.1).astype(np.float32),
                versions=versions.astype(np.int32),
            )
        )
    return seqs, current


@pytest.mark.heavy
def test_packed_rows_equal_one_sequence_per_row():
    seqs, current = _packed_case()
    cfg = opj.CorrectionConfig(
        use_tis=True, max_weight_staleness=2, mask_offpolicy_in_partial_rollout=True
    )
    packed = opj.pack_sequences(seqs, 12, max_segments=3)
    a = packed.arrays
    # Jitted (one compile per layout, not an eager dispatch per operation).
    correct = jax.jit(opj.compute_correction, static_argnums=3, static_argnames=("num_segments",))
    got = correct(
        a["old"],
        a["rollout"],
        a["mask"],
        cfg,
        segment_ids=packed.segment_ids,
        num_segments=packed.num_segments,
        versions=a["versions"],
        current_version=current,
    )
    rows = opj.unpack_sequences(a, packed.segment_ids, packed.num_segments, length=12)
    rows = {k: v.reshape(-1, 12) for k, v in rows.items()}
    want = correct(
        rows["old"],
        rows["rollout"],
        rows["mask"],
        cfg,
        versions=rows["versions"],
        current_version=current,
    )
    for key in want.metrics:
        np.testing.assert_allclose(
            got.metrics[key], want.metrics[key], rtol=1e-5, atol=1e-6, err_msg=key
        )
    unpacked_mask = opj.unpack_sequences(
        {"m": np.asarray(got.mask)}, packed.segment_ids, packed.num_segments, length=12
    )["m"].reshape(-1, 12)
    np.testing.assert_array_equal(unpacked_mask, want.mask)


@pytest.mark.heavy
def test_micro_batches_pool_exactly_and_the_max_with_max():
    old, rollout, mask, versions, current = _pool_case()
    cfg = opj.CorrectionConfig(use_tis=True, max_weight_staleness=3)

    def parts(rows):
        """A micro-batch's metric parts (what policy_loss_parts pools)."""
        v, c = staleness.check_versions(versions[rows], current, old[rows].shape, needed_by=None)
        return correction.correction_parts(
            jnp.asarray(old[rows]),
            jnp.asarray(rollout[rows]),
            jnp.asarray(mask[rows], jnp.float32),
            cfg,
            reduction="sequence",
            layout=reduction.layout(opj.MeshAxes(), None, None, old[rows].shape),
            versions=v,
            current_version=c,
        )[2]

    whole = parts(slice(None))
    first, second = parts(slice(0, 2)), parts(slice(2, None))
    pooled = stages.pool(first, second)
    assert isinstance(pooled["mis_staleness_max"], stages.Extreme)
    for key, value in whole.items():
        np.testing.assert_allclose(pooled[key].value(), value.value(), rtol=1e-6, err_msg=key)
    # The maximum is in the second micro-batch only: a mean of the two would be lower.
    assert float(first["mis_staleness_max"].value()) < float(whole["mis_staleness_max"].value())


def _pool_case():
    rng = np.random.default_rng(7)
    shape = (5, 6)
    old = rng.normal(-1, 0.5, shape).astype(np.float32)
    rollout = (old + rng.normal(0, 0.2, shape)).astype(np.float32)
    mask = rng.random(shape) > 0.2
    mask[2:, 0] = True
    versions = np.full(shape, 9)
    versions[3, 0] = 4  # the oldest token of the batch, in the second micro-batch
    return old, rollout, mask, versions, 10


@pytest.mark.parametrize(
    ("kwargs", "cfg", "error", "match"),
    [
        (dict(), dict(max_weight_staleness=1), ValueError, "versions is required"),
        (dict(), dict(mask_offpolicy_in_partial_rollout=True), ValueError, "versions is required"),
        (dict(versions=np.ones((2, 3), int)), dict(), ValueError, "current_version is required"),
        (dict(current_version=3), dict(), ValueError, "without versions"),
        (dict(versions=np.ones((2, 3)), current_version=3), dict(), TypeError, "versions"),
        (dict(versions=np.ones((2, 4), int), current_version=3), dict(), ValueError, "versions"),
        (
            dict(versions=np.ones((2, 3), int), current_version=2.5),
            dict(),
            TypeError,
            "current_version",
        ),
        (
            dict(versions=np.ones((2, 3), int), current_version=np.ones(4, int)),
            dict(),
            ValueError,
            "current_version",
        ),
    ],
)
def test_bad_versions_are_refused(kwargs, cfg, error, match):
    x = jnp.zeros((2, 3))
    with pytest.raises(error, match=match):
        opj.compute_correction(
            x, x, jnp.ones((2, 3)), opj.CorrectionConfig(use_tis=True, **cfg), **kwargs
        )


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (dict(use_tis=False, max_weight_staleness=2), "use_tis"),
        (dict(use_tis=False, mask_offpolicy_in_partial_rollout=True), "use_tis"),
        (dict(use_tis=True, max_weight_staleness=-1), "max_weight_staleness"),
        (dict(use_tis=True, max_weight_staleness=True), "max_weight_staleness"),
        (dict(use_tis=True, nonfinite_rollout="skip"), "nonfinite_rollout"),
        (dict(use_tis=True, staleness_level="geometric"), "staleness_level"),
    ],
)
def test_bad_async_keys_are_refused(cfg, match):
    with pytest.raises(ValueError, match=match):
        opj.CorrectionConfig(**cfg)
    assert (
        opj.CorrectionConfig.from_yaml(
            "use_tis: true\nmax_weight_staleness: 4\n"
        ).max_weight_staleness
        == 4
    )


@pytest.mark.multi_device
@pytest.mark.slow
@pytest.mark.usefixtures("clear_jax_caches")
def test_shard_map_over_data_and_tokens_equals_unsharded():
    if len(jax.devices("cpu")) < 8:
        pytest.skip("needs JAX_NUM_CPU_DEVICES=8 (tests/conftest.py)")
    rng = np.random.default_rng(3)
    shape = (4, 16)
    old = rng.normal(-1, 0.5, shape).astype(np.float32)
    rollout = (old + rng.normal(0, 0.3, shape)).astype(np.float32)
    mask = (rng.random(shape) > 0.2).astype(np.float32)
    current = 8
    versions = np.minimum(
        current - rng.integers(0, 5, (4, 1)) + (rng.random(shape) < 0.2).cumsum(-1), current
    )
    cfg = opj.CorrectionConfig(
        use_tis=True, max_weight_staleness=2, mask_offpolicy_in_partial_rollout=True
    )
    want = opj.compute_correction(
        old, rollout, mask, cfg, versions=versions, current_version=current
    )
    mesh = jax.make_mesh((2, 4), ("data", "tok"), devices=jax.devices("cpu")[:8])
    spec = P("data", "tok")

    def step(o, b, m, v):
        res = opj.compute_correction(
            o,
            b,
            m,
            cfg,
            versions=v,
            current_version=current,
            axis_names=opj.MeshAxes(batch="data", token="tok"),
        )
        return res.mask, res.metrics

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, P())))
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (old, rollout, mask, versions)]
    got_mask, got_metrics = fn(*args)
    np.testing.assert_array_equal(got_mask, want.mask)
    for key, value in want.metrics.items():
        np.testing.assert_allclose(got_metrics[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
