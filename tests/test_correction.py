"""compute_correction against the independent NumPy reference, its errors, and D1–D10."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import ALL_CORRECTION_CONFIGS, correction_configs, examples, ragged_batches

import offpolicy_jax as opj

correct = jax.jit(opj.compute_correction, static_argnames=("config", "reduction", "axis_names"))

MIS_YAML = opj.CorrectionConfig(
    use_tis=True,
    use_rs=True,
    tis_level="token",
    rs_level="token",
    tis_mode="truncate",
    tis_lower_bound=0.5,
    tis_upper_bound=2.0,
    rs_veto_threshold=1e-4,
    tis_batch_normalize=True,
)


def assert_matches_reference(batch, config, reduction):
    res = correct(
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
    assert set(metrics) <= set(res.metrics)
    for key, value in metrics.items():
        np.testing.assert_allclose(
            float(res.metrics[key]), value, rtol=1e-5, atol=1e-5, err_msg=key
        )


@settings(max_examples=examples(40))
@given(
    batch=ragged_batches(),
    config=correction_configs,
    reduction=st.sampled_from(["sequence", "token"]),
)
def test_matches_numpy_reference(batch, config, reduction):
    assert_matches_reference(batch, config, reduction)


def test_mis_yaml_example_config_is_shipped():
    from importlib import resources

    path = resources.files("offpolicy_jax") / "configs" / "mis.yaml"
    assert opj.CorrectionConfig.from_yaml(str(path)) == MIS_YAML


def _example(seed=0, batch=4, length=9):
    rng = np.random.default_rng(seed)
    old = (-rng.exponential(size=(batch, length))).astype(np.float32)
    rollout = (old + 0.3 * rng.standard_normal((batch, length))).astype(np.float32)
    mask = (np.arange(length)[None] < rng.integers(1, length + 1, size=(batch, 1))).astype(
        np.float32
    )
    return old, rollout, mask


# ------------------------------------------------------------------------ input errors


def test_error_scalar_input_names_argument():
    with pytest.raises(ValueError, match="old_logp"):
        opj.compute_correction(jnp.float32(0.0), jnp.float32(0.0), jnp.float32(1.0), MIS_YAML)


def test_error_mismatched_shapes_name_argument():
    old, rollout, mask = _example()
    with pytest.raises(ValueError, match="rollout_logp"):
        correct(old, rollout[:, :-1], mask, config=MIS_YAML)
    with pytest.raises(ValueError, match="mask"):
        correct(old, rollout, mask[:-1], config=MIS_YAML)


def test_error_integer_logprobs():
    old, rollout, mask = _example()
    with pytest.raises(TypeError, match="old_logp.*floating"):
        correct(old.astype(np.int32), rollout, mask, config=MIS_YAML)
    with pytest.raises(TypeError, match="rollout_logp"):
        correct(old, rollout.astype(np.int32), mask, config=MIS_YAML)


def test_error_bad_reduction_and_config_type():
    old, rollout, mask = _example()
    with pytest.raises(ValueError, match="reduction"):
        opj.compute_correction(old, rollout, mask, MIS_YAML, reduction="mean")
    with pytest.raises(TypeError, match="CorrectionConfig"):
        opj.compute_correction(old, rollout, mask, {"use_tis": True})


# ------------------------------------------------------------------------ dtypes, layout


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_inputs_give_float32_outputs(dtype):
    old, rollout, mask = _example()
    res = correct(jnp.asarray(old, dtype), jnp.asarray(rollout, dtype), mask, config=MIS_YAML)
    assert res.weights.dtype == jnp.float32 and res.mask.dtype == jnp.float32
    assert all(v.dtype == jnp.float32 and v.shape == () for v in res.metrics.values())
    # Upcasting is exact, so the result equals the float32 call on the rounded inputs.
    want = correct(
        jnp.asarray(old, dtype).astype(jnp.float32),
        jnp.asarray(rollout, dtype).astype(jnp.float32),
        mask,
        config=MIS_YAML,
    )
    np.testing.assert_array_equal(res.weights, want.weights)


def test_bool_mask_equals_float_mask():
    old, rollout, mask = _example()
    a = correct(old, rollout, mask, config=MIS_YAML)
    b = correct(old, rollout, mask.astype(bool), config=MIS_YAML)
    np.testing.assert_array_equal(a.weights, b.weights)
    assert a.metrics.keys() == b.metrics.keys()


def test_result_is_a_pytree():
    old, rollout, mask = _example()
    res = correct(old, rollout, mask, config=MIS_YAML)
    leaves, tree = jax.tree.flatten(res)
    assert len(leaves) == 2 + len(res.metrics)
    rebuilt = jax.tree.unflatten(tree, leaves)
    assert (
        isinstance(rebuilt, opj.CorrectionResult) and rebuilt.metrics.keys() == res.metrics.keys()
    )
    doubled = jax.tree.map(lambda x: 2 * x, res)
    np.testing.assert_allclose(doubled.weights, 2 * np.asarray(res.weights))


def test_weights_carry_no_gradient():
    old, rollout, mask = _example()
    grad = jax.grad(
        lambda o, b: jnp.sum(opj.compute_correction(o, b, mask, MIS_YAML).weights), argnums=(0, 1)
    )(old, rollout)
    assert all(np.all(np.asarray(g) == 0) for g in grad)


# ------------------------------------------------------------------------ metric keys

# §4; the probability metrics of §8 come with them only when asked for.
MONITORING = set(ref.MONITORING_KEYS)
PROBABILITY = {"mis_token_mult_prob_error", "mis_js_divergence"}


@pytest.mark.parametrize(
    "config, extra",
    [
        (opj.CorrectionConfig(use_tis=False), set()),
        (opj.CorrectionConfig(use_tis=True), {"mis_tis_truncate_fraction"}),
        (
            opj.CorrectionConfig(use_tis=True, tis_mode="clip"),
            {"mis_tis_clip_fraction_low", "mis_tis_clip_fraction_high"},
        ),
        (
            opj.CorrectionConfig(
                use_tis=True, tis_mode="mask", use_rs=True, rs_veto_threshold=1e-3
            ),
            {
                "mis_tis_mask_fraction_low",
                "mis_tis_mask_fraction_high",
                "mis_rs_mask_fraction_low",
                "mis_rs_mask_fraction_high",
                "mis_rs_catastrophic_token_fraction",
                "mis_rs_catastrophic_seq_fraction",
            },
        ),
        (
            opj.CorrectionConfig(
                use_tis=True,
                tis_mode="band",
                rs_criteria=("token_k1:2.0", "seq_max_k2:2.5"),
                seq_logprob_error_threshold=2.0,
                m2po_tau=0.1,
            ),
            {"mis_tis_band_fraction_low", "mis_tis_band_fraction_high", "mis_m2po_m2_after"}
            | {
                f"{p}_{s}"
                for p in (
                    "mis_rs_token_k1",
                    "mis_rs_seq_max_k2",
                    "mis_seq_logprob_error",
                    "mis_m2po",
                )
                for s in ("mean", "max", "min", "fraction_high", "seq_fraction")
            }
            | {"mis_rs_token_k1_fraction_low"},
        ),
        (opj.CorrectionConfig(use_tis=True, tis_mode="none"), set()),
        (opj.CorrectionConfig(probability_metrics=True), PROBABILITY),
        (
            opj.CorrectionConfig(use_tis=True, probability_metrics=True),
            PROBABILITY | {"mis_tis_truncate_fraction"},
        ),
    ],
)
def test_metric_keys_follow_config(config, extra):
    old, rollout, mask = _example()
    # The keys are the traced program's output structure, which the compiled call returns
    # unchanged: tracing alone (no compilation) reads them.
    keys = set(
        jax.eval_shape(
            lambda o, b, m: opj.compute_correction(o, b, m, config), old, rollout, mask
        ).metrics
    )
    common = {
        "mis_tis_weight_before_bound",
        "mis_tis_weight_after_bound",
        "mis_is_ratio_mean_after_tis_rs",
        "mis_batch_norm_factor",
        "mis_is_ratio_mean_final",
        "mis_is_ratio_min_final",
        "mis_is_ratio_max_final",
        "mis_nonfinite_seq_fraction",
        "mis_ess",
        "mis_is_ratio_min_before_bound",
        "mis_is_ratio_max_before_bound",
        "mis_is_ratio_batch_min_final",
        "mis_is_ratio_batch_max_final",
    }
    if config.tis_mode != "none":  # both tails of a bound, before it and after
        common |= {
            f"mis_is_ratio_fraction_{side}_{when}"
            for side in ("low", "high")
            for when in ("before_bound", "final")
        }
    assert keys == MONITORING | (common | extra if config.use_tis else extra)


# ------------------------------------------------------------------------ D1–D10


def _batch(old, rollout, mask):
    return dict(
        old_logp=np.asarray(old, np.float32),
        rollout_logp=np.asarray(rollout, np.float32),
        mask=np.asarray(mask, np.float32),
    )


def test_d1_veto_works_without_rs():
    old = np.zeros((2, 3))
    rollout = np.array([[0.0, 0.0, 0.0], [0.0, 12.0, 0.0]])  # δ = −12 < log(1e-4)
    mask = np.ones((2, 3))
    config = opj.CorrectionConfig(use_tis=True, use_rs=False, rs_veto_threshold=1e-4)
    res = correct(*_batch(old, rollout, mask).values(), config=config)
    np.testing.assert_array_equal(res.mask, [[1, 1, 1], [0, 0, 0]])
    assert float(res.metrics["mis_rs_catastrophic_seq_fraction"]) == 0.5
    np.testing.assert_allclose(float(res.metrics["mis_rs_catastrophic_token_fraction"]), 1 / 6)


def test_d2_batch_norm_factor_emitted_when_off():
    res = correct(*_example(), config=opj.CorrectionConfig(use_tis=True))
    assert float(res.metrics["mis_batch_norm_factor"]) == 1.0


def test_d3_garbage_at_masked_positions_never_leaks():
    old, rollout, mask = _example()
    clean = correct(old, rollout, mask, config=MIS_YAML)
    for junk in (np.nan, np.inf, -np.inf, 1e30):
        dirty = correct(
            np.where(mask > 0, old, junk), np.where(mask > 0, rollout, -junk), mask, config=MIS_YAML
        )
        np.testing.assert_array_equal(dirty.weights, clean.weights)
        for key in clean.metrics:
            assert float(dirty.metrics[key]) == float(clean.metrics[key]), key


@pytest.mark.parametrize("mode", ["truncate", "clip", "mask"])
def test_d4_geometric_level_with_batch_normalisation(mode):
    old, rollout, mask = _example(seed=3)
    config = opj.CorrectionConfig(
        use_tis=True,
        tis_level="geometric",
        tis_mode=mode,
        tis_upper_bound=3.0,
        tis_batch_normalize=True,
    )
    res = correct(old, rollout, mask, config=config)
    kept = np.asarray(res.mask).sum(-1) > 0
    per_seq = np.asarray(res.weights).sum(-1)[kept] / np.asarray(res.mask).sum(-1)[kept]
    np.testing.assert_allclose(per_seq.mean(), 1.0, rtol=1e-6)


def test_d6_batch_norm_mean_excludes_rejected_weights():
    # Token 2 of sequence 0 has ratio e^20 and is rejected by mask mode: it must
    # not enter μ, so the kept weights (all 1) stay exactly 1.
    old = np.array([[0.0, 0.0, 30.0], [0.0, 0.0, 0.0]])
    rollout = np.zeros((2, 3))
    config = opj.CorrectionConfig(use_tis=True, tis_mode="mask", tis_batch_normalize=True)
    res = correct(*_batch(old, rollout, np.ones((2, 3))).values(), config=config)
    np.testing.assert_array_equal(res.weights, [[1, 1, 0], [1, 1, 1]])
    assert float(res.metrics["mis_batch_norm_factor"]) == 1.0


def test_d7_final_stats_only_over_kept_tokens():
    old = np.array([[0.0, 1.0, -5.0]])  # ratios 1, e, e^-5; mask mode keeps [0.5, 2]
    res = correct(
        *_batch(old, np.zeros((1, 3)), np.ones((1, 3))).values(),
        config=opj.CorrectionConfig(use_tis=True, tis_mode="mask"),
    )
    assert float(res.metrics["mis_is_ratio_min_final"]) == 1.0
    assert float(res.metrics["mis_is_ratio_max_final"]) == 1.0
    assert float(res.metrics["mis_is_ratio_mean_final"]) == 1.0


def test_d8_mask_mode_after_bound_weights_are_bounded():
    old = np.array([[0.0, 15.0, 0.5]])
    res = correct(
        *_batch(old, np.zeros((1, 3)), np.ones((1, 3))).values(),
        config=opj.CorrectionConfig(use_tis=True, tis_mode="mask", tis_upper_bound=2.0),
    )
    np.testing.assert_allclose(
        float(res.metrics["mis_tis_weight_after_bound"]), (1 + np.exp(0.5)) / 2, rtol=1e-6
    )


@pytest.mark.parametrize("reduction", ["sequence", "token"])
def test_d10_empty_sequences_left_out_of_metric_reductions(reduction):
    old, rollout, mask = _example()
    padded = [np.concatenate([x, np.zeros_like(x[:2])]) for x in (old, rollout, mask)]
    a = correct(old, rollout, mask, config=MIS_YAML, reduction=reduction)
    b = correct(*padded, config=MIS_YAML, reduction=reduction)
    for key in a.metrics:
        np.testing.assert_allclose(
            float(b.metrics[key]), float(a.metrics[key]), rtol=1e-6, err_msg=key
        )


def test_nonfinite_valid_token_rejects_its_sequence():
    old, rollout, mask = _example()
    mask[:] = 1
    old[1, 2] = np.nan
    rollout[2, 0] = -np.inf
    res = correct(old, rollout, mask, config=MIS_YAML)
    np.testing.assert_array_equal(np.asarray(res.mask)[1:3], 0)
    assert np.all(np.isfinite(np.asarray(res.weights)))
    assert float(res.metrics["mis_nonfinite_seq_fraction"]) == 0.5
    assert all(np.isfinite(float(v)) for v in res.metrics.values())


def test_fractional_mask_weights_tokens():
    old, rollout, mask = _example()
    half = mask * 0.5
    config = opj.CorrectionConfig(use_tis=True, tis_level="geometric")
    full = correct(old, rollout, mask, config=config)
    frac = correct(old, rollout, half, config=config)
    # Geometric means divide by Σm: halving every mask value changes nothing there
    # (a max(N, 1) clamp would have halved short sequences' log-ratios).
    np.testing.assert_allclose(np.asarray(frac.weights), 0.5 * np.asarray(full.weights), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(frac.mask), half)


def test_all_configs_in_strategy_are_valid_and_distinct():
    assert len(set(ALL_CORRECTION_CONFIGS)) == len(ALL_CORRECTION_CONFIGS) > 200
