"""OAPL (Ritter et al., 2026, arXiv:2602.19362): the ``oapl`` surrogate and
``oapl_advantages`` against an independent float64 NumPy transcription of the paper's
Eq. 2 / Eq. 3 and of the authors' ``compute_policy_loss``: values and gradients (ragged,
NaN/inf in the padding, probabilities within 1e-7 of 0 and of 1), every aggregation and
algorithm, NeMo-RL's worked example, jit / vmap / grad, the all-masked batch, packed ==
one sequence per row, micro-batch pooling == full batch, and the validation of ``beta2``
and ``beta1``. Sharded == unsharded runs in test_sharding_losses (``mesh_cases``)."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as mis_ref
import packing_cases as pc
import policy_losses_reference as ref
import pytest
from test_policy_losses import TIS_RS, _jit_loss, policy_batch

import offpolicy_jax as opj
from offpolicy_jax._src.losses.oapl import oapl_advantages

RTOL, ATOL = 2e-5, 2e-6
AGGREGATIONS = (
    "sequence_mean",
    "token_mean",
    "sequence_sum",
    "sequence_sum_norm",
    "token_sum",
    "row_mean",
)


# --------------------------------------------------------------------------- oracle


def numpy_oapl(theta, d, adv, final_mask, *, beta2, aggregation, scale=None):
    """Loss, ``∂loss/∂θ`` and the per-sequence residuals, in float64.

    Per sequence ``i`` over its kept tokens: ``S_i = Σ_t (θ − d)``,
    ``Â_i = mean_t A``, ``L_i = (β₂·S_i − Â_i)²`` (the authors' ``residuals ** 2``);
    every kept token carries ``L_i`` and the aggregation's weights sum them.
    """
    keep = np.asarray(final_mask) > 0
    theta, d, adv = (np.where(keep, np.asarray(a, np.float64), 0.0) for a in (theta, d, adv))
    n = keep.sum(-1)
    s = (theta - d).sum(-1)
    a_hat = adv.sum(-1) / np.maximum(n, 1)
    residual = beta2 * s - a_hat
    per_token = np.where(keep, (residual**2)[:, None], 0.0)
    value, weight = ref.aggregate(per_token, keep, keep, aggregation, scale)
    grad = np.where(keep, (weight.sum(-1) * 2 * beta2 * residual)[:, None], 0.0)
    return value, grad, residual, n


def authors_loss(log_prob, ref_log_prob, response_mask, rewards, values, beta2):
    """The authors' ``compute_policy_loss`` (verl/trainer/oapl/core_algos.py), in NumPy:
    ``mean((β₂·Σ_t mask·(log π − log π_ref) − (R − V))²)`` over the sequences."""
    m = np.asarray(response_mask, np.float64)
    log_prob_ratio = (log_prob * m).sum(-1) - (ref_log_prob * m).sum(-1)
    residuals = beta2 * log_prob_ratio - (rewards - values)
    return (residuals**2).mean()


def numpy_vstar(rewards, beta1):
    r = np.asarray(rewards, np.float64)
    return beta1 * np.log(np.mean(np.exp(r / beta1)))


def extreme_batch(seed):
    """Ragged ``[5, 8]``: probabilities within 1e-7 of 0 and of 1 (trainer and denominator
    alike), an empty row, NaN / inf in the padding, one advantage per sequence."""
    rng = np.random.default_rng(seed)
    lengths = np.array([8, 4, 1, 0, 6])
    valid = np.arange(8)[None, :] < lengths[:, None]
    p = rng.uniform(0.05, 0.95, valid.shape)
    q = np.clip(p + rng.normal(0, 0.1, p.shape), 1e-3, 1 - 1e-3)
    tiny = rng.uniform(0.1, 1.0, p.shape) * 1e-7
    p[0, :3], q[0, :3] = tiny[0, :3], tiny[0, 3:6]  # near 0
    p[1, :2], q[1, 1:3] = 1 - tiny[1, :2], 1 - tiny[1, 2:4]  # near 1
    p[4, 0], q[4, 0] = 1 - tiny[4, 0], tiny[4, 1]  # one of each
    theta, d = np.log(p), np.log(q)
    adv = rng.normal(size=(5, 1)) * np.ones((1, 8))
    junk = np.array([np.nan, np.inf, -np.inf, 1e30])[np.arange(40).reshape(5, 8) % 4]
    f32 = lambda a: np.where(valid, a, junk).astype(np.float32)  # noqa: E731
    return f32(theta), f32(d), f32(adv), valid


def _config(algorithm="bypass_ppo", aggregation="sequence_mean", **extra):
    return opj.LossConfig(algorithm=algorithm, policy_loss="oapl", aggregation=aggregation, **extra)


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("algorithm", ["ppo", "bypass_ppo"])
def test_loss_and_gradient_match_numpy(algorithm, aggregation):
    """``π_d`` is π_old under ``ppo`` (the authors' trainer pass over the lagged policy)
    and π_rollout under ``bypass_ppo`` (NeMo-RL's generation log-probs)."""
    theta, old, rollout, adv, valid = policy_batch(3)
    beta2 = 0.05  # large enough that β₂·S moves the residual
    config = _config(algorithm, aggregation, beta2=beta2)
    (loss, metrics), grad = _jit_loss(config)(theta, old, rollout, adv, valid, None)
    d = rollout if algorithm == "bypass_ppo" else old
    want, want_grad, residual, n = numpy_oapl(
        theta, d, adv, valid, beta2=beta2, aggregation=aggregation
    )
    np.testing.assert_allclose(float(loss), want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=RTOL, atol=ATOL)
    assert np.all(np.asarray(grad)[~valid] == 0.0)
    # metric_reduction="sequence": each sequence's residual once.
    np.testing.assert_allclose(float(metrics["oapl_residual"]), residual[n > 0].mean(), rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("algorithm", ["ppo", "bypass_ppo"])
def test_probabilities_next_to_zero_and_one(seed, algorithm):
    theta, d, adv, valid = extreme_batch(seed)
    config = _config(algorithm, beta2=1e-3)
    (loss, metrics), grad = _jit_loss(config)(theta, d, d, adv, valid, None)
    want, want_grad, _, _ = numpy_oapl(
        theta, d, adv, valid, beta2=1e-3, aggregation="sequence_mean"
    )
    np.testing.assert_allclose(float(loss), want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=RTOL, atol=1e-8)
    assert all(np.isfinite(float(v)) for v in metrics.values())


def test_sequence_mean_is_the_authors_loss():
    """With one advantage ``R − V`` per sequence, ``sequence_mean`` equals the authors'
    ``compute_policy_loss`` (ratio against ``ref_log_prob``: ``algorithm="ppo"``)."""
    theta, old, rollout, _, valid = policy_batch(9)
    keep = valid.sum(-1) > 0  # the authors' batch has no empty responses
    rng = np.random.default_rng(9)
    rewards = rng.integers(0, 2, valid.shape[0]).astype(np.float64)
    values = np.full(valid.shape[0], numpy_vstar(rewards, 1.0))
    adv = np.broadcast_to((rewards - values)[:, None], valid.shape).astype(np.float32)
    config = _config("ppo", beta2=0.02)
    (loss, _), _ = _jit_loss(config)(theta, old, rollout, adv, valid, None)
    m = valid[keep]
    clean = lambda a: np.where(m, np.asarray(a, np.float64)[keep], 0.0)  # noqa: E731
    want = authors_loss(clean(theta), clean(old), m, rewards[keep], values[keep], 0.02)
    np.testing.assert_allclose(float(loss), want, rtol=RTOL)


def test_nemo_rl_worked_example():
    """NeMo-RL's ``test_oapl_loss_regresses_sequence_log_ratio_to_advantage``:
    ``policy_beta=0.5``, two sequences of two tokens, targets ``[1, −0.5]``."""
    logp = jnp.array([[0.2, -0.1], [0.4, 0.6]])
    gen = np.array([[0.1, -0.3], [0.1, 0.2]], np.float32)
    adv = np.array([[1.0, 1.0], [-0.5, -0.5]], np.float32)
    mask = np.ones((2, 2), bool)
    loss, _ = opj.policy_loss(logp, gen, gen, adv, mask, _config(beta2=0.5))
    s = np.array([0.2 - 0.1 - 0.1 + 0.3, 0.4 + 0.6 - 0.1 - 0.2])
    np.testing.assert_allclose(float(loss), np.mean((0.5 * s - [1.0, -0.5]) ** 2), rtol=1e-6)


def test_is_weights_are_not_applied_but_rejection_drops_tokens():
    """Under ``decoupled_ppo`` with token TIS + RS the loss is the oracle's on the
    correction's final mask, with no weight (OAPL regresses without IS)."""
    theta, old, rollout, adv, valid = policy_batch(5)
    config = _config("decoupled_ppo", correction=opj.CorrectionConfig(**TIS_RS), beta2=0.05)
    (loss, _), grad = _jit_loss(config)(theta, old, rollout, adv, valid, None)
    w, m_final, _ = mis_ref.correction(old, rollout, valid, **TIS_RS)
    assert 0 < (m_final > 0).sum() < valid.sum() and np.any(np.where(m_final > 0, w, 1.0) != 1.0)
    want, want_grad, _, _ = numpy_oapl(
        theta, old, adv, m_final, beta2=0.05, aggregation="sequence_mean"
    )
    np.testing.assert_allclose(float(loss), want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=RTOL, atol=ATOL)


def test_zero_at_the_optimum_of_the_regularised_objective():
    """``β₂·S_i = Â_i`` on every sequence: loss and gradient 0 (the closed-form optimum)."""
    theta, d, adv, valid = extreme_batch(3)
    n = valid.sum(-1)
    s_target = np.where(n > 0, adv[:, 0] / 0.5, 0.0)
    theta = np.where(valid, d + (s_target / np.maximum(n, 1))[:, None], theta).astype(np.float32)
    (loss, _), grad = _jit_loss(_config(beta2=0.5))(theta, d, d, adv, valid, None)
    want, _, _, _ = numpy_oapl(theta, d, adv, valid, beta2=0.5, aggregation="sequence_mean")
    assert want < 1e-12 and float(loss) < 1e-10
    assert np.all(np.abs(np.asarray(grad)) < 1e-6)


# --------------------------------------------------------------------------- advantages


def test_advantages_match_the_closed_form_on_ragged_groups():
    rng = np.random.default_rng(0)
    rewards = rng.integers(0, 2, (4, 6)).astype(np.float32)
    rewards[1] = [50.0, 49.0, 0.0, 1.0, 2.0, 3.0]  # r/β₁ large: the log-sum-exp is shifted
    where = np.ones((4, 6), bool)
    where[2, 3:] = False
    where[3] = False
    rewards[2, 3:] = np.nan  # garbage where not counted
    for beta1 in (1.0, 0.5, 3.0):
        got = np.asarray(oapl_advantages(rewards, beta1=beta1, where=where))
        for g in range(4):
            counted = where[g]
            want = np.zeros(6)
            if counted.any():
                r = rewards[g, counted].astype(np.float64)
                want[counted] = r - numpy_vstar(r, beta1)
            np.testing.assert_allclose(got[g], want, rtol=1e-5, atol=1e-5)


def test_advantage_limits_follow_nemo_rl():
    """``β₁ → 0``: ``V̂* = max r``; ``β₁ → ∞``: the mean reward (NeMo-RL's test)."""
    r = jnp.array([0.0, 0.0, 1.0, 0.0])
    np.testing.assert_allclose(oapl_advantages(r, beta1=1e-8), [-1.0, -1.0, 0.0, -1.0], atol=1e-6)
    np.testing.assert_allclose(
        oapl_advantages(r, beta1=1e8), [-0.25, -0.25, 0.75, -0.25], rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("beta1", [0.0, -1.0, float("nan"), float("inf"), 1e-46, "x", True])
def test_advantages_validate_beta1(beta1):
    with pytest.raises(ValueError, match="beta1"):
        oapl_advantages(jnp.zeros(3), beta1=beta1)


# --------------------------------------------------------------------------- transforms


def test_jit_vmap_and_grad():
    config = _config(beta2=0.05)
    batches = [policy_batch(s) for s in (11, 12, 13)]
    stacked = [np.stack(a) for a in zip(*batches, strict=True)]

    def loss(lp, old, rollout, adv, mask):
        return opj.policy_loss(lp, old, rollout, adv, mask, config)[0]

    grad_fn = jax.jit(jax.vmap(jax.value_and_grad(loss)))
    values, grads = grad_fn(*stacked)
    for i, (theta, old, rollout, adv, valid) in enumerate(batches):
        eager = jax.value_and_grad(loss)(theta, old, rollout, adv, valid)
        want, want_grad, _, _ = numpy_oapl(
            theta, rollout, adv, valid, beta2=0.05, aggregation="sequence_mean"
        )
        np.testing.assert_allclose(float(values[i]), want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(float(eager[0]), want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(np.asarray(grads[i]), want_grad, rtol=RTOL, atol=ATOL)
        assert np.all(np.isfinite(np.asarray(grads[i])))


@pytest.mark.parametrize("algorithm", ["bypass_ppo", "decoupled_ppo"])
@pytest.mark.parametrize("how", ["empty", "rejected"])
def test_all_masked_gives_zero_loss_and_zero_gradient(algorithm, how):
    theta, old, rollout, adv, valid = policy_batch(26)
    correction = opj.CorrectionConfig(**TIS_RS) if algorithm == "decoupled_ppo" else None
    config = _config(algorithm, correction=correction)
    if how == "empty" or algorithm != "decoupled_ppo":
        valid = np.zeros_like(valid)
    else:  # every token rejected: π_old/π_rollout = e^-30, below the RS bound 0.5
        rollout = np.where(valid, old + 30.0, rollout).astype(np.float32)
    (loss, metrics), grad = _jit_loss(config)(theta, old, rollout, adv, valid, None)
    assert float(loss) == 0.0
    np.testing.assert_array_equal(np.asarray(grad), 0.0)
    assert all(np.isfinite(float(v)) for v in metrics.values())


K = 4


def _loss(config, batch, segments=None):
    packed = {} if segments is None else {"segment_ids": segments, "num_segments": K}
    args = (batch["old_logp"], batch["rollout_logp"], batch["advantages"], batch["mask"])
    return jax.value_and_grad(
        lambda lp: opj.policy_loss(lp, *args, config, **packed), has_aux=True
    )(batch["logp"])


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean"])
def test_packed_equals_one_sequence_per_row(aggregation):
    """Several sequences per row: ``S_i`` and ``Â_i`` are per segment, not per row."""
    config = _config(aggregation=aggregation, beta2=0.05)
    b = pc.packed_batch(4, rows=4, length=24, num_segments=K)
    (loss, metrics), grad = jax.jit(functools.partial(_loss, config))(b, b["segment_ids"])
    flat = pc.unpack(b, K)
    (want, want_metrics), want_grad = jax.jit(functools.partial(_loss, config))(flat)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5, atol=1e-6)
    repacked = pc.repack(np.asarray(want_grad), b["segment_ids"], K)
    np.testing.assert_allclose(np.asarray(grad), repacked, rtol=1e-5, atol=1e-6)
    for key in want_metrics:
        np.testing.assert_allclose(
            float(metrics[key]), float(want_metrics[key]), rtol=1e-5, atol=1e-6, err_msg=key
        )


@functools.cache
def _jit_parts(config):
    def numerator(lp, old, rollout, adv, mask):
        parts, metrics = opj.policy_loss_parts(lp, old, rollout, adv, mask, config)
        return parts.numerator, (parts.denominator, metrics)

    return jax.jit(jax.value_and_grad(numerator, has_aux=True))


@pytest.mark.heavy
@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean"])
def test_micro_batches_pool_to_the_full_batch(aggregation):
    config = _config(aggregation=aggregation, beta2=0.05)
    args = policy_batch(8)
    (full_loss, full_metrics), full_grad = _jit_loss(config)(*args, None)
    num, den, grads, pooled = 0.0, 0.0, [], None
    for start, stop in itertools.pairwise([0, 2, 3, 6]):
        (n, (d, metrics)), g = _jit_parts(config)(*(x[start:stop] for x in args))
        num, den = num + n, den + d
        grads.append(g)
        pooled = metrics if pooled is None else opj.pool_metric_parts(pooled, metrics)
    np.testing.assert_allclose(
        float(opj.LossParts(num, den).value()), float(full_loss), rtol=1e-5, atol=1e-6
    )
    grad = np.concatenate(grads) / (float(den) or 1.0)
    np.testing.assert_allclose(grad, np.asarray(full_grad), rtol=1e-5, atol=1e-6)
    pooled = opj.finalize_metrics(pooled)
    assert pooled.keys() == full_metrics.keys()
    for key in pooled:
        np.testing.assert_allclose(
            float(pooled[key]), float(full_metrics[key]), rtol=1e-5, atol=1e-5, err_msg=key
        )


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(policy_loss="oapl", beta2=0.0), "LossConfig.beta2 must be > 0"),
        (dict(policy_loss="oapl", beta2=-1e-3), "LossConfig.beta2 must be > 0"),
        (dict(policy_loss="oapl", beta2=float("nan")), "LossConfig.beta2"),
        (dict(policy_loss="oapl", beta2=1e39), "LossConfig.beta2"),
        (dict(policy_loss="oapl", beta2=1e-46), "LossConfig.beta2"),
        (dict(policy_loss="oapl", beta2="x"), "LossConfig.beta2"),
        (dict(policy_loss="oapl", beta2=True), "LossConfig.beta2"),
        (dict(policy_loss="ppo_clip", beta2=1e-3), "beta2"),
        (dict(policy_loss="oapl", dro_beta=0.1), "dro_beta"),
    ],
)
def test_beta2_is_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        opj.LossConfig(**kwargs)


def test_defaults_are_the_papers_and_keys_round_trip():
    cfg = opj.LossConfig(policy_loss="oapl")
    assert cfg.beta2 == 1e-3 and opj.LossConfig().beta2 is None
    tuned = opj.LossConfig(policy_loss="oapl", beta2="5e-3", aggregation="sequence_mean")
    assert tuned.beta2 == 5e-3
    assert opj.LossConfig.from_dict(tuned.to_dict()) == tuned
