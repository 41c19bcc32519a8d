"""The switch between the reduction paths (``OFFPOLICY_JAX_REDUCTION``), and the two
paths against each other: the plain one (TPU/GPU) and the fused CPU one give the same
losses, gradients, weights, masks and metrics, padded and packed.

The whole suite runs on one path per process (CI runs it under both); this module
traces both in one process, each under its own setting of the variable.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import offpolicy_jax as opj
from offpolicy_jax.reduction import backend


def test_the_variable_chooses_the_path(monkeypatch):
    monkeypatch.delenv(backend.ENV, raising=False)
    default = "fused" if jax.default_backend() == "cpu" else "plain"
    assert backend.implementation() == default
    for value, want in (("plain", "plain"), (" Plain ", "plain"), ("auto", default), ("", default)):
        monkeypatch.setenv(backend.ENV, value)
        assert backend.implementation() == want
    monkeypatch.setenv(backend.ENV, "fast")
    with pytest.raises(ValueError, match="OFFPOLICY_JAX_REDUCTION"):
        backend.implementation()


def test_fused_on_an_accelerator_is_an_error(monkeypatch):
    monkeypatch.setattr(backend.jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv(backend.ENV, "auto")
    assert backend.implementation() == "plain"
    monkeypatch.setenv(backend.ENV, "fused")
    with pytest.raises(ValueError, match="fused.*'gpu'"):
        backend.implementation()


def _batch(rng, rows, length):
    logp = rng.normal(-2.0, 0.5, (rows, length)).astype(np.float32)
    old = (logp + rng.normal(0, 0.05, logp.shape)).astype(np.float32)
    rollout = (old + rng.normal(0, 0.4, logp.shape)).astype(np.float32)
    adv = rng.normal(size=logp.shape).astype(np.float32)
    mask = np.arange(length) < rng.integers(1, length + 1, (rows, 1))
    return logp, old, rollout, adv, mask


def _run(monkeypatch, path, packed, *args):
    """Loss, gradient and correction traced afresh under ``OFFPOLICY_JAX_REDUCTION=path``."""
    monkeypatch.setenv(backend.ENV, path)
    logp, old, rollout, adv, mask, ids = args
    config = opj.LossConfig(
        algorithm="decoupled_ppo",
        correction=opj.CorrectionConfig.preset("mis"),
        get_mismatch_metrics=True,
    )
    segments = {"segment_ids": ids, "num_segments": 4, "contiguous_segments": True}
    segments = segments if packed else {}

    def loss(lp):
        return opj.policy_loss(lp, old, rollout, adv, mask, config, **segments)

    (value, metrics), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(logp)
    result = jax.jit(
        lambda o, r, m: opj.compute_correction(o, r, m, config.correction, **segments)
    )(old, rollout, mask)
    return value, grad, metrics, result


@pytest.mark.heavy
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the fused path is CPU's")
@pytest.mark.parametrize("packed", [False, True])
def test_plain_and_fused_paths_agree(monkeypatch, packed):
    rng = np.random.default_rng(7)
    length = 300
    logp, old, rollout, adv, mask = _batch(rng, 6, length)
    # pack_sequences' layout: runs of ids 1..4 in order, each longer than a window
    cuts = np.sort(rng.choice(np.arange(70, length - 70), 3, replace=False))
    ids = np.broadcast_to(np.searchsorted(cuts, np.arange(length), side="right") + 1, mask.shape)
    ids = np.where(np.arange(length) < length - 20, ids, 0).astype(np.int32)
    assert bool(opj.reduction.contiguous_rows(ids, 4))
    args = (logp, old, rollout, adv, mask, ids)
    fused = _run(monkeypatch, "fused", packed, *args)
    plain = _run(monkeypatch, "plain", packed, *args)
    np.testing.assert_allclose(fused[0], plain[0], rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(fused[1], plain[1], rtol=2e-5, atol=1e-8)
    assert fused[2].keys() == plain[2].keys()
    for key in fused[2]:
        np.testing.assert_allclose(fused[2][key], plain[2][key], rtol=2e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(fused[3].weights, plain[3].weights, rtol=2e-5, atol=1e-7)
    np.testing.assert_array_equal(fused[3].mask, plain[3].mask)
    for key in fused[3].metrics:
        np.testing.assert_allclose(
            fused[3].metrics[key], plain[3].metrics[key], rtol=2e-5, atol=1e-6, err_msg=key
        )


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4)])
def test_batch_totals_sum_every_axis_and_differentiate(shape):
    """Batch totals of per-sequence terms (``[...]`` padded, ``[..., K]`` packed): on the
    fused path small operands of two or more axes are summed in one loop. Both paths
    give the sums, to float32 rounding, and the gradient of a total is all ones."""
    from offpolicy_jax.reduction import fused_cpu, plain

    rng = np.random.default_rng(11)
    values = tuple(rng.normal(size=shape).astype(np.float32) for _ in range(3))
    want = [v.astype(np.float64).sum() for v in values]
    for totals in (fused_cpu.batch_totals, backend.batch_totals):
        got = jax.jit(totals)(values)
        assert all(g.shape == () for g in got)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    grad = jax.grad(lambda v: fused_cpu.batch_totals((v, 2 * v))[1])(values[0])
    np.testing.assert_array_equal(grad, np.full(shape, 2.0, np.float32))
    tangent = jax.jvp(fused_cpu.batch_totals, (values,), (values,))[1]
    np.testing.assert_allclose(tangent, want, rtol=1e-6, atol=1e-6)
    plain_sums = plain.reduce_columns(("sum",) * 3, tuple(v.reshape(-1) for v in values))
    np.testing.assert_allclose(plain_sums, want, rtol=1e-6, atol=1e-6)
