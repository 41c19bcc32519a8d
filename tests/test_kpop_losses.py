"""KPop on the loss side: prime-rl's ``kpop`` loss and AReaL's ``metric: binary_kl``.

Each reading against a port of its home system's code on the same inputs (prime-rl's
``kpop_loss_fn`` with ``compute_loss``'s normalisation; AReaL's ``ppo_actor_loss_fn``
with ``apply_rejection_sampling`` and ``compute_binary_kl_divergence``), against the
independent float64 references (``policy_losses_reference.kpop``,
``numpy_reference_rules.areal_binary_kl``) on ragged batches with NaN padding and
probabilities within 1e-7 of 0 and of 1; thresholds, jit / vmap / grad, the all-masked
batch, pooled micro-batches, packed rows, and the configuration. The prime-rl suites
(``test_prime_rl_losses``: terms, garbage, decoupled weights, empty batches) and the
mesh cases (sharded == unsharded, packed == padded) carry ``kpop`` too.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import mesh_cases as mc
import numpy as np
import numpy_reference_rules as rules_ref
import packing_cases as pc
import policy_losses_reference as ref
import pytest
import test_areal_minpro as areal_tests
import test_prime_rl_losses as prime_tests

import offpolicy_jax as opj
from offpolicy_jax._src.correction.binary_kl import bidirectional_binary_kl
from offpolicy_jax._src.losses import policy_losses as pl

# Probabilities at the edges: within 1e-7 of 0 (below the clamp ε = 1e-6 and AReaL's
# 1e-8) and of 1 (1 − 5e-8 is float32's 1 − 2^-24; log p = 0 and −1e-9 are exactly 1).
EDGE_LOGP = np.log(np.array([1e-9, 5e-8, 1e-7, 0.3, 0.9, 0.9999, 1 - 5e-8], np.float64))
EDGE_LOGP = np.concatenate([EDGE_LOGP, [-1e-9, 0.0]]).astype(np.float32)


def edge_batch(seed: int, garbage: bool = True):
    """Ragged ``[6, 12]`` log-probs with every pair of edge probabilities somewhere
    (trainer ``θ``, denominator ``d``), advantages of both signs, NaN / ±inf in the
    padding (``garbage``), and the lengths 12, 7, 1, 0, 12, 4."""
    rng = np.random.default_rng(seed)
    lengths = np.array([12, 7, 1, 0, 12, 4])
    valid = np.arange(12)[None, :] < lengths[:, None]
    base = np.log(rng.uniform(0.02, 0.98, valid.shape))
    theta = base + rng.normal(0.0, 0.3, valid.shape)
    d = base.copy()
    pairs = [(a, b) for a in EDGE_LOGP for b in EDGE_LOGP]
    picks = rng.choice(len(pairs), size=24, replace=False)
    flat = np.flatnonzero(valid)
    for slot, pick in zip(rng.choice(flat, size=24, replace=False), picks, strict=True):
        theta.flat[slot], d.flat[slot] = pairs[pick]
    theta = np.minimum(theta, 0.0)
    adv = rng.normal(size=valid.shape) * (rng.random(valid.shape) > 0.1)
    if garbage:
        junk = np.array([np.nan, np.inf, -np.inf])[np.arange(valid.size) % 3].reshape(valid.shape)
        theta, d, adv = (np.where(valid, x, junk) for x in (theta, d, adv))
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    return f32(theta), f32(d), f32(adv), valid


# --------------------------------------------------------------------------- prime-rl

KPOP = dict(kpop_threshold=0.02, adv_tau=1.3, kl_tau=0.05)


def _torch_binary_kl(log_p, log_q, eps):
    """``p·log(p/q) + (1 − p)·log((1 − p)/(1 − q))`` of ``clamp(exp(·), ε, 1 − ε)`` in
    float32, as written in torch by both home systems (``1 − ε`` rounded to float32)."""
    lo, hi = jnp.float32(eps), jnp.float32(1 - eps)
    p, q = jnp.clip(jnp.exp(log_p), lo, hi), jnp.clip(jnp.exp(log_q), lo, hi)
    return p * jnp.log(p / q) + (1 - p) * jnp.log((1 - p) / (1 - q))


def prime_rl_kpop_port(trainer, inference, adv, loss_mask, *, kpop_threshold, adv_tau, kl_tau):
    """prime-rl's ``kpop_loss_fn`` (pull request 3283: ``ipo_loss_fn`` of
    ``src/prime_rl/trainer/rl/loss.py`` at 559b44772 with the binary-KL mask it
    describes, clamp ``[1e-6, 1 − 1e-6]``) for each sample (row), summed and divided by
    the count of loss tokens as ``compute_loss`` does; the metrics as its per-sample
    ``_safe_mean`` averaged over the samples with a loss token. Float32, jnp, so the
    gradient is autodiff's; inputs without garbage (prime-rl packs without padding)."""
    log_ratio = trainer - inference
    ratio = jnp.exp(log_ratio)
    mismatch_kl = ratio - log_ratio - 1
    fwd = _torch_binary_kl(trainer, inference, 1e-6)
    rev = _torch_binary_kl(inference, trainer, 1e-6)
    is_masked = ~((fwd <= kpop_threshold) & (rev <= kpop_threshold))
    keep = loss_mask & ~is_masked
    pg_loss = keep * (adv_tau * adv) * ratio
    kl_loss = loss_mask * log_ratio**2
    per_token = -pg_loss + kl_tau * kl_loss
    loss = per_token.sum() / jnp.maximum(loss_mask.sum(), 1)

    def safe_mean(values, mask):  # per sample
        return jnp.where(mask, values, 0.0).sum(-1) / jnp.maximum(mask.sum(-1), 1)

    nonempty = loss_mask.any(-1)

    def over_samples(per_sample):
        return jnp.where(nonempty, per_sample, 0.0).sum() / jnp.maximum(nonempty.sum(), 1)

    metrics = {
        "is_masked": over_samples(safe_mean(is_masked, loss_mask)),
        "masked_mismatch_kl": over_samples(safe_mean(mismatch_kl, loss_mask & is_masked)),
        "unmasked_mismatch_kl": over_samples(safe_mean(mismatch_kl, keep)),
    }
    return loss, (metrics, is_masked)


