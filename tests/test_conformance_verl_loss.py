"""The ``verl_loss`` cases of the verl-parity pack (../shared/conformance-verl).

``LossConfig.from_verl(rollout_correction, actor)`` + ``policy_loss`` under
``jax.jit(jax.value_and_grad(..., has_aux=True))`` give verl's loss and its gradient
w.r.t. ``logp``: nine loss modes, five aggregations, bypass (``old_logp :=
rollout_logp``) and decoupled modes. The pack is skipped where it is absent; set
OFFPOLICY_JAX_CONFORMANCE_VERL to point at another copy.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib

import grouped_cases
import jax
import numpy as np
import pytest

import offpolicy_jax as opj


def _pack_dir() -> pathlib.Path | None:
    env = os.environ.get("OFFPOLICY_JAX_CONFORMANCE_VERL")
    root = (
        pathlib.Path(env)
        if env
        else pathlib.Path(__file__).resolve().parents[2] / "shared" / "conformance-verl"
    )
    return root if (root / "manifest.json").is_file() else None


def _cases() -> list[dict]:
    root = _pack_dir()
    if root is None:
        return []
    cases = json.loads((root / "manifest.json").read_text())["cases"]
    return [c for c in cases if c["kind"] == "verl_loss"]


CASES = _cases()
pytestmark = [
    pytest.mark.conformance,
    pytest.mark.skipif(
        _pack_dir() is None,
        reason="verl conformance pack not found (../shared/conformance-verl, or set "
        "OFFPOLICY_JAX_CONFORMANCE_VERL); skipped without it",
    ),
]


@functools.partial(jax.jit, static_argnums=1)
def _loss_and_grad_group(args, configs):
    """The cases of one chunk and input shape in one program (tests/grouped_cases.py)."""
    return [
        jax.value_and_grad(
            lambda lp, o, b, a, m, config=config: opj.policy_loss(lp, o, b, a, m, config),
            has_aux=True,
        )(*arrays)
        for arrays, config in zip(args, configs, strict=True)
    ]


def _prepared(params):
    case = params["case"]
    if _needs_rules(case) and not hasattr(opj.CorrectionConfig, "from_verl"):
        return None
    config = opj.LossConfig.from_verl(case["rollout_correction"], case["actor"])
    with np.load(_pack_dir() / case["file"]) as data:
        arrays = {key: data[key] for key in data.files}
    # verl's bypass mode sets π_old := π_rollout.
    old = arrays["rollout_logp"] if case["mode"] == "bypass" else arrays["old_logp"]
    args = (arrays["logp"], old, arrays["rollout_logp"], arrays["advantages"], arrays["mask"])
    return config, args


def _run_group(prepared):
    configs, args = zip(*prepared, strict=True)
    return _loss_and_grad_group(list(args), tuple(configs))


def _needs_rules(case) -> bool:
    rc = case["rollout_correction"]
    return rc.get("rollout_is") is not None or rc.get("rollout_rs") is not None


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_verl_loss_case(case, request, clear_jax_caches):
    if _needs_rules(case) and not hasattr(opj.CorrectionConfig, "from_verl"):
        pytest.skip("needs CorrectionConfig.from_verl (the rollout_is / rollout_rs converter)")
    with np.load(_pack_dir() / case["file"]) as data:
        arrays = {key: data[key] for key in data.files}
    (loss, metrics), grad = grouped_cases.result(request.node, _prepared, _run_group)
    tol = case["tolerance"]
    assert loss.dtype == np.float32 and grad.dtype == np.float32
    assert all(np.isfinite(float(v)) for v in metrics.values())
    for key, got in (("loss", loss), ("grad_logp", grad)):
        if case["compare"].get(key, True):
            np.testing.assert_allclose(
                np.asarray(got, np.float64),
                np.asarray(arrays[key], np.float64),
                rtol=tol["rtol"],
                atol=tol["atol"],
                err_msg=f"{case['name']}: {key}",
            )


def test_verl_loss_pack_covers_every_mode():
    if not CASES:
        pytest.skip("no pack")
    modes = {(c["actor"]["loss_mode"], c["mode"]) for c in CASES}
    assert {m for m, _ in modes} == {
        "vanilla",
        "gspo",
        "cispo",
        "geo_mean",
        "sapo",
        "gpg",
        "dppo_tv",
        "dppo_kl",
        "dro",
    }
    assert {a for c in CASES for a in [c["actor"]["loss_agg_mode"]]} == {
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
        "token-sum",
    }
    assert len(CASES) >= 292
