"""The composable core (opj.rules, opj.correct, opj.objectives) equals the config path.

Every rule value, chain and loss entry is compared with the CorrectionConfig /
LossConfig that names the same pieces (bit for bit for the correction, which runs the
same stages; rtol 1e-6 for losses, metrics and gradients), and with an independent
NumPy float64 reference where the formula is short.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import offpolicy_jax as opj
from offpolicy_jax import objectives, rules

RTOL = 1e-6


def _spread(cases, every=3):
    """Every ``every``-th case for the fast tier, the rest marked heavy (whole suite
    only): each compiles its own config's program, and the composed and config paths
    share every stage, so a spread of settings checks the composition in the edit loop."""
    return [
        case if i % every == 0 else pytest.param(*_as_tuple(case), marks=pytest.mark.heavy)
        for i, case in enumerate(cases)
    ]


def _as_tuple(case):
    return case if isinstance(case, tuple) else (case,)


def _batch(seed: int = 0, shape=(6, 11)):
    rng = np.random.default_rng(seed)
    old = rng.normal(-2.0, 0.6, shape).astype(np.float32)
    rollout = (old + rng.normal(0.0, 0.5, shape)).astype(np.float32)
    rollout[0, 2] = old[0, 2] + 12.0  # a catastrophic token (ratio e^-12) for the veto
    logp = (old + rng.normal(0.0, 0.1, shape)).astype(np.float32)
    lengths = rng.integers(1, shape[-1] + 1, shape[:-1])
    lengths[-1] = 0  # an empty sequence
    mask = np.arange(shape[-1]) < lengths[..., None]
    adv = rng.normal(size=shape[:-1]).astype(np.float32)
    return logp, old, rollout, adv, mask


# (config, the chain of public rules that config names, written out by hand)
CASES = {
    "mis": (
        opj.CorrectionConfig.preset("mis"),
        lambda: rules.chain(
            rules.mismatch_metrics(),
            rules.importance_weights(level="token", mode="truncate", upper=2.0),
            rules.rejection_sampling(level="token", lower=0.5, upper=2.0),
            rules.veto(threshold=1e-4),
            rules.batch_normalize(),
        ),
    ),
    "decoupled_geo_rs": (  # verl's geometric rejection: seq_mean_k1 in [0.999, 1.001]
        opj.CorrectionConfig.preset("decoupled_geo_rs"),
        lambda: rules.chain(
            rules.mismatch_metrics(),
            rules.importance_weights(level="token", mode="none", upper=2.0),
            rules.criterion("seq_mean_k1", threshold="0.999_1.001"),
        ),
    ),
    "decoupled_seq_is_rs": (  # sequence-level TIS with a sequence-sum k1 rejection
        opj.CorrectionConfig.preset("decoupled_seq_is_rs"),
        lambda: rules.chain(
            rules.mismatch_metrics(),
            rules.importance_weights(level="sequence", mode="truncate", upper=2.0),
            rules.criterion("seq_sum_k1", threshold="0.5_2.0"),
        ),
    ),
    "geometric_clip_rs": (
        opj.CorrectionConfig(
            use_tis=True,
            tis_level="geometric",
            tis_mode="clip",
            tis_lower_bound=0.8,
            tis_upper_bound=1.5,
            tis_batch_normalize=True,
            use_rs=True,
            rs_level="geometric",
            rs_lower_bound=0.7,
            rs_upper_bound=1.4,
            rs_veto_threshold=1e-3,
            probability_metrics=True,
            m2po_tau=0.3,
        ),
        lambda: rules.chain(
            rules.mismatch_metrics(),
            rules.probability_metrics(),
            rules.importance_weights(level="geometric", mode="clip", lower=0.8, upper=1.5),
            rules.rejection_sampling(level="geometric", lower=0.7, upper=1.4),
            rules.veto(threshold=1e-3),
            rules.m2po(tau=0.3),
            rules.batch_normalize(),
        ),
    ),
}


def _assert_same_result(got, want, rtol=0.0):
    np.testing.assert_allclose(np.asarray(got.weights), np.asarray(want.weights), rtol=rtol)
    np.testing.assert_allclose(np.asarray(got.mask), np.asarray(want.mask), rtol=rtol)
    assert set(got.metrics) == set(want.metrics)
    for key in want.metrics:
        np.testing.assert_allclose(got.metrics[key], want.metrics[key], rtol=rtol, err_msg=key)


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(CASES))
def test_correct_equals_compute_correction(name):
    config, build = CASES[name]
    _, old, rollout, _, mask = _batch()
    correction = build()
    assert correction == rules.from_config(config)  # the config builds exactly these values
    for reduction in ("sequence", "token"):
        want = jax.jit(
            lambda o, b, m, how=reduction: opj.compute_correction(o, b, m, config, reduction=how)
        )(old, rollout, mask)
        got = jax.jit(
            lambda o, b, m, how=reduction: opj.correct(o, b, m, *correction.rules, reduction=how)
        )(old, rollout, mask)
        _assert_same_result(got, want)


def _loss_and_grad(fn, logp):
    def scalar(lp):
        parts, metric_parts = fn(lp)
        return parts.value(), opj.finalize_metrics(metric_parts)

    (value, metrics), grad = jax.jit(jax.value_and_grad(scalar, has_aux=True))(jnp.asarray(logp))
    return value, grad, metrics


def _assert_same_loss(got, want):
    (v1, g1, m1), (v2, g2, m2) = got, want
    np.testing.assert_allclose(v1, v2, rtol=RTOL)
    np.testing.assert_allclose(g1, g2, rtol=RTOL, atol=1e-9)
    assert set(m1) == set(m2)
    for key in m2:
        np.testing.assert_allclose(m1[key], m2[key], rtol=RTOL, atol=1e-9, err_msg=key)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean"])
def test_decoupled_ppo_equals_policy_loss(name, aggregation):
    config, build = CASES[name]
    logp, old, rollout, adv, mask = _batch(1)
    loss_config = opj.LossConfig(
        algorithm="decoupled_ppo",
        correction=config,
        aggregation=aggregation,
        clip_eps=0.25,
        dual_clip_c=3.0,
    )
    surrogate = objectives.ppo_clip(clip_eps=0.25, dual_clip_c=3.0)

    def composed(lp):
        return objectives.decoupled_ppo(
            lp, old, rollout, adv, mask,
            correction=build(), surrogate=surrogate, aggregation=aggregation,
        )  # fmt: skip

    def configured(lp):
        return opj.policy_loss_parts(lp, old, rollout, adv, mask, loss_config)

    _assert_same_loss(_loss_and_grad(composed, logp), _loss_and_grad(configured, logp))


@pytest.mark.heavy
def test_decoupled_ppo_with_a_precomputed_correction():
    config, build = CASES["mis"]
    logp, old, rollout, adv, mask = _batch(2)
    result = opj.correct(old, rollout, mask, *build().rules)
    loss_config = opj.LossConfig(algorithm="decoupled_ppo", correction=config)

    def composed(lp):
        return objectives.decoupled_ppo(lp, old, rollout, adv, mask, correction=result)

    def configured(lp):
        return opj.policy_loss_parts(
            lp, old, rollout, adv, mask, loss_config, correction_result=result
        )

    _assert_same_loss(_loss_and_grad(composed, logp), _loss_and_grad(configured, logp))
    # and the loss equals the one that runs the correction inside
    inside = _loss_and_grad(
        lambda lp: objectives.decoupled_ppo(lp, old, rollout, adv, mask, correction=build()),
        logp,
    )
    np.testing.assert_allclose(_loss_and_grad(composed, logp)[0], inside[0], rtol=RTOL)


def test_a_chain_is_a_loss_config_correction():
    config, build = CASES["mis"]
    logp, old, rollout, adv, mask = _batch(3)
    by_chain = opj.LossConfig(algorithm="decoupled_ppo", correction=build())
    by_config = opj.LossConfig(algorithm="decoupled_ppo", correction=config)
    loss, metrics = opj.policy_loss(logp, old, rollout, adv, mask, by_chain)
    want_loss, want_metrics = opj.policy_loss(logp, old, rollout, adv, mask, by_config)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    assert set(metrics) == set(want_metrics)
    assert hash(by_chain) == hash(opj.LossConfig(algorithm="decoupled_ppo", correction=build()))


@pytest.mark.parametrize(
    ("entry", "algorithm"), [(objectives.ppo, "ppo"), (objectives.bypass_ppo, "bypass_ppo")]
)
def test_ppo_and_bypass_equal_policy_loss(entry, algorithm):
    logp, old, rollout, adv, mask = _batch(4)
    denominator = old if algorithm == "ppo" else rollout
    surrogate = objectives.surrogate("gspo", clip_eps=3e-4)
    config = opj.LossConfig(algorithm=algorithm, policy_loss="gspo", clip_eps=3e-4)

    def composed(lp):
        return entry(lp, denominator, adv, mask, surrogate=surrogate)

    def configured(lp):
        old_logp, rollout_logp = (old, None) if algorithm == "ppo" else (None, rollout)
        return opj.policy_loss_parts(lp, old_logp, rollout_logp, adv, mask, config)

    _assert_same_loss(_loss_and_grad(composed, logp), _loss_and_grad(configured, logp))


def _plans_of(monkeypatch, call):
    """The plans the objectives hand the loss pipeline during ``call()``; a config
    resolved on the way fails the call."""
    from offpolicy_jax._src.losses import entries
    from offpolicy_jax._src.losses import policy_loss as pipeline

    plans = []

    def recording(inputs, plan):
        plans.append(plan)
        return pipeline.loss_terms(inputs, plan)

    def refuse(config):
        raise AssertionError(f"an objective resolved a config: {config}")

    monkeypatch.setattr(entries, "loss_terms", recording)
    monkeypatch.setattr(pipeline, "resolve", refuse)
    jax.eval_shape(call)  # traced, not run: the plan is fixed at trace time
    return plans


def test_objectives_build_the_plan_their_config_resolves_to(monkeypatch):
    from offpolicy_jax._src.config.plan import resolve

    logp, old, rollout, adv, mask = _batch(5)
    _, build = CASES["mis"]
    cases = [
        (
            lambda: objectives.decoupled_ppo(
                logp, old, rollout, adv, mask, correction=build(),
                surrogate=objectives.ppo_clip(clip_eps=0.25, dual_clip_c=3.0),
                aggregation="token_mean", rejected_in_denominator=True,
            ),
            opj.LossConfig(
                algorithm="decoupled_ppo", correction=build(), clip_eps=0.25, dual_clip_c=3.0,
                aggregation="token_mean", rejected_in_denominator=True,
            ),
        ),
        (
            lambda: objectives.ppo(
                logp, old, adv, mask, surrogate=objectives.surrogate("gspo", clip_eps=3e-4),
                aggregation="sequence_sum_norm", loss_scale_factor=8,
            ),
            opj.LossConfig(
                algorithm="ppo", policy_loss="gspo", clip_eps=3e-4,
                aggregation="sequence_sum_norm", loss_scale_factor=8,
            ),
        ),
        (
            lambda: objectives.bypass_ppo(logp, rollout, adv, mask, metric_reduction="token"),
            opj.LossConfig(algorithm="bypass_ppo", metric_reduction="token"),
        ),
    ]  # fmt: skip
    for call, config in cases:
        (plan,) = _plans_of(monkeypatch, call)
        monkeypatch.undo()
        assert plan == resolve(config)
    assert plan.reports_ois is False and plan.needs_rollout is True


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda b: objectives.ppo(b[1], b[1], b[3], b[4], aggregation="sequence_meen"),
            r"objectives\.ppo\.aggregation must be one of .* \(did you mean 'sequence_mean'\?\)",
        ),
        (
            lambda b: objectives.bypass_ppo(b[1], b[2], b[3], b[4], loss_scale_factor=4.0),
            r"objectives\.bypass_ppo\.loss_scale_factor only applies to "
            r"aggregation='sequence_sum_norm'",
        ),
        (
            lambda b: objectives.decoupled_ppo(
                *b, correction=rules.chain(), rejected_in_denominator="yes"
            ),
            r"objectives\.decoupled_ppo\.rejected_in_denominator must be true or false",
        ),
    ],
)
def test_an_objective_names_its_own_bad_argument(call, match):
    batch = _batch()
    with pytest.raises(ValueError, match=match):
        call(batch)


def test_correct_matches_a_numpy_reference():
    # truncate at 2, token RS in [0.5, 2], veto at 1e-4, batch normalised per token
    _, old, rollout, _, mask = _batch(5)
    got = opj.correct(old, rollout, mask, *CASES["mis"][1]().rules)
    delta = old.astype(np.float64) - rollout
    ratio = np.exp(np.clip(delta, -20, 20))
    keep_seq = ~np.any(mask & (delta < np.log(1e-4)), axis=-1, keepdims=True)
    final = mask & (ratio >= 0.5) & (ratio <= 2.0) & keep_seq
    w = np.minimum(ratio, 2.0)
    mu = w[final].mean()
    np.testing.assert_array_equal(np.asarray(got.mask) > 0, final)
    np.testing.assert_allclose(got.weights, np.where(final, w / mu, 0.0), rtol=1e-5)
    np.testing.assert_allclose(got.metrics["mis_batch_norm_factor"], mu, rtol=1e-5)
    fraction = np.where(mask, ratio > 2.0, False).sum(-1) / np.maximum(mask.sum(-1), 1)
    nonempty = mask.sum(-1) > 0
    np.testing.assert_allclose(
        got.metrics["mis_tis_truncate_fraction"], fraction[nonempty].mean(), rtol=1e-5
    )


def test_metrics_only_chain_leaves_weights_and_mask():
    _, old, rollout, _, mask = _batch(6)
    got = opj.correct(old, rollout, mask, rules.mismatch_metrics())
    want = opj.compute_correction(old, rollout, mask, opj.CorrectionConfig())
    _assert_same_result(got, want)
    np.testing.assert_array_equal(got.weights, mask.astype(np.float32))


@pytest.mark.heavy
def test_jit_vmap_and_grad():
    correction = CASES["mis"][1]()
    logp, old, rollout, adv, mask = _batch(7, shape=(3, 4, 9))
    one = jax.jit(correction)
    eager = correction(old[0], rollout[0], mask[0])
    _assert_same_result(one(old[0], rollout[0], mask[0]), eager, rtol=RTOL)
    per_slice = jax.jit(jax.vmap(correction))(old, rollout, mask)
    for i in range(old.shape[0]):
        want = one(old[i], rollout[i], mask[i])
        np.testing.assert_allclose(per_slice.weights[i], want.weights, rtol=RTOL)
        for key in ("mis_kl", "mis_ess", "mis_batch_norm_factor"):
            np.testing.assert_allclose(per_slice.metrics[key][i], want.metrics[key], rtol=RTOL)

    def loss(lp):
        parts, _ = objectives.decoupled_ppo(lp, old, rollout, adv, mask, correction=correction)
        return parts.value()

    grad = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(logp)))
    assert np.isfinite(grad).all() and np.abs(grad).sum() > 0
    np.testing.assert_array_equal(grad[~mask], 0.0)
    weights_grad = jax.jit(jax.grad(lambda o: correction(o, rollout, mask).weights.sum()))(old)
    assert not np.asarray(weights_grad).any()  # the weights are stop-gradient


def test_an_empty_batch_gives_zero_loss_and_gradients():
    logp, old, rollout, adv, _ = _batch(8)
    mask = np.zeros(logp.shape, bool)
    value, grad = jax.jit(
        jax.value_and_grad(
            lambda lp: objectives.decoupled_ppo(
                lp, old, rollout, adv, mask, correction=CASES["mis"][1]()
            )[0].value()
        )
    )(jnp.asarray(logp))
    assert float(value) == 0.0 and not np.asarray(grad).any()


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["mis", "decoupled_seq_is_rs"])
def test_packed_equals_padded(name):
    correction = CASES[name][1]()
    logp, old, rollout, adv, mask = _batch(9, shape=(7, 10))
    lengths = mask.sum(-1)
    sequences = [
        {
            "logp": logp[i, :n],
            "old": old[i, :n],
            "rollout": rollout[i, :n],
            "adv": np.full(n, adv[i], np.float32),
            "mask": mask[i, :n],
        }
        for i, n in enumerate(lengths)
        if n > 0
    ]
    packed = opj.pack_sequences(sequences, 24, max_segments=3, pad_value=0)
    a, ids, k = packed.arrays, packed.segment_ids, packed.num_segments
    got = jax.jit(
        lambda o, b, m, s: opj.correct(o, b, m, *correction.rules, segment_ids=s, num_segments=k)
    )(a["old"], a["rollout"], a["mask"], ids)
    keep = lengths > 0
    want = jax.jit(correction)(old[keep], rollout[keep], mask[keep])
    for i, (row, start) in enumerate(zip(packed.rows, packed.starts, strict=True)):
        n = lengths[keep][i]
        np.testing.assert_allclose(
            got.weights[row, start : start + n], want.weights[i, :n], rtol=RTOL
        )
        np.testing.assert_array_equal(got.mask[row, start : start + n], want.mask[i, :n])
    for key in want.metrics:
        np.testing.assert_allclose(got.metrics[key], want.metrics[key], rtol=1e-5, err_msg=key)

    def packed_loss(lp):
        return objectives.decoupled_ppo(
            lp, a["old"], a["rollout"], a["adv"], a["mask"],
            correction=correction, segment_ids=ids, num_segments=k,
        )  # fmt: skip

    def padded_loss(lp):
        return objectives.decoupled_ppo(
            lp, old[keep], rollout[keep], adv[keep], mask[keep], correction=correction
        )

    v1, _, m1 = _loss_and_grad(packed_loss, a["logp"])
    v2, _, m2 = _loss_and_grad(padded_loss, logp[keep])
    np.testing.assert_allclose(v1, v2, rtol=1e-5)
    np.testing.assert_allclose(m1["pg_clipfrac"], m2["pg_clipfrac"], rtol=1e-5)


@pytest.mark.parametrize(
    "call",
    [
        lambda: rules.veto(1e-4),
        lambda: rules.importance_weights("token"),
        lambda: rules.rejection_sampling("token", 0.5, 2.0),
        lambda: rules.m2po(0.1),
        lambda: rules.seq_logprob_error(2.0),
        lambda: rules.criterion("seq_max_k2", 2.5),
        lambda: rules.batch_normalize("token"),
        lambda: objectives.ppo_clip(0.2),
        lambda: objectives.kl_penalty(0.1),
        lambda: objectives.entropy_bonus(0.1),
        lambda: objectives.positive_example_nll(0.1),
    ],
)
def test_hyperparameters_are_keyword_only(call):
    with pytest.raises(TypeError):
        call()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: rules.veto(threshold=0.0), "veto: threshold"),
        (lambda: rules.veto(threshold=float("nan")), "threshold"),
        (lambda: rules.veto(threshold=True), "threshold"),
        (lambda: rules.importance_weights(level="tok"), "importance_weights: level"),
        (lambda: rules.importance_weights(mode="trunc"), "importance_weights: mode"),
        (lambda: rules.importance_weights(upper=-2.0), "importance_weights: upper"),
        (lambda: rules.importance_weights(lower=0.0, mode="clip"), "importance_weights: lower"),
        (lambda: rules.importance_weights(mode="clip", lower=3.0, upper=2.0), "lower must be <"),
        (lambda: rules.importance_weights(mode="band", lower=3.0, upper=2.0), "lower must be <="),
        (lambda: rules.rejection_sampling(level="seq"), "rejection_sampling: level"),
        (lambda: rules.rejection_sampling(lower=2.0, upper=2.0), "lower must be <"),
        (lambda: rules.m2po(tau=-1.0), "m2po: tau"),
        (lambda: rules.seq_logprob_error(threshold=0.5), "seq_logprob_error: threshold"),
        (lambda: rules.criterion("seq_max_k9", threshold=2.0), "criterion"),
        (lambda: rules.criterion("seq_max_k2", threshold="x"), "threshold"),
        (lambda: rules.batch_normalize(reduction="row"), "batch_normalize: reduction"),
        (lambda: objectives.ppo_clip(clip_eps=1.5), "clip_eps"),
        (lambda: objectives.ppo_clip(dual_clip_c=0.5), "dual_clip_c"),
        (lambda: objectives.surrogate("gspoo"), "did you mean 'gspo'"),
        (lambda: rules.chain(rules.batch_normalize(), rules.batch_normalize()), "at most once"),
    ],
)
def test_bad_hyperparameters_raise_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_bad_values_of_other_types_raise_type_errors():
    with pytest.raises(TypeError, match="unexpected keyword argument 'clip_eps_hihg'"):
        objectives.surrogate("ppo_clip", clip_eps_hihg=0.3)
    with pytest.raises(TypeError, match=r"rules\[1\]"):
        rules.chain(rules.mismatch_metrics(), "veto")
    _, old, rollout, adv, mask = _batch()
    with pytest.raises(TypeError, match="correction must be"):
        objectives.decoupled_ppo(old, old, rollout, adv, mask, correction=None)
    with pytest.raises(TypeError, match="surrogate must be"):
        objectives.decoupled_ppo(
            old, old, rollout, adv, mask, correction=rules.chain(), surrogate="ppo_clip"
        )
    with pytest.raises(ValueError, match="aggregation"):
        objectives.ppo(old, old, adv, mask, aggregation="sequence_meen")
    with pytest.raises(ValueError, match="rollout_logp"):
        opj.correct(old, rollout[:, :3], mask, rules.veto(threshold=1e-4))


@pytest.mark.multi_device
def test_shard_map_equals_the_unsharded_call():
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    auto = (AxisType.Auto, AxisType.Auto)
    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=auto, devices=jax.devices("cpu")[:8])
    axes = opj.MeshAxes(batch="data", token="seq")
    correction = CASES["geometric_clip_rs"][1]()
    logp, old, rollout, adv, mask = _batch(10, shape=(4, 16))
    adv = np.broadcast_to(adv[:, None], mask.shape).astype(np.float32)

    def step(lp, o, b, a, m):
        res = opj.correct(o, b, m, *correction.rules, axis_names=axes)
        parts, _ = objectives.decoupled_ppo(lp, o, b, a, m, correction=correction, axis_names=axes)
        return res.weights, res.metrics, parts.value()

    spec = P("data", "seq")
    sharded = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec, P(), P()))
    )
    weights, metrics, loss = sharded(logp, old, rollout, adv, mask)
    want = opj.compute_correction(old, rollout, mask, CASES["geometric_clip_rs"][0])
    np.testing.assert_allclose(weights, want.weights, rtol=1e-5, atol=1e-7)
    for key in want.metrics:
        np.testing.assert_allclose(metrics[key], want.metrics[key], rtol=1e-5, atol=1e-7)
    unsharded = objectives.decoupled_ppo(logp, old, rollout, adv, mask, correction=correction)
    np.testing.assert_allclose(loss, unsharded[0].value(), rtol=1e-5, atol=1e-7)


# --- every LossConfig setting, composed: regularisers, OPSM, proximal, reinforce_is ---


class _Padded:
    """A ragged batch whose padding holds NaN in every float array (and -1 versions)."""

    def __init__(self, seed: int, shape=(6, 11)):
        rng = np.random.default_rng(seed)
        self.logp, self.old, self.rollout, self.adv, self.mask = _batch(seed, shape)
        self.ref = (self.old + rng.normal(0.0, 0.3, shape)).astype(np.float32)
        self.entropy = rng.uniform(0.1, 2.0, shape).astype(np.float32)
        self.rewards = rng.choice([-1.0, 0.0, 1.0], shape[:-1]).astype(np.float32)
        self.versions = np.repeat(rng.integers(3, 7, shape[:-1])[:, None], shape[-1], -1)
        self.current_version = 7
        for name in ("logp", "old", "rollout", "ref", "entropy"):
            setattr(self, name, np.where(self.mask, getattr(self, name), np.nan))
        self.versions = np.where(self.mask, self.versions, -1)
        # the engine's top-4 ids and both policies' log-probs on them (NaN at padding)
        probs = rng.dirichlet(np.ones(5), shape)[..., :4]
        drift = np.exp(rng.normal(0.0, 0.1, probs.shape))
        valid = self.mask[..., None]
        self.topk = opj.TopKLogprobs(
            np.broadcast_to(np.arange(4), probs.shape).astype(np.int32),
            np.where(valid, np.log(probs), np.nan).astype(np.float32),
            np.where(valid, np.log(probs * drift / 1.5), np.nan).astype(np.float32),
        )


def _mis():
    return CASES["mis"][1]()


def _decoupled_kwargs(b):
    return {"ref_logp": b.ref, "entropy": b.entropy, "rewards": b.rewards}


# (objective call, the LossConfig that names the same pieces, the config's call)
SETTINGS = {
    "kl_penalty": (
        lambda b, lp: objectives.decoupled_ppo(
            lp, b.old, b.rollout, b.adv, b.mask, correction=_mis(), ref_logp=b.ref,
            regularisers=[objectives.kl_penalty(kl_coef=0.05, kl_estimator="k2")],
        ),
        opj.LossConfig(
            algorithm="decoupled_ppo", correction=_mis(), kl_coef=0.05, kl_estimator="k2"
        ),
        lambda b, lp, c: opj.policy_loss_parts(
            lp, b.old, b.rollout, b.adv, b.mask, c, ref_logp=b.ref
        ),
    ),
    "kl_off_policy_k1_entropy": (
        lambda b, lp: objectives.bypass_ppo(
            lp, b.rollout, b.adv, b.mask, ref_logp=b.ref, entropy=b.entropy,
            regularisers=(
                objectives.kl_penalty(kl_coef=0.1, kl_estimator="k1", kl_off_policy=True),
                objectives.entropy_bonus(entropy_coef=-0.02),
            ),
        ),
        opj.LossConfig(
            algorithm="bypass_ppo", kl_coef=0.1, kl_estimator="k1", kl_off_policy=True,
            entropy_coef=-0.02,
        ),
        lambda b, lp, c: opj.policy_loss_parts(
            lp, None, b.rollout, b.adv, b.mask, c, ref_logp=b.ref, entropy=b.entropy
        ),
    ),
    "regularisers_as_metrics_only": (  # the arrays without coefficients: metrics only
        lambda b, lp: objectives.ppo(lp, b.old, b.adv, b.mask, **_decoupled_kwargs(b)),
        opj.LossConfig(algorithm="ppo"),
        lambda b, lp, c: opj.policy_loss_parts(
            lp, b.old, None, b.adv, b.mask, c, **_decoupled_kwargs(b)
        ),
    ),
    "all_three_token_mean": (
        lambda b, lp: objectives.decoupled_ppo(
            lp, b.old, b.rollout, b.adv, b.mask, correction=_mis(), aggregation="token_mean",
            regularisers=(
                objectives.positive_example_nll(positive_example_nll_weight=0.3),
                objectives.entropy_bonus(entropy_coef=0.01),
                objectives.kl_penalty(kl_coef=0.02),
            ),
            **_decoupled_kwargs(b),
        ),
        opj.LossConfig(
            algorithm="decoupled_ppo", correction=_mis(), aggregation="token_mean",
            positive_example_nll_weight=0.3, entropy_coef=0.01, kl_coef=0.02,
        ),
        lambda b, lp, c: opj.policy_loss_parts(
            lp, b.old, b.rollout, b.adv, b.mask, c, **_decoupled_kwargs(b)
        ),
    ),
    "opsm": (
        lambda b, lp: objectives.decoupled_ppo(
            lp, b.old, b.rollout, b.adv, b.mask, correction=_mis(), opsm_delta=0.05
        ),
        opj.LossConfig(algorithm="decoupled_ppo", correction=_mis(), opsm_delta=0.05),
        lambda b, lp, c: opj.policy_loss_parts(lp, b.old, b.rollout, b.adv, b.mask, c),
    ),
    "ppo_rollout_opsm_mismatch_metrics": (
        lambda b, lp: objectives.ppo(
            lp, b.old, b.adv, b.mask, rollout_logp=b.rollout, opsm_delta=0.02,
            get_mismatch_metrics=True, versions=b.versions, current_version=b.current_version,
        ),
        opj.LossConfig(algorithm="ppo", opsm_delta=0.02, get_mismatch_metrics=True),
        lambda b, lp, c: opj.policy_loss_parts(
            lp, b.old, b.rollout, b.adv, b.mask, c, versions=b.versions,
            current_version=b.current_version,
        ),
    ),
    "bypass_mismatch_metrics": (
        lambda b, lp: objectives.bypass_ppo(
            lp, b.rollout, b.adv, b.mask, get_mismatch_metrics=True, metric_reduction="token"
        ),
        opj.LossConfig(algorithm="bypass_ppo", get_mismatch_metrics=True, metric_reduction="token"),
        lambda b, lp, c: opj.policy_loss_parts(lp, None, b.rollout, b.adv, b.mask, c),
    ),
    "decoupled_mismatch_metrics": (
        lambda b, lp: objectives.decoupled_ppo(
            lp, b.old, b.rollout, b.adv, b.mask, get_mismatch_metrics=True,
            correction=rules.chain(rules.importance_weights(level="token", mode="truncate")),
        ),
        opj.LossConfig(
            algorithm="decoupled_ppo", get_mismatch_metrics=True,
            correction=rules.chain(rules.importance_weights(level="token", mode="truncate")),
        ),
        lambda b, lp, c: opj.policy_loss_parts(lp, b.old, b.rollout, b.adv, b.mask, c),
    ),
    "prox_loglinear": (
        lambda b, lp: objectives.decoupled_ppo(
            lp, None, b.rollout, b.adv, b.mask, correction=_mis(),
            prox_logp_method="loglinear", versions=b.versions,
            current_version=b.current_version,
        ),
        opj.LossConfig(
            algorithm="decoupled_ppo", correction=_mis(), prox_logp_method="loglinear"
        ),
        lambda b, lp, c: opj.policy_loss_parts(
            lp, None, b.rollout, b.adv, b.mask, c, versions=b.versions,
            current_version=b.current_version,
        ),
    ),
    "prox_metrics": (
        lambda b, lp: objectives.decoupled_ppo(
            lp, b.old, b.rollout, b.adv, b.mask, correction=_mis(), prox_logp_method="metrics",
            versions=b.versions, current_version=b.current_version,
        ),
        opj.LossConfig(algorithm="decoupled_ppo", correction=_mis(), prox_logp_method="metrics"),
        lambda b, lp, c: opj.policy_loss_parts(
            lp, b.old, b.rollout, b.adv, b.mask, c, versions=b.versions,
            current_version=b.current_version,
        ),
    ),
    "reinforce_is": (
        lambda b, lp: objectives.reinforce_is(
            lp, b.rollout, b.adv, b.mask, correction=_mis(), aggregation="sequence_sum",
            regularisers=objectives.entropy_bonus(entropy_coef=0.01), entropy=b.entropy,
        ),
        opj.LossConfig(
            algorithm="reinforce_is", correction=_mis(), aggregation="sequence_sum",
            entropy_coef=0.01,
        ),
        lambda b, lp, c: opj.policy_loss_parts(
            lp, None, b.rollout, b.adv, b.mask, c, entropy=b.entropy
        ),
    ),
    "reinforce_is_old_mismatch_metrics": (
        lambda b, lp: objectives.reinforce_is(
            lp, b.rollout, b.adv, b.mask, correction=_mis(), old_logp=b.old,
            get_mismatch_metrics=True, rejected_in_denominator=True,
        ),
        opj.LossConfig(
            algorithm="reinforce_is", correction=_mis(), get_mismatch_metrics=True,
            rejected_in_denominator=True,
        ),
        lambda b, lp, c: opj.policy_loss_parts(lp, b.old, b.rollout, b.adv, b.mask, c),
    ),
    "ppo_opsm_rejected_in_denominator": (
        lambda b, lp: objectives.ppo(
            lp, b.old, b.adv, b.mask, rollout_logp=b.rollout, opsm_delta=0.02,
            rejected_in_denominator=True, aggregation="token_mean",
        ),
        opj.LossConfig(
            algorithm="ppo", opsm_delta=0.02, rejected_in_denominator=True,
            aggregation="token_mean",
        ),
        lambda b, lp, c: opj.policy_loss_parts(lp, b.old, b.rollout, b.adv, b.mask, c),
    ),
    "topk_trust_region": (
        lambda b, lp: objectives.bypass_ppo(
            lp, b.rollout, b.adv, b.mask, topk=b.topk,
            surrogate=objectives.surrogate("dppo_tv", divergence_type="topk_tv", divergence_topk=4),
        ),
        opj.LossConfig(
            algorithm="bypass_ppo", policy_loss="dppo_tv", divergence_type="topk_tv",
            divergence_topk=4,
        ),
        lambda b, lp, c: opj.policy_loss_parts(lp, None, b.rollout, b.adv, b.mask, c, topk=b.topk),
    ),
    "clip_cov_key": (
        lambda b, lp: objectives.ppo(
            lp, b.old, b.adv, b.mask, key=jax.random.key(3),
            surrogate=objectives.surrogate("clip_cov", clip_cov_ratio=0.2),
        ),
        opj.LossConfig(algorithm="ppo", policy_loss="clip_cov", clip_cov_ratio=0.2),
        lambda b, lp, c: opj.policy_loss_parts(
            lp, b.old, None, b.adv, b.mask, c, key=jax.random.key(3)
        ),
    ),
}  # fmt: skip


def _bits(parts_and_metrics):
    parts, metrics = parts_and_metrics
    flat = {"loss.numerator": parts.numerator, "loss.denominator": parts.denominator}
    for name, value in metrics.items():
        if isinstance(value, opj.MeanParts):
            flat[f"{name}.numerator"], flat[f"{name}.denominator"] = value
        else:
            flat[name] = value
    return {k: np.asarray(v) for k, v in flat.items()}


def _assert_bits_equal(got, want):
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _assert_bitwise_same_loss(composed, configured, logp, mask):
    """The two losses' parts, metrics and gradients are equal bit for bit, finite, and
    the gradient is 0 at padding. Both run, each with its gradient, in one compiled
    program: one compilation instead of four, and compiling is the suite's time."""

    def with_grad(f):
        def value(lp):
            parts, metrics = f(lp)
            return parts.value(), (parts, metrics)

        return jax.value_and_grad(value, has_aux=True)

    both = jax.jit(lambda lp: (with_grad(composed)(lp), with_grad(configured)(lp)))
    ((_, got), got_grad), ((_, want), want_grad) = both(jnp.asarray(logp))
    _assert_bits_equal(_bits(got), _bits(want))
    assert np.isfinite(np.asarray(got[0].numerator)).all()
    np.testing.assert_array_equal(got_grad, want_grad)
    np.testing.assert_array_equal(np.asarray(got_grad)[~mask], 0.0)