def _kpop_config(algorithm="bypass_ppo", **extra):
    return opj.LossConfig(
        algorithm=algorithm, policy_loss="kpop", aggregation="token_mean", **{**KPOP, **extra}
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kpop_equals_a_port_of_prime_rls_kpop_loss_fn(seed):
    """bypass_ppo, token_mean: prime-rl's loss value, gradient and ``is_masked`` share on the
    same inputs, edge probabilities included; the mask binds and keeps tokens."""
    theta, d, adv, valid = edge_batch(seed, garbage=False)
    clean = [np.where(valid, x, -1.0).astype(np.float32) for x in (theta, d, adv)]
    (loss, metrics), grad = prime_tests._value_and_grad(_kpop_config())(
        clean[0], None, clean[1], clean[2], valid
    )
    port = jax.value_and_grad(
        lambda lp: prime_rl_kpop_port(lp, clean[1], clean[2], jnp.asarray(valid), **KPOP),
        has_aux=True,
    )
    (want, (want_metrics, masked)), want_grad = port(jnp.asarray(clean[0]))
    np.testing.assert_allclose(float(loss), float(want), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(float(metrics["is_masked"]), float(want_metrics["is_masked"]))
    masked = np.asarray(masked) & valid
    assert masked.any() and (valid & ~masked).any()
    # prime-rl's subset means are not reported (docs/coming_from.md); the library's
    # surrogate metrics are the mask share only, as for ipo.
    assert {k for k in metrics if "mismatch_kl" in k} == set()


@pytest.mark.parametrize("seed", [0, 3])
def test_kpop_terms_match_float64_reference_at_the_edges(seed):
    """Probabilities within 1e-7 of 0 and 1, NaN / inf padding: the mask, the per-token loss
    and its gradient equal the float64 reference; gradients finite, 0 on the padding."""
    theta, d, adv, valid = edge_batch(seed)
    hyper = dict(kpop_threshold=0.02, adv_tau=1.3, kl_tau=0.05)
    expected = ref.kpop(theta, d, adv, valid, **hyper)
    adv_j = jnp.where(valid, adv, 0.0)

    def loss(th):
        return pl.kpop(th, jnp.asarray(d), adv_j, jnp.asarray(valid), **hyper)

    terms = loss(jnp.asarray(theta))
    np.testing.assert_array_equal(np.asarray(terms.masked) & valid, expected.masked & valid)
    np.testing.assert_allclose(
        np.asarray(terms.loss)[valid], expected.loss[valid], rtol=2e-5, atol=2e-6
    )
    cot = np.random.default_rng(seed).normal(size=theta.shape).astype(np.float32)
    _, vjp = jax.vjp(lambda th: loss(th).loss, jnp.asarray(theta))
    (grad,) = vjp(jnp.asarray(cot))
    np.testing.assert_allclose(grad, expected.vjp(cot), rtol=2e-5, atol=2e-6)
    assert np.all(np.isfinite(np.asarray(grad))) and np.all(np.asarray(grad)[~valid] == 0)
    # Both edges bind somewhere: a token with q ≈ 0 against p ≈ 1 is masked, p = q kept.
    assert (expected.masked & valid).any() and (~expected.masked & valid).any()


def _d_b(theta, d):
    """``max(D_B(p‖q), D_B(q‖p))`` in float32, as the library computes it."""
    return np.float32(bidirectional_binary_kl(jnp.float32(theta), jnp.float32(d)))


def test_kpop_threshold_is_inclusive_and_symmetric():
    """A token exactly at φ is kept (prime-rl's ``≤``), one ulp below it is masked; the
    mask is the same with θ and d swapped, whatever the advantage's sign."""
    theta, d = np.log(0.5), np.log(0.35)
    phi = float(_d_b(theta, d))
    below = float(np.nextafter(np.float32(phi), np.float32(0)))
    for t, dd in ((theta, d), (d, theta)):
        for adv in (1.0, -1.0, 0.0):
            _, _, masks = prime_tests._one_token("kpop", t, dd, adv, kpop_threshold=phi)
            assert not masks["masked"]
            _, grad, masks = prime_tests._one_token(
                "kpop", t, dd, adv, kpop_threshold=below, kl_tau=0.0
            )
            assert masks["masked"] and grad == 0.0


def test_kpop_masks_confident_tokens_that_ipo_keeps_and_keeps_rare_ones_it_masks():
    """The point of KPop: a near-certain token that moved by 0.09 in probability is far out
    in binary KL (IPO's |Δp| ≤ 0.1 keeps it); a rare token that moved by 0.15 is close
    in binary KL (IPO masks it)."""
    confident = (np.log(0.999), np.log(0.909))  # D_B ≈ 0.12
    rare = (np.log(0.45), np.log(0.3))  # |Δp| = 0.15, D_B ≈ 0.047
    for (t, dd), kpop_masks, ipo_masks in ((confident, True, False), (rare, False, True)):
        _, _, k = prime_tests._one_token("kpop", t, dd, 1.0, kpop_threshold=0.1)
        _, _, i = prime_tests._one_token("ipo", t, dd, 1.0, ipo_threshold=0.1)
        assert (k["masked"], i["masked"]) == (kpop_masks, ipo_masks)


def test_binary_kl_is_never_negative_and_finite_at_the_edges():
    grid = np.array(np.meshgrid(EDGE_LOGP, EDGE_LOGP)).reshape(2, -1)
    value = np.asarray(bidirectional_binary_kl(jnp.asarray(grid[0]), jnp.asarray(grid[1])))
    assert np.all(np.isfinite(value)) and np.all(value >= 0)
    want = np.maximum(ref.binary_kl(grid[0], grid[1]), ref.binary_kl(grid[1], grid[0]))
    np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-6)
    same = grid[0] == grid[1]
    assert np.all(value[same] == 0)


def test_kpop_jit_vmap_grad_and_the_all_masked_batch():
    """vmap over rows == one call; jit == eager; every token masked with kl_tau = 0: loss 0
    and zero gradient, never NaN, through policy_loss."""
    theta, d, adv, valid = edge_batch(5)
    adv_j = jnp.where(valid, adv, 0.0)

    def terms(th, dd, a, v):
        return pl.kpop(th, dd, a, v, **KPOP).loss

    full = jax.jit(terms)(theta, d, adv_j, valid)
    rows = jax.vmap(lambda *x: terms(*(y[None] for y in x))[0])(theta, d, adv_j, valid)
    np.testing.assert_array_equal(np.asarray(rows)[valid], np.asarray(full)[valid])
    np.testing.assert_array_equal(
        np.asarray(terms(theta, d, adv_j, valid))[valid], np.asarray(full)[valid]
    )
    far = np.where(valid, np.log(0.3), d).astype(np.float32)
    near = np.where(valid, np.log(0.95), theta).astype(np.float32)
    config = _kpop_config(kl_tau=0.0)
    (loss, metrics), grad = prime_tests._value_and_grad(config)(near, None, far, adv, valid)
    assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0.0)
    assert float(metrics["is_masked"]) == 1.0
    (loss, metrics), grad = prime_tests._value_and_grad(config)(
        near, None, far, adv, np.zeros_like(valid)
    )
    assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0.0)
    assert all(np.isfinite(float(v)) for v in metrics.values())


