"""Log-probs over the sampler's kept set: exactness, padding, invalid input.

* Regressions: a padding id that is also a token id is refused; CSR offsets that
  start below 0 give the invalid id under ``jit`` (and raise eagerly); int64 kept ids
  beyond int32 raise instead of wrapping; the hidden-state path is exact to float32
  rounding at large logits (it shifts by the maximum before subtracting ``log s``).
* Properties (Hypothesis) over given kept sets and top-k / top-p kept sets, from
  logits and from hidden states: equal to a float64 NumPy reference within float32
  rounding, invariant to padding (of the id lists and of the token axis), ``jit`` ==
  eager, and finite gradients equal to the reference's.

The inputs are exact in float32: hidden states are multiples of 1/4, the unembedding
multiples of 1/8 plus a per-column offset of up to 3e5 (so the logits are large), and
temperatures are powers of two. ``hidden @ W / T`` is then the same number in float32
and float64, and the only error left is the library's own float32 rounding. Shapes
are fixed and per-sequence settings are arrays, so each property compiles a few
programs and then runs thousands of examples.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import offpolicy_jax as opj

INVALID_ID = np.iinfo(np.int32).max
B, T, D, V, K = 2, 5, 4, 12, 6
OFFSETS = (0.0, 100.0, -100.0, 160000.0, -160000.0, 300000.0)
TEMPERATURES = (1.0, 0.5, 2.0)  # powers of two: z = hidden @ W / T stays exact
PADS = (-1, V, -7)
CHUNKS = (1, 3, 16)
EPS = float(np.finfo(np.float32).eps)


# ----------------------------------------------------------------- float64 reference


def np_kept_logprobs(z, keep, tokens, broken=None):
    """float64 ``(logp, entropy, prob)`` over the kept set ``keep [..., V]`` of ``z``:
    ``z_y − log Σ_keep e^z`` (−inf outside the set or for an empty one, NaN for an id
    outside ``[0, V)`` or a row with an invalid kept id), the entropy over the set."""
    vocab = z.shape[-1]
    logp, entropy = np.empty(z.shape[:-1]), np.empty(z.shape[:-1])
    prob = np.zeros(z.shape)
    for idx in np.ndindex(*z.shape[:-1]):
        kept = np.flatnonzero(keep[idx])
        tok = int(tokens[idx])
        if kept.size == 0:
            lp, entropy[idx] = -np.inf, 0.0
        else:
            zk = z[idx][kept]
            top = zk.max()
            log_s = np.log(np.sum(np.exp(zk - top)))
            p = np.exp(zk - top - log_s)
            prob[idx][kept] = p
            entropy[idx] = -np.sum(p * (zk - top - log_s))
            lp = (z[idx][tok] - top - log_s) if 0 <= tok < vocab and keep[idx][tok] else -np.inf
        bad = not 0 <= tok < vocab or (broken is not None and broken[idx])
        logp[idx] = np.nan if bad else lp
    return logp, entropy, prob


def np_listed(support, pad, vocab):
    """``(keep [..., V], broken [...])`` of padded id lists: a listed id is kept (once),
    a row listing an id that is neither ``pad`` nor in ``[0, V)`` is broken."""
    keep = np.zeros(support.shape[:-1] + (vocab,), bool)
    broken = np.zeros(support.shape[:-1], bool)
    for idx in np.ndindex(*support.shape[:-1]):
        for i in support[idx]:
            if i == pad:
                continue
            if 0 <= i < vocab:
                keep[idx][i] = True
            else:
                broken[idx] = True
    return keep, broken


def np_top_k_top_p(z, top_k, top_p):
    """``(keep, margin)``: vLLM's kept set token by token (top-k keeps ``z >=`` the k-th
    largest, an entry ``<= 0`` off; top-p keeps ``i`` iff the renormalised mass of the
    tokens strictly more probable than ``i`` is ``< p``) and the distance of the top-p
    decisions from ``p``."""
    vocab = z.shape[-1]
    keep = np.ones(z.shape, bool)
    margin = np.full(z.shape[:-1], np.inf)
    for idx in np.ndindex(*z.shape[:-1]):
        row, k, p = z[idx], int(top_k[idx]), float(top_p[idx])
        if k > 0:
            keep[idx] &= row >= np.sort(row)[::-1][min(k, vocab) - 1]
        if p < 1.0:
            q = np.where(keep[idx], np.exp(row - row[keep[idx]].max()), 0.0)
            q /= q.sum()
            above = np.array([q[row > row[i]].sum() for i in range(vocab)])
            keep[idx] &= above < p
            margin[idx] = np.min(np.abs(above - p))
    return keep, margin


def np_kept_grads(z, prob, tokens, ok, g, temperature):
    """float64 ``d(Σ g0·logp + g1·H)/dz_raw`` for raw logits ``z_raw = z·T`` over the
    rows ``ok`` (``prob`` the kept-set distribution, 0 outside it)."""
    onehot = np.arange(z.shape[-1]) == np.where(ok, tokens, -1)[..., None]
    zs = np.where(prob > 0, z, 0.0)
    expected = np.sum(prob * zs, axis=-1, keepdims=True)
    dz = g[0][..., None] * (onehot - prob) - g[1][..., None] * prob * (zs - expected)
    return np.where(ok[..., None], dz, 0.0) / temperature


def assert_matches(got, want, rtol, atol):
    """Same NaN and ±inf positions; finite values within ``rtol · |want| + atol``."""
    got = np.asarray(got, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=rtol, atol=atol)


# --------------------------------------------------------------------- regressions


def test_padding_id_that_is_a_token_id_is_refused():
    """``support_pad = 0`` would remove token 0 from every kept set (−inf instead of
    log 0.5): the docs promise a padding id outside ``[0, V)``."""
    logits = jnp.log(jnp.array([[[0.5, 0.3, 0.2]]]))
    support = jnp.array([[[0, 1, 2]]])
    for pad in (0, 2):
        with pytest.raises(ValueError, match="support_pad"):
            opj.token_logprobs(logits, jnp.array([[0]]), support=support, support_pad=pad)
        with pytest.raises(ValueError, match="support_pad"):
            opj.token_logprobs_from_hidden(
                jnp.ones((1, 1, 1)), jnp.ones((1, 3)), jnp.array([[0]]), support=support,
                support_pad=pad,
            )  # fmt: skip
    with pytest.raises(ValueError, match="support_pad"):  # the invalid id is no padding
        opj.token_logprobs(logits, jnp.array([[0]]), support=support, support_pad=INVALID_ID)
    # A padding id outside the vocabulary still pads, on both sides of it.
    for pad in (-1, 3, 99):
        got = opj.token_logprobs(
            logits, jnp.array([[0]]), support=jnp.array([[[0, pad, 1]]]), support_pad=pad
        )
        np.testing.assert_allclose(got, [[np.log(0.5 / 0.8)]], rtol=1e-6)


def test_csr_offsets_starting_below_zero_give_the_invalid_id_under_jit():
    """A negative first offset was clipped to 0 under ``jit``: the token "kept"
    ``[7, 7, 7]``. Eagerly the offsets raise; under ``jit`` the token gets the invalid
    id and a NaN log-prob, and the other tokens keep their sets."""
    token_ids, offsets = jnp.array([7, 8, 9, 4]), jnp.array([-1, 2, 4])
    with pytest.raises(ValueError, match="offsets"):
        opj.support_from_csr(token_ids, offsets, max_size=3)
    got = jax.jit(functools.partial(opj.support_from_csr, max_size=3))(token_ids, offsets)
    np.testing.assert_array_equal(got, [[INVALID_ID] * 3, [9, 4, -1]])
    got = jax.jit(functools.partial(opj.support_from_csr, max_size=3))(
        jnp.array([7, 8, 9, 4]), jnp.array([-3, 0])
    )
    np.testing.assert_array_equal(got, [[INVALID_ID] * 3])
    lp = opj.token_logprobs(jnp.zeros((1, 10)), jnp.array([7]), support=got)
    assert np.isnan(np.asarray(lp)).all()


def test_int64_kept_ids_beyond_int32_raise_instead_of_wrapping():
    """``2**32 + 1`` wrapped to 1: a kept set {1} (log-prob 0) instead of an error."""
    logits = jnp.log(jnp.array([[[0.5, 0.3, 0.2]]]))
    wide = np.array([[[2**32 + 1, -1]]], np.int64)
    for support in (wide, wide.tolist()):
        with pytest.raises(ValueError, match="support holds ids outside int32"):
            opj.token_logprobs(logits, jnp.array([[1]]), support=support)
        with pytest.raises(ValueError, match="support holds ids outside int32"):
            opj.token_logprobs_from_hidden(
                jnp.ones((1, 1, 1)), jnp.ones((1, 3)), jnp.array([[1]]), support=support
            )
    with pytest.raises(ValueError, match="token_ids holds ids outside int32"):
        opj.support_from_csr(np.array([2**32 + 5], np.int64), [0, 1])
    with pytest.raises(ValueError, match="offsets holds ids outside int32"):
        opj.support_from_csr([5], np.array([2**32, 2**32 + 1], np.int64))
    # int64 ids inside int32 are fine.
    got = opj.token_logprobs(logits, jnp.array([[1]]), support=np.array([[[1, 0]]], np.int64))
    np.testing.assert_allclose(got, [[np.log(0.3 / 0.8)]], rtol=1e-6)


def _large_logit_case():
    """Rows of exactly representable logits near 1.6e5 and 100 (one-hot hidden states)."""
    w = np.array(
        [
            [160000.0] * 6,  # log π = −log 6 for every token
            [160000.0 + d for d in (0.0, 0.5, 1.0, -1.0, 2.0, -0.25)],
            [100.0 + d for d in (0.0, 0.125, -0.5, 1.0, 0.25, -2.0)],
            [-160000.0 + d for d in (0.0, 0.5, 1.0, -1.0, 2.0, -0.25)],
        ]
    )
    hidden = np.eye(4)[None]  # [1, 4 tokens, D = 4]
    tokens = np.array([[0, 2, 4, 1]])
    return hidden, w, tokens


@pytest.mark.heavy
def test_from_hidden_is_exact_to_float32_rounding_at_large_logits():
    """``z_y − (m + log s)`` rounded ``lse`` to an ulp of the logits (−1.796875 for
    −log 6 at 1.6e5); the hidden path now shifts first, as the logits path does. Values,
    entropies and the unembedding's gradient against float64, with the full
    vocabulary (one block, and blocks with an online log-sum-exp) and with a kept set;
    and the logits path with a kept set far below the row's maximum."""
    hidden, w, tokens = _large_logit_case()
    z = (hidden @ w)[0]
    all_kept = np.ones(z.shape, bool)
    subset = np.array([[0, 2, 4, -1]] * 4)
    part = np.zeros(z.shape, bool)
    part[:, [0, 2, 4]] = True
    h32, w32 = jnp.asarray(hidden, jnp.float32), jnp.asarray(w, jnp.float32)
    g = np.array([[1.0, -0.5, 2.0, 0.75], [0.5, 1.0, -1.0, 0.25]])
    for kw, keep in (
        (dict(), all_kept),
        (dict(vocab_chunk_size=4), all_kept),
        (dict(support=subset[None]), part),
    ):
        want, want_ent, prob = np_kept_logprobs(z, keep, tokens[0])
        ok = np.isfinite(want)  # a token outside the kept set: masked

        def loss(h, w, kw=kw, ok=ok):
            lp, ent = opj.token_logprobs_from_hidden(
                h, w, tokens, chunk_size=3, return_entropy=True, **kw
            )
            return jnp.sum(jnp.where(ok, lp[0] * g[0] + ent[0] * g[1], 0.0)), (lp, ent)

        (_, (lp, ent)), dw = jax.value_and_grad(loss, 1, has_aux=True)(h32, w32)
        assert_matches(lp[0], want, rtol=1e-6, atol=1e-6)
        assert_matches(ent[0], want_ent, rtol=1e-6, atol=1e-6)
        want_dw = np_kept_grads(z, prob, tokens[0], ok, g, 1.0)  # h = I: dW = dz
        np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-6)
    assert float(opj.token_logprobs_from_hidden(h32, w32, tokens)[0, 0]) == np.float32(-np.log(6))
    # Logits path, kept set far below the row maximum (a 0 logit outside the set).
    logits = np.concatenate([np.zeros((4, 1)), z[:, :5]], axis=-1)
    kept = np.array([[1, 2, 3, 4, 5]] * 4)
    keep = np.zeros(logits.shape, bool)
    keep[:, 1:] = True
    want, want_ent, _ = np_kept_logprobs(logits, keep, tokens[0] + 1)
    lp, ent = opj.token_logprobs(
        jnp.asarray(logits, jnp.float32), tokens[0] + 1, support=kept, return_entropy=True
    )
    assert_matches(lp, want, rtol=1e-6, atol=1e-6)
    assert_matches(ent, want_ent, rtol=1e-6, atol=1e-6)