@pytest.mark.parametrize("name", _spread(sorted(SETTINGS)))
def test_a_setting_composed_equals_its_config_bit_for_bit(monkeypatch, name):
    from offpolicy_jax._src.config.plan import resolve

    composed, config, configured = SETTINGS[name]
    b = _Padded(11)
    (plan,) = _plans_of(monkeypatch, lambda: composed(b, b.logp))
    monkeypatch.undo()
    assert plan == resolve(config)
    _assert_bitwise_same_loss(
        lambda lp: composed(b, lp), lambda lp: configured(b, lp, config), b.logp, b.mask
    )


@pytest.mark.parametrize("rejected_in_denominator", [False, True])
def test_bypass_ppo_with_a_rejection_only_correction_equals_the_config(rejected_in_denominator):
    # verl's bypass PPO-clip with rollout_rs: the mask of a correction, every weight 1
    config = opj.CorrectionConfig(
        use_tis=True, tis_mode="none", use_rs=True, rs_level="token", rs_lower_bound=0.5,
        rs_upper_bound=2.0, rs_veto_threshold=1e-4,
    )  # fmt: skip
    b = _Padded(15)
    loss_config = opj.LossConfig(
        algorithm="bypass_ppo", correction=config, rejected_in_denominator=rejected_in_denominator
    )

    def composed(lp):
        return objectives.bypass_ppo(
            lp, b.rollout, b.adv, b.mask, correction=rules.from_config(config),
            rejected_in_denominator=rejected_in_denominator,
        )  # fmt: skip

    def configured(lp):
        return opj.policy_loss_parts(lp, None, b.rollout, b.adv, b.mask, loss_config)

    got, want = _loss_and_grad(composed, b.logp), _loss_and_grad(configured, b.logp)
    _assert_same_loss(got, want)
    assert float(got[2]["mis_rs_catastrophic_seq_fraction"]) > 0  # the veto acted
    unmasked = _loss_and_grad(
        lambda lp: objectives.bypass_ppo(lp, b.rollout, b.adv, b.mask), b.logp
    )
    assert not np.allclose(got[0], unmasked[0])  # and the loss is not bypass PPO's without it
    with pytest.raises(ValueError, match=r"objectives\.bypass_ppo\.correction: .* rules\[1\]"):
        objectives.bypass_ppo(b.logp, b.rollout, b.adv, b.mask, correction=_mis())