KPOP_CONFIGS = [
    _kpop_config(kpop_threshold=0.003),
    opj.LossConfig(
        algorithm="decoupled_ppo",
        correction=opj.VanillaTIS(clip_low=0.5, clip=1.5),
        policy_loss="kpop",
        aggregation="sequence_mean",
        kpop_threshold=0.003,
    ),
]


def _loss_args(b, config):
    old = None if config.algorithm == "bypass_ppo" else b["old_logp"]
    return (b["logp"], old, b["rollout_logp"], b["advantages"], b["mask"])


@pytest.mark.heavy
@pytest.mark.parametrize("config", KPOP_CONFIGS, ids=lambda c: c.algorithm)
def test_kpop_micro_batches_pool_to_the_full_batch(config):
    b = pc.packed_batch(1, rows=5, length=21, num_segments=prime_tests.K)
    b = pc.unpack(b, prime_tests.K)
    args = _loss_args(b, config)
    (full, full_metrics), full_grad = prime_tests._value_and_grad(config)(*args)
    num, den, grads, pooled = 0.0, 0.0, [], None
    for rows in (slice(0, 3), slice(3, 11), slice(11, None)):
        part = [None if a is None else a[rows] for a in args]
        (n, (dd, metrics)), g = prime_tests._numerator(config)(*part)
        num, den = num + n, den + dd
        grads.append(np.asarray(g))
        pooled = metrics if pooled is None else opj.pool_metric_parts(pooled, metrics)
    np.testing.assert_allclose(float(opj.LossParts(num, den).value()), float(full), rtol=1e-5)
    grad = opj.LossParts(np.concatenate(grads), den).value()
    np.testing.assert_allclose(grad, np.asarray(full_grad), rtol=1e-5, atol=1e-7)
    pooled = opj.finalize_metrics(pooled)
    assert pooled.keys() == full_metrics.keys() and "is_masked" in pooled
    for key, value in full_metrics.items():
        np.testing.assert_allclose(pooled[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    assert 0 < float(full_metrics["is_masked"]) < 1


@pytest.mark.heavy
@pytest.mark.parametrize("config", KPOP_CONFIGS, ids=lambda c: c.algorithm)
def test_kpop_packed_equals_one_sequence_per_row(config):
    k = prime_tests.K
    b = pc.packed_batch(3, rows=5, length=21, num_segments=k)
    keys = ("logp", "old_logp", "rollout_logp", "advantages", "mask")
    bypass = config.algorithm == "bypass_ppo"
    packed = [None if (key == "old_logp" and bypass) else b[key] for key in keys]
    (loss, metrics), grad = prime_tests._packed_value_and_grad(config, True)(
        *packed, b["segment_ids"]
    )
    flat = pc.unpack(b, k)
    rows = [None if (key == "old_logp" and bypass) else flat[key] for key in keys]
    (want, want_metrics), want_grad = prime_tests._packed_value_and_grad(config, False)(*rows, None)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(grad), pc.repack(np.asarray(want_grad), b["segment_ids"], k), atol=1e-6
    )
    for key, value in want_metrics.items():
        np.testing.assert_allclose(float(metrics[key]), float(value), rtol=1e-5, err_msg=key)


def test_kpop_configuration():
    cfg = opj.LossConfig(policy_loss="kpop")
    assert (cfg.kpop_threshold, cfg.adv_tau, cfg.kl_tau) == (0.1, 1.0, 1e-3)  # prime-rl's
    cfg = opj.LossConfig.from_dict(
        {"algorithm": "bypass_ppo", "policy_loss": "kpop", "kpop_threshold": "0.05"}
    )
    assert cfg.kpop_threshold == 0.05 and opj.LossConfig.from_dict(cfg.to_dict()) == cfg
    assert opj.LossConfig(policy_loss="ipo").kpop_threshold is None
    scaled = opj.objectives.surrogate("kpop", kpop_threshold=0.2)
    assert scaled is not None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(kpop_threshold=-0.1), "LossConfig.kpop_threshold"),
        (dict(kpop_threshold=float("nan")), "LossConfig.kpop_threshold"),
        (dict(kpop_threshold="x"), "LossConfig.kpop_threshold"),
        (dict(kpop_threshold=1e39), "LossConfig.kpop_threshold"),
        (dict(kl_tau=-1.0), "LossConfig.kl_tau"),
        (dict(ipo_threshold=0.1), "ipo_threshold"),
    ],
)
def test_kpop_bad_hyperparameters_name_their_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        opj.LossConfig(policy_loss="kpop", **kwargs)
    # (a keyword of another surrogate is a TypeError there, as for any function)
    with pytest.raises((ValueError, TypeError), match=message.split(".")[-1]):
        opj.objectives.surrogate("kpop", **kwargs)
    if "kpop_threshold" in kwargs:
        with pytest.raises(ValueError, match="kpop_threshold"):
            opj.LossConfig(policy_loss="ipo", kpop_threshold=0.1)


