"""CorrectionConfig / LossConfig / VanillaTIS: defaults, validation, YAML I/O, from_flags."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import offpolicy_jax as opj

MIS_YAML_TEXT = """\
use_tis: true
use_rs: true
tis_level: "token"
rs_level: "token"
tis_mode: "truncate"
tis_lower_bound: 0.5
tis_upper_bound: 2.0
rs_lower_bound: null
rs_upper_bound: null
rs_veto_threshold: 1.0e-4
tis_batch_normalize: true
"""


def test_defaults_match_reference_mis_yaml_keys():
    config = opj.CorrectionConfig()
    assert config.to_dict() == {
        "use_tis": False,
        "tis_level": "token",
        "tis_mode": "truncate",
        "tis_lower_bound": None,
        "tis_upper_bound": 2.0,
        "tis_batch_normalize": False,
        "use_rs": False,
        "rs_level": "token",
        "rs_lower_bound": None,
        "rs_upper_bound": None,
        "rs_veto_threshold": None,
        "rs_criteria": [],
        "seq_logprob_error_threshold": None,
        "m2po_tau": None,
        "probability_metrics": False,
        "nonfinite_rollout": "reject",
        "max_weight_staleness": None,
        "staleness_level": "sequence",
        "mask_offpolicy_in_partial_rollout": False,
        "rejection_sampling": None,
    }


def test_resolved_bounds():
    config = opj.CorrectionConfig(use_tis=True, tis_upper_bound=4.0, use_rs=True)
    assert (config.lower_bound, config.upper_bound) == (0.25, 4.0)
    assert (config.rs_lower, config.rs_upper) == (0.25, 4.0)
    config = opj.CorrectionConfig(tis_lower_bound=0.1, rs_lower_bound=0.3, rs_upper_bound=1.5)
    assert (config.rs_lower, config.rs_upper) == (0.3, 1.5)


def test_frozen_hashable_and_static_under_jit():
    config = opj.CorrectionConfig(use_tis=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.use_tis = False  # type: ignore[misc]
    assert hash(config) == hash(opj.CorrectionConfig(use_tis=True))
    f = jax.jit(lambda x, config: x * config.upper_bound, static_argnums=1)
    assert float(f(np.float32(1.0), config)) == 2.0
    assert hash(opj.LossConfig(algorithm="decoupled_ppo", correction=config))


def test_from_yaml_text_and_path(tmp_path):
    from_text = opj.CorrectionConfig.from_yaml(MIS_YAML_TEXT)
    path = tmp_path / "mis.yaml"
    path.write_text(MIS_YAML_TEXT)
    assert opj.CorrectionConfig.from_yaml(path) == from_text
    assert opj.CorrectionConfig.from_yaml(str(path)) == from_text
    assert from_text.rs_veto_threshold == 1e-4 and from_text.tis_batch_normalize


def test_yaml_number_without_dot_is_a_number():
    # PyYAML reads 1e-4 (no dot) as the string "1e-4"; the reference's users write it so.
    config = opj.CorrectionConfig.from_yaml("use_tis: true\nrs_veto_threshold: 1e-4\n")
    assert config.rs_veto_threshold == 1e-4 and isinstance(config.rs_veto_threshold, float)


def test_yaml_round_trip():
    config = opj.CorrectionConfig(
        use_tis=True,
        tis_level="geometric",
        tis_mode="mask",
        tis_lower_bound=0.8,
        tis_upper_bound=1.25,
        use_rs=True,
        rs_level="sequence",
        rs_veto_threshold=1e-3,
    )
    assert opj.CorrectionConfig.from_yaml(config.to_yaml()) == config
    assert opj.CorrectionConfig.from_dict(config.to_dict()) == config


def test_yaml_is_read_safely():
    with pytest.raises(Exception, match="python/object|could not determine a constructor"):
        opj.CorrectionConfig.from_yaml("use_tis: !!python/object/apply:os.system ['true']\n")


def test_error_unknown_key_with_hint():
    with pytest.raises(ValueError, match=r"tis_uper_bound.*did you mean 'tis_upper_bound'"):
        opj.CorrectionConfig.from_yaml("use_tis: true\ntis_uper_bound: 2.0\n")
    with pytest.raises(ValueError, match="veto"):
        opj.CorrectionConfig.from_dict({"veto": 1e-4})


@pytest.mark.parametrize("text", ["- use_tis\n- true\n", "just a string\n", "42\n", ""])
def test_error_yaml_not_a_mapping(text, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match="mapping"):
        opj.CorrectionConfig.from_yaml(path)


def test_error_missing_yaml_file():
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        opj.CorrectionConfig.from_yaml("configs/nope.yaml")


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(tis_level="seq"), "tis_level"),
        (dict(tis_mode="icepops"), "tis_mode"),
        (dict(use_rs=True, rs_level="bogus"), "rs_level"),
        (dict(use_tis="yes"), "use_tis"),
        (dict(tis_batch_normalize=1), "tis_batch_normalize"),
        (dict(tis_upper_bound=0.0), "tis_upper_bound"),
        (dict(tis_upper_bound=-1.0), "tis_upper_bound"),
        (dict(tis_upper_bound="two"), "tis_upper_bound"),
        (dict(tis_upper_bound=float("inf")), "tis_upper_bound"),
        (dict(tis_lower_bound=-0.5, tis_mode="clip"), "tis_lower_bound"),
        (dict(tis_lower_bound=2.0, tis_upper_bound=2.0, tis_mode="clip"), "tis_lower_bound"),
        (dict(tis_lower_bound=3.0, tis_upper_bound=2.0, tis_mode="mask"), "tis_upper_bound"),
        (dict(tis_upper_bound=0.8, tis_mode="mask"), "tis_upper_bound"),  # 1/U > U
        (dict(use_rs=True, rs_lower_bound=1.5, rs_upper_bound=1.2), "rs_lower_bound"),
        (dict(use_rs=True, rs_upper_bound=-1.0), "rs_upper_bound"),
        (dict(rs_veto_threshold=-1e-4), "rs_veto_threshold"),
        (dict(rs_veto_threshold=0.0), "rs_veto_threshold"),
    ],
)
def test_error_bad_values_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        opj.CorrectionConfig(**{"use_tis": True, **kwargs})


def test_misspelt_level_gets_a_hint():
    with pytest.raises(ValueError, match="did you mean 'sequence'"):
        opj.CorrectionConfig(tis_level="seq")
    with pytest.raises(ValueError, match="did you mean 'truncate'"):
        opj.CorrectionConfig(tis_mode="truncat")


def test_truncate_ignores_lower_bound_and_rs_bounds_checked_only_with_rs():
    opj.CorrectionConfig(use_tis=True, tis_upper_bound=0.8)  # 1/U > U is fine for truncate
    opj.CorrectionConfig(use_rs=False, rs_lower_bound=5.0, rs_upper_bound=1.0)


# ------------------------------------------------------------------------ VanillaTIS


def test_vanilla_tis_validation():
    assert opj.VanillaTIS() == opj.VanillaTIS(clip_low=0.0, clip=2.0)
    for low, high in [(-0.1, 2.0), (2.0, 2.0), (3.0, 2.0)]:
        with pytest.raises(ValueError, match="clip_low"):
            opj.VanillaTIS(clip_low=low, clip=high)


def test_vanilla_tis_infinite_clip_means_no_cap():
    import math

    import jax.numpy as jnp

    assert opj.VanillaTIS(clip=math.inf).clip == math.inf
    for bad in (math.nan, -math.inf, "inf"):
        with pytest.raises(ValueError, match="VanillaTIS.clip"):
            opj.VanillaTIS(clip=bad)
    with pytest.raises(ValueError, match="clip_low"):
        opj.VanillaTIS(clip_low=math.inf, clip=math.inf)
    # The weight of a token with ratio e^8 is e^8, uncapped: loss -(e^8 + 1 + 1) / 3.
    old, rollout = jnp.zeros((1, 3)), jnp.array([[-8.0, 0.0, 0.0]])
    config = opj.LossConfig(algorithm="decoupled_ppo", correction=opj.VanillaTIS(clip=math.inf))
    loss, _ = opj.policy_loss(old, old, rollout, jnp.ones(1), jnp.ones((1, 3)), config)
    assert abs(float(loss) + (math.exp(8.0) + 2) / 3) < 1e-5 * math.exp(8.0)


# ------------------------------------------------------------------------ LossConfig


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(algorithm="grpo"), "algorithm"),
        (dict(aggregation="mean"), "aggregation"),
        (dict(metric_reduction="batch"), "metric_reduction"),
        (dict(clip_eps=0.0), "clip_eps"),
        (dict(clip_eps_high=-0.1), "clip_eps_high"),
        (dict(dual_clip_c=1.0), "dual_clip_c"),
        (dict(rejected_in_denominator="no"), "rejected_in_denominator"),
        (dict(algorithm="decoupled_ppo"), "correction"),
        (dict(algorithm="decoupled_ppo", correction=opj.CorrectionConfig()), "correction"),
        (dict(algorithm="reinforce_is"), "correction"),
        (dict(algorithm="ppo", correction=opj.VanillaTIS()), "decoupled_ppo"),
        (
            dict(algorithm="bypass_ppo", correction=opj.CorrectionConfig(use_tis=True)),
            "reinforce_is",
        ),
        (dict(algorithm="decoupled_ppo", correction={"use_tis": True}), "correction"),
    ],
)
def test_loss_config_errors_name_the_field(kwargs, key):
    with pytest.raises(ValueError, match=key):
        opj.LossConfig(**kwargs)


def test_loss_config_defaults():
    config = opj.LossConfig()
    assert (config.algorithm, config.clip_eps, config.upper_clip_eps, config.aggregation) == (
        "ppo",
        0.2,
        0.2,
        "sequence_mean",
    )
    assert opj.LossConfig(clip_eps_high=0.28).upper_clip_eps == 0.28


@pytest.mark.parametrize(
    "use_rollout_logprobs, use_tis, algorithm",
    [
        (False, False, "ppo"),
        (True, False, "bypass_ppo"),
        (False, True, "decoupled_ppo"),
        (True, True, "reinforce_is"),
    ],
)
def test_from_flags_table(use_rollout_logprobs, use_tis, algorithm, tmp_path):
    config = opj.LossConfig.from_flags(use_rollout_logprobs=use_rollout_logprobs, use_tis=use_tis)
    assert config.algorithm == algorithm
    assert config.correction == (opj.VanillaTIS() if use_tis else None)
    path = tmp_path / "mis.yaml"
    path.write_text(MIS_YAML_TEXT if use_tis else "use_tis: false\n")
    config = opj.LossConfig.from_flags(use_rollout_logprobs, use_tis, path, clip_eps=0.1)
    assert config.algorithm == algorithm and config.clip_eps == 0.1
    assert isinstance(config.correction, opj.CorrectionConfig)
    assert config.get_mismatch_metrics == (not use_tis)


def test_from_flags_vanilla_tis_clip_flags():
    config = opj.LossConfig.from_flags(use_tis=True, tis_clip=3.0, tis_clip_low=0.1)
    assert config.correction == opj.VanillaTIS(clip_low=0.1, clip=3.0)


def test_from_flags_contradictions(tmp_path):
    enabled, disabled = tmp_path / "on.yaml", tmp_path / "off.yaml"
    enabled.write_text(MIS_YAML_TEXT)
    disabled.write_text("use_tis: false\n")
    with pytest.raises(ValueError, match="use_tis=False contradicts"):
        opj.LossConfig.from_flags(use_tis=False, custom_config_path=enabled)
    with pytest.raises(ValueError, match="use_tis=True contradicts"):
        opj.LossConfig.from_flags(use_tis=True, custom_config_path=disabled)
    with pytest.raises(ValueError, match="algorithm"):
        opj.LossConfig.from_flags(use_tis=True, algorithm="ppo")
