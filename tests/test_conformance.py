"""Every case of the shared conformance pack, through the public API under ``jax.jit``."""

from __future__ import annotations

import builtins

import jax
import numpy as np
import pytest
from conformance import SKIP_REASON, assert_close, conformance_dir, load_cases, load_inputs

import offpolicy_jax as opj

pytestmark = [
    pytest.mark.conformance,
    pytest.mark.skipif(conformance_dir() is None, reason=SKIP_REASON),
    pytest.mark.usefixtures("clear_jax_caches"),
]


def _params(kind):
    cases = load_cases(kind)
    return pytest.mark.parametrize("case", cases, ids=[c["name"] for c in cases])


def _correction_config(case):
    if "config_yaml" in case:
        return opj.CorrectionConfig.from_yaml(case["config_yaml"])
    if case.get("config_from_dict"):
        return opj.CorrectionConfig.from_dict(case["config"])
    return opj.CorrectionConfig(**case["config"])


def _loss_config(case):
    config = dict(case["config"])
    if config["correction"] is not None:
        cls = opj.VanillaTIS if case["correction_type"] == "VanillaTIS" else opj.CorrectionConfig
        config["correction"] = cls(**config["correction"])
    return opj.LossConfig(**config)


def _expect_config_error(case, build):
    err = case["expect_error"]
    types = tuple(getattr(builtins, t) for t in err["types"])
    with pytest.raises(types) as info:
        build(case)
    assert any(key in str(info.value) for key in err["key_any_of"] or [""]), str(info.value)


# Both reductions in one program: one compile a case (the two share their first pass).
_correct = jax.jit(
    lambda o, b, m, c: {
        tag: opj.compute_correction(o, b, m, c, reduction=reduction)
        for reduction, tag in (("sequence", "seq"), ("token", "tok"))
    },
    static_argnums=3,
)


@_params("correction")
def test_correction_case(case):
    err = case["expect_error"]
    if err["raised"] and err["stage"] == "config":
        _expect_config_error(case, _correction_config)
        return
    config = _correction_config(case)
    inputs, data = load_inputs(case)
    args = (inputs["old_logp"], inputs["rollout_logp"], inputs["mask"], config)
    if err["raised"]:
        with pytest.raises((ValueError, TypeError)):
            _correct(*args)
        return
    for tag, res in _correct(*args).items():
        assert res.weights.dtype == np.float32 and res.mask.dtype == np.float32
        if case["compare"]["weights"]:
            assert res.weights.shape == data["weights"].shape
            assert_close(res.weights, data["weights"], case, "weights")
            np.testing.assert_array_equal(np.asarray(res.mask), data["mask_out"])
        for key in case["compare"]["metrics"]:
            assert res.metrics[key].dtype == np.float32 and res.metrics[key].shape == ()
            assert_close(
                res.metrics[key], data[f"metric_{tag}__{key}"], case, f"metric_{tag}__{key}"
            )


@_params("loss")
def test_loss_case(case):
    err = case["expect_error"]
    if err["raised"] and err["stage"] == "config":
        _expect_config_error(case, _loss_config)
        return
    config = _loss_config(case)
    inputs, data = load_inputs(case)
    value_and_grad = jax.jit(
        jax.value_and_grad(
            lambda lp, o, b, a, m: opj.policy_loss(lp, o, b, a, m, config), has_aux=True
        )
    )
    args = tuple(inputs[k] for k in ("logp", "old_logp", "rollout_logp", "advantages", "mask"))
    if err["raised"]:
        with pytest.raises((ValueError, TypeError)):
            value_and_grad(*args)
        return
    (loss, metrics), grad = value_and_grad(*args)
    assert loss.dtype == np.float32 and grad.dtype == np.float32
    assert_close(loss, data["loss"], case, "loss")
    assert_close(grad, data["grad_logp"], case, "grad_logp")
    for key in case["compare"]["metrics"]:
        assert_close(metrics[key], data[f"metric__{key}"], case, f"metric__{key}")


def test_conformance_pack_is_not_empty():
    assert len(load_cases("correction")) > 300 and len(load_cases("loss")) > 100
