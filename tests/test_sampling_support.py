"""The sampler's exact support: log-probs renormalised over the engine's kept set.

* ``token_logprobs(support=)`` and ``token_logprobs_from_hidden(support=)`` against a
  NumPy float64 reference that builds each token's set from the padded id list (ragged
  sets, repeated ids, padding, invalid ids, masked garbage), values and entropies;
* the given set equal to the trainer's own top-k set gives ``token_logprobs(top_k=)``;
* the from-hidden gradient (custom VJP) against autodiff of the logits version and
  ``jax.test_util.check_grads``;
* compiled temporary memory of the from-hidden version at ``V = 131072``: ``O(N·K)``
  plus a chunk's gathered columns, the same at half the vocabulary, and far from
  ``N·V``;
* ``support_from_csr`` against a NumPy loop over vLLM's CSR layout; shard_map with the
  vocabulary split equals the unsharded call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import offpolicy_jax as opj

PAD = -1


def np_support_logprobs(logits, tokens, support, temperature=1.0, pad=PAD):
    """float64 (logp, entropy) token by token from the kept set's definition."""
    z_all = np.asarray(logits, np.float64) / temperature
    vocab = z_all.shape[-1]
    logp = np.empty(z_all.shape[:-1])
    entropy = np.empty(z_all.shape[:-1])
    for idx in np.ndindex(*z_all.shape[:-1]):
        ids = [int(i) for i in support[idx] if i != pad]
        kept = sorted(set(ids))
        tok = int(tokens[idx])
        if any(not 0 <= i < vocab for i in kept) or not 0 <= tok < vocab:
            logp[idx], entropy[idx] = np.nan, np.nan
            continue
        if not kept:
            logp[idx], entropy[idx] = -np.inf, 0.0
            continue
        z = z_all[idx][kept]
        lse = np.log(np.sum(np.exp(z - z.max()))) + z.max()
        p = np.exp(z - lse)
        entropy[idx] = -np.sum(p * (z - lse))
        logp[idx] = z_all[idx][tok] - lse if tok in kept else -np.inf
    return logp, entropy


@st.composite
def support_cases(draw):
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=1)))
    length = draw(st.integers(1, 5))
    vocab = draw(st.integers(2, 20))
    dim = draw(st.integers(1, 6))
    k = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = lead + (length,)
    support = rng.integers(0, vocab, size=shape + (k,))
    sizes = rng.integers(0, k + 1, size=shape)  # ragged sets, some empty
    support = np.where(np.arange(k) < sizes[..., None], support, PAD)
    # The sampled token: mostly inside its set, sometimes outside.
    first = support[..., 0]
    tokens = np.where(
        (first != PAD) & (rng.random(shape) < 0.8), first, rng.integers(0, vocab, shape)
    )
    if draw(st.booleans()):  # an invalid id (neither padding nor in range) somewhere
        support[(0,) * len(shape) + (k - 1,)] = vocab + 3
    mask = rng.random(shape) > 0.25
    garbage = rng.choice(np.array([-5, vocab, 2**30]), size=shape)
    tokens = np.where(mask, tokens, garbage)
    hidden = rng.normal(size=shape + (dim,))
    w = rng.normal(size=(dim, vocab))
    temperature = draw(st.sampled_from([1.0, 0.6]))
    chunk = draw(st.integers(1, 4))
    return hidden, w, tokens, support, mask, temperature, chunk


def _close(got, want, tol=2e-5):
    got = np.asarray(got, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=tol, atol=tol)


@pytest.mark.heavy
@given(support_cases())
def test_support_logprobs_match_numpy_reference(case):
    hidden, w, tokens, support, mask, temperature, chunk = case
    logits = np.asarray(jnp.asarray(hidden, jnp.float32) @ jnp.asarray(w, jnp.float32))
    want_lp, want_ent = np_support_logprobs(logits, tokens, support, temperature)
    lp, ent = jax.jit(
        functools.partial(opj.token_logprobs, temperature=temperature, return_entropy=True)
    )(jnp.asarray(logits), tokens, support=support)
    _close(lp, want_lp)
    ok = ~np.isnan(want_lp)
    _close(np.asarray(ent)[ok], want_ent[ok])
    lp_h, ent_h = jax.jit(
        functools.partial(
            opj.token_logprobs_from_hidden,
            temperature=temperature,
            chunk_size=chunk,
            return_entropy=True,
        )
    )(jnp.asarray(hidden, jnp.float32), jnp.asarray(w, jnp.float32), tokens, support=support)
    _close(lp_h, want_lp, 1e-4)
    _close(np.asarray(ent_h)[ok], want_ent[ok], 1e-4)


