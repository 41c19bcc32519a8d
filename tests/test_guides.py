"""The code of the guides in docs/guide/ runs, and does what the text says."""

from __future__ import annotations

import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

import offpolicy_jax as opj
from offpolicy_jax import rules
from offpolicy_jax._src.correction import criteria

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
    blocks = _unit("adding_a_rule.md")
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
        rules.register_rule("seq_max_abs_delta")(lambda threshold: None)
    with pytest.raises(ValueError, match="built-in"):
        rules.register_rule("seq_max_k2")
    assert jnp.asarray(result.weights).shape == (2, 3)
    # without a config: the registered name is a rule value, with the config's mask
    np.testing.assert_array_equal(namespace["composed"].mask, result.mask)
    chained = opj.correct(old, rollout, mask, *rules.from_config(both).rules)
    np.testing.assert_array_equal(chained.mask, got.mask)


@pytest.fixture
def fresh_surrogates():
    from offpolicy_jax._src.losses import registry

    before = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(before)


@pytest.mark.heavy
def test_adding_a_loss(fresh_surrogates):
    import jax

    unit, value_block = _python_blocks("adding_a_loss.md")[:2]
    code_lines = [line for line in unit.splitlines() if line.strip()]
    assert len(code_lines) <= 25, "the guide promises a complete surrogate in <= 25 lines"
    assert "offpolicy_jax." not in unit, "the guide uses the public names of opj only"
    namespace: dict = {}
    exec(compile(unit, "adding_a_loss.md", "exec"), namespace)  # noqa: S102
    exec(compile(value_block, "adding_a_loss.md", "exec"), namespace)  # noqa: S102
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
    # the surrogate as a value: opj.objectives.ppo gives the config's loss and gradient
    scaled = namespace["scaled"]
    composed = jax.value_and_grad(
        lambda lp: opj.objectives.ppo(lp, lp, adv, valid, surrogate=scaled)[0].value()
    )(jnp.asarray(theta))
    np.testing.assert_allclose(composed[0], value, rtol=1e-6)
    np.testing.assert_allclose(composed[1], grad, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="LossConfig.scale"):
        opj.LossConfig(policy_loss="scaled_pg", scale=-1.0)
    with pytest.raises(ValueError, match="scale"):
        opj.objectives.surrogate("scaled_pg", scale=0.0)
    with pytest.raises(ValueError, match="not of 'scaled_pg'"):
        opj.LossConfig(policy_loss="scaled_pg", tau_pos=1.0)


def _unit(name: str, limit: int = 25) -> list[str]:
    """The page's code blocks; the first, the unit, in <= ``limit`` lines of code that use
    only the names ``offpolicy_jax`` exports."""
    blocks = _python_blocks(name)
    code_lines = [line for line in blocks[0].splitlines() if line.strip()]
    assert len(code_lines) <= limit, f"{name} promises its unit in <= {limit} lines"
    imports = [line for block in blocks for line in block.splitlines() if "import" in line]
    assert all("offpolicy_jax." not in line for line in imports), imports
    return blocks


