"""The proximal-policy approximation (AReaL ``prox_logp_method``) against NumPy.

``α``, ``loglinear`` and ``linear`` from their definitions in float64 (AReaL's
``compute_prox_logp_approximations``, with its ``1e−10`` in the log of ``linear``,
which the stable form here agrees with wherever the probability is not tiny); a token
sampled by the proximal version gets π_rollout exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest

import offpolicy_jax as opj
from offpolicy_jax._src.losses import proximal


def np_alpha(versions, current):
    v = np.asarray(versions, np.float64)
    span = current - v
    usable = (span > 0) & (v >= 0)
    return np.where(usable, np.clip((current - 1 - v) / np.where(usable, span, 1), 0, 1), 0.0)


def np_approx(method, rollout, theta, alpha):
    if method == "loglinear":
        return rollout + alpha * (theta - rollout)
    return np.log((1 - alpha) * np.exp(rollout) + alpha * np.exp(theta) + 1e-10)


@pytest.mark.parametrize("method", proximal.METHODS)
def test_approximations_match_numpy(method):
    rng = np.random.default_rng(0)
    shape = (4, 9)
    current = 7
    versions = rng.integers(-1, current + 2, size=shape)  # prompt (-1), older, current, newer
    rollout = rng.uniform(-6, -0.01, size=shape)
    theta = rollout + rng.normal(0, 0.5, size=shape)
    alpha = proximal.interpolation_weight(jnp.asarray(versions, jnp.float32), jnp.float32(current))
    np.testing.assert_allclose(alpha, np_alpha(versions, current), rtol=1e-6, atol=1e-7)
    got = proximal.approximate(
        method, jnp.asarray(rollout, jnp.float32), jnp.asarray(theta, jnp.float32), alpha
    )
    want = np_approx(method, rollout, theta, np_alpha(versions, current))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # On-policy for the proximal version (v = c − 1), and for prompt / newer tokens: α = 0.
    on_policy = (versions == current - 1) | (versions < 0) | (versions >= current)
    np.testing.assert_array_equal(np.asarray(got)[on_policy], np.float32(rollout)[on_policy])


def test_alpha_follows_areal_examples():
    # AReaL tests/test_prox_approx.py: v = c − 2 → α = 1/2; v = c − 4 → 3/4.
    alpha = proximal.interpolation_weight(jnp.array([8.0, 6.0, 9.0, -1.0]), jnp.float32(10.0))
    np.testing.assert_allclose(alpha, [0.5, 0.75, 0.0, 0.0])
    loglinear = proximal.approximate("loglinear", jnp.float32(-1.0), jnp.float32(-1.5), alpha[0])
    np.testing.assert_allclose(loglinear, -1.25)
    with pytest.raises(ValueError, match="unknown proximal approximation"):
        proximal.approximate("cubic", jnp.float32(0), jnp.float32(0), jnp.float32(0))


# ---------------------------------------------------------------- in the decoupled loss


def _loss_case(seed=0):
    """A ragged batch with NaN / inf garbage at masked positions and mixed versions."""
    rng = np.random.default_rng(seed)
    shape = (5, 8)
    lengths = np.array([8, 0, 3, 6, 1])
    mask = (np.arange(8) < lengths[:, None]) & (rng.random(shape) > 0.1)
    rollout = rng.normal(-1.3, 0.5, shape).astype(np.float32)
    logp = (rollout + rng.normal(0, 0.3, shape)).astype(np.float32)
    adv = rng.normal(0, 1, shape).astype(np.float32)
    current = 9
    versions = np.minimum(
        current - rng.integers(1, 6, (5, 1)) + (rng.random(shape) < 0.2).cumsum(-1), current
    )
    hole = ~mask
    for x in (rollout, logp, adv):
        x[hole] = rng.choice([np.nan, np.inf, -np.inf], size=int(hole.sum()))
    versions = np.where(hole, -7, versions)
    return logp, rollout, adv, mask, versions, current


CORRECTION = opj.CorrectionConfig(use_tis=True, tis_mode="clip", tis_upper_bound=1.5)


@pytest.mark.heavy
@pytest.mark.parametrize("method", proximal.METHODS)
def test_approximated_loss_matches_numpy_reference(method):
    logp, rollout, adv, mask, versions, current = _loss_case()
    alpha = np_alpha(np.where(mask, versions, 0), current)
    with np.errstate(invalid="ignore", over="ignore"):
        old = np.where(
            mask,
            np_approx(method, rollout.astype(np.float64), logp.astype(np.float64), alpha),
            np.nan,
        )
    want, want_grad, want_metrics = ref.policy_loss(
        logp, old, rollout, adv, mask, algorithm="decoupled_ppo", correction=CORRECTION.to_dict()
    )
    cfg = opj.LossConfig(algorithm="decoupled_ppo", correction=CORRECTION, prox_logp_method=method)

    def loss(lp):
        return opj.policy_loss(
            lp, None, rollout, adv, mask, cfg, versions=versions, current_version=current
        )

    (got, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logp))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.where(mask, grad, 0), want_grad, rtol=2e-5, atol=2e-6)
    for key in ("pg_clipfrac", "ppo_kl", "mis_is_ratio_mean_final"):
        np.testing.assert_allclose(
            metrics[key], want_metrics[key], rtol=2e-5, atol=2e-6, err_msg=key
        )
    np.testing.assert_allclose(
        metrics["prox_alpha_mean"],
        np.mean([alpha[i][mask[i]].mean() for i in range(5) if mask[i].any()]),
        rtol=1e-6,
    )


@pytest.mark.heavy
@pytest.mark.parametrize("method", proximal.METHODS)
def test_exact_approximation_gives_the_recomputed_loss(method):
    """When the recomputed π_old is what the approximation gives, the two losses (and
    gradients) are the same; where the versions say a token is the proximal version's,
    the approximation is π_rollout, i.e. the recomputed π_old of the same weights."""
    logp, rollout, adv, mask, versions, current = _loss_case(1)
    alpha = proximal.interpolation_weight(jnp.asarray(versions, jnp.float32), jnp.float32(current))
    exact = proximal.approximate(method, jnp.asarray(rollout), jnp.asarray(logp), alpha)
    approx_cfg = opj.LossConfig(
        algorithm="decoupled_ppo", correction=CORRECTION, prox_logp_method=method
    )
    recompute_cfg = opj.LossConfig(algorithm="decoupled_ppo", correction=CORRECTION)

    def loss(cfg, old):
        def f(lp):
            return opj.policy_loss(
                lp, old, rollout, adv, mask, cfg, versions=versions, current_version=current
            )[0]

        return jax.value_and_grad(f)(jnp.asarray(logp))

    got, got_grad = loss(approx_cfg, None)
    want, want_grad = loss(recompute_cfg, exact)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-6, atol=1e-7)
    on_policy = mask & (versions == current - 1)
    assert on_policy.any()
    np.testing.assert_array_equal(np.asarray(exact)[on_policy], rollout[on_policy])


@pytest.mark.heavy
def test_metrics_mode_trains_on_the_recomputed_policy_and_reports_both_errors():
    logp, rollout, adv, mask, versions, current = _loss_case(2)
    rng = np.random.default_rng(5)
    old = np.where(mask, rollout + rng.normal(0, 0.1, rollout.shape), np.nan).astype(np.float32)
    cfg = opj.LossConfig(
        algorithm="decoupled_ppo", correction=CORRECTION, prox_logp_method="metrics"
    )
    plain = opj.LossConfig(algorithm="decoupled_ppo", correction=CORRECTION)
    loss, metrics = opj.policy_loss(
        logp, old, rollout, adv, mask, cfg, versions=versions, current_version=current
    )
    want, _ = opj.policy_loss(logp, old, rollout, adv, mask, plain)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    alpha = np_alpha(np.where(mask, versions, 0), current)
    for method in proximal.METHODS:
        with np.errstate(invalid="ignore", over="ignore"):
            approx = np_approx(method, rollout.astype(np.float64), logp.astype(np.float64), alpha)
        err = np.abs(old - approx)
        want_err = np.mean([err[i][mask[i]].mean() for i in range(5) if mask[i].any()])
        np.testing.assert_allclose(
            metrics[f"prox_{method}_abs_error"], want_err, rtol=1e-4, atol=1e-6
        )


@pytest.mark.parametrize(
    ("cfg", "kwargs", "error", "match"),
    [
        (dict(algorithm="ppo", prox_logp_method="loglinear"), {}, ValueError, "decoupled_ppo"),
        (dict(prox_logp_method="cubic"), {}, ValueError, "prox_logp_method"),
        (dict(prox_logp_method="loglinear"), dict(old_logp=None), ValueError, "versions"),
        (dict(prox_logp_method="metrics"), dict(old_logp=None, versions=1), ValueError, "old_logp"),
    ],
)
def test_bad_proximal_settings_are_refused(cfg, kwargs, error, match):
    logp, rollout, adv, mask, versions, current = _loss_case()
    args = dict(old_logp=rollout, versions=None, current_version=None)
    if kwargs.get("versions"):
        kwargs = {**kwargs, "versions": versions, "current_version": current}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        config = opj.LossConfig(**{"algorithm": "decoupled_ppo", "correction": CORRECTION, **cfg})
        opj.policy_loss(
            logp,
            args["old_logp"],
            rollout,
            adv,
            mask,
            config,
            versions=args["versions"],
            current_version=args["current_version"],
        )


def test_staleness_rule_through_the_loss():
    logp, rollout, adv, mask, versions, current = _loss_case(3)
    correction = opj.CorrectionConfig(use_tis=True, max_weight_staleness=2)
    cfg = opj.LossConfig(algorithm="decoupled_ppo", correction=correction)
    terms = opj.policy_loss_terms(
        logp, rollout, rollout, adv, mask, cfg, versions=versions, current_version=current
    )
    direct = opj.compute_correction(
        rollout, rollout, mask, correction, versions=versions, current_version=current
    )
    np.testing.assert_array_equal(terms.mask, direct.mask)
    assert float(opj.finalize_metrics(terms.metrics)["mis_staleness_max"]) == float(
        direct.metrics["mis_staleness_max"]
    )


@pytest.mark.heavy
def test_packed_rows_equal_one_sequence_per_row():
    rng = np.random.default_rng(4)
    current, seqs = 9, []
    for length in (6, 2, 0, 5, 3):
        rollout = rng.normal(-1.2, 0.4, length).astype(np.float32)
        seqs.append(
            dict(
                logp=(rollout + rng.normal(0, 0.2, length)).astype(np.float32),
                rollout=rollout,
                adv=np.full(length, rng.normal(), np.float32),
                mask=(rng.random(length) > 0.1).astype(np.float32),
                versions=np.minimum(current - rng.integers(1, 5) + np.arange(length) // 3, current),
            )
        )
    correction = opj.CorrectionConfig(use_tis=True, max_weight_staleness=3)
    cfg = opj.LossConfig(
        algorithm="decoupled_ppo", correction=correction, prox_logp_method="linear"
    )
    packed = opj.pack_sequences(seqs, 10, max_segments=3)
    a = packed.arrays

    def call(x, **kw):
        def f(lp):
            return opj.policy_loss(
                lp,
                None,
                x["rollout"],
                x["adv"],
                x["mask"],
                cfg,
                versions=x["versions"],
                current_version=current,
                **kw,
            )

        return jax.jit(jax.value_and_grad(f, has_aux=True))(jnp.asarray(x["logp"]))

    (got, got_metrics), got_grad = call(
        a, segment_ids=packed.segment_ids, num_segments=packed.num_segments
    )
    rows = opj.unpack_sequences(a, packed.segment_ids, packed.num_segments, length=10)
    rows = {k: v.reshape(-1, 10) for k, v in rows.items()}
    (want, want_metrics), want_grad = call(rows)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for key, value in want_metrics.items():
        np.testing.assert_allclose(got_metrics[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    unpacked = opj.unpack_sequences(
        {"g": np.asarray(got_grad)}, packed.segment_ids, packed.num_segments, length=10
    )
    np.testing.assert_allclose(unpacked["g"].reshape(-1, 10), want_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.multi_device
@pytest.mark.slow
@pytest.mark.usefixtures("clear_jax_caches")
def test_shard_map_over_data_and_tokens_equals_unsharded():
    if len(jax.devices("cpu")) < 8:
        pytest.skip("needs JAX_NUM_CPU_DEVICES=8 (tests/conftest.py)")
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    logp, rollout, adv, mask, versions, current = _loss_case(6)
    logp, rollout, adv = (np.where(mask, x, 0.0).astype(np.float32) for x in (logp, rollout, adv))
    pad = ((0, 1), (0, 0))  # 6 rows: 2 data shards x 4 token shards of 2 tokens
    logp, rollout, adv, versions = (np.pad(x, pad) for x in (logp, rollout, adv, versions))
    mask = np.pad(mask, pad).astype(np.float32)
    correction = opj.CorrectionConfig(use_tis=True, max_weight_staleness=3)
    cfg = opj.LossConfig(
        algorithm="decoupled_ppo", correction=correction, prox_logp_method="metrics"
    )
    old = rollout + 0.05

    def loss(lp, o, b, a, m, v, axis_names=None):
        return opj.policy_loss(
            lp, o, b, a, m, cfg, versions=v, current_version=current, axis_names=axis_names
        )

    want, want_metrics = loss(logp, old, rollout, adv, mask, versions)
    mesh = jax.make_mesh((2, 4), ("data", "tok"), devices=jax.devices("cpu")[:8])
    spec = P("data", "tok")
    axes = opj.MeshAxes(batch="data", token="tok")
    fn = jax.jit(
        jax.shard_map(
            lambda *x: loss(*x, axis_names=axes),
            mesh=mesh,
            in_specs=(spec,) * 6,
            out_specs=(P(), P()),
        )
    )
    args = [
        jax.device_put(x, NamedSharding(mesh, spec))
        for x in (logp, old, rollout, adv, mask, versions)
    ]
    got, got_metrics = fn(*args)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for key, value in want_metrics.items():
        np.testing.assert_allclose(got_metrics[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_metrics_only_losses_report_staleness_too():
    logp, rollout, adv, mask, versions, current = _loss_case(3)
    cfg = opj.LossConfig(algorithm="ppo", get_mismatch_metrics=True)
    _, metrics = opj.policy_loss(
        logp, rollout, rollout, adv, mask, cfg, versions=versions, current_version=current
    )
    direct = opj.compute_correction(
        rollout, rollout, mask, opj.CorrectionConfig(), versions=versions, current_version=current
    )
    for key in ("mis_staleness_mean", "mis_staleness_max"):
        np.testing.assert_allclose(metrics[key], direct.metrics[key], rtol=1e-6, err_msg=key)
