"""DPPO's top-k trust region (TRL ``divergence_type="topk_tv" | "topk_kl"``): the divergence
against a float64 NumPy reference and a port of TRL's code, the gather of the trainer's
log-probs on the engine's ids, the loss through ``policy_loss`` (jit / vmap / grad,
packed == padded, sharded == unsharded, empty batches), the ``mis_topk_*`` metrics and
the errors that name their argument."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import topk_reference as ref

import offpolicy_jax as opj
from offpolicy_jax._src.correction.topk_divergence import topk_divergence
from offpolicy_jax._src.losses import policy_losses as pl

RTOL, ATOL = 2e-5, 1e-6
LENGTHS = (8, 5, 1, 0, 6, 3)
NEAR_ONE = 1e-7  # a probability within 1e-7 of 1 (and the rest within 1e-7 of 0)


def _peaked_row(rng, vocab: int) -> np.ndarray:
    """Logits whose top token has probability ``1 − 1e-7`` (the others share ``1e-7``)."""
    top = int(rng.integers(0, vocab))
    row = np.zeros(vocab)
    row[top] = np.log((1 - NEAR_ONE) / NEAR_ONE * (vocab - 1))
    return row


def topk_batch(seed: int, *, k: int = 4, vocab: int = 16, spread: float = 0.5, garbage=True):
    """A ragged ``[6, 8]`` batch (an empty row) with the engine's top-k support built as
    TRL does, peaked positions (probabilities within 1e-7 of 0 and 1) and NaN / out-of-
    vocabulary garbage at the padded positions."""
    rng = np.random.default_rng(seed)
    b, t = len(LENGTHS), max(LENGTHS)
    valid = np.arange(t)[None, :] < np.array(LENGTHS)[:, None]
    engine = rng.normal(scale=2.0, size=(b, t, vocab))
    peaked = rng.random((b, t)) < 0.25
    for i, j in zip(*np.nonzero(peaked), strict=True):
        engine[i, j] = _peaked_row(rng, vocab)
    trainer = engine + rng.normal(scale=spread, size=engine.shape)
    trainer[peaked] = engine[peaked] + rng.normal(scale=0.01, size=(peaked.sum(), vocab))
    engine_lp, trainer_lp = ref.log_softmax(engine), ref.log_softmax(trainer)
    sampled = np.stack(
        [[rng.choice(vocab, p=np.exp(engine_lp[i, j])) for j in range(t)] for i in range(b)]
    )
    ids, rollout_topk = ref.trl_support(engine, sampled, k)
    out = {
        "ids": ids.astype(np.int32),
        "rollout_topk": rollout_topk.astype(np.float32),
        "topk": ref.gather(trainer_lp, ids).astype(np.float32),
        "logp": ref.gather(trainer_lp, sampled[..., None])[..., 0].astype(np.float32),
        "rollout": ref.gather(engine_lp, sampled[..., None])[..., 0].astype(np.float32),
        "adv": rng.normal(size=b).astype(np.float32),
        "valid": valid,
        "trainer_logits": trainer.astype(np.float32),
        "sampled": sampled.astype(np.int32),
    }
    if garbage:
        pad = ~valid
        for key in ("rollout_topk", "topk"):
            out[key] = np.where(pad[..., None], np.nan, out[key]).astype(np.float32)
        for key in ("logp", "rollout"):
            out[key] = np.where(pad, np.nan, out[key]).astype(np.float32)
        out["ids"] = np.where(pad[..., None], -1, out["ids"]).astype(np.int32)
    return out


def _topk(data) -> opj.TopKLogprobs:
    return opj.TopKLogprobs(data["ids"], data["rollout_topk"], data["topk"])


def _config(kind: str, k: int = 4, **extra) -> opj.LossConfig:
    extra.setdefault("algorithm", "bypass_ppo")
    extra.setdefault("aggregation", "token_mean")
    return opj.LossConfig(
        policy_loss=f"dppo_{kind}", divergence_type=f"topk_{kind}", divergence_topk=k, **extra
    )


# --------------------------------------------------------------------------- divergence


@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_divergence_matches_the_numpy_reference(kind, seed):
    data = topk_batch(seed)
    got = topk_divergence(data["topk"], data["rollout_topk"], data["valid"], divergence=kind)
    want = ref.divergence(data["topk"], data["rollout_topk"], data["valid"], kind)
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    assert np.all(np.asarray(got)[~data["valid"]] == 0.0)
    assert np.all(np.asarray(got) >= 0.0)


@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_divergence_equals_trls_code(kind, seed):
    data = topk_batch(seed, garbage=False)
    got = np.asarray(topk_divergence(data["topk"], data["rollout_topk"], divergence=kind))
    want = ref.trl_divergence(data["topk"], data["rollout_topk"], kind)
    # TRL leaves float32 rounding below 0 as it is; the library clamps a KL at 0.
    np.testing.assert_allclose(got, np.maximum(want, 0.0), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("k", [1, 3, 5, 7, 12, 20, 23])
def test_divergence_matches_the_numpy_reference_for_any_k(k):
    # K = 20 (TRL's default) is reduced in 4 lanes of 5 ids, 12 in 4 of 3, 7 in 7 of 1,
    # a prime K above 8 in one lane: each within the tolerance of the float64 reference.
    data = topk_batch(k, k=k, vocab=32)
    for kind in ("tv", "kl"):
        got = topk_divergence(data["topk"], data["rollout_topk"], data["valid"], divergence=kind)
        want = ref.divergence(data["topk"], data["rollout_topk"], data["valid"], kind)
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=kind)


def _reductions(jaxpr) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(operand shape, reduced axes)`` of every reduction in ``jaxpr`` and its sub-jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("reduce"):
            axes = eqn.params.get("axes", eqn.params.get("dimensions"))
            found.append((eqn.invars[0].aval.shape, tuple(axes)))
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr
                if hasattr(inner, "eqns"):
                    found += _reductions(inner)
    return found


def test_the_sums_over_k_are_one_reduction_of_a_major_axis():
    # On XLA:CPU a reduction of the minor axis runs element by element, exponentials
    # included (about three times slower at K = 20): the K ids are reduced as [K/L, L]
    # over the major axis, the L partials added elementwise, nothing reduced again.
    x = jnp.zeros((2, 3, 20))
    kl = functools.partial(topk_divergence, divergence="kl")
    found = _reductions(jax.make_jaxpr(kl)(x, x, jnp.ones((2, 3), bool)).jaxpr)
    assert found == [((2, 3, 5, 4), (2,))], found


def test_divergence_limits_are_finite_and_exact():
    # An id the engine gives probability 0 adds 0 (TRL: 0 * inf = NaN); equal
    # distributions give exactly 0; disjoint mass gives TV = 1.
    rollout = jnp.log(jnp.array([[[0.5, 0.5, 0.0]]]))
    same = topk_divergence(rollout, rollout, divergence="kl")
    assert float(same[0, 0]) == 0.0
    half = jnp.log(jnp.array([[[0.25, 0.25, 0.5]]]))
    kl = topk_divergence(half, rollout, divergence="kl")
    np.testing.assert_allclose(kl, [[np.log(2.0)]], rtol=1e-6)
    tv = topk_divergence(
        jnp.log(jnp.array([[[1.0, 0.0]]])), jnp.log(jnp.array([[[0.0, 1.0]]])), divergence="tv"
    )
    np.testing.assert_allclose(tv, [[1.0]], rtol=1e-6)


def test_divergence_gradient_is_finite_with_nan_padding():
    data = topk_batch(3)

    def total(lp):
        return jnp.sum(topk_divergence(lp, data["rollout_topk"], data["valid"], divergence="kl"))

    grad = np.asarray(jax.grad(total)(jnp.asarray(data["topk"])))
    assert np.all(np.isfinite(grad))
    assert np.all(grad[~data["valid"]] == 0.0)


# --------------------------------------------------------------------------- gather


@pytest.mark.parametrize("chunk", [None, 5, 16, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_topk_logprobs_matches_numpy(chunk, temperature):
    data = topk_batch(4)
    valid = data["valid"]
    got = opj.topk_logprobs(
        data["trainer_logits"],
        data["ids"],
        temperature=temperature,
        mask=valid,
        vocab_chunk_size=chunk,
    )
    want = ref.gather(
        ref.log_softmax(data["trainer_logits"] / temperature),
        np.where(valid[..., None], data["ids"], 0),
    )
    want = np.where(valid[..., None], want, 0.0)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=2e-6)


def test_topk_logprobs_bf16_chunked_equals_unchunked_and_differentiates():
    data = topk_batch(5)
    logits = jnp.asarray(data["trainer_logits"], jnp.bfloat16)
    ids, valid = data["ids"], data["valid"]
    whole = opj.topk_logprobs(logits, ids, mask=valid)
    chunked = opj.topk_logprobs(logits, ids, mask=valid, vocab_chunk_size=3)
    np.testing.assert_allclose(whole, chunked, rtol=1e-5, atol=1e-5)

    def f(x, chunk):
        return jnp.sum(opj.topk_logprobs(x, ids, mask=valid, vocab_chunk_size=chunk))

    x = jnp.asarray(data["trainer_logits"])
    g1, g2 = jax.grad(f)(x, None), jax.grad(functools.partial(f, chunk=3))(x)
    np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(g1)[~valid] == 0.0)


# --------------------------------------------------------------------------- the loss


def _margin_thresholds(div, valid, positive_gap):
    """A threshold no valid divergence is within 1e-5 of (the float32 boundary
    would otherwise decide ties differently from float64)."""
    values = np.sort(np.asarray(div)[valid])
    for q in (0.5, 0.4, 0.6, 0.3, 0.7):
        delta = float(np.quantile(values, q)) + positive_gap
        if np.min(np.abs(values - delta)) > 1e-5:
            return delta
    raise AssertionError("no threshold away from every divergence")


@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_and_gradient_equal_trls_dppo(kind, seed):
    data = topk_batch(seed)
    valid = data["valid"]
    div = ref.divergence(data["topk"], data["rollout_topk"], valid, kind)
    low = _margin_thresholds(div, valid, 1e-4)
    high = _margin_thresholds(div, valid, 3e-3)
    cfg = _config(
        kind, clip_eps=low, clip_eps_high=high, dppo_ratio_cap=3.0, metric_reduction="token"
    )

    def loss_fn(lp):
        return opj.policy_loss(lp, None, data["rollout"], data["adv"], valid, cfg, topk=_topk(data))

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(data["logp"]))
    trl_div = ref.trl_divergence(
        np.where(valid[..., None], data["topk"], 0.0),
        np.where(valid[..., None], data["rollout_topk"], 0.0),
        kind,
    )
    want, want_grad, keep = ref.trl_loss(
        data["logp"],
        data["rollout"],
        data["adv"][:, None],
        valid,
        trl_div,
        eps_low=low,
        eps_high=high,
        clip_ratio_c=3.0,
    )
    np.testing.assert_allclose(loss, want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, want_grad, rtol=RTOL, atol=ATOL)
    masked = (keep == 0) & valid
    assert 0 < masked.sum() < valid.sum(), "the case must mask some tokens, not all"
    np.testing.assert_allclose(metrics["pg_clipfrac"], masked.sum() / valid.sum(), rtol=1e-6)


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_topk_core_matches_the_loss_path(kind):
    data = topk_batch(6)
    valid = jnp.asarray(data["valid"])
    terms = pl.dppo_topk(
        jnp.asarray(data["logp"]),
        data["rollout"],
        jnp.asarray(data["adv"])[:, None],
        valid,
        data["topk"],
        data["rollout_topk"],
        divergence=kind,
        clip_eps=0.05,
        clip_eps_high=0.08,
        ratio_cap=20.0,
    )
    loss = np.asarray(terms.loss)
    assert np.all(np.isfinite(loss)) and np.all(loss[~data["valid"]] == 0.0)


@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_jit_vmap_and_grad_are_finite_and_agree(kind):
    data = topk_batch(7)
    cfg = _config(kind, clip_eps=0.05, clip_eps_high=0.05)

    def loss_fn(lp, rollout, adv, valid, ids, rtk, tk):
        topk = opj.TopKLogprobs(ids, rtk, tk)
        return opj.policy_loss(lp, None, rollout, adv, valid, cfg, topk=topk)[0]

    args = (
        data["logp"],
        data["rollout"],
        data["adv"],
        data["valid"],
        data["ids"],
        data["rollout_topk"],
        data["topk"],
    )
    eager = loss_fn(*args)
    jitted = jax.jit(loss_fn)(*args)
    np.testing.assert_allclose(jitted, eager, rtol=1e-6)
    grad = np.asarray(jax.jit(jax.grad(loss_fn))(*args))
    assert np.all(np.isfinite(grad)) and np.all(grad[~data["valid"]] == 0.0)
    # vmap over a leading axis of two copies of the batch: each its own loss.
    stacked = [np.stack([a, a]) for a in args]
    batched = jax.vmap(loss_fn)(*stacked)
    np.testing.assert_allclose(batched, [eager, eager], rtol=1e-6)


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_all_masked_batch_gives_zero_loss_and_zero_gradient(kind):
    data = topk_batch(8)
    none = np.zeros_like(data["valid"])
    cfg = _config(kind)

    def loss_fn(lp):
        return opj.policy_loss(lp, None, data["rollout"], data["adv"], none, cfg, topk=_topk(data))

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(data["logp"]))
    assert float(loss) == 0.0
    assert not np.any(np.asarray(grad))
    assert float(metrics["mis_topk_tv"]) == 0.0 and float(metrics["mis_topk_kl"]) == 0.0


def _pack(data, rows):
    """Two sequences per row (segments 1 and 2) of the padded batch: per-token arrays
    ``[rows, T]`` / ``[rows, T, K]``, and each padded token's packed position."""
    t = max(LENGTHS)
    width = 2 * t
    seg = np.zeros((rows, width), np.int32)
    where = {}
    for r in range(rows):
        start = 0
        for s in range(2):
            i = 2 * r + s
            n = LENGTHS[i]
            seg[r, start : start + n] = s + 1
            for j in range(n):
                where[(i, j)] = (r, start + j)
            start += n
    packed = {}
    for key in ("logp", "rollout", "ids", "rollout_topk", "topk"):
        x = data[key]
        fill = 0 if key == "ids" else np.nan
        out = np.full((rows, width) + x.shape[2:], fill, x.dtype)
        for (i, j), (r, c) in where.items():
            out[r, c] = x[i, j]
        packed[key] = out
    adv = np.zeros((rows, width), np.float32)
    for (i, _j), (r, c) in where.items():
        adv[r, c] = data["adv"][i]
    packed["adv"] = adv
    packed["valid"] = seg > 0
    packed["segment_ids"] = seg
    return packed, where


