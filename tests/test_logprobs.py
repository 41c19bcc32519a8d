"""token_logprobs and token_logprobs_from_hidden against independent references.

* ``token_logprobs`` against a NumPy float64 reference that decides the top-k /
  top-p support token by token from its definition (keep ``i`` iff ``z_i >=`` the
  k-th largest ``z``, then iff the renormalised mass of tokens strictly more probable
  than ``i`` is ``< p``), with logits on a coarse grid so that ties at both
  boundaries are common.
* ``token_logprobs_from_hidden`` (values, entropy and gradients w.r.t. hidden and
  unembedding) against ``jax.nn.log_softmax(hidden @ W / τ)`` on float32 upcasts,
  over shapes, dtypes and chunk sizes that do not divide ``N`` or ``V``, with masked
  positions holding garbage token ids.
* Sharded == unsharded on the 8 virtual CPU devices (vocabulary axis split via
  ``shard_map`` + ``axis_name`` and via ``jit`` over sharded inputs, token axis
  split), and the compiled HLO of the vocabulary-parallel version moves only
  per-token values (plus the ``[N, D]`` hidden-state gradient of the backward).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import mesh_cases as mc
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import offpolicy_jax as opj

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


# ----------------------------------------------------------------- NumPy reference


def np_token_logprobs(logits, tokens, temperature=1.0, top_k=None, top_p=None):
    """float64 (logp, entropy, support, mass-above) row by row, from the definitions."""
    z_all = np.asarray(logits, np.float64) / np.asarray(temperature, np.float64)[..., None]
    vocab = z_all.shape[-1]
    lead = z_all.shape[:-1]
    logp = np.empty(lead)
    entropy = np.empty(lead)
    support = np.zeros(z_all.shape, bool)
    margin = np.full(lead, np.inf)  # distance of top-p decisions from p
    for idx in np.ndindex(*lead):
        z = z_all[idx]
        keep = np.ones(vocab, bool)
        if top_k is not None:
            kth = np.sort(z)[::-1][min(top_k, vocab) - 1]
            keep &= z >= kth
        if top_p is not None and top_p < 1.0:
            q = np.where(keep, np.exp(z - z[keep].max()), 0.0)
            q /= q.sum()
            above = np.array([q[z > z[i]].sum() for i in range(vocab)])
            keep &= above < top_p
            margin[idx] = np.min(np.abs(above - top_p))
        zk = np.where(keep, z, -np.inf)
        lse = np.log(np.sum(np.exp(zk[keep] - zk.max()))) + zk.max()
        prob = np.where(keep, np.exp(zk - lse), 0.0)
        entropy[idx] = -np.sum(prob * (np.where(keep, zk, 0.0) - lse))
        tok = tokens[idx]
        logp[idx] = (zk[tok] - lse) if 0 <= tok < vocab else np.nan
        support[idx] = keep
    return logp, entropy, support, margin


def jax_reference(hidden, w, tokens, temperature=1.0):
    """log_softmax(hidden @ W / τ)[tokens] and the entropy, float32 throughout."""
    z = jnp.matmul(
        hidden.astype(jnp.float32), w.astype(jnp.float32), precision="highest"
    ) / jnp.float32(temperature)
    logsm = jax.nn.log_softmax(z, axis=-1)
    safe = jnp.clip(tokens, 0, w.shape[1] - 1)
    logp = jnp.take_along_axis(logsm, safe[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logsm) * logsm, axis=-1)
    return logp, entropy


# ------------------------------------------------------------------ token_logprobs


@st.composite
def logits_cases(draw):
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    length = draw(st.integers(1, 5))
    vocab = draw(st.integers(1, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    # A coarse grid (multiples of 1/2, exact in bf16/fp16): many ties at the boundary.
    logits = rng.integers(-4, 5, size=lead + (length, vocab)) / 2.0
    tokens = rng.integers(0, vocab, size=lead + (length,))
    dtype = draw(st.sampled_from(list(DTYPES)))
    temperature = draw(st.sampled_from([1.0, 0.7, 1.5]))
    top_k = draw(st.none() | st.integers(1, vocab + 2))
    top_p = draw(st.none() | st.sampled_from([0.05, 0.3, 0.5, 0.77, 0.9, 0.999, 1.0]))
    return logits, tokens, dtype, temperature, top_k, top_p


@pytest.mark.slow
@given(logits_cases())
def test_token_logprobs_match_float64_reference(case):
    logits, tokens, dtype, temperature, top_k, top_p = case
    want_logp, want_ent, support, margin = np_token_logprobs(
        logits, tokens, temperature, top_k, top_p
    )
    # A cumulative mass within float32 rounding of p is decided by the rounding.
    assume(np.all(margin > 1e-5))
    logp, ent = jax.jit(
        functools.partial(
            opj.token_logprobs,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            return_entropy=True,
        )
    )(jnp.asarray(logits, DTYPES[dtype]), jnp.asarray(tokens))
    assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logp), want_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), want_ent, rtol=1e-5, atol=1e-5)
    assert not np.any(np.isnan(np.asarray(logp)))
    # Outside the support: exactly -inf.
    inside = np.take_along_axis(support, tokens[..., None], -1)[..., 0]
    assert np.all(np.isneginf(np.asarray(logp)[~inside]))

    # Gradient w.r.t. the logits, where the token is in the support:
    # d logp / d logits = (onehot - q) / τ on the support, 0 elsewhere.
    cot = np.random.default_rng(1).normal(size=tokens.shape)
    cot = np.where(inside, cot, 0.0)

    def f(x):
        lp = opj.token_logprobs(x, tokens, temperature=temperature, top_k=top_k, top_p=top_p)
        return jnp.sum(jnp.where(inside, lp, 0.0) * cot)

    grad = jax.jit(jax.grad(f))(jnp.asarray(logits, jnp.float32))
    z = logits / temperature
    # log-sum-exp over the support, recovered from the reference: z_y - log π(y).
    lse = np.take_along_axis(z, tokens[..., None], -1)[..., 0] - want_logp
    lse = np.where(inside, lse, 0.0)
    q = np.where(support, np.exp(z - lse[..., None]), 0.0)
    onehot = np.arange(z.shape[-1]) == tokens[..., None]
    want_grad = cot[..., None] * (onehot - q) / temperature
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-6)
    assert np.all(np.isfinite(np.asarray(grad)))


@pytest.mark.heavy
def test_tie_rules_at_the_boundary():
    """Ties at the k-th value are all kept; a tied group straddling p is kept whole."""
    logits = jnp.log(jnp.array([[[0.4, 0.2, 0.2, 0.1, 0.1]]]))
    tokens = jnp.arange(5).reshape(1, 1, 5)

    def support(**kw):
        lp = opj.token_logprobs(jnp.broadcast_to(logits, (1, 5, 5)), tokens[0], **kw)
        return np.isfinite(np.asarray(lp[0]))

    # k = 2 cuts the tied pair {1, 2}: both are kept.
    np.testing.assert_array_equal(support(top_k=2), [1, 1, 1, 0, 0])
    # p = 0.5: mass above token 1 (and 2) is 0.4 < 0.5, so the tied pair is kept whole,
    # although 0.4 + 0.2 already reaches 0.5.
    np.testing.assert_array_equal(support(top_p=0.5), [1, 1, 1, 0, 0])
    # p = 0.4: mass above the pair is 0.4, not < 0.4: only token 0.
    np.testing.assert_array_equal(support(top_p=0.4), [1, 0, 0, 0, 0])
    # top-p after top-k, on the renormalised distribution: top_k=1 leaves one token.
    np.testing.assert_array_equal(support(top_k=1, top_p=0.99), [1, 0, 0, 0, 0])
    lp = opj.token_logprobs(logits, jnp.array([[1]]), top_k=3)
    np.testing.assert_allclose(np.exp(np.asarray(lp)), [[0.25]], rtol=1e-6)


@pytest.mark.heavy
def test_per_sequence_sampler_parameters():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 4, 9))
    tokens = rng.integers(0, 9, size=(3, 4))
    temps, ks, ps = [0.6, 1.0, 1.3], [2, 9, 4], [0.9, 0.5, 1.0]
    got = opj.token_logprobs(
        jnp.asarray(logits, jnp.float32),
        jnp.asarray(tokens),
        temperature=jnp.asarray(temps)[:, None],
        top_k=jnp.asarray(ks)[:, None],
        top_p=jnp.asarray(ps)[:, None],
    )
    for b in range(3):
        want = np_token_logprobs(logits[b], tokens[b], temps[b], ks[b], ps[b])[0]
        np.testing.assert_allclose(np.asarray(got[b]), want, rtol=1e-5, atol=1e-5)


@pytest.mark.heavy
def test_out_of_range_ids_are_nan_and_the_correction_rejects_them():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 6, 10)), jnp.float32)
    tokens = np.asarray(rng.integers(0, 10, size=(4, 6)))
    tokens[1, 2] = 10  # == V
    tokens[2, 0] = -1
    mask = np.ones((4, 6), bool)
    mask[3, 4:] = False
    tokens[3, 5] = 123456  # masked garbage: no effect
    hidden = jnp.asarray(rng.normal(size=(4, 6, 3)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 10)), jnp.float32)
    for logp in (
        opj.token_logprobs(logits, tokens),
        opj.token_logprobs_from_hidden(hidden, w, tokens, chunk_size=5),
    ):
        assert np.isnan(np.asarray(logp)[1, 2]) and np.isnan(np.asarray(logp)[2, 0])
        rollout = jnp.where(jnp.isfinite(logp), logp, -1.0) - 0.01
        res = opj.compute_correction(logp, rollout, mask, opj.CorrectionConfig(use_tis=True))
        np.testing.assert_allclose(res.metrics["mis_nonfinite_seq_fraction"], 0.5)
        kept = np.asarray(res.mask).any(-1)
        np.testing.assert_array_equal(kept, [True, False, False, True])
    # Tokens outside the sampler's support (-inf) are rejected the same way.
    logp = opj.token_logprobs(logits, tokens % 10, top_k=1)
    res = opj.compute_correction(logp, logp, mask, opj.CorrectionConfig(use_tis=True))
    assert float(res.metrics["mis_nonfinite_seq_fraction"]) > 0


# ------------------------------------------------------- token_logprobs_from_hidden


@st.composite
def hidden_cases(draw):
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    length = draw(st.integers(1, 7))
    dim = draw(st.integers(1, 6))
    vocab = draw(st.integers(1, 23))
    n = int(np.prod(lead + (length,)))
    chunk = draw(st.integers(1, n + 3))
    vchunk = draw(st.none() | st.integers(1, vocab + 2))
    dtype = draw(st.sampled_from(list(DTYPES)))
    temperature = draw(st.sampled_from([1.0, 0.6, 1.4]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    hidden = rng.normal(size=lead + (length, dim))
    w = rng.normal(size=(dim, vocab))
    tokens = rng.integers(0, vocab, size=lead + (length,))
    mask = rng.random(lead + (length,)) > 0.3
    garbage = rng.choice(np.array([-1, vocab, vocab + 7, 2**30, -(2**30)]), size=tokens.shape)
    tokens = np.where(mask, tokens, garbage)
    cot = rng.normal(size=(2,) + lead + (length,))
    return hidden, w, tokens, mask, cot, chunk, vchunk, dtype, temperature


@pytest.mark.slow
@given(hidden_cases())
def test_from_hidden_values_and_gradients_match_log_softmax(case):
    hidden, w, tokens, mask, cot, chunk, vchunk, dtype, temperature = case
    h = jnp.asarray(hidden, DTYPES[dtype])
    w = jnp.asarray(w, DTYPES[dtype])

    def loss(fn, h, w):
        logp, ent = fn(h, w)
        logp = jnp.where(mask, logp, 0.0)  # garbage ids at masked positions
        return jnp.sum(logp * cot[0]) + jnp.sum(jnp.where(mask, ent, 0.0) * cot[1]), (logp, ent)

    mine = functools.partial(
        opj.token_logprobs_from_hidden,
        tokens=jnp.asarray(tokens),
        temperature=temperature,
        chunk_size=chunk,
        vocab_chunk_size=vchunk,
        return_entropy=True,
    )
    ref = functools.partial(jax_reference, tokens=jnp.asarray(tokens), temperature=temperature)
    (got, (lp, ent)), grads = jax.jit(
        jax.value_and_grad(lambda h, w: loss(mine, h, w), (0, 1), has_aux=True)
    )(h, w)
    (want, (want_lp, want_ent)), want_grads = jax.jit(
        jax.value_and_grad(lambda h, w: loss(ref, h, w), (0, 1), has_aux=True)
    )(h, w)
    assert lp.dtype == jnp.float32
    np.testing.assert_allclose(lp, want_lp, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(ent, want_ent, rtol=2e-5, atol=2e-5)
    for g, want_g in zip(grads, want_grads, strict=True):
        assert g.dtype == DTYPES[dtype]
        g, want_g = np.asarray(g, np.float32), np.asarray(want_g, np.float32)
        assert np.all(np.isfinite(g))
        # float32 math; bf16 / fp16 gradients are rounded to their dtype once.
        tol = 2e-5 if dtype == "float32" else float(jnp.finfo(DTYPES[dtype]).eps) * 2
        np.testing.assert_allclose(g, want_g, rtol=tol, atol=tol * max(1.0, np.abs(want_g).max()))


@pytest.mark.heavy
def test_from_hidden_forward_only_and_vmap():
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(3, 5, 4)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 9)), jnp.float32)
    tok = jnp.asarray(rng.integers(0, 9, size=(3, 5)))
    want = jax_reference(h, w, tok)[0]
    got = jax.jit(jax.vmap(lambda h, t: opj.token_logprobs_from_hidden(h, w, t, chunk_size=2)))(
        h, tok
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # from_hidden equals token_logprobs on the materialised logits.
    np.testing.assert_allclose(
        opj.token_logprobs(h @ w, tok), opj.token_logprobs_from_hidden(h, w, tok), atol=1e-5
    )


# ---------------------------------------------------------------------- validation


def _args():
    return jnp.zeros((2, 3, 5)), jnp.zeros((2, 3), jnp.int32)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        (dict(logits=jnp.zeros((5,))), ValueError, "logits"),
        (dict(tokens=jnp.zeros((2, 4), jnp.int32)), ValueError, "tokens"),
        (dict(tokens=jnp.zeros((2, 3))), TypeError, "tokens"),
        (dict(logits=jnp.zeros((2, 3, 5), jnp.int32)), TypeError, "logits"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(top_p=-0.2), ValueError, "top_p"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_k=2.0), TypeError, "top_k"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(temperature=jnp.ones((4,))), ValueError, "temperature"),
    ],
)
def test_token_logprobs_rejects_bad_input(kwargs, error, name):
    logits, tokens = _args()
    logits = kwargs.pop("logits", logits)
    tokens = kwargs.pop("tokens", tokens)
    with pytest.raises(error, match=name):
        opj.token_logprobs(logits, tokens, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        (dict(hidden=jnp.zeros((4,))), ValueError, "hidden"),
        (dict(hidden=jnp.zeros((2, 3, 4), jnp.int32)), TypeError, "hidden"),
        (dict(unembedding=jnp.zeros((5, 7))), ValueError, "unembedding"),
        (dict(unembedding=jnp.zeros((4, 7, 1))), ValueError, "unembedding"),
        (dict(unembedding=jnp.zeros((4, 7), jnp.int32)), TypeError, "unembedding"),
        (dict(tokens=jnp.zeros((2, 3), jnp.float32)), TypeError, "tokens"),
        (dict(tokens=jnp.zeros((3, 2), jnp.int32)), ValueError, "tokens"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(vocab_chunk_size=0), ValueError, "vocab_chunk_size"),
        (dict(top_k=5), NotImplementedError, "top_k"),
        (dict(top_p=0.9), NotImplementedError, "top_p"),
    ],
)
def test_from_hidden_rejects_bad_input(kwargs, error, name):
    args = dict(
        hidden=jnp.zeros((2, 3, 4)),
        unembedding=jnp.zeros((4, 7)),
        tokens=jnp.zeros((2, 3), jnp.int32),
    )
    for key in list(args):
        if key in kwargs:
            args[key] = kwargs.pop(key)
    with pytest.raises(error, match=name):
        opj.token_logprobs_from_hidden(
            args["hidden"], args["unembedding"], args["tokens"], **kwargs
        )


# -------------------------------------------------------------------------- meshes

B, T, D, V = 4, 12, 6, 40


def _data(seed=0):
    rng = np.random.default_rng(seed)
    mask = rng.random((B, T)) > 0.2
    tokens = np.where(mask, rng.integers(0, V, size=(B, T)), rng.integers(V, 2 * V, size=(B, T)))
    return dict(
        hidden=rng.normal(size=(B, T, D)).astype(np.float32),
        w=rng.normal(size=(D, V)).astype(np.float32),
        tokens=tokens.astype(np.int32),
        mask=mask,
        g=rng.normal(size=(2, B, T)).astype(np.float32),
    )


def _loss(hidden, w, tokens, mask, g, **kw):
    logp, ent = opj.token_logprobs_from_hidden(
        hidden, w, tokens, temperature=0.8, return_entropy=True, **kw
    )
    logp = jnp.where(mask, logp, 0.0)
    return jnp.sum(logp * g[0]) + jnp.sum(jnp.where(mask, ent, 0.0) * g[1]), (logp, ent)


def _unsharded(d):
    grad = jax.value_and_grad(_loss, (0, 1), has_aux=True)
    (loss, (logp, ent)), (dh, dw) = grad(d["hidden"], d["w"], d["tokens"], d["mask"], d["g"])
    return loss, logp, ent, dh, dw


def _assert_same(got, want):
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


def _mesh(shape, names, axis_type=AxisType.Explicit):
    return jax.make_mesh(
        shape, names, axis_types=(axis_type,) * len(names), devices=jax.devices("cpu")[:8]
    )


def _need_8_devices():
    if len(jax.devices("cpu")) < 8:
        pytest.skip("needs JAX_NUM_CPU_DEVICES=8 (tests/conftest.py)")


@pytest.mark.multi_device
@pytest.mark.slow
@pytest.mark.usefixtures("clear_jax_caches")
@pytest.mark.parametrize("vocab_chunk", [None, 3])
def test_vocab_sharded_shard_map_equals_unsharded(vocab_chunk):
    """Tensor-parallel unembedding inside shard_map (data 2 x vocab 4)."""
    _need_8_devices()
    d = _data()
    want = _unsharded(d)
    mesh = _mesh((2, 4), ("data", "vocab"))
    with jax.set_mesh(mesh):

        def step(hidden, w, tokens, mask, g):
            kw = dict(axis_name="vocab", chunk_size=5, vocab_chunk_size=vocab_chunk)
            grad = jax.value_and_grad(functools.partial(_loss, **kw), (0, 1), has_aux=True)
            (loss, (logp, ent)), (dh, dw) = grad(hidden, w, tokens, mask, g)
            return jax.lax.psum(loss, "data"), logp, ent, dh, dw

        specs = (P("data"), P(None, "vocab"), P("data"), P("data"), P(None, "data"))
        fn = jax.jit(
            jax.shard_map(
                step,
                mesh=mesh,
                in_specs=specs,
                out_specs=(P(), P("data"), P("data"), P("data"), P(None, "vocab")),
            )
        )
        args = [
            jax.device_put(d[k], NamedSharding(mesh, s))
            for k, s in zip(("hidden", "w", "tokens", "mask", "g"), specs, strict=True)
        ]
        _assert_same(fn(*args), want)


@pytest.mark.slow
@pytest.mark.usefixtures("clear_jax_caches")
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize(
    "layout",
    ["vocab", "batch_and_vocab", "tokens", "batch_and_tokens"],
)
@pytest.mark.multi_device
def test_jit_over_sharded_inputs_equals_unsharded(layout, axis_type):
    """Plain jit, the vocabulary of W and/or the batch / token axes of hidden sharded.

    On an Explicit mesh the function runs itself per shard (shard_map with the
    vocabulary axis as ``axis_name``); on an Auto mesh the XLA partitioner decides.
    """
    _need_8_devices()
    d = _data(1)
    want = _unsharded(d)
    shape, names, lead, vocab = {
        "vocab": ((8,), ("v",), (None, None), "v"),
        "batch_and_vocab": ((2, 4), ("b", "v"), ("b", None), "v"),
        "tokens": ((4,), ("t",), (None, "t"), None),
        "batch_and_tokens": ((2, 4), ("b", "t"), ("b", "t"), None),
    }[layout]
    mesh = _mesh(shape, names, axis_type)
    with jax.set_mesh(mesh):
        specs = dict(
            hidden=P(*lead, None),
            w=P(None, vocab),
            tokens=P(*lead),
            mask=P(*lead),
            g=P(None, *lead),
        )
        args = [jax.device_put(d[k], NamedSharding(mesh, specs[k])) for k in specs]
        fn = jax.jit(
            lambda *a: _unsharded(dict(zip(("hidden", "w", "tokens", "mask", "g"), a, strict=True)))
        )
        _assert_same(fn(*args), want)


@pytest.mark.multi_device
@pytest.mark.slow
@pytest.mark.usefixtures("clear_jax_caches")
def test_vocab_parallel_hlo_moves_only_per_token_values():
    """Collectives of the vocabulary-parallel program, read from the compiled HLO.

    Forward: every operand holds at most ``chunk`` values (the per-row max, the
    rescaled sums and the target logit of one chunk of rows). Forward + backward:
    the same, plus exactly one all-reduce of the ``[N, D]`` hidden-state gradient
    (each shard's ``dz @ W_shard.T`` is a partial sum over the vocabulary). Nothing
    ever has ``V`` or ``V / 8`` in its shape.
    """
    _need_8_devices()
    d = _data(2)
    n, chunk = B * T, 16
    mesh = _mesh((8,), ("vocab",))
    with jax.set_mesh(mesh):
        h = jax.device_put(d["hidden"], NamedSharding(mesh, P()))
        w = jax.device_put(d["w"], NamedSharding(mesh, P(None, "vocab")))
        tok = jax.device_put(d["tokens"], NamedSharding(mesh, P()))
        g = jax.device_put(d["g"][0], NamedSharding(mesh, P()))

        def forward(h, w, tok):
            return opj.token_logprobs_from_hidden(
                h, w, tok, chunk_size=chunk, return_entropy=True, axis_name="vocab"
            )

        def both(h, w, tok, g):
            def loss(h, w):
                lp, ent = forward(h, w, tok)
                return jnp.sum(jnp.where(jnp.isfinite(lp), lp, 0.0) * g) + jnp.sum(ent)

            return jax.grad(loss, (0, 1))(h, w)

        fwd = jax.jit(
            jax.shard_map(
                forward,
                mesh=mesh,
                in_specs=(P(), P(None, "vocab"), P()),
                out_specs=(P(), P()),
            )
        )
        full = jax.jit(
            jax.shard_map(
                both,
                mesh=mesh,
                in_specs=(P(), P(None, "vocab"), P(), P()),
                out_specs=(P(), P(None, "vocab")),
            )
        )
        fwd_ops = mc.hlo_collectives(mc.compiled_text(fwd, h, w, tok))
        full_ops = mc.hlo_collectives(mc.compiled_text(full, h, w, tok, g))
    print("\nforward:\n" + mc.summarize_collectives(fwd_ops))
    print("forward + backward:\n" + mc.summarize_collectives(full_ops))
    assert fwd_ops, "expected the cross-shard log-sum-exp as collectives"
    for c in fwd_ops:
        assert all(int(np.prod(s)) <= chunk for s in c["shapes"]), c["line"][:300]
    big = []
    for c in full_ops:
        for s in c["shapes"]:
            assert V not in s and V // 8 not in s, c["line"][:300]
            if int(np.prod(s)) > chunk:
                big.append(s)
    assert big == [(n, D)], big
