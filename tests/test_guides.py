"""The code of the guides in docs/guide/ runs, and does what the text says."""

from __future__ import annotations

import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

import offpolicy_jax as opj
from offpolicy_jax.correction import criteria
from offpolicy_jax.correction.rules import register_rule

GUIDES = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide"


def _python_blocks(name: str) -> list[str]:
    text = (GUIDES / name).read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.fixture
def fresh_rules():
    before = dict(criteria.RULES)
    yield
    criteria.RULES.clear()
    criteria.RULES.update(before)


@pytest.mark.heavy
def test_adding_a_rule(fresh_rules, capsys):
    blocks = _python_blocks("adding_a_rule.md")
    unit = blocks[0]
    code_lines = [line for line in unit.splitlines() if line.strip()]
    assert len(code_lines) <= 25, "the guide promises a complete rule in <= 25 lines"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "adding_a_rule.md", "exec"), namespace)  # noqa: S102
    result = namespace["result"]
    # the first sequence holds |δ| = log(0.9 / 0.05) = 2.89 > 2: dropped whole
    np.testing.assert_array_equal(result.mask, [[0, 0, 0], [1, 1, 1]])
    assert float(result.metrics["mis_seq_max_abs_delta_fraction_high"]) == pytest.approx(0.5)
    # the registered name is a config key like the built-in criteria, checked at build time
    config = namespace["config"]
    assert config.rs_criteria == ("seq_max_abs_delta:2.0",)
    with pytest.raises(ValueError, match="rs_criteria"):
        opj.CorrectionConfig(use_tis=True, rs_criteria=("seq_max_abs_deltaa:2.0",))
    with pytest.raises(ValueError, match="rs_criteria"):
        opj.CorrectionConfig(use_tis=True, rs_criteria=("seq_max_abs_delta:x",))
    # it composes with the built-in rules and keeps the NumPy meaning on a ragged batch
    rng = np.random.default_rng(0)
    old = rng.normal(-2.0, 0.5, (6, 9)).astype(np.float32)
    rollout = (old + rng.normal(0.0, 1.0, old.shape)).astype(np.float32)
    mask = np.arange(9) < rng.integers(1, 10, (6, 1))
    both = opj.CorrectionConfig(use_tis=True, rs_criteria=("seq_max_abs_delta:2.0", "token_k2:3.0"))
    got = opj.compute_correction(old, rollout, mask, both)
    delta = np.abs(old - rollout)
    keep_seq = np.where(mask, delta, 0.0).max(-1) <= 2.0
    keep_tok = 0.5 * (old - rollout) ** 2 <= 3.0
    np.testing.assert_array_equal(np.asarray(got.mask) > 0, mask & keep_seq[:, None] & keep_tok)
    with pytest.raises(ValueError, match="already registered"):
        register_rule("seq_max_abs_delta")(lambda threshold: None)
    with pytest.raises(ValueError, match="built-in"):
        register_rule("seq_max_k2")
    assert jnp.asarray(result.weights).shape == (2, 3)


@pytest.fixture
def fresh_surrogates():
    from offpolicy_jax.losses import registry

    before = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(before)


@pytest.mark.heavy
def test_adding_a_loss(fresh_surrogates):
    import jax

    unit = _python_blocks("adding_a_loss.md")[0]
    code_lines = [line for line in unit.splitlines() if line.strip()]
    assert len(code_lines) <= 25, "the guide promises a complete surrogate in <= 25 lines"
    namespace: dict = {}
    exec(compile(unit, "adding_a_loss.md", "exec"), namespace)  # noqa: S102
    config = namespace["config"]
    rng = np.random.default_rng(0)
    valid = np.arange(5)[None, :] < np.array([[5], [2], [0]])
    theta = np.where(valid, rng.normal(-1.0, 0.5, (3, 5)), np.nan).astype(np.float32)
    adv = rng.normal(size=(3, 5)).astype(np.float32)

    def loss(lp):
        return opj.policy_loss(lp, lp, None, adv, valid, config)[0]

    value, grad = jax.value_and_grad(loss)(jnp.asarray(theta))
    # NumPy: sequence_mean of −0.5·A·θ over the valid tokens of the two non-empty rows,
    # garbage (NaN) at padding reaching neither the value nor the gradient.
    n = valid.sum(-1, keepdims=True)
    per_seq = np.where(valid, -0.5 * adv * np.nan_to_num(theta), 0.0).sum(-1) / np.maximum(
        n[:, 0], 1
    )
    np.testing.assert_allclose(value, per_seq[:2].mean(), rtol=1e-6)
    want_grad = np.where(valid, -0.5 * adv / np.maximum(n, 1), 0.0) / 2
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="LossConfig.scale"):
        opj.LossConfig(policy_loss="scaled_pg", scale=-1.0)
    with pytest.raises(ValueError, match="not of 'scaled_pg'"):
        opj.LossConfig(policy_loss="scaled_pg", tau_pos=1.0)