def test_kl_penalty_matches_a_numpy_reference():
    # ppo with ratio 1 (logp = old): the policy term is −A; plus 0.1·k3 per token,
    # sequence_mean over the valid tokens of the non-empty sequences
    b = _Padded(12)
    parts, metrics = objectives.ppo(
        b.old, b.old, b.adv, b.mask, ref_logp=b.ref,
        regularisers=[objectives.kl_penalty(kl_coef=0.1)],
    )  # fmt: skip
    delta = np.where(b.mask, b.ref.astype(np.float64) - b.old, 0.0)
    k3 = np.exp(delta) - delta - 1.0
    per_token = np.where(b.mask, -b.adv[:, None] + 0.1 * k3, 0.0)
    n = b.mask.sum(-1)
    rows = n > 0
    want = (per_token.sum(-1)[rows] / n[rows]).mean()
    np.testing.assert_allclose(parts.value(), want, rtol=1e-5)
    kl = opj.finalize_metrics(metrics)["kl_loss"]
    np.testing.assert_allclose(kl, (k3.sum(-1)[rows] / n[rows]).mean(), rtol=1e-5)


def test_every_loss_config_setting_has_an_objective_keyword():
    import dataclasses
    import inspect

    from offpolicy_jax.config import ALGORITHMS

    keywords = set()
    for entry in (objectives.decoupled_ppo, objectives.ppo, objectives.bypass_ppo,
                  objectives.reinforce_is):  # fmt: skip
        keywords |= set(inspect.signature(entry).parameters)
    for value in (objectives.kl_penalty(), objectives.entropy_bonus(),
                  objectives.positive_example_nll()):  # fmt: skip
        keywords |= {f.name for f in dataclasses.fields(value)}
    # the algorithm is the entry, the surrogate and its hyperparameters the surrogate value
    named_otherwise = {"algorithm", "policy_loss", "params"}
    fields = {f.name for f in dataclasses.fields(opj.LossConfig)} - named_otherwise
    assert fields - keywords == set()
    entries = {"decoupled_ppo", "ppo", "bypass_ppo", "reinforce_is"}
    assert set(ALGORITHMS) <= entries <= set(objectives.__all__)


