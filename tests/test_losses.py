"""policy_loss: values, gradients and metrics against the NumPy oracle; gradient rules;
stop-gradient IS weights; empty batches; garbage; micro-batch pooling; D5, D8b, D9."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import itertools
import pathlib
import typing

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads
from strategies import examples, ragged_batches

import offpolicy_jax as opj

MIS = opj.CorrectionConfig(
    use_tis=True,
    use_rs=True,
    tis_lower_bound=0.5,
    tis_upper_bound=2.0,
    rs_veto_threshold=1e-4,
    tis_batch_normalize=True,
)
SEQ_MASK = opj.CorrectionConfig(
    use_tis=True,
    tis_level="sequence",
    tis_mode="mask",
    tis_upper_bound=4.0,
    use_rs=True,
    rs_level="geometric",
)
GEO_CLIP = opj.CorrectionConfig(
    use_tis=True,
    tis_level="geometric",
    tis_mode="clip",
    tis_batch_normalize=True,
    rs_veto_threshold=0.05,
)
METRICS_ONLY = opj.CorrectionConfig(use_tis=False)


def _loss_configs():
    out = []
    corrections = {
        "ppo": [None, METRICS_ONLY],
        "bypass_ppo": [None, METRICS_ONLY],
        "decoupled_ppo": [MIS, SEQ_MASK, GEO_CLIP, opj.VanillaTIS(), opj.VanillaTIS(0.5, 1.5)],
        "reinforce_is": [MIS, SEQ_MASK, opj.VanillaTIS()],
    }
    for algorithm, aggregation, in_den, (eps_high, dual) in itertools.product(
        corrections,
        ("sequence_mean", "token_mean", "sequence_sum"),
        (False, True),
        ((None, None), (0.28, 3.0)),
    ):
        for correction in corrections[algorithm]:
            out.append(
                opj.LossConfig(
                    algorithm=algorithm,
                    clip_eps=0.2,
                    clip_eps_high=eps_high,
                    dual_clip_c=dual,
                    correction=correction,
                    aggregation=aggregation,
                    rejected_in_denominator=in_den,
                    get_mismatch_metrics=correction is METRICS_ONLY,
                )
            )
    return out


LOSS_CONFIGS = _loss_configs()
loss_configs = st.sampled_from(LOSS_CONFIGS)


def _reference_correction(correction):
    if correction is None:
        return None
    if isinstance(correction, opj.VanillaTIS):
        return ("vanilla_tis", correction.clip_low, correction.clip)
    return correction.to_dict()


# Cached by config: the properties and parametrizations that meet a config again reuse
# its compiled program.
@functools.cache
def _value_and_grad(config):
    return jax.jit(
        jax.value_and_grad(
            lambda lp, o, b, a, m: opj.policy_loss(lp, o, b, a, m, config), has_aux=True
        )
    )


def _args(batch, *, old=True):
    return (
        batch["logp"],
        batch["old_logp"] if old else None,
        batch["rollout_logp"],
        batch["advantages"],
        batch["mask"],
    )


@settings(max_examples=examples(40))
@given(
    batch=ragged_batches(), config=loss_configs, reduction=st.sampled_from(["sequence", "token"])
)
def test_matches_numpy_reference(batch, config, reduction):
    config = opj.LossConfig(**{**config.__dict__, "metric_reduction": reduction})
    (loss, metrics), grad = _value_and_grad(config)(*_args(batch))
    want_loss, want_grad, want_metrics = ref.policy_loss(
        *_args(batch),
        algorithm=config.algorithm,
        clip_eps=config.clip_eps,
        clip_eps_high=config.clip_eps_high,
        dual_clip_c=config.dual_clip_c,
        correction=_reference_correction(config.correction),
        aggregation=config.aggregation,
        rejected_in_denominator=config.rejected_in_denominator,
        get_mismatch_metrics=config.get_mismatch_metrics,
        metric_reduction=reduction,
    )
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-6)
    assert set(want_metrics) <= set(metrics)
    for key, value in want_metrics.items():
        np.testing.assert_allclose(float(metrics[key]), value, rtol=1e-5, atol=1e-5, err_msg=key)


# ------------------------------------------------------------------------ gradients


def _smooth_batch(seed=0, batch=3, length=7):
    """Ratios strictly inside or far outside the clip range: no kink within ±1e-2."""
    rng = np.random.default_rng(seed)
    old = -rng.uniform(0.5, 3.0, size=(batch, length))
    inside = rng.uniform(-0.1, 0.1, size=old.shape)
    outside = rng.choice([-1.0, 1.0], size=old.shape) * rng.uniform(0.5, 1.0, size=old.shape)
    logp = old + np.where(rng.random(old.shape) < 0.7, inside, outside)
    rollout = old + rng.uniform(-0.3, 0.3, size=old.shape)
    adv = rng.choice([-1.0, 1.0], size=old.shape) * rng.uniform(0.5, 2.0, size=old.shape)
    mask = np.arange(length)[None] < np.array([[7], [4], [5]])[:batch]
    return [np.asarray(x, np.float64) for x in (logp, old, rollout, adv)] + [
        mask.astype(np.float64)
    ]


@pytest.mark.heavy
@pytest.mark.parametrize(
    "config",
    [
        opj.LossConfig(algorithm="ppo"),
        opj.LossConfig(algorithm="bypass_ppo", aggregation="token_mean"),
        opj.LossConfig(algorithm="decoupled_ppo", correction=MIS, dual_clip_c=3.0),
        opj.LossConfig(algorithm="decoupled_ppo", correction=GEO_CLIP, aggregation="sequence_sum"),
    ],
    ids=lambda c: f"{c.algorithm}-{c.aggregation}",
)
def test_gradient_matches_finite_differences_away_from_kinks(config):
    # float32 finite differences with eps = 1e-3: every kink is > 0.05 away.
    logp, old, rollout, adv, mask = (np.asarray(x, np.float32) for x in _smooth_batch())
    loss = jax.jit(lambda lp: opj.policy_loss(lp, old, rollout, adv, mask, config)[0])
    check_grads(loss, (logp,), order=1, modes=["rev"], eps=1e-3, atol=2e-3, rtol=2e-3)


@pytest.mark.heavy
def test_reinforce_is_gradient_matches_finite_differences_with_frozen_weights():
    # sg(w(θ)) changes with θ, so finite differences only apply with w frozen at θ0.
    logp, _, rollout, adv, mask = (np.asarray(x, np.float32) for x in _smooth_batch())
    config = opj.LossConfig(algorithm="reinforce_is", correction=SEQ_MASK)
    frozen = opj.compute_correction(logp, rollout, mask, SEQ_MASK)

    def loss(lp):
        return opj.policy_loss(lp, None, rollout, adv, mask, config, correction_result=frozen)[0]

    check_grads(loss, (logp,), order=1, modes=["rev"], eps=1e-3, atol=2e-3, rtol=2e-3)
    live = jax.grad(lambda lp: opj.policy_loss(lp, None, rollout, adv, mask, config)[0])(logp)
    np.testing.assert_allclose(np.asarray(live), np.asarray(jax.grad(loss)(logp)), rtol=1e-6)


def _ppo_grad(theta, d, a, **kwargs):
    config = opj.LossConfig(algorithm="ppo", aggregation="token_mean", **kwargs)

    def f(lp):
        return opj.policy_loss(
            lp, jnp.asarray(d), None, jnp.asarray(a), jnp.ones(len(theta)), config
        )[0]

    return np.asarray(jax.jit(jax.grad(f))(jnp.asarray(theta, jnp.float32))) * len(theta)


def test_gradient_zero_on_clipped_branch():
    # A > 0 and r = e^0.5 > 1.2: clipped; A < 0 and r = e^-0.5 < 0.8: clipped.
    g = _ppo_grad([0.5, -0.5, 0.1], [0.0, 0.0, 0.0], [1.0, -1.0, 1.0])
    np.testing.assert_allclose(g, [0.0, 0.0, -np.exp(0.1)], rtol=1e-6)


def test_gradient_zero_beyond_log_ratio_clamp_full_at_it():
    # θ − d = 25 is beyond the ±20 clamp (r constant); clipping is off here because
    # A < 0 with a huge ratio takes the unclipped branch.
    g = _ppo_grad([25.0, -30.0, 20.0], [0.0, 0.0, 0.0], [-1.0, 1.0, -1.0])
    np.testing.assert_allclose(g, [0.0, 0.0, np.exp(20.0)], rtol=1e-6)


def test_gradient_zero_where_dual_clip_binds():
    # A < 0, r = e^2: ℓ = −r·A = e^2 > −c·A = 3 → the dual clip's constant wins.
    g = _ppo_grad([2.0, 0.5], [0.0, 0.0], [-1.0, -1.0], dual_clip_c=3.0)
    np.testing.assert_allclose(g, [0.0, np.exp(0.5)], rtol=1e-6)


def test_gradient_at_exact_ties_is_the_full_unclipped_gradient():
    # θ = d: r = 1 and L1 == L2 for any ε; jnp.maximum's JVP would halve this.
    g = _ppo_grad([-1.0, -2.0], [-1.0, -2.0], [1.5, -0.5])
    np.testing.assert_allclose(g, [-1.5, 0.5], rtol=1e-6)


@pytest.mark.parametrize(
    "config",
    [
        opj.LossConfig(algorithm="decoupled_ppo", correction=MIS),
        opj.LossConfig(algorithm="decoupled_ppo", correction=opj.VanillaTIS()),
        opj.LossConfig(algorithm="reinforce_is", correction=SEQ_MASK),
        opj.LossConfig(algorithm="bypass_ppo"),
    ],
    ids=lambda c: c.algorithm,
)
def test_is_weights_carry_no_gradient(config):
    logp, old, rollout, adv, mask = (np.asarray(x, np.float32) for x in _smooth_batch())
    grads = jax.grad(
        lambda o, b: opj.policy_loss(logp, o, b, adv, mask, config)[0], argnums=(0, 1)
    )(old, rollout)
    for g in grads:
        np.testing.assert_array_equal(np.asarray(g), 0.0)


# ------------------------------------------------------------------------ empty batches


# Tiers: each config compiles its own program (~0.7 s of CPU). The fast tier keeps six
# that together cover every algorithm, aggregation and kind of correction (none,
# metrics-only, token / sequence / geometric TIS, vanilla TIS) and both denominators;
# all 21 run in the full suite.
ALL_MASKED_FAST = (0, 5, 13, 15, 16, 18)


@pytest.mark.heavy
@pytest.mark.parametrize(
    "config",
    [
        c if i in ALL_MASKED_FAST else pytest.param(c, marks=pytest.mark.slow)
        for i, c in enumerate(LOSS_CONFIGS[::7])
    ],
    ids=lambda c: f"{c.algorithm}-{c.aggregation}",
)
def test_all_masked_batch_gives_zero_loss_and_zero_gradient(config):
    shape = (3, 5)
    garbage = jnp.full(shape, jnp.nan)
    (loss, metrics), grad = _value_and_grad(config)(
        garbage, garbage, garbage, garbage, jnp.zeros(shape)
    )
    assert float(loss) == 0.0
    np.testing.assert_array_equal(np.asarray(grad), 0.0)
    assert all(np.isfinite(float(v)) for v in metrics.values())


@pytest.mark.heavy
@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean", "sequence_sum"])
@pytest.mark.parametrize("in_denominator", [False, True])
def test_all_rejected_batch_gives_zero_loss_and_finite_zero_gradient(aggregation, in_denominator):
    logp, old, rollout, adv, mask = (np.asarray(x, np.float32) for x in _smooth_batch())
    rollout = old + 5.0  # every ratio e^-5 < 0.5: mask mode rejects every token
    config = opj.LossConfig(
        algorithm="decoupled_ppo",
        aggregation=aggregation,
        rejected_in_denominator=in_denominator,
        correction=opj.CorrectionConfig(use_tis=True, tis_mode="mask", tis_batch_normalize=True),
    )
    (loss, metrics), grad = _value_and_grad(config)(logp, old, rollout, adv, mask)
    assert float(loss) == 0.0
    np.testing.assert_array_equal(np.asarray(grad), 0.0)
    assert float(metrics["mis_batch_norm_factor"]) == 1.0
    assert all(np.isfinite(float(v)) for v in metrics.values())


# ------------------------------------------------------------------------ properties


def _clean(batch):
    mask = batch["mask"] > 0
    return {
        k: (np.where(mask, v, 0.0).astype(np.float32) if k not in ("mask", "lengths") else v)
        for k, v in batch.items()
    }


@pytest.mark.heavy
@settings(max_examples=examples(20))
@given(batch=ragged_batches(), config=loss_configs)
def test_padding_garbage_never_leaks_into_loss_or_gradient(batch, config):
    vg = _value_and_grad(config)
    (loss, metrics), grad = vg(*_args(batch))
    (loss_c, metrics_c), grad_c = vg(*_args(_clean(batch)))
    assert float(loss) == float(loss_c) and np.isfinite(float(loss))
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(grad_c))
    assert np.all(np.isfinite(np.asarray(grad)))
    for key in metrics:
        assert float(metrics[key]) == float(metrics_c[key]), key


@pytest.mark.heavy
@settings(max_examples=examples(20))
@given(batch=ragged_batches(batch=6), config=loss_configs, data=st.data())
def test_micro_batch_pooling_equals_full_batch(batch, config, data):
    cuts = sorted(data.draw(st.sets(st.integers(1, 5), min_size=1, max_size=3)))
    bounds = [0, *cuts, 6]
    full_correction = None
    if config.reweights and not isinstance(config.correction, opj.VanillaTIS):
        # Batch-level statistics (normalisation) must see the whole batch:
        # compute the correction once, then split it with the tokens.
        numerator_logp = batch["logp"] if config.algorithm == "reinforce_is" else batch["old_logp"]
        full_correction = jax.jit(opj.compute_correction, static_argnames=("config", "reduction"))(
            numerator_logp,
            batch["rollout_logp"],
            batch["mask"],
            config=config.correction,
            reduction=config.metric_reduction,
        )
    (full_loss, full_metrics), full_grad = _value_and_grad(config)(*_args(batch))

    def numerator(lp, old, rollout, adv, mask, precomputed):
        parts, metrics = opj.policy_loss_parts(
            lp, old, rollout, adv, mask, config, correction_result=precomputed
        )
        return parts.numerator, (parts.denominator, metrics)

    # One compiled step per micro-batch shape (eager dispatch would compile every
    # primitive of the pipeline for each new shape).
    step = jax.jit(jax.value_and_grad(numerator, has_aux=True))
    pooled_num, pooled_den, grads, pooled_metrics = 0.0, 0.0, [], None
    for start, stop in itertools.pairwise(bounds):
        rows = slice(start, stop)
        precomputed = (
            None
            if full_correction is None
            else opj.CorrectionResult(full_correction.weights[rows], full_correction.mask[rows], {})
        )
        (num, (den, metrics)), g = step(*(x[rows] for x in _args(batch)), precomputed)
        pooled_num += num
        pooled_den += den
        grads.append(g)
        pooled_metrics = (
            metrics if pooled_metrics is None else opj.pool_metric_parts(pooled_metrics, metrics)
        )
    loss = opj.LossParts(pooled_num, pooled_den).value()
    grad = np.concatenate(grads) / (float(pooled_den) or 1.0)
    np.testing.assert_allclose(float(loss), float(full_loss), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, np.asarray(full_grad), rtol=1e-5, atol=1e-6)
    pooled = opj.finalize_metrics(pooled_metrics)
    for key in pooled:
        np.testing.assert_allclose(
            float(pooled[key]), float(full_metrics[key]), rtol=1e-5, atol=1e-5, err_msg=key
        )


# ------------------------------------------------------------------------ D5, D8b, D9, inputs


def _reject_second_half():
    logp, old, rollout, adv, mask = (np.asarray(x, np.float32) for x in _smooth_batch())
    mask[:] = 1
    rollout = old.copy()
    rollout[:, 4:] = old[:, 4:] + 5.0  # ratio e^-5: rejected by mask mode
    return logp, old, rollout, adv, mask


@pytest.mark.heavy
@pytest.mark.parametrize("in_denominator, length", [(False, 4), (True, 7)])
def test_d5_rejected_tokens_and_the_denominator(in_denominator, length):
    logp, old, rollout, adv, mask = _reject_second_half()
    config = opj.LossConfig(
        algorithm="decoupled_ppo",
        rejected_in_denominator=in_denominator,
        correction=opj.CorrectionConfig(use_tis=True, tis_mode="mask"),
    )
    loss, _ = opj.policy_loss(logp, old, rollout, adv, mask, config)
    kept = opj.policy_loss(
        logp[:, :4],
        old[:, :4],
        rollout[:, :4],
        adv[:, :4],
        mask[:, :4],
        opj.LossConfig(
            algorithm="decoupled_ppo", correction=config.correction, aggregation="sequence_sum"
        ),
    )[0]
    np.testing.assert_allclose(float(loss), float(kept) / length, rtol=1e-6)


def test_d8b_bypass_reports_the_real_logprob_difference():
    logp, old, rollout, adv, mask = (np.asarray(x, np.float32) for x in _smooth_batch())
    _, metrics = opj.policy_loss(
        logp, None, rollout, adv, mask, opj.LossConfig(algorithm="bypass_ppo")
    )
    want = ref.reduce_metric(np.abs(logp - rollout), mask, "sequence")
    assert float(metrics["train_rollout_logprob_abs_diff"]) > 0.01
    np.testing.assert_allclose(float(metrics["train_rollout_logprob_abs_diff"]), want, rtol=1e-6)


def test_d9_reinforce_is_with_rollout_logprobs_and_tis():
    logp, _, rollout, adv, mask = (np.asarray(x, np.float32) for x in _smooth_batch())
    config = opj.LossConfig.from_flags(
        use_rollout_logprobs=True, use_tis=True, aggregation="token_mean"
    )
    assert config.algorithm == "reinforce_is"
    grad = jax.grad(lambda lp: opj.policy_loss(lp, None, rollout, adv, mask, config)[0])(logp)
    w = np.clip(np.exp(logp - rollout), 0.0, 2.0)
    np.testing.assert_allclose(np.asarray(grad), -w * adv * mask / mask.sum(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "config",
    [
        opj.LossConfig(algorithm="decoupled_ppo", correction=MIS, aggregation="token_mean"),
        opj.LossConfig(algorithm="reinforce_is", correction=GEO_CLIP),
        opj.LossConfig(algorithm="bypass_ppo", aggregation="token_mean"),
    ],
    ids=lambda c: c.algorithm,
)
def test_uniformly_scaled_fractional_mask_leaves_mean_losses_unchanged(config):
    # Each token is weighted by its mask value exactly once: numerator and
    # denominator both scale by 1/2 (a weight applied twice would quarter one).
    logp, old, rollout, adv, mask = (np.asarray(x, np.float32) for x in _smooth_batch())
    full = opj.policy_loss(logp, old, rollout, adv, mask, config)[0]
    half = opj.policy_loss(logp, old, rollout, adv, 0.5 * mask, config)[0]
    np.testing.assert_allclose(float(half), float(full), rtol=1e-6)


def test_per_sequence_advantages_broadcast_over_tokens():
    logp, old, rollout, adv, mask = (np.asarray(x, np.float32) for x in _smooth_batch())
    per_seq = adv[:, 0]
    config = opj.LossConfig(algorithm="decoupled_ppo", correction=MIS)
    a = opj.policy_loss(logp, old, rollout, per_seq, mask, config)[0]
    b = opj.policy_loss(logp, old, rollout, np.repeat(per_seq[:, None], 7, 1), mask, config)[0]
    assert float(a) == float(b)


def test_input_errors_name_the_argument():
    logp, old, rollout, adv, mask = (np.asarray(x, np.float32) for x in _smooth_batch())
    ppo = opj.LossConfig(algorithm="ppo")
    with pytest.raises(ValueError, match="old_logp"):
        opj.policy_loss(logp, None, rollout, adv, mask, ppo)
    with pytest.raises(ValueError, match="advantages"):
        opj.policy_loss(logp, old, rollout, adv[:, :3], mask, ppo)
    with pytest.raises(ValueError, match="rollout_logp"):
        opj.policy_loss(logp, old, rollout[:2], adv, mask, ppo)
    with pytest.raises(TypeError, match="logp"):
        opj.policy_loss(logp.astype(np.int32), old, rollout, adv, mask, ppo)
    with pytest.raises(ValueError, match="rollout_logp is required"):
        opj.policy_loss(
            logp, old, None, adv, mask, opj.LossConfig(algorithm="decoupled_ppo", correction=MIS)
        )
    with pytest.raises(TypeError, match="LossConfig"):
        opj.policy_loss(logp, old, rollout, adv, mask, MIS)
    # Plain PPO needs no rollout log-probs at all.
    loss, metrics = opj.policy_loss(logp, old, None, adv, mask, ppo)
    assert np.isfinite(float(loss)) and "train_rollout_logprob_abs_diff" not in metrics


def test_user_correction_callable():
    logp, old, rollout, adv, mask = (np.asarray(x, np.float32) for x in _smooth_batch())

    def halve(old_logp, rollout_logp, mask, *, reduction, axis_names):
        res = opj.compute_correction(
            old_logp, rollout_logp, mask, MIS, reduction=reduction, axis_names=axis_names
        )
        return opj.CorrectionResult(res.weights * 0.5, res.mask, {"custom": jnp.float32(1.0)})

    custom = opj.LossConfig(algorithm="decoupled_ppo", correction=halve)
    builtin = opj.LossConfig(algorithm="decoupled_ppo", correction=MIS)
    loss, metrics = jax.jit(lambda *a: opj.policy_loss(*a, custom))(logp, old, rollout, adv, mask)
    np.testing.assert_allclose(
        float(loss),
        0.5 * float(opj.policy_loss(logp, old, rollout, adv, mask, builtin)[0]),
        rtol=1e-6,
    )
    assert float(metrics["custom"]) == 1.0


def test_abs_diff_metric_sums_over_the_final_mask():
    """decoupled PPO with a correction: ``train_rollout_logprob_abs_diff`` is the mean of
    ``|log π_old − log π_rollout|`` over the final mask m'."""
    rng = np.random.default_rng(3)
    old = jnp.asarray(-rng.exponential(size=(3, 8)), jnp.float32)
    rollout = old + jnp.asarray(0.3 * rng.normal(size=(3, 8)), jnp.float32)
    mask = jnp.arange(8) < jnp.array([[8], [5], [2]])
    config = opj.LossConfig(algorithm="decoupled_ppo", correction=MIS)
    _, metrics = opj.policy_loss(old + 0.05, old, rollout, jnp.ones(3), mask, config)
    diff = np.abs(np.asarray(old) - np.asarray(rollout))
    final = np.asarray(opj.compute_correction(old, rollout, mask, MIS).mask)
    expected = np.mean((diff * final).sum(-1) / final.sum(-1))  # sequence-mean metric
    np.testing.assert_allclose(metrics["train_rollout_logprob_abs_diff"], expected, rtol=1e-6)


