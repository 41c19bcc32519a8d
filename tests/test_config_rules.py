"""Config keys of the field's rejection rules (docs/semantics.md §8), verl parsing, presets."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import offpolicy_jax as opj
from offpolicy_jax.interop import verl

TRM_ICEPOP = dict(
    use_tis=True,
    tis_mode="band",
    tis_lower_bound=0.5,
    tis_upper_bound=5.0,
    rs_criteria=("seq_max_k2:2.5", "seq_mean_k3:0.01"),
)


def test_new_keys_round_trip_yaml_and_dict_and_hash():
    config = opj.CorrectionConfig(**TRM_ICEPOP, seq_logprob_error_threshold=2.0, m2po_tau=0.04)
    assert opj.CorrectionConfig.from_yaml(config.to_yaml()) == config
    assert opj.CorrectionConfig.from_dict(config.to_dict()) == config
    assert hash(config) == hash(opj.CorrectionConfig.from_yaml(config.to_yaml()))
    f = jax.jit(lambda x, c: x * len(c.rs_criteria), static_argnums=1)
    assert float(f(np.float32(1.0), config)) == 2.0


def test_rs_criteria_canonical_form():
    config = opj.CorrectionConfig(
        use_tis=True, rs_criteria=["token_k1:2", " seq_mean_k1 : 0.9_1.1 "]
    )
    assert config.rs_criteria == ("token_k1:0.5_2.0", "seq_mean_k1:0.9_1.1")
    one = opj.CorrectionConfig(use_tis=True, rs_criteria="seq_max_k3:1")
    assert one.rs_criteria == ("seq_max_k3:1.0",)
    (k1, geo) = config.criteria
    assert (k1.aggregate, k1.estimator, k1.lo, k1.hi) == ("token", "k1", 0.5, 2.0)
    assert geo.lower == pytest.approx(np.log(0.9)) and geo.upper == pytest.approx(np.log(1.1))


def test_yaml_text_with_criteria_list():
    config = opj.CorrectionConfig.from_yaml(
        "use_tis: true\ntis_mode: none\nrs_criteria:\n  - seq_max_k2:2.5\n  - seq_mean_k3:0.01\n"
    )
    assert config.rs_criteria == ("seq_max_k2:2.5", "seq_mean_k3:0.01")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        # unknown criterion, with a did-you-mean hint
        (dict(rs_criteria=("seq_max_k1:2.0",)), r"rs_criteria.*unknown rejection criterion"),
        (dict(rs_criteria=("seq_mean_k4:2.0",)), r"rs_criteria.*did you mean 'seq_mean_k"),
        # lo > hi
        (dict(rs_criteria=("token_k1:2.0_0.5",)), r"rs_criteria.*lower <= upper"),
        (dict(tis_mode="band", tis_lower_bound=3.0, tis_upper_bound=2.0), "tis_lower_bound"),
        # non-positive bounds, δ, τ
        (dict(rs_criteria=("seq_max_k2:0",)), r"rs_criteria.*positive"),
        (dict(rs_criteria=("token_k1:-1_2",)), r"rs_criteria.*positive"),
        (dict(m2po_tau=0.0), "m2po_tau"),
        (dict(m2po_tau=-0.1), "m2po_tau"),
        (dict(seq_logprob_error_threshold=0.0), "seq_logprob_error_threshold"),
        (dict(seq_logprob_error_threshold=0.5), "seq_logprob_error_threshold"),
        # malformed strings
        (dict(rs_criteria=("seq_max_k2",)), r"rs_criteria.*criterion:threshold"),
        (dict(rs_criteria=("seq_max_k2:abc",)), r"rs_criteria.*malformed"),
        (dict(rs_criteria=("seq_max_k2:0.5_2.0",)), r"rs_criteria.*single upper bound"),
        (dict(rs_criteria=("token_k1:0.5_x",)), r"rs_criteria.*malformed"),
        (dict(rs_criteria=(2.5,)), r"rs_criteria"),
        (dict(rs_criteria=("seq_max_k2:2", "seq_max_k2:3")), r"rs_criteria.*twice"),
        (dict(rs_criteria=42), r"rs_criteria"),
        (dict(tis_mode="bnad"), r"tis_mode.*did you mean 'band'"),
    ],
)
def test_bad_rule_keys_raise_naming_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        opj.CorrectionConfig(**{"use_tis": True, **kwargs})


def test_icepop_allows_equal_bounds_and_defaults_lower_to_reciprocal():
    assert (
        opj.CorrectionConfig(use_tis=True, tis_mode="band", tis_lower_bound=2.0).lower_bound == 2.0
    )
    assert (
        opj.CorrectionConfig(use_tis=True, tis_mode="band", tis_upper_bound=4.0).lower_bound == 0.25
    )


# ------------------------------------------------------------------------- from_verl


def test_from_verl_maps_every_key():
    config = opj.CorrectionConfig.from_verl(
        {
            "rollout_is": "sequence",
            "rollout_is_threshold": "0.5_2.0",
            "rollout_is_batch_normalize": True,
            "rollout_rs": "token_k1, seq_max_k2,token_k1",
            "rollout_rs_threshold": "0.5_2.0,2.5",
            "bypass_mode": True,  # loss-only: ignored here
            "loss_type": "reinforce",
        }
    )
    assert config == opj.CorrectionConfig(
        use_tis=True,
        tis_level="sequence",
        tis_mode="band",
        tis_lower_bound=0.5,
        tis_upper_bound=2.0,
        tis_batch_normalize=True,
        rs_criteria=("token_k1:0.5_2.0", "seq_max_k2:2.5"),
    )


def test_from_verl_is_off():
    assert opj.CorrectionConfig.from_verl({"rollout_is": None}) == opj.CorrectionConfig()
    assert opj.CorrectionConfig.from_verl({}) == opj.CorrectionConfig()
    rs_only = opj.CorrectionConfig.from_verl(
        {"rollout_is": None, "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01}
    )
    assert (rs_only.use_tis, rs_only.tis_mode, rs_only.rs_criteria) == (
        True,
        "none",
        ("seq_mean_k3:0.01",),
    )
    # verl ignores the IS threshold when IS is off, and skips IS without a threshold
    assert opj.CorrectionConfig.from_verl({"rollout_is": None, "rollout_is_threshold": 0.0})
    no_threshold = {"rollout_is": "token", "rollout_is_threshold": None}
    assert opj.CorrectionConfig.from_verl(no_threshold) == opj.CorrectionConfig()


def test_from_verl_truncate_from_numeric_string():
    config = opj.CorrectionConfig.from_verl({"rollout_is": "token", "rollout_is_threshold": "1.2"})
    assert (config.tis_mode, config.tis_upper_bound) == ("truncate", 1.2)


def test_from_verl_old_veto_key():
    config = opj.CorrectionConfig.from_verl(
        {"rollout_is": "token", "rollout_token_veto_threshold": 1e-4}
    )
    assert config.rs_veto_threshold == 1e-4


@pytest.mark.parametrize(
    "block, key",
    [
        ({"rollout_rs": "token_k4", "rollout_rs_threshold": 2.0}, "rollout_rs"),
        ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 2.0}, "rollout_rs"),
        ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.5_2.0"}, "rollout_rs_threshold"),
        ({"rollout_rs": "token_k1", "rollout_rs_threshold": None}, "rollout_rs_threshold"),
        ({"rollout_rs": "token_k1", "rollout_rs_threshold": "2.0_0.5"}, "rollout_rs_threshold"),
        ({"rollout_rs": "token_k1", "rollout_rs_threshold": "-1"}, "rollout_rs_threshold"),
        ({"rollout_rs": "token_k1", "rollout_rs_threshold": "x_2"}, "rollout_rs_threshold"),
        (
            {"rollout_rs": "token_k1,seq_max_k2", "rollout_rs_threshold": "1,2,3"},
            "rollout_rs_threshold",
        ),
        ({"rollout_rs": ",", "rollout_rs_threshold": 2.0}, "rollout_rs"),
        ({"rollout_rs": 3, "rollout_rs_threshold": 2.0}, "rollout_rs"),
        ({"rollout_is": "geometric"}, "rollout_is"),
        ({"rollout_is": "token", "rollout_is_threshold": 0.0}, "rollout_is_threshold"),
        ({"rollout_is": "token", "rollout_is_threshold": "2.0_0.5"}, "rollout_is_threshold"),
        ({"rollout_is": "token", "rollout_is_threshold": "0_2.0"}, "rollout_is_threshold"),
        ({"rollout_is": "token", "rollout_is_threshold": "a_b"}, "rollout_is_threshold"),
        ({"rollout_is": "token", "rollout_is_threshold": ""}, "rollout_is_threshold"),
        ({"rollout_is": "token", "rollout_is_threshold": True}, "rollout_is_threshold"),
        (
            {"rollout_is": "token", "rollout_is_batch_normalize": "yes"},
            "rollout_is_batch_normalize",
        ),
        ({"rollout_iss": "token"}, "did you mean 'rollout_is'"),
    ],
)
def test_from_verl_errors_name_the_key(block, key):
    with pytest.raises(ValueError, match=key):
        opj.CorrectionConfig.from_verl(block)


def test_from_verl_rejects_non_mapping():
    with pytest.raises(ValueError, match="mapping"):
        opj.CorrectionConfig.from_verl("token")


@pytest.mark.parametrize("name", sorted(verl.VERL_PRESETS))
def test_every_verl_preset_builds(name):
    config = opj.CorrectionConfig.preset(name)
    assert config == opj.CorrectionConfig.from_verl(verl.VERL_PRESETS[name])


def test_preset_values_and_errors():
    assert opj.CorrectionConfig.preset("decoupled_token_icepop") == opj.CorrectionConfig(
        use_tis=True, tis_mode="band", tis_lower_bound=0.5, tis_upper_bound=5.0
    )
    assert opj.CorrectionConfig.preset("decoupled_geo_rs").rs_criteria == (
        "seq_mean_k1:0.999_1.001",
    )
    with pytest.raises(ValueError, match="did you mean 'decoupled_geo_rs'"):
        opj.CorrectionConfig.preset("decoupled_geo_rss")


@pytest.mark.parametrize("key", ["rs_criteria", "seq_logprob_error_threshold", "m2po_tau"])
def test_rules_need_use_tis(key):
    value = {"rs_criteria": ("seq_max_k2:2.5",), "seq_logprob_error_threshold": 2.0}.get(key, 0.1)
    with pytest.raises(ValueError, match=f"{key}.*use_tis"):
        opj.CorrectionConfig(**{key: value})


@pytest.mark.parametrize("value", [0.0, -0.5, "x"])
def test_opsm_delta_must_be_positive(value):
    with pytest.raises(ValueError, match="opsm_delta"):
        opj.LossConfig(opsm_delta=value)
    assert opj.LossConfig(opsm_delta="1e-4").opsm_delta == 1e-4
