"""The surrogate registry: the documented snippet, registration rules, LossConfig round trips."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import offpolicy_jax as opj
from offpolicy_jax import registry

GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide" / "adding_a_loss.md"


@pytest.fixture
def scratch_registry():
    """Registrations made by a test are removed after it."""
    before = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(before)


def _snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    return blocks[0]


def test_guide_snippet_is_a_complete_surrogate_in_25_lines(scratch_registry):
    code = _snippet()
    assert len(code.strip().splitlines()) <= 25
    namespace: dict = {}
    exec(compile(code, str(GUIDE), "exec"), namespace)
    config = namespace["config"]
    rng = np.random.default_rng(0)
    theta = rng.normal(-1.0, 0.5, (3, 5)).astype(np.float32)
    valid = np.arange(5)[None, :] < np.array([[5], [2], [0]])
    theta = np.where(valid, theta, np.nan).astype(np.float32)  # garbage at padding
    adv = rng.normal(size=(3, 5)).astype(np.float32)

    def loss(lp):
        return opj.policy_loss(lp, lp, None, adv, valid, config)[0]

    value, grad = jax.value_and_grad(loss)(jnp.asarray(theta))
    # NumPy reference: sequence_mean of −0.5·A·θ over the valid tokens of non-empty rows.
    per_token = np.where(valid, -0.5 * adv * np.nan_to_num(theta), 0.0)
    rows = valid.sum(-1) > 0
    want = (per_token.sum(-1)[rows] / valid.sum(-1)[rows]).mean()
    np.testing.assert_allclose(value, want, rtol=1e-6)
    want_grad = np.where(valid, -0.5 * adv / np.maximum(valid.sum(-1, keepdims=True), 1), 0) / 2
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="LossConfig.scale"):
        opj.LossConfig(policy_loss="scaled_pg", scale=-1.0)
    with pytest.raises(ValueError, match="not of 'scaled_pg'"):
        opj.LossConfig(policy_loss="scaled_pg", tau_pos=1.0)


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
    with pytest.raises(ValueError, match="to_dict"):
        opj.LossConfig(algorithm="decoupled_ppo", correction=opj.VanillaTIS()).to_dict()
