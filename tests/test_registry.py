"""The surrogate registry: registration rules, LossConfig's flat keywords and round trips
(the guide's snippet runs in test_guides.py)."""

from __future__ import annotations

import dataclasses

import pytest

import offpolicy_jax as opj
from offpolicy_jax import registry


@pytest.fixture
def scratch_registry():
    """Registrations made by a test are removed after it."""
    before = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(before)


def test_registration_rules(scratch_registry):
    @dataclasses.dataclass(frozen=True)
    class Clash:
        aggregation: float = 1.0

    @dataclasses.dataclass
    class Mutable:
        k: float = 1.0

    @dataclasses.dataclass(frozen=True)
    class NoDefault:
        k: float

    for params, message in ((Clash, "clashes"), (Mutable, "frozen"), (NoDefault, "default")):
        with pytest.raises(ValueError, match=message):
            opj.register_surrogate("bad", params=params)
    with pytest.raises(ValueError, match="already registered"):
        opj.register_surrogate("gspo")
    with pytest.raises(ValueError, match="did you mean 'cispo'"):
        opj.LossConfig(policy_loss="cipso")
    assert registry.names()[:2] == ("ppo_clip", "gspo")


def test_loss_config_reads_hyperparameters_flat_and_round_trips():
    cfg = opj.LossConfig(policy_loss="dppo_kl", clip_eps_high=0.3, aggregation="token_mean")
    assert (cfg.clip_eps, cfg.upper_clip_eps, cfg.dppo_ratio_cap) == (0.2, 0.3, 20.0)
    assert cfg.dual_clip_c is None  # another surrogate's hyperparameter
    assert opj.LossConfig.from_dict(cfg.to_dict()) == cfg
    assert opj.LossConfig.from_yaml(cfg.to_yaml()) == cfg
    # dataclasses.replace takes flat hyperparameters and another surrogate alike.
    assert dataclasses.replace(cfg, dppo_ratio_cap=5).dppo_ratio_cap == 5.0
    gspo = dataclasses.replace(cfg, policy_loss="gspo")
    assert gspo.params == opj.LossConfig(policy_loss="gspo", clip_eps_high=0.3).params
    with pytest.raises(ValueError, match="dual_clip_c"):
        dataclasses.replace(opj.LossConfig(dual_clip_c=3.0), policy_loss="gspo")
    # clip_eps is every config's keyword; positional arguments keep the spec's order.
    assert opj.LossConfig(policy_loss="gpg", clip_eps=0.1) == opj.LossConfig(policy_loss="gpg")
    assert opj.LossConfig("ppo", 0.1).clip_eps == 0.1
    with pytest.raises(ValueError, match="clip_eps"):
        opj.LossConfig(policy_loss="gpg", clip_eps=1.5)
    with pytest.raises(TypeError, match="did you mean 'tau_pos'"):
        opj.LossConfig(policy_loss="sapo", tau_pso=1.0)
    with pytest.raises(ValueError, match="to_dict"):
        opj.LossConfig(algorithm="decoupled_ppo", correction=opj.VanillaTIS()).to_dict()