@pytest.mark.parametrize(
    ("composed", "settings"),
    [
        (lambda: objectives.kl_penalty(kl_coef=-0.1), {"kl_coef": -0.1}),
        (lambda: objectives.kl_penalty(kl_coef=float("nan")), {"kl_coef": float("nan")}),
        (lambda: objectives.kl_penalty(kl_coef=1e39), {"kl_coef": 1e39}),
        (lambda: objectives.kl_penalty(kl_estimator="k4"), {"kl_estimator": "k4"}),
        (lambda: objectives.kl_penalty(kl_off_policy="yes"), {"kl_off_policy": "yes"}),
        (lambda: objectives.entropy_bonus(entropy_coef="x"), {"entropy_coef": "x"}),
        (lambda: objectives.entropy_bonus(entropy_coef=1e-40), {"entropy_coef": 1e-40}),
        (
            lambda: objectives.positive_example_nll(positive_example_nll_weight=-1.0),
            {"positive_example_nll_weight": -1.0},
        ),
    ],
)
def test_a_bad_regulariser_raises_the_config_message_naming_its_keyword(composed, settings):
    with pytest.raises(ValueError) as config_error:
        opj.LossConfig(**settings)
    (key,) = settings
    with pytest.raises(ValueError) as error:
        composed()
    owner = {"kl": "kl_penalty", "entropy": "entropy_bonus", "positive": "positive_example_nll"}
    builder = owner[key.split("_")[0]]
    want = str(config_error.value).replace("LossConfig.", f"objectives.{builder}.")
    assert str(error.value) == want
    assert f"objectives.{builder}.{key}" in str(error.value)