@pytest.mark.parametrize(
    ("kind", "aggregation"),
    [
        ("tv", "token_mean"),
        ("kl", "sequence_mean"),
        # the other two combinations only in the whole suite (each value runs above)
        pytest.param("tv", "sequence_mean", marks=pytest.mark.slow),
        pytest.param("kl", "token_mean", marks=pytest.mark.slow),
    ],
)
def test_packed_equals_padded(kind, aggregation):
    data = topk_batch(9)
    cfg = _config(kind, clip_eps=0.05, clip_eps_high=0.08, aggregation=aggregation)

    def padded(lp):
        return opj.policy_loss(
            lp,
            None,
            data["rollout"],
            data["adv"][:, None] + 0 * lp,
            data["valid"],
            cfg,
            topk=_topk(data),
        )

    packed, where = _pack(data, len(LENGTHS) // 2)

    def packed_fn(lp):
        return opj.policy_loss(
            lp,
            None,
            packed["rollout"],
            packed["adv"],
            packed["valid"],
            cfg,
            topk=_topk(packed),
            segment_ids=packed["segment_ids"],
            num_segments=2,
        )

    (want, want_m), want_g = jax.value_and_grad(padded, has_aux=True)(jnp.asarray(data["logp"]))
    (got, got_m), got_g = jax.value_and_grad(packed_fn, has_aux=True)(jnp.asarray(packed["logp"]))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    for key in ("mis_topk_tv", "mis_topk_kl", "pg_clipfrac"):
        np.testing.assert_allclose(got_m[key], want_m[key], rtol=RTOL, atol=ATOL, err_msg=key)
    got_g, want_g = np.asarray(got_g), np.asarray(want_g)
    for (i, j), (r, c) in where.items():
        np.testing.assert_allclose(got_g[r, c], want_g[i, j], rtol=RTOL, atol=ATOL)


@pytest.mark.multi_device
@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_sharded_equals_unsharded(kind):
    from jax.sharding import PartitionSpec as P

    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    data = topk_batch(10)
    data = {k: (v[:4] if np.ndim(v) else v) for k, v in data.items()}  # 4 rows, T = 8
    cfg = _config(kind, clip_eps=0.05, clip_eps_high=0.08, aggregation="sequence_mean")
    keys = ("logp", "rollout", "adv", "valid", "ids", "rollout_topk", "topk")

    def loss_fn(lp, rollout, adv, valid, ids, rtk, tk, axis_names=None):
        topk = opj.TopKLogprobs(ids, rtk, tk)
        loss, metrics = opj.policy_loss(
            lp, None, rollout, adv[:, None] + 0 * lp, valid, cfg, topk=topk, axis_names=axis_names
        )
        return loss, (metrics["mis_topk_tv"], metrics["mis_topk_kl"])

    args = tuple(data[k] for k in keys)
    (want, want_m), want_g = jax.value_and_grad(loss_fn, has_aux=True)(*args)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "seq"))
    token, row = P("data", "seq"), P("data")
    specs = (
        token,
        token,
        row,
        token,
        P("data", "seq", None),
        P("data", "seq", None),
        P("data", "seq", None),
    )
    sharded = jax.shard_map(
        functools.partial(loss_fn, axis_names=opj.MeshAxes(batch="data", token="seq")),
        mesh=mesh,
        in_specs=specs,
        out_specs=(P(), (P(), P())),
    )
    (got, got_m), got_g = jax.jit(jax.value_and_grad(sharded, has_aux=True))(*args)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got_m, want_m, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got_g, want_g, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("reduction", ["token", "sequence"])