def test_repeated_ids_count_once_and_custom_pad():
    logits = jnp.log(jnp.array([[[0.5, 0.3, 0.2]]]))
    once = opj.token_logprobs(
        logits, jnp.array([[1]]), support=jnp.array([[[0, 1, 99]]]), support_pad=99
    )
    twice = opj.token_logprobs(logits, jnp.array([[1]]), support=jnp.array([[[1, 0, 1]]]))
    np.testing.assert_allclose(jnp.exp(once), [[0.375]], rtol=1e-6)
    np.testing.assert_allclose(twice, once, rtol=1e-6)
    # jit and vmap (over a leading axis of logits, tokens and support), bf16 logits.
    logits3 = jnp.tile(logits, (4, 1, 1)).astype(jnp.bfloat16)
    support3 = jnp.array([[[0, 1, -1]], [[1, 2, -1]], [[2, -1, -1]], [[0, 2, 1]]])
    fn = jax.jit(jax.vmap(lambda z, t, s: opj.token_logprobs(z, t, support=s)))
    got = fn(logits3, jnp.ones((4, 1), int), support3)
    assert got.dtype == jnp.float32
    want = [np.log(0.3 / 0.8), np.log(0.3 / 0.5), -np.inf, np.log(0.3)]
    np.testing.assert_allclose(got[:, 0], want, rtol=1e-2)  # bf16 logits


@pytest.mark.heavy
@pytest.mark.parametrize("k", [1, 4, 31])
def test_trainers_own_top_k_set_equals_top_k(k):
    rng = np.random.default_rng(k)
    hidden = jnp.asarray(rng.normal(size=(2, 6, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(8, 40)), jnp.float32)
    logits = hidden @ w
    ids = jax.lax.top_k(logits / 0.7, k)[1]  # continuous logits: no ties at the k-th value
    tokens = jnp.where(jnp.arange(6) % 2 == 0, ids[..., 0], ids[..., -1] if k > 1 else 3)
    # Jitted: one compile per call, not an eager dispatch per operation.
    logprobs = functools.partial(opj.token_logprobs, temperature=0.7, return_entropy=True)
    want, want_ent = jax.jit(functools.partial(logprobs, top_k=k))(logits, tokens)
    got, ent = jax.jit(logprobs)(logits, tokens, support=ids)
    _close(got, np.asarray(want, np.float64), 1e-6)  # same set; the sums' order may differ
    np.testing.assert_allclose(ent, want_ent, rtol=1e-6, atol=1e-6)
    from_hidden = functools.partial(opj.token_logprobs_from_hidden, temperature=0.7, chunk_size=5)
    got_h = jax.jit(from_hidden)(hidden, w, tokens, support=ids)
    _close(got_h, np.asarray(want, np.float64), 1e-5)


def _hidden_case(seed=0, n=(2, 5), dim=6, vocab=30, k=5):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=n + (dim,)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(dim, vocab)), jnp.float32)
    support = rng.integers(0, vocab, size=n + (k,))
    support = np.where(np.arange(k) < rng.integers(1, k + 1, size=n)[..., None], support, PAD)
    tokens = np.where(rng.random(n) < 0.8, support[..., 0], rng.integers(0, vocab, n))
    mask = (rng.random(n) > 0.2) & (jnp.asarray(tokens) == support[..., 0])
    tokens = np.where(mask, tokens, 2**30)  # garbage at masked positions
    g = jnp.asarray(rng.normal(size=(2,) + n), jnp.float32)
    return hidden, w, jnp.asarray(tokens), jnp.asarray(support), jnp.asarray(mask), g


def _objective(fn, mask, g):
    def loss(h, w):
        lp, ent = fn(h, w)
        return jnp.sum(jnp.where(mask, lp, 0.0) * g[0]) + jnp.sum(jnp.where(mask, ent, 0.0) * g[1])

    return loss