@pytest.mark.parametrize(
    ("call", "settings", "owner"),
    [
        (
            lambda b: objectives.decoupled_ppo(*b[:5], correction=_mis(), opsm_delta=0.0),
            {"opsm_delta": 0.0},
            "objectives.decoupled_ppo",
        ),
        (
            lambda b: objectives.ppo(b[0], b[1], b[3], b[4], opsm_delta="-1"),
            {"opsm_delta": "-1"},
            "objectives.ppo",
        ),
        (
            lambda b: objectives.decoupled_ppo(
                *b[:5], correction=_mis(), prox_logp_method="loglin"
            ),
            {"prox_logp_method": "loglin"},
            "objectives.decoupled_ppo",
        ),
        (
            lambda b: objectives.bypass_ppo(b[0], b[2], b[3], b[4], get_mismatch_metrics=1),
            {"get_mismatch_metrics": 1},
            "objectives.bypass_ppo",
        ),
        (
            lambda b: objectives.reinforce_is(
                b[0], b[2], b[3], b[4], correction=_mis(), rejected_in_denominator="no"
            ),
            {"rejected_in_denominator": "no"},
            "objectives.reinforce_is",
        ),
    ],
)
def test_a_bad_loss_setting_raises_the_config_message_naming_its_keyword(call, settings, owner):
    with pytest.raises(ValueError) as config_error:
        opj.LossConfig(**settings)
    with pytest.raises(ValueError) as error:
        call(_batch())
    assert str(error.value) == str(config_error.value).replace("LossConfig.", f"{owner}.")