def test_metrics_match_numpy_and_pool_over_micro_batches(reduction):
    data = topk_batch(11)
    valid = data["valid"]
    cfg = opj.LossConfig(algorithm="bypass_ppo", metric_reduction=reduction)

    def metrics_of(rows):
        part = {k: (v[rows] if np.ndim(v) else v) for k, v in data.items()}
        return opj.policy_loss_parts(
            part["logp"],
            None,
            part["rollout"],
            part["adv"],
            part["valid"],
            cfg,
            topk=_topk(part),
        )[1]

    full = opj.finalize_metrics(metrics_of(slice(None)))
    pooled = opj.finalize_metrics(
        opj.pool_metric_parts(metrics_of(slice(0, 3)), metrics_of(slice(3, None)))
    )
    for name, kind in (("mis_topk_tv", "tv"), ("mis_topk_kl", "kl")):
        per_token = ref.divergence(data["topk"], data["rollout_topk"], valid, kind)
        if reduction == "token":
            want = per_token[valid].mean()
        else:
            rows = valid.any(-1)
            want = (per_token.sum(-1)[rows] / valid.sum(-1)[rows]).mean()
        np.testing.assert_allclose(full[name], want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(pooled[name], want, rtol=RTOL, atol=ATOL)


def test_metrics_only_with_topk_and_binary_loss_unchanged():
    data = topk_batch(12)
    cfg = opj.LossConfig(algorithm="bypass_ppo", policy_loss="dppo_tv")
    args = (data["logp"], None, data["rollout"], data["adv"], data["valid"], cfg)
    plain_loss, plain = opj.policy_loss(*args)
    with_loss, with_topk = opj.policy_loss(*args, topk=_topk(data))
    assert not any("topk" in k for k in plain)
    assert set(with_topk) - set(plain) == {"mis_topk_tv", "mis_topk_kl"}
    assert float(plain_loss) == float(with_loss)


# --------------------------------------------------------------------------- errors


def _call(data, cfg, topk):
    return opj.policy_loss(
        data["logp"], None, data["rollout"], data["adv"], data["valid"], cfg, topk=topk
    )


def test_errors_name_the_argument():
    data = topk_batch(13)
    cfg = _config("tv")
    with pytest.raises(ValueError, match="needs topk=TopKLogprobs"):
        _call(data, cfg, None)
    with pytest.raises(ValueError, match="topk.logp has shape"):
        _call(data, cfg, opj.TopKLogprobs(data["ids"], data["rollout_topk"], data["topk"][..., :3]))
    with pytest.raises(ValueError, match="topk.rollout_logp has shape"):
        _call(data, cfg, opj.TopKLogprobs(data["ids"], data["rollout_topk"][:, :4], data["topk"]))
    with pytest.raises(ValueError, match=r"ids has shape"):
        _call(data, cfg, opj.TopKLogprobs(data["ids"][:, :, 0], data["rollout_topk"], data["topk"]))
    with pytest.raises(TypeError, match="ids must be an integer array"):
        _call(data, cfg, opj.TopKLogprobs(data["topk"], data["rollout_topk"], data["topk"]))
    with pytest.raises(ValueError, match="topk.logp is required"):
        _call(data, cfg, opj.TopKLogprobs(data["ids"], data["rollout_topk"]))
    with pytest.raises(ValueError, match="divergence_topk is 5"):
        _call(data, _config("tv", k=5), _topk(data))
    with pytest.raises(TypeError, match="topk must be an offpolicy_jax.TopKLogprobs"):
        _call(data, cfg, (data["ids"], data["rollout_topk"], data["topk"]))


def test_topk_logprobs_errors_name_the_argument():
    data = topk_batch(14)
    logits, ids, valid = data["trainer_logits"], data["ids"], data["valid"]
    with pytest.raises(ValueError, match=r"ids holds a token id outside the vocabulary \[0, 16\)"):
        opj.topk_logprobs(logits, np.where(valid[..., None], 16, ids))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        opj.topk_logprobs(logits, ids)  # -1 at padded positions, no mask
    with pytest.raises(ValueError, match="ids has shape"):
        opj.topk_logprobs(logits, ids[:, :3], mask=valid)
    with pytest.raises(ValueError, match="mask has shape"):
        opj.topk_logprobs(logits, ids, mask=valid[:, :3])
    with pytest.raises(ValueError, match="vocab_chunk_size"):
        opj.topk_logprobs(logits, ids, mask=valid, vocab_chunk_size=0)
    # Under jit an out-of-vocabulary id cannot be refused: NaN at its entries.
    bad = np.where(valid[..., None], ids, 99)
    out = jax.jit(opj.topk_logprobs)(logits, bad)
    assert np.all(np.isnan(np.asarray(out)[~valid]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(policy_loss="dppo_tv", divergence_type="topk_kl"),
            "a divergence of policy_loss 'dppo_kl'",
        ),
        (dict(policy_loss="dppo_kl", divergence_type="topk"), "did you mean 'topk_kl'"),
        (dict(policy_loss="dppo_kl", divergence_topk=0), "divergence_topk must be an int >= 1"),
        (dict(policy_loss="dppo_kl", divergence_topk=2.5), "divergence_topk must be an int >= 1"),
        (dict(policy_loss="ppo_clip", divergence_type="topk_tv"), "hyperparameter of policy_loss"),
    ],
)
def test_config_errors_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        opj.LossConfig(**kwargs)