@pytest.mark.multi_device
@pytest.mark.slow
@pytest.mark.usefixtures("clear_jax_caches")
def test_vocab_sharded_from_hidden_is_exact_at_large_logits():
    """The vocabulary split over 4 devices (``shard_map``, ``axis_name``): the shards'
    maxima and rescaled sums combine to the same float32-exact log-probs and entropies
    at logits of 1.6e5, with one vocabulary block, several, and a kept set."""
    if len(jax.devices("cpu")) < 8:
        pytest.skip("needs JAX_NUM_CPU_DEVICES=8 (tests/conftest.py)")
    hidden, w, tokens = _large_logit_case()
    w = np.concatenate([w, w[:, :2] - 3.0], axis=-1)  # V = 8: two columns per device
    z = (hidden @ w)[0]
    subset = np.array([[0, 2, 4, 7]] * 4)
    part = np.zeros(z.shape, bool)
    part[:, [0, 2, 4, 7]] = True
    mesh = jax.make_mesh(
        (4,), ("vocab",), axis_types=(AxisType.Auto,), devices=jax.devices("cpu")[:4]
    )
    h32, w32 = jnp.asarray(hidden, jnp.float32), jnp.asarray(w, jnp.float32)
    for kw, keep in (
        (dict(), np.ones(z.shape, bool)),
        (dict(vocab_chunk_size=1), np.ones(z.shape, bool)),
        (dict(support=jnp.asarray(subset[None])), part),
    ):
        want, want_ent, _ = np_kept_logprobs(z, keep, tokens[0])

        def fn(h, w, kw=kw):
            return opj.token_logprobs_from_hidden(
                h, w, jnp.asarray(tokens), axis_name="vocab", return_entropy=True, **kw
            )

        lp, ent = jax.jit(
            jax.shard_map(fn, mesh=mesh, in_specs=(P(), P(None, "vocab")), out_specs=(P(), P()))
        )(h32, w32)
        assert_matches(lp[0], want, rtol=1e-6, atol=1e-6)
        assert_matches(ent[0], want_ent, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------- properties


@st.composite
def exact_inputs(draw):
    """``(hidden [B, T, D], w [D, V], z = hidden @ w / T (float64, exact in float32),
    temperature)``: hidden multiples of 1/4, w multiples of 1/8, the last hidden unit
    0 or 1 switching on a large per-column offset."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    offset = draw(st.sampled_from(OFFSETS))
    temperature = draw(st.sampled_from(TEMPERATURES))
    hidden = rng.integers(-8, 9, size=(B, T, D)) / 4.0
    hidden[..., -1] = rng.integers(0, 2, size=(B, T))
    w = rng.integers(-16, 17, size=(D, V)) / 8.0
    w[-1] += offset
    return hidden, w, hidden @ w / temperature, temperature, rng


@st.composite
def listed_cases(draw):
    """Exact inputs with padded kept-id lists: ragged (some empty), repeated ids, a
    padding id drawn from both sides of the vocabulary, sometimes an invalid id, and
    tokens mostly inside their set, sometimes outside, garbage where masked."""
    hidden, w, z, temperature, rng = draw(exact_inputs())
    pad = draw(st.sampled_from(PADS))
    support = rng.integers(0, V, size=(B, T, K))
    sizes = rng.integers(0, K + 1, size=(B, T))
    support = np.where(np.arange(K) < sizes[..., None], support, pad)
    if draw(st.booleans()):
        support[rng.integers(B), rng.integers(T), rng.integers(K)] = V + 3 if pad != V + 3 else -3
    first = support[..., 0]
    tokens = np.where(
        (first >= 0) & (first < V) & (rng.random((B, T)) < 0.8), first, rng.integers(0, V, (B, T))
    )
    mask = rng.random((B, T)) > 0.2
    tokens = np.where(mask, tokens, rng.choice(np.array([-5, V, 2**30]), size=(B, T)))
    chunk = draw(st.sampled_from(CHUNKS))
    return dict(
        hidden=hidden, w=w, z=z, temperature=temperature, support=support, pad=pad,
        tokens=tokens, mask=mask, chunk=chunk, rng=rng,
    )  # fmt: skip


@st.composite
def sampler_cases(draw):
    """Exact inputs with per-sequence top-k (``<= 0``: off) and top-p arrays."""
    hidden, w, z, temperature, rng = draw(exact_inputs())
    top_k = rng.integers(-1, V + 2, size=(B, 1))
    top_p = rng.choice(np.array([0.05, 0.3, 0.5, 0.8, 0.95, 1.0]), size=(B, 1))
    tokens = rng.integers(0, V, size=(B, T))
    chunk = draw(st.sampled_from(CHUNKS))
    vocab_chunk = draw(st.sampled_from((None, 5)))
    return dict(
        hidden=hidden, w=w, z=z, temperature=temperature, top_k=top_k, top_p=top_p,
        tokens=tokens, chunk=chunk, vocab_chunk=vocab_chunk, rng=rng,
    )  # fmt: skip


def _f32(*xs):
    return tuple(jnp.asarray(x, jnp.float32) for x in xs)


def _logits(case):
    return jnp.asarray(case["z"] * case["temperature"], jnp.float32)  # exact


def _from_logits(logits, tokens, temperature, support=None, pad=-1, top_k=None, top_p=None):
    return opj.token_logprobs(
        logits, tokens, temperature=temperature, support=support, support_pad=pad,
        top_k=top_k, top_p=top_p, return_entropy=True,
    )  # fmt: skip


def _from_hidden(hidden, w, tokens, temperature, support=None, *, pad=-1, chunk=3, vchunk=None):
    return opj.token_logprobs_from_hidden(
        hidden, w, tokens, temperature=temperature, support=support, support_pad=pad,
        chunk_size=chunk, vocab_chunk_size=vchunk, return_entropy=True,
    )  # fmt: skip


# One compiled program per static combination (pad, chunk sizes), whatever the values.
from_logits_jit = jax.jit(_from_logits, static_argnames="pad")
from_hidden_jit = jax.jit(_from_hidden, static_argnames=("pad", "chunk", "vchunk"))


def _check_against(want, got, *, ok_entropy):
    """log-probs within float32 rounding of ``|logp|``; the entropy within the
    rounding of the logits' spread (its terms are ``p · (z − m)``)."""
    lp, ent = got
    want_lp, want_ent = want
    assert lp.dtype == ent.dtype == jnp.float32
    assert_matches(lp, want_lp, rtol=4 * 8 * EPS, atol=4 * 8 * EPS)
    assert_matches(np.asarray(ent)[ok_entropy], want_ent[ok_entropy], rtol=1e-5, atol=1e-5)


@pytest.mark.heavy
@given(listed_cases())
def test_listed_kept_sets_match_float64_reference(case):
    keep, broken = np_listed(case["support"], case["pad"], V)
    want_lp, want_ent, _ = np_kept_logprobs(case["z"], keep, case["tokens"], broken)
    ok = ~np.isnan(want_lp)
    temperature, tokens = jnp.float32(case["temperature"]), jnp.asarray(case["tokens"])
    got = from_logits_jit(_logits(case), tokens, temperature, case["support"], pad=case["pad"])
    _check_against((want_lp, want_ent), got, ok_entropy=ok)
    got = from_hidden_jit(
        *_f32(case["hidden"], case["w"]), tokens, temperature, case["support"],
        pad=case["pad"], chunk=case["chunk"],
    )  # fmt: skip
    _check_against((want_lp, want_ent), got, ok_entropy=ok)


@pytest.mark.heavy
@given(sampler_cases())
def test_top_k_top_p_kept_sets_match_float64_reference(case):
    """top-k / top-p from the logits; the same kept set given to the hidden path as
    ids; the full vocabulary (one block or an online log-sum-exp over blocks)."""
    keep, margin = np_top_k_top_p(case["z"], np.broadcast_to(case["top_k"], (B, T)),
                                  np.broadcast_to(case["top_p"], (B, T)))  # fmt: skip
    sure = margin > 1e-5  # a mass within float32 rounding of p is decided by the rounding
    want_lp, want_ent, _ = np_kept_logprobs(case["z"], keep, case["tokens"])
    temperature, tokens = jnp.float32(case["temperature"]), jnp.asarray(case["tokens"])
    lp, ent = from_logits_jit(
        _logits(case), tokens, temperature, top_k=case["top_k"], top_p=case["top_p"]
    )
    _check_against((want_lp[sure], want_ent[sure]), (lp[sure], ent[sure]), ok_entropy=...)
    ids = np.where(keep, np.arange(V), -1)  # [B, T, V]: the kept set as a padded list
    hidden, w = _f32(case["hidden"], case["w"])
    got = from_hidden_jit(hidden, w, tokens, temperature, ids, chunk=case["chunk"])
    _check_against((want_lp, want_ent), got, ok_entropy=...)
    full_lp, full_ent, _ = np_kept_logprobs(case["z"], np.ones((B, T, V), bool), case["tokens"])
    got = from_hidden_jit(
        hidden, w, tokens, temperature, chunk=case["chunk"], vchunk=case["vocab_chunk"]
    )
    _check_against((full_lp, full_ent), got, ok_entropy=...)


def _padded(case):
    """The case with 3 more padding ids per list (columns shuffled, one id repeated)
    and 3 more positions of garbage tokens and arbitrary lists."""
    rng, support, pad = case["rng"], case["support"], case["pad"]
    wide = np.concatenate([support, np.full((B, T, 3), pad)], axis=-1)
    wide[..., -1] = np.where(support[..., 0] != pad, support[..., 0], pad)  # a repeat
    wide = np.take_along_axis(wide, rng.permuted(np.tile(np.arange(K + 3), (B, T, 1)), axis=-1), -1)
    extra_ids = rng.integers(-1, V, size=(B, 3, K + 3))
    extra_ids = np.where(extra_ids < 0, pad, extra_ids)
    hidden = np.concatenate([case["hidden"], rng.integers(-8, 9, size=(B, 3, D)) / 4.0], axis=1)
    garbage = rng.choice(np.array([-5, 0, V - 1, V, 2**30]), size=(B, 3))
    tokens = np.concatenate([case["tokens"], garbage], axis=1)
    return hidden, tokens, np.concatenate([wide, extra_ids], axis=1)


@pytest.mark.heavy
@given(listed_cases())
def test_kept_set_logprobs_are_padding_invariant(case):
    """More padding ids in the lists (anywhere, with a repeated id) and more padded
    positions after the tokens change nothing at the original positions."""
    hidden, tokens, support = _padded(case)
    temperature, pad, w = jnp.float32(case["temperature"]), case["pad"], case["w"]
    logits = jnp.asarray(hidden @ w, jnp.float32)  # exact
    base = from_logits_jit(_logits(case), case["tokens"], temperature, case["support"], pad=pad)
    got = from_logits_jit(logits, tokens, temperature, support, pad=pad)
    for a, b in zip(got, base, strict=True):
        assert_matches(a[:, :T], np.asarray(b, np.float64), rtol=4 * EPS, atol=4 * EPS)
    hidden32, w32 = _f32(case["hidden"], w)
    base = from_hidden_jit(hidden32, w32, case["tokens"], temperature, case["support"], pad=pad,
                           chunk=case["chunk"])  # fmt: skip
    got = from_hidden_jit(*_f32(hidden, w), tokens, temperature, support, pad=pad,
                          chunk=case["chunk"])  # fmt: skip
    for a, b in zip(got, base, strict=True):
        assert_matches(a[:, :T], np.asarray(b, np.float64), rtol=4 * EPS, atol=4 * EPS)


@pytest.mark.heavy
@given(listed_cases(), sampler_cases())
def test_kept_set_logprobs_jit_equals_eager(case, sampler):
    """The same values traced and compiled as computed eagerly: given lists (from the
    logits, from hidden states, and built by ``support_from_csr``) and top-k / top-p."""
    temperature, pad, tokens = jnp.float32(case["temperature"]), case["pad"], case["tokens"]
    logits = _logits(case)
    pairs = [
        (
            _from_logits(logits, tokens, temperature, case["support"], pad),
            from_logits_jit(logits, tokens, temperature, case["support"], pad=pad),
        ),
        (
            # One chunk: an eager row loop would compile its body on every call.
            _from_hidden(*_f32(case["hidden"], case["w"]), tokens, temperature, case["support"],
                         pad=pad, chunk=B * T),
            from_hidden_jit(*_f32(case["hidden"], case["w"]), tokens, temperature,
                            case["support"], pad=pad, chunk=B * T),
        ),
        (
            _from_logits(_logits(sampler), sampler["tokens"], jnp.float32(sampler["temperature"]),
                         top_k=sampler["top_k"], top_p=sampler["top_p"]),
            from_logits_jit(_logits(sampler), sampler["tokens"],
                            jnp.float32(sampler["temperature"]), top_k=sampler["top_k"],
                            top_p=sampler["top_p"]),
        ),
    ]  # fmt: skip
    for eager, jitted in pairs:
        for a, b in zip(eager, jitted, strict=True):
            assert_matches(b, np.asarray(a, np.float64), rtol=4 * EPS, atol=4 * EPS)
    # CSR: the counts of the lists (padding dropped) as vLLM's (token_ids, offsets).
    listed = _compact(case["support"].reshape(-1, K), pad)
    counts = np.sum(listed != pad, axis=-1)
    ids = listed[np.arange(K) < counts[:, None]]
    offsets = np.concatenate([[0], np.cumsum(counts)])
    eager = opj.support_from_csr(ids, offsets, max_size=K, pad=pad)
    jitted = _csr_jit(jnp.asarray(ids), jnp.asarray(offsets), pad)
    np.testing.assert_array_equal(jitted, eager)
    np.testing.assert_array_equal(eager, listed)


def _compact(rows, pad):
    """Each row's non-padding ids first, in their order, then padding."""
    return np.stack([np.concatenate([r[r != pad], r[r == pad]]) for r in rows])


@functools.partial(jax.jit, static_argnums=2)
def _csr_jit(ids, offsets, pad):
    return opj.support_from_csr(ids, offsets, max_size=K, pad=pad)


@pytest.mark.heavy
@given(listed_cases(), sampler_cases())
def test_kept_set_gradients_are_finite_and_match_reference(case, sampler):
    """Gradients of ``Σ g0·logp + g1·H`` over the positions a trainer keeps (masked:
    garbage ids, tokens outside the set, invalid lists, empty sets) are finite and equal
    the float64 ``(onehot − p) − p (z − E z)`` / T: w.r.t. the logits, the hidden
    states and the unembedding, for given lists and for top-k / top-p."""
    keep, broken = np_listed(case["support"], case["pad"], V)
    want_lp, _, prob = np_kept_logprobs(case["z"], keep, case["tokens"], broken)
    ok = np.isfinite(want_lp)  # entropies too: a valid, non-empty set
    g = case["rng"].normal(size=(2, B, T))
    want_dz = np_kept_grads(case["z"], prob, case["tokens"], ok, g, case["temperature"])
    args = (case["tokens"], jnp.float32(case["temperature"]), case["support"])
    kw = dict(pad=case["pad"])
    d_logits = _grad(grad_logits_jit, ok, g, _logits(case), *args, **kw)
    np.testing.assert_allclose(d_logits, want_dz, rtol=1e-5, atol=1e-5)
    hidden, w = _f32(case["hidden"], case["w"])
    dh, dw = _grad(grad_hidden_jit, ok, g, hidden, w, *args, chunk=case["chunk"], **kw)
    np.testing.assert_allclose(dw, np.einsum("btd,btv->dv", case["hidden"], want_dz),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    # dz is exact to about eps · (|g0| + |g1| (1 + |z − E z|)) per kept column (onehot − p
    # cancels in any float32 arithmetic, the logits path's too); dh sums it times w, whose
    # offsets reach 3e5, so its bound is that rounding carried through w.
    expected = np.sum(prob * np.where(prob > 0, case["z"], 0.0), axis=-1, keepdims=True)
    spread = np.where(prob > 0, np.abs(case["z"] - expected), 0.0)
    dz_error = np.abs(g[0])[..., None] + np.abs(g[1])[..., None] * (1 + spread)
    dz_error = np.where(ok[..., None] & (prob > 0), dz_error, 0.0) / case["temperature"]
    want_dh = np.einsum("btv,dv->btd", want_dz, case["w"])
    bound = 16 * EPS * np.einsum("btv,dv->btd", dz_error, np.abs(case["w"])) + 1e-5
    assert np.all(np.abs(np.asarray(dh, np.float64) - want_dh) <= bound)
    # top-k / top-p from the logits (the kept set carries no gradient).
    keep, _ = np_top_k_top_p(sampler["z"], np.broadcast_to(sampler["top_k"], (B, T)),
                             np.broadcast_to(sampler["top_p"], (B, T)))  # fmt: skip
    want_lp, _, prob = np_kept_logprobs(sampler["z"], keep, sampler["tokens"])
    ok = np.isfinite(want_lp)
    want_dz = np_kept_grads(sampler["z"], prob, sampler["tokens"], ok, g, sampler["temperature"])
    got = _grad(grad_logits_jit, ok, g, _logits(sampler), sampler["tokens"],
                jnp.float32(sampler["temperature"]), top_k=sampler["top_k"],
                top_p=sampler["top_p"])  # fmt: skip
    assert np.all(np.isfinite(np.asarray(got)))
    _, margin = np_top_k_top_p(sampler["z"], np.broadcast_to(sampler["top_k"], (B, T)),
                               np.broadcast_to(sampler["top_p"], (B, T)))  # fmt: skip
    sure = margin > 1e-5
    np.testing.assert_allclose(np.asarray(got)[sure], want_dz[sure], rtol=1e-5, atol=1e-5)


def _masked_gradient(fn, argnums):
    """The gradient of ``Σ g0·logp + g1·H`` over the positions ``ok`` (``jnp.where``,
    never a product with the mask), as ``grad(ok, g, *args, **kw)``."""

    def grad(ok, g, *args, **kw):
        def objective(*args):
            lp, ent = fn(*args, **kw)
            return jnp.sum(jnp.where(ok, lp, 0.0) * g[0] + jnp.where(ok, ent, 0.0) * g[1])

        return jax.grad(objective, argnums)(*args)

    return grad


grad_logits_jit = jax.jit(_masked_gradient(_from_logits, 0), static_argnames="pad")
grad_hidden_jit = jax.jit(
    _masked_gradient(_from_hidden, (0, 1)), static_argnames=("pad", "chunk", "vchunk")
)


def _grad(fn, ok, g, *args, **kw):
    grads = fn(ok, g, *args, **kw)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(grads))
    return grads


def test_top_k_entropy_gradient_is_finite():
    """The entropy over a top-k / top-p set multiplied ``0 · (−inf)`` in the branch its
    ``jnp.where`` discards: NaN gradients at every kept logit, of every row (masked
    ones too). Against float64: ``dH/dz = −p (z − E z)`` on the set."""
    logits = np.array([[[1.0, 2.0, 3.0, 0.5]], [[0.0, 0.25, -1.0, 4.0]]])
    grad = jax.grad(
        lambda x: jnp.sum(opj.token_logprobs(x, jnp.zeros((2, 1), int), top_k=2,
                                             return_entropy=True)[1])
    )(jnp.asarray(logits, jnp.float32))  # fmt: skip
    keep = np.zeros(logits.shape, bool)
    keep[0, 0, [1, 2]] = keep[1, 0, [1, 3]] = True
    _, _, prob = np_kept_logprobs(logits, keep, np.zeros((2, 1), int))
    want = np_kept_grads(logits, prob, np.zeros((2, 1), int), np.ones((2, 1), bool),
                         np.array([np.zeros((2, 1)), np.ones((2, 1))]), 1.0)  # fmt: skip
    np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-7)