def test_a_regulariser_names_the_input_it_needs():
    b = _Padded(13)
    with pytest.raises(ValueError, match=r"ref_logp is required: objectives\.kl_penalty"):
        objectives.ppo(
            b.logp, b.old, b.adv, b.mask, regularisers=[objectives.kl_penalty(kl_coef=0.1)]
        )
    with pytest.raises(ValueError, match=r"entropy is required: objectives\.entropy_bonus"):
        objectives.bypass_ppo(
            b.logp, b.rollout, b.adv, b.mask,
            regularisers=[objectives.entropy_bonus(entropy_coef=0.1)],
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"rewards is required: objectives\.positive_example"):
        objectives.reinforce_is(
            b.logp, b.rollout, b.adv, b.mask, correction=_mis(),
            regularisers=[objectives.positive_example_nll(positive_example_nll_weight=0.1)],
        )  # fmt: skip
    with pytest.raises(
        ValueError, match=r"versions is required: objectives\.decoupled_ppo\.prox_logp_method"
    ):
        objectives.decoupled_ppo(
            b.logp, None, b.rollout, b.adv, b.mask, correction=_mis(),
            prox_logp_method="linear",
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"regularisers: kl_penalty given more than once"):
        objectives.ppo(
            b.logp, b.old, b.adv, b.mask, ref_logp=b.ref,
            regularisers=[objectives.kl_penalty(), objectives.kl_penalty(kl_coef=0.1)],
        )  # fmt: skip
    with pytest.raises(TypeError, match=r"objectives\.ppo\.regularisers\[0\] must be"):
        objectives.ppo(b.logp, b.old, b.adv, b.mask, regularisers=["kl"])
    with pytest.raises(TypeError, match="correction must be"):
        objectives.reinforce_is(b.logp, b.rollout, b.adv, b.mask, correction=None)


def test_an_empty_batch_with_every_setting_gives_zero_loss_and_gradients():
    b = _Padded(14)
    mask = np.zeros(b.mask.shape, bool)

    def loss(lp):
        parts, _ = objectives.decoupled_ppo(
            lp, b.old, b.rollout, b.adv, mask, correction=_mis(), opsm_delta=0.1,
            regularisers=(
                objectives.kl_penalty(kl_coef=0.1),
                objectives.entropy_bonus(entropy_coef=0.1),
                objectives.positive_example_nll(positive_example_nll_weight=0.1),
            ),
            **_decoupled_kwargs(b),
        )  # fmt: skip
        return parts.value()

    value, grad = jax.jit(jax.value_and_grad(loss))(jnp.asarray(b.logp))
    assert float(value) == 0.0 and not np.asarray(grad).any()


# --- every CorrectionConfig setting, chained: async rules, neutral reads, VanillaTIS ---


class _Async(_Padded):
    """:class:`_Padded` with partial rollouts (versions that change within a sequence) and
    non-finite rollout log-probs at some valid tokens (and a NaN old one)."""

    def __init__(self, seed: int, shape=(6, 11)):
        super().__init__(seed, shape)
        rng = np.random.default_rng(seed + 100)
        base = rng.integers(2, 6, shape[:-1])[:, None]
        resumed = np.arange(shape[-1]) >= rng.integers(1, shape[-1], shape[:-1])[:, None]
        self.versions = np.where(self.mask, base + resumed, -1).astype(np.int32)
        self.rollout = self.rollout.copy()
        self.rollout[1, 0] = np.nan  # an engine that returned no log-prob
        self.rollout[2, 0] = -np.inf
        self.old = self.old.copy()
        self.old[3, 0] = np.nan  # a non-finite π_old is always rejected
        assert self.mask[1, 0] and self.mask[2, 0] and self.mask[3, 0]


_IW = rules.importance_weights(level="token", mode="truncate", upper=2.0)

# (config, the chain written out by hand)
CORRECTION_SETTINGS = {
    "neutral": (
        opj.CorrectionConfig(use_tis=True, nonfinite_rollout="neutral"),
        lambda: rules.chain(rules.mismatch_metrics(), _IW, nonfinite_rollout="neutral"),
    ),
    "neutral_metrics_only": (
        opj.CorrectionConfig(nonfinite_rollout="neutral", probability_metrics=True),
        lambda: rules.chain(
            rules.mismatch_metrics(), rules.probability_metrics(), nonfinite_rollout="neutral"
        ),
    ),
    "staleness_sequence": (
        opj.CorrectionConfig(use_tis=True, max_weight_staleness=3),
        lambda: rules.chain(rules.mismatch_metrics(), _IW, rules.staleness(max_weight_staleness=3)),
    ),
    "staleness_token_mask": (
        opj.CorrectionConfig(
            use_tis=True, tis_mode="mask", max_weight_staleness=2, staleness_level="token"
        ),
        lambda: rules.chain(
            rules.mismatch_metrics(),
            rules.importance_weights(level="token", mode="mask", upper=2.0),
            rules.staleness(max_weight_staleness=2, staleness_level="token"),
        ),
    ),
    "offpolicy_prefix": (
        opj.CorrectionConfig(
            use_tis=True, mask_offpolicy_in_partial_rollout=True, tis_batch_normalize=True
        ),
        lambda: rules.chain(
            rules.mismatch_metrics(), _IW, rules.offpolicy_prefix(), rules.batch_normalize()
        ),
    ),
    "every_async_key_mis": (
        dataclasses.replace(
            opj.CorrectionConfig.preset("mis"),
            nonfinite_rollout="neutral",
            max_weight_staleness=3,
            mask_offpolicy_in_partial_rollout=True,
        ),
        lambda: rules.chain(
            *_mis().rules[:-1],
            rules.staleness(max_weight_staleness=3),
            rules.offpolicy_prefix(),
            rules.batch_normalize(),
            nonfinite_rollout="neutral",
        ),
    ),
    "areal_grid_neutral": (
        dataclasses.replace(
            opj.CorrectionConfig.from_areal({"level": "sequence", "action": "mask", "upper": 3.0}),
            nonfinite_rollout="neutral",
        ),
        lambda: rules.chain(
            rules.mismatch_metrics(),
            rules.areal_rejection(level="sequence", action="mask", upper=3.0),
            nonfinite_rollout="neutral",
        ),
    ),
}


def _correction_bits(result):
    flat = {"weights": result.weights, "mask": result.mask}
    flat |= {f"metrics.{k}": v for k, v in result.metrics.items()}
    return {k: np.asarray(v) for k, v in flat.items()}


@pytest.mark.parametrize("name", _spread(sorted(CORRECTION_SETTINGS)))
def test_a_correction_setting_chained_equals_compute_correction_bit_for_bit(name):
    config, build = CORRECTION_SETTINGS[name]
    b = _Async(21)
    chained = rules.from_config(config)
    assert build() == chained  # the config builds exactly the hand-written chain
    versions = {"versions": b.versions, "current_version": b.current_version}

    def both(o, r, m, v):  # one compiled program for both paths and both reductions
        return [
            (
                opj.correct(
                    o, r, m, *chained.rules, nonfinite_rollout=chained.nonfinite_rollout,
                    reduction=how, **v,
                ),
                opj.compute_correction(o, r, m, config, reduction=how, **v),
            )
            for how in ("sequence", "token")
        ]  # fmt: skip

    for got, want in jax.jit(both)(b.old, b.rollout, b.mask, versions):
        _assert_bits_equal(_correction_bits(got), _correction_bits(want))
        assert np.isfinite(np.asarray(got.weights)).all()
    # and called as a value, outside jit, as the config's call outside jit
    eager = chained(b.old, b.rollout, b.mask, **versions)
    want = opj.compute_correction(b.old, b.rollout, b.mask, config, **versions)
    _assert_bits_equal(_correction_bits(eager), _correction_bits(want))