# ------------------------------------------------------------------------------ AReaL

# AReaL's examples/math/gsm8k_kpop.yaml, actor.rejection_sampling.
AREAL_KPOP_YAML = """
actor:
  use_decoupled_loss: true
  rejection_sampling:
    level: token
    action: mask
    metric: binary_kl
    upper: 2.0
"""


def _areal_kpop_port(logprobs, proximal, old, advantages, loss_mask, rs, eps, eps_high, c_clip):
    """AReaL's ``ppo_actor_loss_fn`` with ``apply_rejection_sampling(metric="binary_kl",
    action="mask")`` and ``compute_binary_kl_divergence`` (2D padded path, token-level
    PPO ratio), ported to float32 ``jnp`` from ``areal/utils/functional/functional.py``
    (commit 13353cc6): a NaN statistic fails the bounds as in torch; the denominator is
    the count of loss tokens before rejection; the kept tokens carry the unbounded
    ``exp(proximal − old)``."""
    loss_mask_count = jnp.maximum(loss_mask.sum(), 1)
    prox, behave_lp = jax.lax.stop_gradient(proximal), jax.lax.stop_gradient(old)
    log_ratio = prox - behave_lp
    log_ratio = jnp.where(jnp.isfinite(log_ratio), log_ratio, 0.0)
    kl_fwd = _torch_binary_kl(prox, behave_lp, 1e-8)
    kl_rev = _torch_binary_kl(behave_lp, prox, 1e-8)
    metric = jnp.where(jnp.isnan(kl_fwd) | jnp.isnan(kl_rev), jnp.nan, jnp.maximum(kl_fwd, kl_rev))
    lower, upper = rs.get("lower"), rs["upper"]

    def check(x):
        return (x >= lower) & (x <= upper) if lower is not None else x <= upper

    if rs["level"] == "sequence":
        masked = jnp.where(loss_mask, metric, 0.0)
        count = jnp.maximum(loss_mask.sum(-1, keepdims=True), 1)
        if rs["agg"] == "sum":
            seq = masked.sum(-1, keepdims=True)
        elif rs["agg"] == "mean":
            seq = masked.sum(-1, keepdims=True) / count
        else:  # torch's max propagates NaN
            seq = jnp.where(loss_mask, metric, -jnp.inf).max(-1, keepdims=True)
            seq = jnp.where(loss_mask.sum(-1, keepdims=True) == 0, 0.0, seq)
        inside = jnp.broadcast_to(check(seq), loss_mask.shape)
    else:
        inside = check(metric)
    loss_mask = loss_mask & inside
    behave = jnp.where(loss_mask, jnp.exp(log_ratio), 0.0)
    ratio = jnp.where(loss_mask, jnp.exp(logprobs - proximal), 0.0)
    clipped = jnp.clip(ratio, 1.0 - eps, 1.0 + eps_high)
    pg_loss = jnp.maximum(-advantages * ratio, -advantages * clipped)
    pg_loss = jnp.minimum(pg_loss, jnp.sign(advantages) * c_clip * advantages)
    pg_loss = pg_loss * behave
    return jnp.where(loss_mask, pg_loss, 0.0).sum() / loss_mask_count