@pytest.mark.heavy
def test_from_hidden_gradient_matches_autodiff_and_numerics():
    hidden, w, tokens, support, mask, g = _hidden_case()
    kw = dict(support=support, return_entropy=True, temperature=0.8)
    mine = _objective(
        lambda h, w: opj.token_logprobs_from_hidden(h, w, tokens, chunk_size=3, **kw), mask, g
    )
    ref = _objective(lambda h, w: opj.token_logprobs(h @ w, tokens, **kw), mask, g)
    got = jax.grad(mine, (0, 1))(hidden, w)
    want = jax.grad(ref, (0, 1))(hidden, w)
    for a, b in zip(got, want, strict=True):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
    # Only the kept columns of W receive a gradient.
    listed = np.asarray(support)
    kept = np.isin(np.arange(w.shape[1]), listed[listed != PAD])
    assert np.all(np.asarray(got[1])[:, ~kept] == 0)
    check_grads(mine, (hidden, w), order=1, modes=["rev"], atol=5e-3, rtol=5e-3)
    # bf16 inputs: float32 arithmetic, gradients in the input dtype.
    dh, dw = jax.grad(mine, (0, 1))(hidden.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    assert dh.dtype == dw.dtype == jnp.bfloat16


def _temp_bytes(fn, *shapes):
    return jax.jit(fn).lower(*shapes).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.heavy
def test_from_hidden_temp_memory_is_order_n_k_at_v_131072():
    """Compiled temporary memory: O(N·K) + one chunk's gathered columns, whatever V."""
    n, dim, k, chunk = 512, 32, 16, 128
    temps = {}
    for vocab in (65536, 131072):
        shapes = (
            jax.ShapeDtypeStruct((n, dim), jnp.float32),
            jax.ShapeDtypeStruct((dim, vocab), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.int32),
            jax.ShapeDtypeStruct((n, k), jnp.int32),
        )

        def logp(h, w, t, s):
            return opj.token_logprobs_from_hidden(h, w, t, support=s, chunk_size=chunk)

        def grads(h, w, t, s):
            return jax.grad(lambda h, w: jnp.sum(logp(h, w, t, s)), (0, 1))(h, w)

        temps[vocab] = (_temp_bytes(logp, *shapes), _temp_bytes(grads, *shapes))
    forward, backward = temps[131072]
    columns = chunk * k * dim * 4  # one chunk's gathered [D, chunk, K] float32 columns
    assert forward <= 2 * columns + 16 * n * k * 4, temps
    assert backward <= 3 * columns + 16 * n * k * 4, temps  # + the dW terms of a chunk
    assert temps[65536] == temps[131072], temps  # independent of V
    # For scale: the logits alone would take n·V·4 = 256 MiB, dW 16 MiB.
    assert backward < (dim * 131072 * 4) // 8


def np_support_from_csr(token_ids, offsets, max_size, pad=PAD):
    out = np.full((len(offsets) - 1, max_size), pad)
    for t in range(len(offsets) - 1):
        kept = token_ids[offsets[t] : offsets[t + 1]]
        out[t, : len(kept)] = kept
    return out


def test_support_from_csr_matches_numpy_and_rejects_bad_offsets():
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 5, size=(3, 7))
    offsets = np.concatenate([np.zeros((3, 1), int), np.cumsum(counts, axis=-1)], axis=-1)
    token_ids = rng.integers(0, 100, size=(3, int(offsets[:, -1].max()) + 2))
    got = opj.support_from_csr(token_ids, offsets)
    want = np.stack([np_support_from_csr(token_ids[i], offsets[i], 4) for i in range(3)])
    np.testing.assert_array_equal(got, want)
    assert got.dtype == jnp.int32
    with pytest.raises(ValueError, match="max_size"):
        opj.support_from_csr(token_ids, offsets, max_size=2)
    with pytest.raises(ValueError, match="non-decreasing"):
        opj.support_from_csr([1, 2], [0, 2, 1])
    with pytest.raises(TypeError, match="token_ids"):
        opj.support_from_csr([1.0, 2.0], [0, 2])
    # Under jit a set larger than K cannot raise: its token's log-prob becomes NaN.
    sup = jax.jit(functools.partial(opj.support_from_csr, max_size=2))(token_ids, offsets)
    over = counts > 2
    assert np.all(np.asarray(sup)[over] == np.iinfo(np.int32).max)
    logits = jnp.zeros((3, 7, 100))
    lp = opj.token_logprobs(logits, jnp.asarray(sup[..., 0].clip(0, 99)), support=sup)
    assert np.all(np.isnan(np.asarray(lp)[over]))
    assert not np.any(np.isnan(np.asarray(lp)[~over]))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(support=np.zeros((2, 3, 2))), TypeError, "support"),
        (dict(support=np.zeros((2, 4, 2), int)), ValueError, "support"),
        (dict(support=np.zeros((2, 3, 0), int)), ValueError, "K >= 1"),
        (dict(support=np.zeros((2, 3, 2), int), top_k=2), ValueError, "not both"),
        (dict(support=np.zeros((2, 3, 2), int), support_pad=True), TypeError, "support_pad"),
    ],
)
def test_bad_support_is_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        opj.token_logprobs(jnp.zeros((2, 3, 5)), jnp.zeros((2, 3), int), **kwargs)
    hidden_kwargs = {k: v for k, v in kwargs.items() if k != "top_k"}
    if "top_k" not in kwargs:
        with pytest.raises(error, match=match):
            opj.token_logprobs_from_hidden(
                jnp.zeros((2, 3, 4)), jnp.zeros((4, 5)), jnp.zeros((2, 3), int), **hidden_kwargs
            )