def _entries(config):
    """The loss entries a correction config may serve (a metrics-only one: bypass PPO)."""
    if not config.use_tis:
        return ["bypass_ppo", "ppo"]
    weighted = ["decoupled_ppo", "reinforce_is"]
    return weighted if config.rejection_sampling is not None else [*weighted, "bypass_ppo"]


@pytest.mark.parametrize(
    ("name", "entry"),
    _spread(
        [(n, e) for n in sorted(CORRECTION_SETTINGS) for e in _entries(CORRECTION_SETTINGS[n][0])]
    ),
)
def test_a_correction_setting_chained_gives_its_config_loss_bit_for_bit(name, entry):
    config, _ = CORRECTION_SETTINGS[name]
    if entry == "bypass_ppo" and config.use_tis:  # bypass PPO takes a correction that rejects
        config = dataclasses.replace(config, tis_mode="none", tis_batch_normalize=False)
    b = _Async(22)
    old = b.old if entry in ("decoupled_ppo", "ppo") else None
    versions = {"versions": b.versions, "current_version": b.current_version}

    def composed(lp):
        chained = rules.from_config(config)
        if entry == "ppo":  # PPO's rollout_logp is a keyword: it only feeds metrics
            return objectives.ppo(
                lp, old, b.adv, b.mask, rollout_logp=b.rollout, correction=chained, **versions
            )
        first = (lp, old, b.rollout) if entry == "decoupled_ppo" else (lp, b.rollout)
        return getattr(objectives, entry)(*first, b.adv, b.mask, correction=chained, **versions)

    def configured(lp):
        loss_config = opj.LossConfig(algorithm=entry, correction=config)
        return opj.policy_loss_parts(lp, old, b.rollout, b.adv, b.mask, loss_config, **versions)

    _assert_bitwise_same_loss(composed, configured, b.logp, b.mask)


@pytest.mark.parametrize("vanilla", [opj.VanillaTIS(), opj.VanillaTIS(clip_low=0.5, clip=1.5)])
@pytest.mark.parametrize("entry", ["decoupled_ppo", "reinforce_is"])
def test_vanilla_tis_chained_gives_the_config_loss_bit_for_bit(vanilla, entry):
    b = _Async(23)
    chained = rules.chain(rules.vanilla_tis(clip_low=vanilla.clip_low, clip=vanilla.clip))
    assert rules.from_config(vanilla) == chained
    old = b.old if entry == "decoupled_ppo" else None

    def composed(lp):
        call = getattr(objectives, entry)
        first = (lp, old, b.rollout) if entry == "decoupled_ppo" else (lp, b.rollout)
        return call(*first, b.adv, b.mask, correction=chained)

    def configured(lp):
        loss_config = opj.LossConfig(algorithm=entry, correction=vanilla)
        return opj.policy_loss_parts(lp, old, b.rollout, b.adv, b.mask, loss_config)

    got, want = _bits(jax.jit(composed)(b.logp)), _bits(jax.jit(configured)(b.logp))
    _assert_bits_equal(got, want)
    assert "metrics.tis.numerator" not in got and "tis.numerator" in got


def test_vanilla_tis_matches_a_numpy_reference():
    _, old, rollout, _, mask = _batch(7)
    got = opj.correct(old, rollout, mask, rules.vanilla_tis(clip_low=0.5, clip=1.5))
    ratio = np.exp(old.astype(np.float64) - rollout)
    w = np.clip(ratio, 0.5, 1.5)
    np.testing.assert_allclose(got.weights, np.where(mask, w, 0.0), rtol=1e-5)
    np.testing.assert_array_equal(got.mask, mask)
    rows = mask.sum(-1) > 0
    per_seq = np.where(mask, w != ratio, 0).sum(-1)[rows] / mask.sum(-1)[rows]
    np.testing.assert_allclose(got.metrics["tis_clipfrac"], per_seq.mean(), rtol=1e-5)


def _non_default_settings():
    """A valid non-default value of every CorrectionConfig field, with what it needs."""
    return {
        "use_tis": ({"use_tis": True}, {}),
        "tis_level": ({"tis_level": "geometric"}, {"use_tis": True}),
        "tis_mode": ({"tis_mode": "clip"}, {"use_tis": True}),
        "tis_lower_bound": ({"tis_lower_bound": 0.25}, {"use_tis": True}),
        "tis_upper_bound": ({"tis_upper_bound": 3.0}, {"use_tis": True}),
        "tis_batch_normalize": ({"tis_batch_normalize": True}, {"use_tis": True}),
        "use_rs": ({"use_rs": True}, {"use_tis": True}),
        "rs_level": ({"rs_level": "sequence"}, {"use_tis": True, "use_rs": True}),
        "rs_lower_bound": ({"rs_lower_bound": 0.3}, {"use_tis": True, "use_rs": True}),
        "rs_upper_bound": ({"rs_upper_bound": 3.0}, {"use_tis": True, "use_rs": True}),
        "rs_veto_threshold": ({"rs_veto_threshold": 1e-4}, {"use_tis": True}),
        "rs_criteria": ({"rs_criteria": ("seq_max_k2:2.5",)}, {"use_tis": True}),
        "seq_logprob_error_threshold": ({"seq_logprob_error_threshold": 2.0}, {"use_tis": True}),
        "m2po_tau": ({"m2po_tau": 0.1}, {"use_tis": True}),
        "probability_metrics": ({"probability_metrics": True}, {}),
        "nonfinite_rollout": ({"nonfinite_rollout": "neutral"}, {}),
        "max_weight_staleness": ({"max_weight_staleness": 2}, {"use_tis": True}),
        "staleness_level": (
            {"staleness_level": "token"}, {"use_tis": True, "max_weight_staleness": 2}
        ),
        "mask_offpolicy_in_partial_rollout": (
            {"mask_offpolicy_in_partial_rollout": True}, {"use_tis": True}
        ),
        "rejection_sampling": (
            {"rejection_sampling": {"upper": 3.0}}, {"use_tis": True, "tis_mode": "none"}
        ),
    }  # fmt: skip


def test_every_correction_config_field_is_accepted_by_from_config():
    settings = _non_default_settings()
    assert set(settings) == set(opj.CorrectionConfig.keys())  # a new field needs a rule
    for key, (value, needs) in settings.items():
        without = rules.from_config(opj.CorrectionConfig(**needs))
        with_it = rules.from_config(opj.CorrectionConfig(**needs, **value))
        assert with_it != without, key  # the field reaches the chain


def _every_key_at_once():
    """Every CorrectionConfig key set at once: once with importance_weights' weight, once
    with AReaL's (``rejection_sampling``, which needs ``tis_mode: none``)."""
    keys: dict = {}
    for key, (value, needs) in _non_default_settings().items():
        if key != "rejection_sampling":
            keys |= needs | value
    areal = keys | {"tis_mode": "none", "rejection_sampling": {"upper": 3.0}}
    return [opj.CorrectionConfig(**keys), opj.CorrectionConfig(**areal)]


def _valid_configs():
    """The shipped presets, the every-key configs and the conformance suite's valid ones."""
    from conformance import load_cases

    from offpolicy_jax.interop.verl import VERL_PRESETS

    configs = [opj.CorrectionConfig.preset(name) for name in ("mis", *VERL_PRESETS)]
    configs += _every_key_at_once()
    for case in load_cases():
        if "expect_error" in case or case.get("config_from_dict") or "config_yaml" in case:
            continue
        config = dict(case["config"])
        if case["kind"] == "loss":
            config = config["correction"] if case["correction_type"] != "VanillaTIS" else None
        if config is not None:
            configs.append(opj.CorrectionConfig(**config))
    return configs


def test_every_valid_config_gives_a_chain_that_builds_again():
    configs = _valid_configs()
    assert len(configs) > 20
    for config in configs:
        chained = rules.from_config(config)
        again = rules.chain(*chained.rules, nonfinite_rollout=config.nonfinite_rollout)
        assert again == chained, config
        rules.chain(*chained.rules, rules.mismatch_metrics())  # an equal group may repeat


def test_the_every_key_chains_run_like_their_configs():
    _, old, rollout, _, mask = _batch(3)
    versions = np.zeros(old.shape, np.int32)
    versions[:, 6:] = 1  # a partial rollout, for the rules that read versions
    for config in _every_key_at_once():
        chained = rules.chain(
            *rules.from_config(config).rules,
            rules.mismatch_metrics(),
            nonfinite_rollout=config.nonfinite_rollout,
        )
        got = chained(old, rollout, mask, versions=versions, current_version=2)
        want = opj.compute_correction(
            old, rollout, mask, config, versions=versions, current_version=2
        )
        np.testing.assert_array_equal(got.weights, want.weights)
        np.testing.assert_array_equal(got.mask, want.mask)
        assert got.metrics.keys() == want.metrics.keys()
        for key in want.metrics:
            np.testing.assert_array_equal(got.metrics[key], want.metrics[key], err_msg=key)