AREAL_BLOCKS = {
    "token/one": dict(level="token", metric="binary_kl", upper=0.05),
    "token/two": dict(level="token", metric="binary_kl", lower=0.001, upper=0.05),
    "sequence/sum": dict(level="sequence", metric="binary_kl", agg="sum", upper=0.2),
    "sequence/mean": dict(level="sequence", metric="binary_kl", agg="mean", upper=0.03),
    "sequence/max/two": dict(
        level="sequence", metric="binary_kl", agg="max", lower=0.001, upper=0.1
    ),
}


FAST_BLOCKS = [
    n if n in ("token/one", "sequence/max/two") else pytest.param(n, marks=pytest.mark.slow)
    for n in AREAL_BLOCKS
]


def _areal_correction(block):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # agg at the token level
        return opj.CorrectionConfig.from_areal(block)


def _areal_batch(seed):
    """AReaL's three log-probs on a ragged batch: π_behave (engine), π_prox (recomputed)
    and π_θ; near-certain and near-impossible tokens in both policies."""
    rng = np.random.default_rng(seed)
    shape = (6, 10)
    mask = np.arange(10)[None, :] < np.array([10, 0, 1, 6, 8, 10])[:, None]
    mask &= rng.random(shape) > 0.1
    old = np.log(rng.uniform(0.05, 0.95, shape))
    prox = np.minimum(old + rng.normal(0.0, 0.15, shape), 0.0)
    for row, col, a, b in ((0, 1, 0.0, 0.0), (0, 4, -1e-9, -0.3), (4, 2, -5e-8, -1e-7)):
        prox[row, col], old[row, col] = a, b
    prox[5, 3], old[5, 3] = np.log(1e-9), np.log(1e-7)
    theta = prox + rng.normal(0.0, 0.1, shape)
    adv = rng.normal(0.0, 1.0, shape)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    return f32(theta), f32(prox), f32(old), f32(adv), mask