def test_config_defaults_follow_trl():
    assert opj.LossConfig(policy_loss="dppo_tv").divergence_type == "binary_tv"
    assert opj.LossConfig(policy_loss="dppo_kl").divergence_type == "binary_kl"
    assert opj.LossConfig(policy_loss="dppo_kl").divergence_topk == 20
    assert opj.LossConfig(policy_loss="ppo_clip").divergence_type is None


# --------------------------------------------------------------------------- diagnose


def _topk_dump(tmp_path, data, name="d.npz", **extra):
    path = tmp_path / name
    arrays = dict(
        old_logp=data["logp"],
        rollout_logp=data["rollout"],
        mask=data["valid"],
        topk_ids=data["ids"],
        topk_old_logp=data["topk"],
        topk_rollout_logp=data["rollout_topk"],
    )
    np.savez(path, **(arrays | extra))
    return path


@pytest.mark.parametrize("reduction", ["sequence", "token"])
@pytest.mark.heavy
def test_diagnose_reports_the_topk_divergence_of_a_dump(tmp_path, reduction):
    pytest.importorskip("matplotlib")
    from offpolicy_jax.diagnose import diagnose

    data = topk_batch(15)
    path = _topk_dump(tmp_path, data)
    report = diagnose(str(path), tmp_path / "out", reduction=reduction, chunk_rows=2)
    got = report["topk_divergence"]
    cfg = opj.LossConfig(algorithm="bypass_ppo", metric_reduction=reduction)
    _, want = opj.policy_loss(
        data["logp"], None, data["rollout"], data["adv"], data["valid"], cfg, topk=_topk(data)
    )
    for key in ("mis_topk_tv", "mis_topk_kl"):
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=ATOL, err_msg=key)
    valid = data["valid"]
    tv = ref.divergence(data["topk"], data["rollout_topk"], valid, "tv")
    np.testing.assert_allclose(got["topk_tv_above"], (tv[valid] > 0.15).mean(), rtol=1e-6)
    assert got["topk_k"] == 4 and got["topk_tokens"] == valid.sum()
    text = (tmp_path / "out" / "report.md").read_text()
    assert "## Top-k divergence" in text and "`mis_topk_kl`" in text
    # A dump without top-k log-probs reports none.
    plain = tmp_path / "plain.npz"
    np.savez(plain, old_logp=data["logp"], rollout_logp=data["rollout"], mask=data["valid"])
    assert "topk_divergence" not in diagnose(str(plain))


