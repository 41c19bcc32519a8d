"""Metric parts: pooling every kind exactly, the ratio's two tails, and metrics that stay
finite and keep their rows.

* :func:`offpolicy_jax.pool_metric_parts` pools micro-batches (and devices) to the full
  batch's metrics for every kind of part: means, batch maxima and minima, the ESS;
* ``nonfinite_rollout="neutral"`` keeps a sequence with a NaN ``π_rollout`` in the PPO
  and bypass losses, as ``compute_correction`` keeps it;
* ``mis_ess`` is finite for float mask weights of 1e20;
* both tails of the IS ratio, before any bound or clamp and after the bound, against a
  float64 NumPy reference; and Hypothesis properties over them (pooled == full batch,
  padding invariance, finite at extreme weights).
"""

from __future__ import annotations

import functools
import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import offpolicy_jax as opj

# ------------------------------------------------------------------ a batch with every kind

B, T = 8, 9
CURRENT = 10


def _batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = (B, T)
    old = rng.normal(-1.5, 0.6, shape).astype(np.float32)
    delta = rng.normal(0.0, 0.3, shape)
    delta[1, 3] = math.log(1e-3)  # the low tail a bound hides
    delta[5, 2] = 2.5
    rollout = (old - delta).astype(np.float32)
    logp = (old + rng.normal(0.0, 0.1, shape)).astype(np.float32)
    adv = rng.normal(0.0, 1.0, B).astype(np.float32)
    lengths = np.array([9, 4, 0, 7, 1, 9, 3, 6])
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    ages = rng.integers(0, 4, shape)
    ages[6, 1] = 8  # the batch's oldest token, in the last micro-batch only
    versions = (CURRENT - ages).astype(np.int32)
    return logp, old, rollout, adv, mask, versions


def _every_kind_config() -> opj.LossConfig:
    """Means, maxima (staleness, rule P_max), minima (rule P_min, MinPRO), the ESS and the
    new tails, all in one call (no batch normalisation: it needs the whole batch)."""
    return opj.LossConfig(
        algorithm="decoupled_ppo",
        correction=opj.CorrectionConfig(
            use_tis=True,
            tis_upper_bound=2.0,
            use_rs=True,
            rs_level="minpro",
            rs_lower_bound=1e-6,
            rs_upper_bound=1e6,
            rs_criteria=("token_k1:2.0", "seq_max_k2:2.5"),
            max_weight_staleness=6,
        ),
    )


def _parts(rows, config, *, axis_names=None, arrays=None):
    logp, old, rollout, adv, mask, versions = arrays if arrays is not None else _batch()
    return opj.policy_loss_parts(
        logp[rows],
        old[rows],
        rollout[rows],
        adv[rows],
        mask[rows],
        config,
        versions=versions[rows],
        current_version=CURRENT,
        axis_names=axis_names,
    )


def _assert_metrics_equal(got, want, rtol=2e-6):
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=rtol, atol=1e-6, err_msg=key)


@pytest.mark.heavy
def test_pool_metric_parts_pools_every_kind_to_the_full_batch():
    """Micro-batches pooled with pool_metric_parts equal one call on the whole batch, for
    means, maxima, minima and the ESS alike; one micro-batch holds no sequence at all."""
    config = _every_kind_config()
    full_loss, full = _parts(slice(None), config)
    kinds = {type(v).__name__ for v in full.values()}
    assert {"MeanParts", "Extreme", "EffectiveSampleSize"} <= kinds
    assert {v.kind for v in full.values() if type(v).__name__ == "Extreme"} == {"max", "min"}
    splits = (slice(0, 2), slice(2, 3), slice(3, 6), slice(6, 8))  # rows 2: empty
    loss_parts, metric_parts = zip(*(_parts(rows, config) for rows in splits), strict=True)
    pooled = opj.pool_metric_parts(*metric_parts)
    _assert_metrics_equal(opj.finalize_metrics(pooled), opj.finalize_metrics(full))
    pooled_loss = opj.pool_metric_parts(*loss_parts)
    np.testing.assert_allclose(pooled_loss.value(), full_loss.value(), rtol=2e-6)
    # Independent float64 reference for two extremes: the oldest valid token's age, and
    # the raw token ratio's smallest value.
    _, old, rollout, _, mask, versions = _batch()
    valid = mask > 0
    got = opj.finalize_metrics(pooled)
    assert float(got["mis_staleness_max"]) == float(np.max((CURRENT - versions)[valid]))
    raw = np.exp(old.astype(np.float64) - rollout.astype(np.float64))
    np.testing.assert_allclose(got["mis_is_ratio_min_before_bound"], raw[valid].min(), rtol=1e-5)
    # Adding the leaves (the old documented way) adds the maxima instead.
    first, third = metric_parts[0], metric_parts[2]
    added = jax.tree.map(jnp.add, first, third)
    assert float(added["mis_staleness_max"].numerator) > float(
        opj.pool_metric_parts(first, third)["mis_staleness_max"].numerator
    )