@pytest.mark.parametrize("name", FAST_BLOCKS)
def test_areal_kpop_loss_equals_a_port_of_areals_loss(name):
    """``from_areal`` in ``LossConfig(decoupled_ppo, token_mean, rejected_in_denominator)``
    with AReaL's clip settings: AReaL's value and gradient, near-certain tokens rejected
    as AReaL's NaN rejects them."""
    theta, prox, old, adv, mask = _areal_batch(4)
    eps, eps_high, c_clip = 0.2, 0.28, 3.0
    config = opj.LossConfig(
        algorithm="decoupled_ppo",
        correction=_areal_correction(AREAL_BLOCKS[name]),
        clip_eps=eps,
        clip_eps_high=eps_high,
        dual_clip_c=c_clip,
        aggregation="token_mean",
        rejected_in_denominator=True,
    )
    got, got_grad = jax.jit(
        jax.value_and_grad(lambda lp: opj.policy_loss(lp, prox, old, adv, mask, config)[0])
    )(theta)
    port = functools.partial(_areal_kpop_port, rs=AREAL_BLOCKS[name], eps=eps)
    want, want_grad = jax.jit(
        jax.value_and_grad(
            lambda lp: port(lp, prox, old, adv, jnp.asarray(mask), eps_high=eps_high, c_clip=c_clip)
        )
    )(theta)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got_grad), np.asarray(want_grad), rtol=1e-5, atol=1e-7)
    assert np.all(np.isfinite(np.asarray(got_grad))) and np.all(np.asarray(got_grad)[~mask] == 0)
    res = opj.compute_correction(prox, old, mask.astype(np.float32), config.correction)
    kept = np.asarray(res.mask) > 0
    assert (mask & ~kept).any() and kept.any()  # the rule binds and keeps
    if name.startswith("token"):
        assert not kept[0, 1] and not kept[0, 4]  # p == 1 in float32: AReaL's NaN


def _nan_padded(batch):
    theta, prox, old, _, mask = batch
    return (
        np.where(mask, prox, np.nan).astype(np.float32),
        np.where(mask, old, np.inf).astype(np.float32),
        mask.astype(np.float32),
    )


@pytest.mark.parametrize("name", FAST_BLOCKS)
def test_areal_kpop_correction_matches_float64_reference(name):
    """Mask, weights and every metric of the AReaL rule on a ragged batch with NaN / inf
    padding and edge probabilities, both metric reductions, against the float64
    reference (numpy_reference_rules.areal_rejection with areal_binary_kl)."""
    o, b, m = _nan_padded(_areal_batch(6))
    batch = {"old_logp": o, "rollout_logp": b, "mask": m}
    for reduction in ("sequence", "token"):
        areal_tests.assert_matches_reference(
            batch, _areal_correction(AREAL_BLOCKS[name]), reduction
        )


def test_areal_kpop_by_hand():
    """Inclusive bounds (``stat ≤ upper``), the unbounded weight on kept tokens, a token
    with a probability of exactly 1 rejected (AReaL's NaN), its statistic finite in the
    metrics, and the reference's undefined set is float32's."""
    o = np.log(np.array([[0.5, 0.9, 1.0, 0.2]], np.float32))
    b = np.log(np.array([[0.55, 0.5, 1.0, 0.2]], np.float32))
    m = np.ones((1, 4), np.float32)
    stat, undefined = rules_ref.areal_binary_kl(o, b)
    assert undefined.tolist() == [[False, False, True, False]]
    upper = float(np.float32(_d_b(o[0, 0], b[0, 0])))
    res = opj.compute_correction(
        o, b, m, _areal_correction({"metric": "binary_kl", "upper": upper})
    )
    assert np.asarray(res.mask)[0].tolist() == [1.0, 0.0, 0.0, 1.0]
    np.testing.assert_allclose(np.asarray(res.weights)[0, 0], 0.5 / 0.55, rtol=1e-6)
    assert all(np.isfinite(float(v)) for v in res.metrics.values())
    np.testing.assert_allclose(float(res.metrics["mis_rs_areal_max"]), stat.max(), rtol=1e-5)
    assert float(res.metrics["mis_rs_areal_fraction_high"]) == 0.5
    below = float(np.nextafter(np.float32(upper), np.float32(0)))
    res = opj.compute_correction(
        o, b, m, _areal_correction({"metric": "binary_kl", "upper": below})
    )
    assert np.asarray(res.mask)[0].tolist() == [0.0, 0.0, 0.0, 1.0]
    # The sequence level: the undefined token takes its sequence with it.
    seq = {"level": "sequence", "metric": "binary_kl", "agg": "sum", "upper": 100.0}
    res = opj.compute_correction(o, b, m, _areal_correction(seq))
    assert float(np.asarray(res.mask).sum()) == 0.0


