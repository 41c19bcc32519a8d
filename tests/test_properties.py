"""Hypothesis properties of compute_correction on ragged, garbage-padded batches."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from strategies import ALL_CORRECTION_CONFIGS, correction_configs, examples, ragged_batches

import offpolicy_jax as opj

correct = jax.jit(opj.compute_correction, static_argnames=("config", "reduction", "axis_names"))
reductions = st.sampled_from(["sequence", "token"])


def _args(batch):
    return batch["old_logp"], batch["rollout_logp"], batch["mask"]


def _without_garbage(batch):
    mask = batch["mask"] > 0
    return {
        k: (np.where(mask, v, 0.0).astype(np.float32) if k in ("old_logp", "rollout_logp") else v)
        for k, v in batch.items()
    }


def _assert_same(a, b, *, exact=True):
    check = (
        np.testing.assert_array_equal
        if exact
        else (
            lambda x, y, err_msg="": np.testing.assert_allclose(
                x, y, rtol=1e-6, atol=1e-7, err_msg=err_msg
            )
        )
    )
    check(np.asarray(a.weights), np.asarray(b.weights))
    check(np.asarray(a.mask), np.asarray(b.mask))
    assert a.metrics.keys() == b.metrics.keys()
    for key in a.metrics:
        check(np.asarray(a.metrics[key]), np.asarray(b.metrics[key]), err_msg=key)


@given(batch=ragged_batches(), config=correction_configs, reduction=reductions)
def test_garbage_at_masked_positions_changes_nothing(batch, config, reduction):
    dirty = correct(*_args(batch), config=config, reduction=reduction)
    clean = correct(*_args(_without_garbage(batch)), config=config, reduction=reduction)
    _assert_same(dirty, clean)


# Each sequence alone, unpadded, at its own length: one program holding one
# compute_correction per sequence compiles in about half the time of one per length.
# Module-level, the config static: examples with the same config and lengths (Hypothesis
# draws some again) reuse the program instead of compiling a fresh closure.
@functools.partial(jax.jit, static_argnums=1)
def _each_alone(seqs, config):
    return [opj.compute_correction(*seq, config, reduction="sequence") for seq in seqs]


@pytest.mark.heavy
@given(
    batch=ragged_batches(holes=False),
    config=st.sampled_from([c for c in ALL_CORRECTION_CONFIGS if not c.tis_batch_normalize]),
)
def test_padded_ragged_batch_equals_sequences_one_by_one(batch, config):
    res = correct(*_args(batch), config=config, reduction="sequence")
    rows = [row for row, length in enumerate(batch["lengths"]) if length > 0]
    seqs = [tuple(x[row, : batch["lengths"][row]] for x in _args(batch)) for row in rows]
    alones = _each_alone(seqs, config)
    per_seq_ppl = []
    for row, alone in zip(rows, alones, strict=True):
        length = batch["lengths"][row]
        np.testing.assert_allclose(np.asarray(res.weights)[row, :length], alone.weights, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(res.mask)[row, :length], alone.mask)
        np.testing.assert_array_equal(np.asarray(res.weights)[row, length:], 0)
        per_seq_ppl.append(float(alone.metrics["mis_training_log_ppl"]))
    # The "sequence" reduction is the plain mean of the per-sequence values.
    want = np.mean(per_seq_ppl) if per_seq_ppl else 0.0
    np.testing.assert_allclose(
        float(res.metrics["mis_training_log_ppl"]), want, rtol=1e-5, atol=1e-6
    )


@pytest.mark.heavy
@settings(max_examples=examples(10))
@given(batch=ragged_batches(), config=correction_configs, reduction=reductions)
def test_jit_equals_eager(batch, config, reduction):
    eager = opj.compute_correction(*_args(batch), config, reduction=reduction)
    _assert_same(correct(*_args(batch), config=config, reduction=reduction), eager, exact=False)


@pytest.mark.heavy
@settings(max_examples=examples(10))
@given(
    batches=st.lists(ragged_batches(), min_size=3, max_size=3),
    config=correction_configs,
    reduction=reductions,
)
def test_vmap_over_leading_axis_equals_loop(batches, config, reduction):
    stacked = [np.stack(xs) for xs in zip(*(_args(b) for b in batches), strict=True)]
    mapped = jax.jit(
        jax.vmap(lambda o, b, m: opj.compute_correction(o, b, m, config, reduction=reduction))
    )(*stacked)
    for i, batch in enumerate(batches):
        one = correct(*_args(batch), config=config, reduction=reduction)
        _assert_same(jax.tree.map(lambda x, i=i: x[i], mapped), one, exact=False)


@pytest.mark.heavy
@given(
    batch=ragged_batches(),
    config=st.sampled_from([c for c in ALL_CORRECTION_CONFIGS if c.tis_batch_normalize]),
)
def test_batch_normalised_mean_weight_is_one(batch, config):
    res = correct(*_args(batch), config=config)
    w, m = np.asarray(res.weights, np.float64), np.asarray(res.mask, np.float64)
    assume(m.sum() > 0)
    if config.tis_level == "token":
        mean = w.sum() / m.sum()
    else:
        kept = m.sum(-1) > 0
        mean = np.mean(w.sum(-1)[kept] / m.sum(-1)[kept])
    if mean <= 1e-8:  # every kept weight ~0: normalisation is skipped, and says so
        assert float(res.metrics["mis_batch_norm_factor"]) == 1.0
        return
    np.testing.assert_allclose(mean, 1.0, rtol=1e-5)


@given(
    batch=ragged_batches(),
    config=st.sampled_from(
        [c for c in ALL_CORRECTION_CONFIGS if c.use_tis and not c.tis_batch_normalize]
    ),
)
def test_bounded_weights_stay_within_bounds(batch, config):
    res = correct(*_args(batch), config=config)
    kept = np.asarray(res.mask) > 0
    w = np.asarray(res.weights)[kept]
    assert np.all(w <= config.upper_bound)
    if config.tis_mode in ("clip", "mask"):
        assert np.all(w >= np.float32(config.lower_bound))
    else:
        assert np.all(w > 0)


@given(batch=ragged_batches(), config=correction_configs, reduction=reductions)
def test_weights_zero_where_mask_zero_and_everything_finite(batch, config, reduction):
    res = correct(*_args(batch), config=config, reduction=reduction)
    w, m = np.asarray(res.weights), np.asarray(res.mask)
    assert np.all(w[m == 0] == 0)
    assert np.all(m[batch["mask"] == 0] == 0)
    assert np.all(np.isfinite(w))
    assert all(np.isfinite(float(v)) for v in res.metrics.values())


@settings(max_examples=examples(10))
@given(
    batch=ragged_batches(),
    config=correction_configs,
    dtype=st.sampled_from([jnp.bfloat16, jnp.float16]),
)
def test_low_precision_inputs_give_float32_outputs(batch, config, dtype):
    old, rollout, mask = _args(_without_garbage(batch))
    # Output dtypes are fixed when the program is traced: the compiled call would return
    # exactly these avals, so tracing (no compilation) checks the same thing.
    res = jax.eval_shape(
        lambda o, b, m: opj.compute_correction(o, b, m, config),
        jnp.asarray(old, dtype),
        jnp.asarray(rollout, dtype),
        mask,
    )
    assert res.weights.dtype == res.mask.dtype == jnp.float32
    assert all(v.dtype == jnp.float32 for v in res.metrics.values())


@settings(max_examples=examples(15))
@given(
    a=ragged_batches(),
    b=ragged_batches(batch=3, max_len=4),
    config=correction_configs,
    reduction=reductions,
)
def test_metric_keys_depend_only_on_config(a, b, config, reduction):
    # The metric keys of a jitted call are its traced output structure: tracing each call
    # (no compilation) gives exactly the keys the compiled calls return.
    def keys(*args):
        traced = jax.eval_shape(
            lambda o, b, m: opj.compute_correction(o, b, m, config, reduction=reduction), *args
        )
        return traced.metrics.keys()

    all_masked = keys(*(np.zeros((2, 3), np.float32),) * 3)
    assert keys(*_args(a)) == keys(*_args(b)) == all_masked