@pytest.mark.heavy
def test_pool_metric_parts_refuses_finished_values_and_token_axes():
    _, metrics = _parts(slice(0, 2), _every_kind_config())
    with pytest.raises(TypeError, match="MeanParts"):
        opj.pool_metric_parts(opj.finalize_metrics(metrics))
    with pytest.raises(ValueError, match="token axes"):
        opj.pool_metric_parts(metrics, axis_names=opj.MeshAxes(batch="data", token="tok"))
    with pytest.raises(TypeError, match="at least one"):
        opj.pool_metric_parts()


@pytest.mark.multi_device
@pytest.mark.usefixtures("clear_jax_caches")
def test_pool_metric_parts_over_devices_equals_the_full_batch_and_axis_names():
    """Per-device parts pooled with pool_metric_parts(axis_names=...) inside shard_map
    (sums psum-ed, extremes pmax / pmin-ed) == the full batch == the call given
    axis_names itself."""
    if len(jax.devices("cpu")) < 8:
        pytest.skip("needs JAX_NUM_CPU_DEVICES=8 (tests/conftest.py)")
    config = _every_kind_config()
    _, want = _parts(slice(None), config)
    want = opj.finalize_metrics(want)
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices("cpu")[:8])
    spec = P("data")

    def local_then_pooled(*arrays):
        _, parts = _parts(slice(None), config, arrays=arrays)
        return opj.finalize_metrics(opj.pool_metric_parts(parts, axis_names="data"))

    def pooled_inside(*arrays):
        _, parts = _parts(slice(None), config, arrays=arrays, axis_names="data")
        return opj.finalize_metrics(parts)

    arrays = [jax.device_put(x, NamedSharding(mesh, spec)) for x in _batch()]
    for body in (local_then_pooled, pooled_inside):
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 6, out_specs=P()))
        _assert_metrics_equal(fn(*arrays), want, rtol=1e-5)


# ------------------------------------------------------- neutral non-finite rollout log-probs


def _ppo_reference(theta, denominator, adv, mask, eps=0.2):
    """float64 PPO clip, sequence_mean over the non-empty sequences."""
    r = np.exp(theta.astype(np.float64) - denominator.astype(np.float64))
    a = adv.astype(np.float64)[:, None]
    loss = np.maximum(-a * r, -a * np.clip(r, 1 - eps, 1 + eps))
    n = mask.sum(-1)
    per_seq = np.where(mask > 0, loss, 0.0).sum(-1) / np.where(n > 0, n, 1)
    return per_seq[n > 0].mean()