@pytest.mark.multi_device
@pytest.mark.slow
@pytest.mark.usefixtures("clear_jax_caches")
def test_vocab_sharded_support_equals_unsharded():
    """shard_map with the vocabulary over 4 devices (ids global) and jit over an
    Explicit mesh: values and gradients equal the unsharded call."""
    if len(jax.devices("cpu")) < 8:
        pytest.skip("needs JAX_NUM_CPU_DEVICES=8 (tests/conftest.py)")
    hidden, w, tokens, support, mask, g = _hidden_case(1, n=(4, 6), vocab=32)
    kw = dict(support=support, return_entropy=True, chunk_size=5)
    want = jax.grad(
        _objective(lambda h, w: opj.token_logprobs_from_hidden(h, w, tokens, **kw), mask, g), (0, 1)
    )(hidden, w)
    want_lp = opj.token_logprobs_from_hidden(hidden, w, tokens, **kw)
    mesh = jax.make_mesh(
        (2, 4),
        ("data", "vocab"),
        axis_types=(AxisType.Explicit,) * 2,
        devices=jax.devices("cpu")[:8],
    )

    def step(h, w, tok, sup, m, g):
        def fn(h, w):
            return opj.token_logprobs_from_hidden(
                h, w, tok, support=sup, return_entropy=True, chunk_size=5, axis_name="vocab"
            )

        grads = jax.grad(_objective(fn, m, g), (0, 1))(h, w)
        return fn(h, w), grads

    specs = (P("data"), P(None, "vocab"), P("data"), P("data"), P("data"), P(None, "data"))
    with jax.set_mesh(mesh):
        args = [
            jax.device_put(x, NamedSharding(mesh, s))
            for x, s in zip((hidden, w, tokens, support, mask, g), specs, strict=True)
        ]
        (lp, _), (dh, dw) = jax.jit(
            jax.shard_map(
                step,
                mesh=mesh,
                in_specs=specs,
                out_specs=((P("data"), P("data")), (P("data"), P(None, "vocab"))),
            )
        )(*args)
        # dW comes back summed over the data shards (W is replicated over them).
        _close(lp, np.asarray(want_lp[0], np.float64), 1e-5)
        np.testing.assert_allclose(dh, want[0], rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(dw, want[1], rtol=2e-5, atol=2e-5)
        explicit = jax.jit(lambda h, w, t, s: opj.token_logprobs_from_hidden(h, w, t, support=s))(
            jax.device_put(hidden, NamedSharding(mesh, P("data"))),
            jax.device_put(w, NamedSharding(mesh, P(None, "vocab"))),
            jax.device_put(tokens, NamedSharding(mesh, P("data"))),
            jax.device_put(support, NamedSharding(mesh, P("data"))),
        )
        _close(explicit, np.asarray(want_lp[0], np.float64), 1e-5)