@pytest.mark.heavy
def test_diagnose_packed_topk_dump_equals_padded(tmp_path):
    from offpolicy_jax.diagnose import diagnose

    data = topk_batch(16)
    packed, _ = _pack(data, len(LENGTHS) // 2)
    path = tmp_path / "packed.npz"
    np.savez(
        path,
        old_logp=packed["logp"],
        rollout_logp=packed["rollout"],
        mask=packed["valid"],
        segment_ids=packed["segment_ids"],
        topk_old_logp=packed["topk"],
        topk_rollout_logp=packed["rollout_topk"],
    )
    got = diagnose(str(path))["topk_divergence"]
    want = diagnose(str(_topk_dump(tmp_path, data)))["topk_divergence"]
    for key in ("mis_topk_tv", "mis_topk_kl", "topk_tv_above", "topk_kl_above"):
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=ATOL, err_msg=key)


def test_diagnose_topk_dump_errors_name_the_field(tmp_path):
    from offpolicy_jax.diagnose import DiagnoseError, diagnose

    data = topk_batch(17)
    half = tmp_path / "half.npz"
    np.savez(
        half,
        old_logp=data["logp"],
        rollout_logp=data["rollout"],
        mask=data["valid"],
        topk_old_logp=data["topk"],
    )
    with pytest.raises(DiagnoseError, match="'topk_old_logp' needs 'topk_rollout_logp'"):
        diagnose(str(half))
    bad = _topk_dump(tmp_path, data, "bad.npz", topk_rollout_logp=data["rollout_topk"][:, :3])
    with pytest.raises(DiagnoseError, match="'topk_rollout_logp' has shape"):
        diagnose(str(bad))
    ids = _topk_dump(tmp_path, data, "ids.npz", topk_ids=data["ids"][..., :2])
    with pytest.raises(DiagnoseError, match="'topk_ids' has shape"):
        diagnose(str(ids))