# --------------------------------------------------------------------------- one signature

_ENTRY_POSITIONAL = ("logp", "old_logp", "rollout_logp", "advantages", "mask", "config")
_ENTRY_KEYWORDS = (  # keyword-only, each None by default
    "axis_names",
    "correction_result",
    "segment_ids",
    "num_segments",
    "ref_logp",
    "entropy",
    "versions",
    "current_version",
    "key",
    "rewards",
    "topk",
)


@pytest.mark.parametrize(
    ("entry", "returns"),
    [
        (opj.policy_loss, "tuple[jax.Array, dict[str, jax.Array]]"),
        (opj.policy_loss_parts, "tuple[MeanParts, dict[str, MeanParts | jax.Array]]"),
        (opj.policy_loss_terms, "PolicyLossTerms"),
    ],
)
def test_the_loss_entry_points_show_their_real_signature(entry, returns):
    signature = inspect.signature(entry)  # what autodoc and help() show
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    want = [(name, positional, inspect.Parameter.empty) for name in _ENTRY_POSITIONAL]
    want += [(name, inspect.Parameter.KEYWORD_ONLY, None) for name in _ENTRY_KEYWORDS]
    assert [(p.name, p.kind, p.default) for p in signature.parameters.values()] == want
    assert signature.return_annotation == returns
    hints = typing.get_type_hints(entry)  # every annotation resolves, as autodoc needs
    assert set(hints) == {*_ENTRY_POSITIONAL, *_ENTRY_KEYWORDS, "return"}
    assert entry.__doc__ and entry.__module__ == "offpolicy_jax._src.losses.policy_loss"
    # jax.jit reads the signature to find a static argument by name
    lp = jnp.log(jnp.array([[0.5, 0.4, 0.9], [0.3, 0.2, 0.7]]))
    args = (lp, lp, None, jnp.array([1.0, -1.0]), jnp.ones((2, 3), bool))
    cfg = opj.LossConfig(algorithm="ppo")
    jitted = jax.jit(entry, static_argnames=("config", "num_segments"))
    got, want = jitted(*args, config=cfg), entry(*args, cfg)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), got, want))
    with pytest.raises(TypeError, match="segment_idz"):
        entry(np.zeros((1, 2)), None, None, np.zeros(1), np.ones((1, 2)), opj.LossConfig(),
              segment_idz=None)  # fmt: skip


def test_the_loss_entry_points_declare_their_parameters_once():
    module = importlib.import_module("offpolicy_jax._src.losses.policy_loss")
    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    declaring = [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and any(a.arg == "current_version" for a in node.args.kwonlyargs)
    ]
    assert declaring == ["_terms"]
