"""The ``verl_loss`` cases of the verl-parity pack (../shared/conformance-verl).

``LossConfig.from_verl(rollout_correction, actor)`` + ``policy_loss`` under
``jax.jit(jax.value_and_grad(..., has_aux=True))`` give verl's loss and its gradient
w.r.t. ``logp``: nine loss modes, five aggregations, bypass (``old_logp :=
rollout_logp``) and decoupled modes. The pack is skipped where it is absent; set
OFFPOLICY_JAX_CONFORMANCE_VERL to point at another copy.
"""

from __future__ import annotations

import json
import os
import pathlib

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


def _loss_and_grad(config):
    def loss(logp, old, rollout, advantages, mask):
        return opj.policy_loss(logp, old, rollout, advantages, mask, config)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def _needs_rules(case) -> bool:
    rc = case["rollout_correction"]
    return rc.get("rollout_is") is not None or rc.get("rollout_rs") is not None


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_verl_loss_case(case, clear_jax_caches):
    if _needs_rules(case) and not hasattr(opj.CorrectionConfig, "from_verl"):
        pytest.skip("needs CorrectionConfig.from_verl (the rollout_is / rollout_rs converter)")
    config = opj.LossConfig.from_verl(case["rollout_correction"], case["actor"])
    with np.load(_pack_dir() / case["file"]) as data:
        arrays = {key: data[key] for key in data.files}
    # verl's bypass mode sets π_old := π_rollout.
    old = arrays["rollout_logp"] if case["mode"] == "bypass" else arrays["old_logp"]
    (loss, metrics), grad = _loss_and_grad(config)(
        arrays["logp"], old, arrays["rollout_logp"], arrays["advantages"], arrays["mask"]
    )
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