@pytest.mark.heavy
def test_composing(capsys):
    import jax

    blocks = _unit("composing.md")
    namespace: dict = {}
    exec(compile(blocks[0], "composing.md", "exec"), namespace)  # noqa: S102
    grad_fn = namespace["grad_fn"]
    rng = np.random.default_rng(0)
    old = rng.normal(-2.0, 0.6, (8, 12)).astype(np.float32)
    rollout = (old + rng.normal(0.0, 0.6, old.shape)).astype(np.float32)
    rollout[1, 3] = old[1, 3] + 11.0  # vetoed
    logp = (old + rng.normal(0.0, 0.1, old.shape)).astype(np.float32)
    mask = np.arange(12) < rng.integers(0, 13, (8, 1))
    adv = rng.normal(size=8).astype(np.float32)
    grads, metrics = grad_fn(logp, old, rollout, adv, mask)
    # the config path: CorrectionConfig.preset("mis") under decoupled PPO
    config = opj.LossConfig(
        algorithm="decoupled_ppo", correction=opj.CorrectionConfig.preset("mis")
    )
    (want_loss, want_metrics), want_grads = jax.value_and_grad(
        lambda lp: opj.policy_loss(lp, old, rollout, adv, mask, config), has_aux=True
    )(jnp.asarray(logp))
    np.testing.assert_allclose(grads, want_grads, rtol=1e-6, atol=1e-9)
    assert set(metrics) == set(want_metrics)
    for key in want_metrics:
        np.testing.assert_allclose(metrics[key], want_metrics[key], rtol=1e-6, err_msg=key)
    np.testing.assert_allclose(metrics["pg_loss"], want_loss, rtol=1e-6)
    assert float(metrics["mis_rs_catastrophic_seq_fraction"]) > 0  # the veto acted
    # the correction the chain holds is the one the preset builds
    assert namespace["correction"] == rules.from_config(opj.CorrectionConfig.preset("mis"))
    capsys.readouterr()
    for block in blocks[1:]:
        exec(compile(block, "composing.md", "exec"), namespace)  # noqa: S102
    # every comparison the page prints holds (the config path, the regularised loss)
    printed = capsys.readouterr().out.split()
    assert printed == ["True"] * 3, printed
    # the messages the page quotes
    with pytest.raises(
        ValueError, match=r"^objectives\.kl_penalty\.kl_coef must be >= 0, got -1\.0$"
    ):
        opj.objectives.kl_penalty(kl_coef=-1.0)
    with pytest.raises(
        ValueError,
        match=r"^ref_logp is required: objectives\.kl_penalty\(kl_coef=0\.001\) adds a term",
    ):
        opj.objectives.decoupled_ppo(
            *(namespace[k] for k in ("logp", "old_logp", "rollout_logp", "advantages", "mask")),
            correction=namespace["correction"],
            regularisers=[opj.objectives.kl_penalty(kl_coef=1e-3)],
        )


@pytest.mark.heavy
def test_adding_a_metric(capsys):
    blocks = _unit("adding_a_metric.md")
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "adding_a_metric.md", "exec"), namespace)  # noqa: S102
    value = float(namespace["result"].metrics["mis_large_shift_fraction"])
    assert value == pytest.approx((1 / 3 + 0 / 2) / 2, rel=1e-6)
    # NumPy: the sequence mean of each sequence's share of |δ| > 1, over valid tokens,
    # on a ragged batch with an empty row and a sequence holding a NaN (left out)
    correction = namespace["correction"]
    rng = np.random.default_rng(1)
    old = rng.normal(-2.0, 0.5, (6, 9)).astype(np.float32)
    rollout = (old + rng.normal(0.0, 1.0, old.shape)).astype(np.float32)
    rollout[2, 0] = np.nan
    mask = np.arange(9) < np.array([[9], [4], [3], [0], [7], [1]])
    got = opj.correct(old, rollout, mask, *correction.rules)
    shifted = np.abs(old.astype(np.float64) - rollout) > 1.0
    n = mask.sum(-1)
    rows = (n > 0) & ~np.isnan(rollout).any(-1)
    per_seq = np.where(mask, shifted, False).sum(-1)[rows] / n[rows]
    np.testing.assert_allclose(got.metrics["mis_large_shift_fraction"], per_seq.mean(), rtol=1e-6)
    # the preset's own numbers are unchanged by the extra metric
    preset = opj.compute_correction(old, rollout, mask, opj.CorrectionConfig.preset("mis"))
    np.testing.assert_array_equal(got.weights, preset.weights)
    assert set(got.metrics) == set(preset.metrics) | {"mis_large_shift_fraction"}
    # a LossConfig takes the chain; the metric reaches the loss's metrics
    _, metrics = opj.policy_loss(
        old, old, rollout, np.ones(6, np.float32), mask, namespace["loss_config"]
    )
    np.testing.assert_allclose(metrics["mis_large_shift_fraction"], per_seq.mean(), rtol=1e-6)
    # metric groups alone: metrics only, weights 1 and the mask as it is
    alone = opj.correct(old, rollout, mask, namespace["LargeShiftFraction"](threshold=1.0))
    np.testing.assert_array_equal(alone.mask, mask.astype(np.float32))
    np.testing.assert_array_equal(alone.weights, mask.astype(np.float32))
