"""The verl-parity pack (../shared/conformance-verl) through the public API under jit.

``verl_correction``: ``CorrectionConfig.from_verl`` + ``compute_correction`` give verl's
effective weights (``rollout_is_weights · modified_response_mask``) and mask;
``verl_config_error``: ``from_verl`` raises ``ValueError`` where verl does.
"""

from __future__ import annotations

import functools

import grouped_cases
import jax
import numpy as np
import pytest
from conformance_verl import SKIP_REASON, assert_close, load_arrays, load_cases, params, verl_dir

import offpolicy_jax as opj

pytestmark = [
    pytest.mark.conformance,
    pytest.mark.skipif(verl_dir() is None, reason=SKIP_REASON),
]


@functools.partial(jax.jit, static_argnums=1)
def _correct_group(args, configs):
    """The cases of one chunk and input shape in one program (tests/grouped_cases.py)."""
    return [opj.compute_correction(*a, c) for a, c in zip(args, configs, strict=True)]


def _prepared(params):
    case = params["case"]
    data = load_arrays(case)
    config = opj.CorrectionConfig.from_verl(case["rollout_correction"])
    return config, (data["old_logp"], data["rollout_logp"], data["mask"])


def _run_group(prepared):
    configs, args = zip(*prepared, strict=True)
    return _correct_group(list(args), tuple(configs))


@params("verl_correction")
def test_verl_correction_case(case, request):
    data = load_arrays(case)
    res = grouped_cases.result(request.node, _prepared, _run_group)
    assert res.weights.dtype == np.float32 and res.mask.dtype == np.float32
    if case["compare"]["weights"]:
        assert_close(res.weights, data["weights"], case, "weights")
    if case["compare"]["mask_out"]:
        np.testing.assert_array_equal(np.asarray(res.mask), data["mask_out"], err_msg=case["name"])


@params("verl_config_error")
def test_verl_config_error_case(case):
    with pytest.raises(ValueError) as info:
        opj.CorrectionConfig.from_verl(case["rollout_correction"])
    # The message names the verl key at fault.
    assert "rollout_correction.rollout_" in str(info.value), str(info.value)


def test_verl_pack_is_not_empty():
    assert len(load_cases("verl_correction")) >= 98
    assert len(load_cases("verl_config_error")) >= 10