def test_areal_kpop_all_rejected_gives_zero_loss_and_gradient():
    theta, prox, old, adv, mask = _areal_batch(2)
    config = opj.LossConfig(
        algorithm="decoupled_ppo",
        correction=_areal_correction({"metric": "binary_kl", "upper": 1e-30}),
        aggregation="token_mean",
        rejected_in_denominator=True,
    )
    # Far from π_prox everywhere (a rare token's partner is likely: both below the clamp
    # would be equal there, D_B = 0).
    far = np.where(mask, np.where(prox < -1.0, -0.1, prox - 1.5), old).astype(np.float32)
    (loss, metrics), grad = jax.value_and_grad(
        lambda lp: opj.policy_loss(lp, prox, far, adv, mask, config), has_aux=True
    )(theta)
    assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0.0)
    assert all(np.isfinite(float(v)) for v in metrics.values())


@pytest.mark.heavy
def test_areal_kpop_pooled_packed_and_vmap():
    """Micro-batches pool to the full batch; packed rows equal one sequence per row;
    vmap over batches equals the loop."""
    corrections = {
        "token": _areal_correction(AREAL_BLOCKS["token/two"]),
        "seq_max": _areal_correction(AREAL_BLOCKS["sequence/max/two"]),
    }
    packed = pc.packed_batch(2, rows=6, length=24, num_segments=areal_tests.K)
    areal_tests._assert_packed_equals_one_per_row(packed, corrections)
    theta, prox, old, adv, mask = _areal_batch(8)
    o, b, m = _nan_padded((theta, prox, old, adv, mask))
    for config in corrections.values():
        loss_config = opj.LossConfig(
            algorithm="decoupled_ppo",
            correction=config,
            aggregation="token_mean",
            rejected_in_denominator=True,
        )

        @jax.jit
        def parts(lp, old_, rollout, a, mk, loss_config=loss_config):
            return opj.policy_loss_parts(lp, old_, rollout, a, mk, loss_config)

        full, full_metrics = parts(theta, o, b, adv, m)
        num, den, pooled = 0.0, 0.0, None
        for rows in (slice(0, 1), slice(1, 4), slice(4, None)):
            part, metrics = parts(theta[rows], o[rows], b[rows], adv[rows], m[rows])
            num, den = num + part.numerator, den + part.denominator
            pooled = metrics if pooled is None else opj.pool_metric_parts(pooled, metrics)
        np.testing.assert_allclose(float(num / den), float(full.value()), rtol=1e-6)
        got, want = opj.finalize_metrics(pooled), opj.finalize_metrics(full_metrics)
        assert set(got) == set(want)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
        stacked = [np.stack([x, x[::-1]]) for x in (o, b, m)]
        out = jax.vmap(lambda *x, c=config: opj.compute_correction(*x, c).mask)(*stacked)
        for i in range(2):
            want = opj.compute_correction(*(x[i] for x in stacked), config).mask
            np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(want))


def test_from_areal_reads_areals_kpop_yaml():
    import yaml

    block = yaml.safe_load(AREAL_KPOP_YAML)["actor"]["rejection_sampling"]
    cfg = opj.CorrectionConfig.from_areal(block)
    rs = cfg.rejection_sampling
    assert (rs.metric, rs.action, rs.level, rs.upper, rs.lower) == (
        "binary_kl",
        "mask",
        "token",
        2.0,
        None,
    )
    assert (cfg.use_tis, cfg.tis_mode) == (True, "none")
    assert opj.CorrectionConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("block", "message"),
    [
        (dict(metric="binary_kl", action="clamp"), "action='clamp' only supports metric='ratio'"),
        (dict(metric="binary_kl", upper=0.0), r"rejection_sampling\.upper must be > 0"),
        (dict(metric="binary_kl", upper=-1.0), r"rejection_sampling\.upper must be > 0"),
        (dict(metric="binary_kl", upper=float("nan")), r"rejection_sampling\.upper"),
        (dict(metric="binary_kl", lower=0.5, upper=0.1), "lower .* cannot be greater"),
        (dict(metric="binary_kI"), r"rejection_sampling\.metric"),
    ],
)
def test_areal_kpop_bad_blocks_name_their_key(block, message):
    with pytest.raises(ValueError, match=message):
        opj.CorrectionConfig.from_areal(block)