@pytest.mark.parametrize("algorithm", ["ppo", "bypass_ppo"])
def test_neutral_rollout_keeps_the_sequence_in_ppo_and_bypass_losses(algorithm):
    """A NaN π_rollout read as neutral keeps its sequence in the loss and is counted, as in
    compute_correction with the same config."""
    logp, old, rollout, adv, mask, _ = _batch(1)
    rollout = rollout.copy()
    rollout[0, 2] = np.nan
    cfg = opj.CorrectionConfig(use_tis=False, nonfinite_rollout="neutral")
    config = opj.LossConfig(algorithm=algorithm, correction=cfg, aggregation="sequence_mean")
    given_old = old if algorithm == "ppo" else None
    loss, metrics = opj.policy_loss(logp, given_old, rollout, adv, mask, config)
    if algorithm == "ppo":
        want = _ppo_reference(logp, old, adv, mask)
        proxy = old
    else:  # π_rollout is the ratio's denominator; the neutral read is sg(θ): ratio 1
        want = _ppo_reference(logp, np.where(np.isfinite(rollout), rollout, logp), adv, mask)
        proxy = logp
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    assert float(metrics["mis_nonfinite_seq_fraction"]) == 0.0
    expected = opj.compute_correction(proxy, rollout, mask, cfg).metrics
    assert float(metrics["mis_nonfinite_rollout_token_fraction"]) > 0.0
    for key, value in expected.items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-6, err_msg=key)


# ------------------------------------------------------------------------- ESS, 1e20 weights


def test_ess_is_finite_and_exact_for_float_mask_weights_of_1e20():
    old = np.full((2, 3), -1.0, np.float32)
    delta = np.array([[0.5, -0.7, 0.2], [1.5, 0.0, -0.1]])
    rollout = (old - delta).astype(np.float32)
    mask = np.array([[1e20, 3e20, 0.0], [2e20, 1e20, 5e19]], np.float32)
    res = opj.compute_correction(old, rollout, mask, opj.CorrectionConfig(use_tis=True))
    d = old.astype(np.float64) - rollout.astype(np.float64)
    w = np.minimum(np.exp(d), 2.0)
    m = mask.astype(np.float64)
    want = (w * m).sum() ** 2 / (m.sum() * (w * w * m).sum())
    assert np.isfinite(float(res.metrics["mis_ess"]))
    np.testing.assert_allclose(float(res.metrics["mis_ess"]), want, rtol=1e-5)
    # Scale-invariant: the same weights with a 0/1-scale mask give the same ESS.
    small = opj.compute_correction(old, rollout, mask / 1e20, opj.CorrectionConfig(use_tis=True))
    np.testing.assert_allclose(res.metrics["mis_ess"], small.metrics["mis_ess"], rtol=1e-6)


# ------------------------------------------------------------- both tails of the ratio

TAIL_KEYS = (
    "mis_is_ratio_min_before_bound",
    "mis_is_ratio_max_before_bound",
    "mis_is_ratio_fraction_low_before_bound",
    "mis_is_ratio_fraction_high_before_bound",
    "mis_is_ratio_fraction_low_final",
    "mis_is_ratio_fraction_high_final",
    "mis_is_ratio_batch_min_final",
    "mis_is_ratio_batch_max_final",
)


def _seq_mean(x, pop):
    """Mean over sequences non-empty in ``pop`` of their ``pop``-weighted means."""
    n = pop.sum(-1)
    per_seq = np.where(pop > 0, x * pop, 0.0).sum(-1) / np.where(n > 0, n, 1)
    return per_seq[n > 0].mean() if (n > 0).any() else 0.0


def _prefix_min(delta, valid):
    out = np.full(delta.shape, np.inf)
    for i in range(delta.shape[0]):
        low = np.inf
        for j in range(delta.shape[1]):
            out[i, j] = low
            if valid[i, j]:
                low = min(low, delta[i, j])
    return out


