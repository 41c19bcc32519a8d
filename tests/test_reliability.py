"""Regression tests of issue 30: inputs that gave a plausible number instead of an error.

One test per finding; each failed on 05d9d1f. The campaign properties that would have
caught each class are in tests/test_campaign.py.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import offpolicy_jax as opj

MIS = opj.CorrectionConfig.preset("mis")


def _packed_batch(seed=0, rows=2, length=12, segments=3):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-1.0, 0.3, (rows, length)).astype(np.float32)
    old = (logp - 0.05).astype(np.float32)
    rollout = (logp + rng.normal(0.0, 0.3, (rows, length))).astype(np.float32)
    adv = rng.normal(size=(rows, length)).astype(np.float32)
    ids = np.repeat(np.arange(1, segments + 1), length // segments)[None].repeat(rows, 0)
    return logp, old, rollout, adv, np.ones((rows, length), bool), ids.astype(np.int32)


# --------------------------------------------------------------------------- packing


def test_segment_ids_above_num_segments_raise_eagerly_and_are_padding_under_jit():
    logp, old, rollout, adv, mask, ids = _packed_batch()
    config = opj.LossConfig(algorithm="decoupled_ppo", correction=MIS)
    with pytest.raises(ValueError, match="segment_ids holds id 3 but num_segments is 2"):
        opj.policy_loss(logp, old, rollout, adv, mask, config, segment_ids=ids, num_segments=2)
    with pytest.raises(ValueError, match="num_segments"):
        opj.compute_correction(old, rollout, mask, MIS, segment_ids=ids, num_segments=2)
    # Under jit the ids are not read (no host sync): an id above K is padding (§10).
    padded = np.where(ids > 2, 0, ids)
    traced = jax.jit(
        lambda ids: opj.policy_loss(
            logp, old, rollout, adv, mask, config, segment_ids=ids, num_segments=2
        )[0]
    )
    want = opj.policy_loss(
        logp, old, rollout, adv, mask, config, segment_ids=padded, num_segments=2
    )
    np.testing.assert_allclose(float(traced(ids)), float(want[0]), rtol=1e-6)


def test_int64_segment_ids_beyond_int32_raise_instead_of_wrapping():
    logp, old, rollout, adv, mask, ids = _packed_batch()
    wide = ids.astype(np.int64)
    wide[:, -2:] = 2**32 + 1  # would wrap to segment 1 in int32
    with pytest.raises(ValueError, match="segment_ids holds ids outside int32"):
        opj.compute_correction(old, rollout, mask, MIS, segment_ids=wide, num_segments=3)


# --------------------------------------------------------------------------- masks


@pytest.mark.parametrize("bad", [2, 255, -1])
def test_integer_mask_other_than_0_1_raises_naming_mask(bad):
    logp, old, rollout, adv, mask, _ = _packed_batch()
    ints = mask.astype(np.int32)
    ints[0, 1] = bad
    config = opj.LossConfig(algorithm="decoupled_ppo", correction=MIS)
    with pytest.raises(ValueError, match="mask is an integer mask holding"):
        opj.policy_loss(logp, old, rollout, adv, ints, config)
    with pytest.raises(ValueError, match="mask"):
        opj.compute_correction(old, rollout, jnp.asarray(ints), MIS)
    # Float values are documented weights: a weighted mean (numerator and denominator).
    weights = np.where(mask, 1.0, 0.0).astype(np.float32)
    weights[0, :6] = 0.5
    got = opj.aggregate(adv, weights, weights, "token_mean").value()
    np.testing.assert_allclose(float(got), np.sum(adv * weights) / np.sum(weights), rtol=1e-6)


# --------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    ("make", "typo", "hint"),
    [
        (opj.CorrectionConfig, "tis_uper_bound", "tis_upper_bound"),
        (opj.LossConfig, "kl_coeff", "kl_coef"),
        (opj.VanillaTIS, "clip_lo", "clip_low"),
    ],
)
def test_constructor_typos_get_a_did_you_mean_hint(make, typo, hint):
    with pytest.raises(TypeError, match=f"'{typo}'; did you mean '{hint}'"):
        make(**{typo: 1.0})


def _alias_bomb(levels: int) -> str:
    """YAML text whose ``tis_level`` is a list holding 9**levels strings through aliases."""
    items = ["&a0 [" + ", ".join(["x"] * 9) + "]"]
    for i in range(1, levels + 1):
        items.append(f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "tis_level: [" + ", ".join(items) + "]\n"


def test_error_messages_print_bounded_values():
    # 6 levels: 9**7 strings behind a 300-byte document (9 levels took 107 s and ended
    # in MemoryError while the message was formatted with repr).
    with pytest.raises(ValueError, match="tis_level") as err:
        opj.CorrectionConfig.from_yaml(_alias_bomb(6))
    assert len(str(err.value)) < 1000
    huge = "tokn" * 2_500_000  # 10 MB: printed whole, after seconds of did-you-mean matching
    with pytest.raises(ValueError, match="tis_level") as err:
        opj.CorrectionConfig(tis_level=huge)
    assert len(str(err.value)) < 1000


def test_duplicate_yaml_keys_raise_naming_the_key():
    text = "use_tis: true\ntis_upper_bound: 2.0\ntis_upper_bound: 5.0\n"
    with pytest.raises(ValueError, match="duplicate YAML key 'tis_upper_bound'.*line 2.*line 3"):
        opj.CorrectionConfig.from_yaml(text)


@pytest.mark.parametrize(
    ("threshold", "key"),
    [
        ("seq_mean_k1:0.5_2_0", "rs_criteria"),  # was the band [0.5, 20.0]
        ("seq_mean_k3:2_0", "rs_criteria"),  # was 20.0 (float() reads digit separators)
    ],
)
def test_thresholds_with_digit_underscores_are_refused(threshold, key):
    with pytest.raises(ValueError, match=key):
        opj.CorrectionConfig(use_tis=True, rs_criteria=(threshold,))
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        opj.CorrectionConfig.from_verl({"rollout_is": "token", "rollout_is_threshold": "0.5_2_0"})
    with pytest.raises(ValueError, match="tis_upper_bound"):
        opj.CorrectionConfig(use_tis=True, tis_upper_bound="2_0")


def test_huge_integer_bound_raises_naming_the_key():
    with pytest.raises(ValueError, match="tis_upper_bound must be finite"):
        opj.CorrectionConfig.from_yaml("use_tis: true\ntis_upper_bound: " + "9" * 401 + "\n")


def test_deeply_nested_yaml_raises_a_value_error():
    with pytest.raises(ValueError, match="nested too deeply"):
        opj.CorrectionConfig.from_yaml("tis_level: " + "[" * 10_000 + "]" * 10_000 + "\n")


def test_a_directory_is_not_reported_as_a_missing_file(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a directory"):
        opj.CorrectionConfig.from_yaml(str(tmp_path))
    with pytest.raises(IsADirectoryError, match="is a directory"):
        opj.CorrectionConfig.from_yaml(tmp_path)


@pytest.mark.parametrize(
    "fields",
    [
        {"policy_loss": "sapo", "tau_pos": 1e39},  # grad NaN (inf · 0)
        {"policy_loss": "sapo", "tau_neg": 1e-45},  # loss inf (4 / 0)
        {"policy_loss": "dro", "dro_beta": 1e39},
        {"kl_coef": 1e39},
        {"entropy_coef": 1e39},
        {"aggregation": "sequence_sum_norm", "loss_scale_factor": 1e-39},  # flushed to 0
    ],
)
def test_coefficients_that_are_not_normal_float32_raise(fields):
    key = next(k for k in fields if k not in ("policy_loss", "aggregation"))
    with pytest.raises(ValueError, match=f"{key} = .* in float32"):
        opj.LossConfig(**fields)


def test_one_verl_threshold_for_several_criteria_is_shared_like_verl_and_documented():
    # verl's _parse_rollout_rs_thresholds repeats a single threshold for every option.
    shared = opj.CorrectionConfig.from_verl(
        {"rollout_is": None, "rollout_rs": "seq_max_k2,seq_mean_k3", "rollout_rs_threshold": "2.5"}
    )
    assert shared.rs_criteria == ("seq_max_k2:2.5", "seq_mean_k3:2.5")
    k1 = opj.CorrectionConfig.from_verl(
        {"rollout_rs": "token_k1,seq_sum_k1", "rollout_rs_threshold": 2.0}
    )
    assert k1.rs_criteria == ("token_k1:0.5_2.0", "seq_sum_k1:0.5_2.0")  # hi alone: [1/hi, hi]
    with pytest.raises(ValueError, match="rollout_rs_threshold"):  # two for three options
        opj.CorrectionConfig.from_verl(
            {"rollout_rs": "token_k1,token_k2,token_k3", "rollout_rs_threshold": "2,3"}
        )
    with pytest.raises(ValueError, match="rollout_rs_threshold"):  # lo_hi shared with a k3
        opj.CorrectionConfig.from_verl(
            {"rollout_rs": "token_k1,seq_mean_k3", "rollout_rs_threshold": "0.5_2.0"}
        )
    # ... and it is documented where a verl user looks.
    assert "shared by every criterion" in (opj.CorrectionConfig.from_verl.__doc__ or "")
    semantics = (pathlib.Path(__file__).parents[1] / "docs" / "semantics.md").read_text()
    assert "a single entry shared\nby every criterion" in semantics


# --------------------------------------------------------------------------- token_logprobs

_LOGITS = jnp.log(jnp.array([[[0.5, 0.3, 0.2]]]))
_TOKEN = jnp.array([[1]])


def test_array_top_k_top_p_temperature_follow_vllm_or_refuse():
    off = float(opj.token_logprobs(_LOGITS, _TOKEN)[0, 0])  # -1.204
    for k in (0, -1):  # vLLM's "off" per request: was read as top-1 (-inf)
        got = opj.token_logprobs(_LOGITS, _TOKEN, top_k=jnp.array([[k]]))
        np.testing.assert_allclose(float(got[0, 0]), off, rtol=1e-6)
    for p in (0.0, np.nan, 1.5):  # was silently the top-1 support
        with pytest.raises(ValueError, match="top_p"):
            opj.token_logprobs(_LOGITS, _TOKEN, top_p=jnp.array([[p]], jnp.float32))
        traced = jax.jit(lambda p: opj.token_logprobs(_LOGITS, _TOKEN, top_p=p))
        assert np.isnan(float(traced(jnp.array([[p]], jnp.float32))[0, 0]))
    for t in (0.0, -1.0, np.nan, np.inf):
        with pytest.raises(ValueError, match="temperature"):
            opj.token_logprobs(_LOGITS, _TOKEN, temperature=jnp.array([[t]], jnp.float32))
        traced = jax.jit(lambda t: opj.token_logprobs(_LOGITS, _TOKEN, temperature=t))
        assert np.isnan(float(traced(jnp.array([[t]], jnp.float32))[0, 0]))


def test_finite_logits_at_small_temperature_do_not_overflow():
    logits = jnp.array([[[3e38, 1.0, 0.0]]])
    logp, entropy = opj.token_logprobs(
        logits, jnp.array([[0]]), temperature=0.5, return_entropy=True
    )
    assert float(logp[0, 0]) == 0.0 and float(entropy[0, 0]) == 0.0  # was NaN
    rng = np.random.default_rng(0)
    normal = jnp.asarray(rng.normal(0.0, 2.0, (2, 3, 50)), jnp.float32)
    tokens = jnp.argmax(normal, -1)
    got = opj.token_logprobs(normal, tokens, temperature=2e-38)
    np.testing.assert_array_equal(np.asarray(got), 0.0)  # the argmax token, T -> 0
    with pytest.raises(ValueError, match="temperature"):  # subnormal: flushed to 0
        opj.token_logprobs(normal, tokens, temperature=1e-38)
    grad = jax.grad(lambda x: jnp.sum(opj.token_logprobs(x, tokens, temperature=0.5)))(normal)
    assert np.all(np.isfinite(np.asarray(grad)))


def test_int64_token_ids_beyond_int32_raise_instead_of_wrapping():
    wide = np.array([[2**32 + 1]], np.int64)  # wrapped to 1: -1.204 instead of NaN
    with pytest.raises(ValueError, match="tokens holds ids outside int32"):
        opj.token_logprobs(_LOGITS, wide)