def test_kpop_readings_differ_only_where_their_sources_do():
    """The two loss-side readings share ``D_B`` and differ in the clamp (AReaL 1e-8,
    prime-rl 1e-6), in the bound's side (AReaL's upper on π_old vs π_rollout, prime-rl's φ
    on the trainer vs π_d) and in what a masked token keeps (AReaL: nothing; prime-rl:
    the KL term). On probabilities inside ``[1e-6, 1 − 1e-6]`` the statistics agree."""
    theta, d = np.log(np.float32(0.4)), np.log(np.float32(0.6))
    areal_stat, undefined = rules_ref.areal_binary_kl(np.float32(theta), np.float32(d))
    assert not undefined
    np.testing.assert_allclose(_d_b(theta, d), areal_stat, rtol=1e-6)
    rare = np.log(np.float32(1e-8)), np.log(np.float32(1e-3))
    prime = float(_d_b(*rare))
    areal_value = float(rules_ref.areal_binary_kl(*rare)[0])
    assert areal_value > prime  # 1e-8 is clamped to 1e-6 by prime-rl, kept by AReaL
    config = _kpop_config(kl_tau=0.5, kpop_threshold=1e-9)
    theta_b, d_b, adv, valid = (np.full((1, 1), v, np.float32) for v in (theta, d, 1.0, 1.0))
    (loss, _), _ = prime_tests._value_and_grad(config)(theta_b, None, d_b, adv, valid > 0)
    np.testing.assert_allclose(float(loss), 0.5 * (theta - d) ** 2, rtol=1e-5)


# ------------------------------------------------------------------------------ sharded

KPOP_MESH_LOSSES = {k: v for k, v in mc.SURROGATE_LOSSES.items() if "kpop" in k}
KPOP_MESH_CORRECTIONS = {
    "areal_token_binary_kl": _areal_correction(dict(metric="binary_kl", upper=0.02)),
    "areal_seq_binary_kl_mean": _areal_correction(
        dict(level="sequence", metric="binary_kl", agg="mean", lower=1e-4, upper=0.1)
    ),
}


@pytest.mark.multi_device
@pytest.mark.parametrize("path", ["shard_map", "jit"])
def test_kpop_sharded_equals_unsharded(path):
    """The kpop mesh cases (decoupled and bypass) and the AReaL rule on 8 devices,
    ``P('data', 'seq')``: sequences cross token shards; values, gradients, masks and
    metrics as the unsharded call's."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    evaluate = functools.partial(
        mc.evaluate_all, losses=KPOP_MESH_LOSSES, corrections=KPOP_MESH_CORRECTIONS
    )
    devices = jax.devices("cpu")[:8]
    mesh = jax.make_mesh((2, 4), ("data", "seq"), devices=devices)
    spec = P("data", "seq")
    # row_mean averages over every row slot and sequence_sum_norm (unscaled) divides by
    # the padded length, both by definition (as verl): those cases are compared with the
    # unsharded call on the padded batch, the others with the unpadded one.
    by_padding = {
        k: v
        for k, v in KPOP_MESH_LOSSES.items()
        if v[0].aggregation == "row_mean"
        or (v[0].aggregation == "sequence_sum_norm" and v[0].loss_scale_factor is None)
    }
    reference = mc.cpu_reference(
        functools.partial(
            mc.evaluate_all,
            losses={k: v for k, v in KPOP_MESH_LOSSES.items() if k not in by_padding},
            corrections=KPOP_MESH_CORRECTIONS,
        )
    )
    cpu = jax.devices("cpu")[0]
    on_cpu = {k: jax.device_put(v, cpu) for k, v in mc.padded_for(mesh, spec).items()}
    padded_evaluate = functools.partial(mc.evaluate_all, losses=by_padding, corrections={})
    padded_reference = mc.to_numpy(jax.jit(padded_evaluate)(on_cpu))
    with jax.set_mesh(mesh):
        padded = mc.padded_for(mesh, spec)
        specs = mc.input_specs(spec, padded)
        arrays = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in padded.items()}
        if path == "jit":
            out = jax.jit(evaluate)(arrays)
        else:
            axes = opj.MeshAxes(batch="data", token="seq")
            out_specs = mc.output_specs(jax.eval_shape(evaluate, arrays), spec)
            out = jax.jit(
                jax.shard_map(
                    functools.partial(evaluate, axis_names=axes),
                    mesh=mesh,
                    in_specs=(specs,),
                    out_specs=out_specs,
                )
            )(arrays)
    out = mc.to_numpy(out)
    padded_keys = {f"loss/{k}" for k in by_padding}
    failures = mc.compare({k: v for k, v in out.items() if k not in padded_keys}, reference)
    failures += mc.compare(
        {k: v for k, v in out.items() if k in padded_keys},
        padded_reference,
        real_shape=on_cpu["mask"].shape,
    )
    assert set(out) == set(reference) | padded_keys
    assert not failures, "\n".join(failures)
    reference |= padded_reference
    for name in KPOP_MESH_LOSSES:  # not vacuous
        metrics = reference[f"loss/{name}"]["metrics"]
        assert 0 < float(metrics["is_masked"]) < 1, name
    for name in KPOP_MESH_CORRECTIONS:
        fraction = reference[f"correction/{name}/token"]["metrics"][
            "mis_rs_areal_filtered_fraction"
        ]
        assert 0 < float(fraction) < 1, name