def tails_reference(old, rollout, mask, level, mode, lower, upper, normalize=False):
    """float64: the eight tail metrics of docs/semantics.md §3 (reduction "sequence")."""
    valid = mask > 0
    d = np.where(valid, old.astype(np.float64) - rollout.astype(np.float64), 0.0)
    n = mask.sum(-1, keepdims=True)
    if level == "token":
        lam = d
    elif level == "minpro":
        pm = _prefix_min(d, valid)
        lam = d + np.where(pm < np.inf, pm, 0.0)
    else:
        total = (d * mask).sum(-1, keepdims=True)
        lam = total if level == "sequence" else total / np.where(n > 0, n, 1)
        lam = np.broadcast_to(lam, d.shape)
    r = np.exp(np.minimum(lam, 50.0))
    rho = np.exp(np.clip(lam, -20.0, 20.0))
    if mode == "truncate":
        w, keep = np.minimum(rho, upper), np.ones(d.shape, bool)
    elif mode == "clip":
        w, keep = np.clip(rho, lower, upper), np.ones(d.shape, bool)
    else:  # mask
        keep = (rho >= lower) & (rho <= upper)
        if level in ("sequence", "geometric"):
            keep = np.broadcast_to(keep.all(-1, keepdims=True), d.shape)
        w = np.where(keep, rho, 0.0)
    final = np.where(keep & valid, mask, 0.0)
    mu = 1.0
    if normalize and (final > 0).any():
        mu = (w * final).sum() / final.sum()
    kept = final > 0
    return {
        "mis_is_ratio_min_before_bound": r[valid].min() if valid.any() else 0.0,
        "mis_is_ratio_max_before_bound": r[valid].max() if valid.any() else 0.0,
        "mis_is_ratio_fraction_low_before_bound": _seq_mean((r < lower) * 1.0, mask),
        "mis_is_ratio_fraction_high_before_bound": _seq_mean((r > upper) * 1.0, mask),
        "mis_is_ratio_fraction_low_final": _seq_mean((w < lower) * 1.0, final),
        "mis_is_ratio_fraction_high_final": _seq_mean((w > upper) * 1.0, final),
        "mis_is_ratio_batch_min_final": (w / mu)[kept].min() if kept.any() else 0.0,
        "mis_is_ratio_batch_max_final": (w / mu)[kept].max() if kept.any() else 0.0,
    }


@pytest.mark.parametrize(
    "level, mode, normalize",
    [
        ("token", "truncate", False),
        ("token", "clip", False),
        ("token", "mask", False),
        ("token", "truncate", True),
        ("sequence", "truncate", False),
        ("geometric", "mask", False),
        ("minpro", "clip", False),
    ],
)
def test_both_tails_before_and_after_the_bound_match_numpy(level, mode, normalize):
    """The raw minimum 1e-3 that a truncated or clipped weight hides (``_min_final`` reads
    a bounded value) is reported before the bound, with the share below the lower bound."""
    _, old, rollout, _, mask, _ = _batch()
    cfg = opj.CorrectionConfig(
        use_tis=True,
        tis_level=level,
        tis_mode=mode,
        tis_upper_bound=2.0 if level in ("token", "minpro") else 4.0,
        tis_batch_normalize=normalize,
    )
    got = opj.compute_correction(old, rollout, mask, cfg).metrics
    want = tails_reference(
        old, rollout, mask, level, mode, cfg.lower_bound, cfg.upper_bound, normalize
    )
    for key in TAIL_KEYS:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=1e-7, err_msg=key)
    if level == "token":
        np.testing.assert_allclose(got["mis_is_ratio_min_before_bound"], 1e-3, rtol=1e-5)
        assert float(got["mis_is_ratio_fraction_low_before_bound"]) > 0.0


# ------------------------------------------------------------------ Hypothesis properties

HB, HT = 4, 7
PAD = 3
PROPERTY_CONFIGS = tuple(
    opj.CorrectionConfig(use_tis=True, tis_level=level, tis_mode=mode, tis_upper_bound=2.0)
    for level, mode in (
        ("token", "truncate"),
        ("token", "clip"),
        ("token", "mask"),
        ("sequence", "truncate"),
        ("geometric", "clip"),
        ("minpro", "truncate"),
    )
)


@jax.jit
def _all_tails(old, rollout, mask):
    """The tail metrics of every property config (one compiled program)."""
    return [opj.compute_correction(old, rollout, mask, c).metrics for c in PROPERTY_CONFIGS]


def _split_parts(config, old, rollout, mask, cut):
    from offpolicy_jax import reduction
    from offpolicy_jax._src.correction.compute import correction_parts

    def parts(o, b, m):
        layout = reduction.layout(reduction.MeshAxes(), None, None, o.shape)
        return correction_parts(o, b, m, config, reduction="sequence", layout=layout)[2]

    return parts(old[:cut], rollout[:cut], mask[:cut]), parts(old[cut:], rollout[cut:], mask[cut:])