_AREAL = rules.areal_rejection(upper=3.0)


@pytest.mark.parametrize(
    ("chained", "names", "role"),
    [
        ((_AREAL, rules.mismatch_metrics(), _IW), "areal_rejection.*importance_weights",
         "set the importance weights"),
        ((_IW, _AREAL), "importance_weights.*areal_rejection", "set the importance weights"),
        ((_IW, rules.importance_weights(level="sequence", upper=3.0)),
         "importance_weights.*importance_weights", "set the importance weights"),
        ((_AREAL, rules.areal_rejection(level="sequence")),
         "areal_rejection.*areal_rejection", "set the importance weights"),
        ((rules.rejection_sampling(level="token"), rules.rejection_sampling(level="sequence")),
         "rejection_sampling.*rejection_sampling", "report mis_rs_mask_fraction"),
        ((rules.veto(threshold=1e-4), _IW, rules.veto(threshold=1e-3)), "veto.*veto",
         "report mis_rs_catastrophic"),
        ((rules.criterion("seq_max_k2", threshold=2.0),
          rules.criterion("seq_max_k2", threshold=1.0)),
         "criterion\\('seq_max_k2'\\).*criterion\\('seq_max_k2'\\)", "report mis_rs_seq_max_k2_"),
        ((rules.seq_logprob_error(threshold=2.0), rules.seq_logprob_error(threshold=3.0)),
         "seq_logprob_error.*seq_logprob_error", "report mis_seq_logprob_error_"),
        ((rules.m2po(tau=0.1), rules.m2po(tau=0.2)), "m2po.*m2po", "report mis_m2po_"),
        ((rules.staleness(max_weight_staleness=1), rules.staleness()),
         "staleness.*staleness", "report mis_staleness_"),
        ((rules.offpolicy_prefix(), rules.offpolicy_prefix()),
         "offpolicy_prefix.*offpolicy_prefix", "report mis_offpolicy_prefix_"),
    ],
)  # fmt: skip
def test_a_chain_refuses_a_rule_that_would_silently_override_another(chained, names, role):
    with pytest.raises(ValueError, match=f"rules\\[\\d\\] \\({names}\\) both {role}"):
        rules.chain(*chained)
    _, old, rollout, _, mask = _batch()
    with pytest.raises(ValueError, match="would silently replace"):
        opj.correct(old, rollout, mask, *chained)


def test_a_weighting_rule_added_to_a_config_chain_is_refused():
    configured = rules.from_config(opj.CorrectionConfig.preset("mis"))
    with pytest.raises(ValueError, match="give one weighting rule"):
        rules.chain(*configured.rules, rules.importance_weights(mode="clip", upper=3.0))
    with pytest.raises(ValueError, match="give areal_rejection.*tis_mode: none"):
        rules.chain(*configured.rules, _AREAL)


@dataclasses.dataclass(frozen=True)
class _Doubled(rules.Stage):
    """A stage of one's own that weights every token 2 and reports ``name``."""

    name: str = "my_weight"

    def decide(self, t, sums):
        weights = jnp.where(t.population > 0, 2.0, 0.0)
        return rules.Decision(weights=weights, metrics={self.name: rules.Mean(weights)})


def test_a_stage_of_ones_own_that_overrides_another_is_refused_at_trace_time():
    _, old, rollout, _, mask = _batch()
    with pytest.raises(ValueError, match="TISWeights and _Doubled both set the weights"):
        opj.correct(old, rollout, mask, _IW, _Doubled())
    with pytest.raises(
        ValueError, match="MismatchMetrics and _Doubled both set the metric 'mis_kl'"
    ):
        opj.correct(old, rollout, mask, rules.mismatch_metrics(), _Doubled("mis_kl"))
    doubled = opj.correct(old, rollout, mask, _Doubled())  # alone, it is the weight
    np.testing.assert_array_equal(doubled.weights, np.where(mask, 2.0, 0.0))


def test_a_chain_needs_the_versions_its_rules_read():
    _, old, rollout, adv, mask = _batch()
    for rule, name in ((rules.staleness(max_weight_staleness=1), "rules.staleness"),
                       (rules.offpolicy_prefix(), "rules.offpolicy_prefix")):  # fmt: skip
        with pytest.raises(ValueError, match=f"versions is required: {name}"):
            opj.correct(old, rollout, mask, _IW, rule)
        with pytest.raises(ValueError, match=f"versions is required: {name}"):
            objectives.decoupled_ppo(
                old, old, rollout, adv, mask, correction=rules.chain(_IW, rule)
            )


@pytest.mark.parametrize(
    ("composed", "configured", "owner"),
    [
        (
            lambda: rules.staleness(max_weight_staleness=-1),
            lambda: opj.CorrectionConfig(use_tis=True, max_weight_staleness=-1),
            "rules.staleness",
        ),
        (
            lambda: rules.staleness(max_weight_staleness=2.5),
            lambda: opj.CorrectionConfig(use_tis=True, max_weight_staleness=2.5),
            "rules.staleness",
        ),
        (
            lambda: rules.staleness(staleness_level="tok"),
            lambda: opj.CorrectionConfig(staleness_level="tok"),
            "rules.staleness",
        ),
        (
            lambda: rules.chain(_IW, nonfinite_rollout="neutrl"),
            lambda: opj.CorrectionConfig(nonfinite_rollout="neutrl"),
            "rules.chain",
        ),
        (
            lambda: rules.areal_rejection(metric="kl_k4"),
            lambda: opj.CorrectionConfig.from_areal({"metric": "kl_k4"}),
            "rules.areal_rejection",
        ),
        (
            lambda: rules.areal_rejection(upper=0.5),
            lambda: opj.CorrectionConfig.from_areal({"upper": 0.5}),
            "rules.areal_rejection",
        ),
        (
            lambda: rules.areal_rejection(action="clamp", metric="kl_k3", upper=0.1),
            lambda: opj.CorrectionConfig.from_areal(
                {"action": "clamp", "metric": "kl_k3", "upper": 0.1}
            ),
            "rules.areal_rejection",
        ),
    ],
)
def test_a_bad_correction_setting_raises_the_config_message_naming_its_keyword(
    composed, configured, owner
):
    with pytest.raises(ValueError) as config_error:
        configured()
    with pytest.raises(ValueError) as error:
        composed()
    config_owner = "CorrectionConfig.rejection_sampling" if "areal" in owner else "CorrectionConfig"
    assert str(error.value) == str(config_error.value).replace(config_owner, owner)
    assert f"{owner}." in str(error.value)


@pytest.mark.parametrize(
    "settings", [{"clip_low": -1.0}, {"clip": 0.0}, {"clip_low": 2.0, "clip": 1.0}, {"clip": "x"}]
)
def test_a_bad_vanilla_tis_raises_the_config_message_naming_its_keyword(settings):
    with pytest.raises(ValueError) as config_error:
        opj.VanillaTIS(**settings)
    with pytest.raises(ValueError) as error:
        rules.vanilla_tis(**settings)
    assert str(error.value) == str(config_error.value).replace("VanillaTIS", "rules.vanilla_tis")


def test_the_new_rules_take_keyword_only_hyperparameters_and_vanilla_tis_stands_alone():
    with pytest.raises(TypeError):
        rules.staleness(2)  # type: ignore[misc]
    with pytest.raises(TypeError):
        rules.vanilla_tis(0.0, 2.0)  # type: ignore[misc]
    with pytest.raises(TypeError):
        rules.areal_rejection("token")  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"rules\[1\]: vanilla_tis\(\) is a correction of its own"):
        rules.chain(rules.mismatch_metrics(), rules.vanilla_tis())
    b = _batch()
    with pytest.raises(ValueError, match=r"objectives\.ppo\.correction: .* only report metrics"):
        objectives.ppo(b[0], b[1], b[3], b[4], rollout_logp=b[2], correction=_mis())
    with pytest.raises(ValueError, match=r"bypass_ppo\.correction: .* rules\[0\] \(VanillaIS\)"):
        objectives.bypass_ppo(b[0], b[2], b[3], b[4], correction=rules.chain(rules.vanilla_tis()))
