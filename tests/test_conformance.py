"""Every case of the shared conformance pack, through the public API under ``jax.jit``."""

from __future__ import annotations

import builtins
import functools

import grouped_cases
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


# Both reductions in one program, the cases of one chunk and input shape in one program
# (tests/grouped_cases.py): the two reductions share their first pass, and a program's
# fixed cost is paid once for the group.
@functools.partial(jax.jit, static_argnums=1)
def _correct_group(args, configs):
    return [
        {
            tag: opj.compute_correction(*arrays, config, reduction=reduction)
            for reduction, tag in (("sequence", "seq"), ("token", "tok"))
        }
        for arrays, config in zip(args, configs, strict=True)
    ]


def _correction_prepared(params):
    case = params["case"]
    if case["expect_error"]["raised"]:
        return None
    inputs, _ = load_inputs(case)
    return _correction_config(case), (inputs["old_logp"], inputs["rollout_logp"], inputs["mask"])


def _run_correction_group(prepared):
    configs, args = zip(*prepared, strict=True)
    return _correct_group(list(args), tuple(configs))


@_params("correction")
def test_correction_case(case, request):
    err = case["expect_error"]
    if err["raised"] and err["stage"] == "config":
        _expect_config_error(case, _correction_config)
        return
    config = _correction_config(case)
    inputs, data = load_inputs(case)
    if err["raised"]:
        args = (inputs["old_logp"], inputs["rollout_logp"], inputs["mask"])
        with pytest.raises((ValueError, TypeError)):
            _run_correction_group([(config, args)])
        return
    results = grouped_cases.result(request.node, _correction_prepared, _run_correction_group)
    for tag, res in results.items():
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


_LOSS_INPUTS = ("logp", "old_logp", "rollout_logp", "advantages", "mask")


@functools.partial(jax.jit, static_argnums=1)
def _loss_group(args, configs):
    return [
        jax.value_and_grad(
            lambda lp, o, b, a, m, config=config: opj.policy_loss(lp, o, b, a, m, config),
            has_aux=True,
        )(*arrays)
        for arrays, config in zip(args, configs, strict=True)
    ]


def _loss_prepared(params):
    case = params["case"]
    if case["expect_error"]["raised"]:
        return None
    inputs, _ = load_inputs(case)
    return _loss_config(case), tuple(inputs[k] for k in _LOSS_INPUTS)


def _run_loss_group(prepared):
    configs, args = zip(*prepared, strict=True)
    return _loss_group(list(args), tuple(configs))


@_params("loss")
def test_loss_case(case, request):
    err = case["expect_error"]
    if err["raised"] and err["stage"] == "config":
        _expect_config_error(case, _loss_config)
        return
    config = _loss_config(case)
    inputs, data = load_inputs(case)
    if err["raised"]:
        with pytest.raises((ValueError, TypeError)):
            _run_loss_group([(config, tuple(inputs[k] for k in _LOSS_INPUTS))])
        return
    (loss, metrics), grad = grouped_cases.result(request.node, _loss_prepared, _run_loss_group)
    assert loss.dtype == np.float32 and grad.dtype == np.float32
    assert_close(loss, data["loss"], case, "loss")
    assert_close(grad, data["grad_logp"], case, "grad_logp")
    for key in case["compare"]["metrics"]:
        assert_close(metrics[key], data[f"metric__{key}"], case, f"metric__{key}")


def test_conformance_pack_is_not_empty():
    assert len(load_cases("correction")) > 300 and len(load_cases("loss")) > 100