@jax.jit
def _pooled_and_full(old, rollout, mask):
    out = []
    for c in PROPERTY_CONFIGS:
        a, b = _split_parts(c, old, rollout, mask, HB // 2)
        pooled = opj.finalize_metrics(opj.pool_metric_parts(a, b))
        full = opj.compute_correction(old, rollout, mask, c).metrics
        out.append((pooled, full))
    return out


@st.composite
def tail_batches(draw):
    """Ragged rows (empty ones included) with log-ratios from exact sixteenths up to ±40
    (past the ±20 clamp), garbage (NaN, ±inf) in the padding, float mask weights."""
    shape = (HB, HT)
    lengths = np.array(draw(st.lists(st.integers(0, HT), min_size=HB, max_size=HB)))
    valid = np.arange(HT)[None, :] < lengths[:, None]
    old = draw(hnp.arrays(np.int16, shape, elements=st.integers(-96, -1))) / 16.0
    delta = draw(hnp.arrays(np.int16, shape, elements=st.integers(-640, 640))) / 16.0
    junk = draw(hnp.arrays(np.float32, shape, elements=st.sampled_from([np.nan, np.inf, -np.inf])))
    weight = draw(st.sampled_from([1.0, 0.5, 1e20]))
    mask = np.where(valid, weight, 0.0).astype(np.float32)
    rollout = np.where(valid, old - delta, junk).astype(np.float32)
    return old.astype(np.float32), rollout, mask


@given(tail_batches())
def test_property_tails_equal_numpy_reference(batch):
    old, rollout, mask = batch
    for config, got in zip(PROPERTY_CONFIGS, _all_tails(old, rollout, mask), strict=True):
        want = tails_reference(old, rollout, mask, config.tis_level, config.tis_mode, 0.5, 2.0)
        for key in TAIL_KEYS:
            np.testing.assert_allclose(
                got[key], want[key], rtol=2e-5, atol=1e-7, err_msg=f"{config.tis_level} {key}"
            )


@given(tail_batches())
@pytest.mark.heavy
def test_property_two_micro_batches_pool_to_the_full_batch(batch):
    for pooled, full in _pooled_and_full(*batch):
        for key in full:
            np.testing.assert_allclose(pooled[key], full[key], rtol=2e-5, atol=1e-6, err_msg=key)


@pytest.mark.heavy
@given(tail_batches(), st.sampled_from([np.nan, np.inf, -1e30]))
def test_property_padding_leaves_the_metrics_unchanged(batch, junk):
    old, rollout, mask = batch
    pad = ((0, 0), (0, PAD))
    padded = (
        np.pad(old, pad, constant_values=junk),
        np.pad(rollout, pad, constant_values=junk),
        np.pad(mask, pad),
    )
    for got, want in zip(_all_tails(*padded), _all_tails(old, rollout, mask), strict=True):
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7, err_msg=key)


@given(tail_batches())
def test_property_metrics_are_finite_at_extreme_weights(batch):
    """Log-ratios past the clamp and mask weights of 1e20: every metric finite."""
    old, rollout, mask = batch
    for weights in (mask, np.where(mask > 0, 1e20, 0.0).astype(np.float32)):
        for metrics in _all_tails(old, rollout, weights):
            bad = [k for k, v in metrics.items() if not np.isfinite(float(v))]
            assert not bad, bad


def test_the_ratio_metrics_produced_are_the_ones_documented():
    """Every ``mis_is_ratio_*`` key a reweighting correction emits is listed on the
    metrics page, and every one listed there is emitted."""
    import pathlib
    import re

    page = pathlib.Path(__file__).parents[1] / "docs" / "guide" / "metrics.md"
    documented = set(re.findall(r"`(mis_is_ratio_[a-z_]+)`", page.read_text()))
    _, old, rollout, _, mask, _ = _batch()
    produced = set()
    for mode in ("truncate", "clip", "mask", "none"):
        cfg = opj.CorrectionConfig(use_tis=True, tis_mode=mode)
        keys = jax.eval_shape(
            functools.partial(opj.compute_correction, config=cfg), old, rollout, mask
        )
        produced |= {k for k in keys.metrics if k.startswith("mis_is_ratio_")}
    assert produced == documented
