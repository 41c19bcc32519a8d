"""Log-probs renormalised over the sampler's exact support (its kept token set).

With top-k / top-p sampling the inference engine draws from ``softmax(z)`` restricted
to a kept set ``S_t`` and reports ``log π_rollout(y_t) = z_{t,y_t} − logsumexp_{S_t} z``.
Recomputing ``S_t`` from the trainer's own logits (``token_logprobs(top_k=, top_p=)``)
gives a *different* set whenever the two engines' logits differ, which is the very
mismatch being corrected; the engine can instead return ``S_t`` itself ("Keep Sampling
Mask", DeepSeek-V3.2, arXiv:2512.02556 §3.1; vLLM ``return_sampling_mask``, PR 49577;
SGLang ``return_sampling_mask``; prime-rl "sampling replay", PR 3235 and 3431), and the
trainer renormalises θ over exactly that set::

    log π_θ(y_t | S_t) = z_{t,y_t} − log Σ_{v ∈ S_t} exp z_{t,v},   z = logits / temperature

(``−inf`` when ``y_t ∉ S_t``, ``NaN`` for an invalid id), and the entropy
``H_t = −Σ_{v∈S_t} π(v|S_t) log π(v|S_t)`` over the same set.

The support is a padded id list ``[..., T, K]`` (entries equal to ``support_pad``,
default ``−1``, are padding; an id listed twice counts once). The padding id must lie
outside the vocabulary ``[0, V)`` (one inside raises ``ValueError``: its entries could
not be told from that token). :func:`support_from_csr`
builds it from vLLM's CSR layout (``SamplingMask(token_ids, offsets)``: the kept ids of
token ``t`` are ``token_ids[offsets[t]:offsets[t+1]]``; prime-rl's ``ids`` / ``counts``
is the same with ``offsets = [0, *cumsum(counts)]``).

:func:`kept_logprobs_from_hidden` computes the same from hidden states without ever
building ``[N, V]``: each chunk of ``chunk_size`` rows gathers only its rows' kept
columns of the unembedding (``[D, chunk, K]``), and a custom VJP recomputes them in the
backward pass and scatter-adds ``dW`` into exactly those columns. Temporary memory is
``O(N·K)`` plus ``O(chunk·K·D)``, whatever ``V``.
"""

from __future__ import annotations

import functools
import numbers
import typing
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax._src import validation as _validation
from offpolicy_jax._src.logprobs._rowchunks import chunks, loop, match_cotangent_axes, vary, vma

__all__ = ["support_from_csr"]

# The id of a token whose kept set did not fit in `max_size` (or whose CSR offsets are
# inconsistent) under jit, where no error can be raised: neither padding nor a valid id,
# so its log-prob is NaN and the correction rejects its sequence (never a silent cut).
INVALID_ID = np.iinfo(np.int32).max


# ------------------------------------------------------------------------ the support


def support_from_csr(
    token_ids: jax.typing.ArrayLike | Sequence[int],
    offsets: jax.typing.ArrayLike | Sequence[int],
    max_size: int | None = None,
    *,
    pad: int = -1,
) -> jax.Array:
    """The padded ``[..., T, K]`` support from vLLM's CSR sampling mask.

    Token ``t`` of a row kept ``token_ids[..., offsets[t]:offsets[t + 1]]`` (vLLM
    ``SamplingMask(token_ids, offsets)``, one per request; stack requests into rows,
    padding ``token_ids`` and repeating the last offset). Row ``[t, :]`` of the result
    holds those ids, then ``pad``.

    Args:
      token_ids: int ``[..., M]``, the kept ids of a row's tokens, concatenated.
      offsets: int ``[..., T + 1]``, non-decreasing, into ``token_ids`` of the same row.
      max_size: ``K``, the most ids a token may keep (static). None: the largest
        count in ``offsets`` (needs concrete offsets, not tracers); vLLM bounds it
        by ``top_k``. Under ``jit`` a token keeping more than ``K`` ids (or with
        inconsistent offsets: decreasing, negative or past ``token_ids``) gets the
        invalid id ``2**31 − 1``, so its log-prob is NaN; outside ``jit`` it raises.
      pad: the padding id, not in ``[0, V)`` (default ``−1``); an int32 other than
        the invalid id.

    Returns:
      int32 ``[..., T, K]``.

    Raises:
      ValueError: concrete offsets that decrease, are negative, point past
        ``token_ids``, or count more than ``max_size`` ids for a token; ids or offsets
        of a wider integer dtype beyond int32 (they would wrap to other values).

    Examples:
      >>> import offpolicy_jax as opj
      >>> opj.support_from_csr([5, 2, 7, 1, 4], [0, 3, 5]).tolist()  # T = 2 tokens
      [[5, 2, 7], [1, 4, -1]]
      >>> counts = [1, 2]  # prime-rl's layout: ids and per-token counts
      >>> opj.support_from_csr([9, 3, 4], [0, *np.cumsum(counts)], max_size=2).tolist()
      [[9, -1], [3, 4]]
    """
    ids, offsets = _integer_array("token_ids", token_ids), _integer_array("offsets", offsets)
    pad = _check_pad(pad, "pad")
    if ids.ndim < 1 or offsets.ndim < 1 or offsets.shape[-1] < 1:
        raise ValueError(
            f"token_ids must be [..., M] and offsets [..., T + 1]; got {ids.shape}, {offsets.shape}"
        )
    if ids.shape[:-1] != offsets.shape[:-1]:
        raise ValueError(
            f"token_ids {ids.shape} and offsets {offsets.shape} must share their leading axes"
        )
    counts = offsets[..., 1:] - offsets[..., :-1]
    raw = _concrete(offsets)
    concrete = raw is not None
    if raw is not None:
        if np.any(np.diff(raw, axis=-1) < 0) or np.any(raw < 0) or np.any(raw > ids.shape[-1]):
            raise ValueError(
                "offsets must be non-decreasing and within [0, token_ids.shape[-1]] = "
                f"[0, {ids.shape[-1]}]"
            )
    if max_size is None:
        if not concrete:
            raise ValueError("support_from_csr: max_size is required under jit (static K)")
        max_size = max(int(np.max(np.asarray(counts), initial=0)), 1)
    if not isinstance(max_size, numbers.Integral) or isinstance(max_size, bool) or max_size < 1:
        raise ValueError(f"max_size must be an int >= 1, got {max_size!r}")
    if concrete and np.any(np.asarray(counts) > max_size):
        raise ValueError(
            f"a token keeps {int(np.max(np.asarray(counts)))} ids, more than max_size = {max_size}"
        )
    length = ids.shape[-1]
    k = jnp.arange(max_size)
    pos = offsets[..., :-1, None] + k  # [..., T, K]
    inside = k < counts[..., None]
    flat = pos.reshape(*pos.shape[:-2], -1)
    picked = jnp.take_along_axis(ids, jnp.clip(flat, 0, max(length - 1, 0)), axis=-1)
    picked = picked.reshape(pos.shape) if length else jnp.zeros(pos.shape, ids.dtype)
    out = jnp.where(inside, picked, pad).astype(jnp.int32)
    # A negative start would be clipped to 0 and read ids of another token.
    broken = (counts > max_size) | (counts < 0) | (offsets[..., :-1] < 0)
    broken = broken | (offsets[..., 1:] > length)
    return jnp.where(broken[..., None], INVALID_ID, out)


def _concrete(x: jax.Array) -> np.ndarray | None:
    """``x`` as NumPy, or None under a trace (where its values are unknown)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _integer_array(name: str, x) -> jax.Array:
    x = _validation.as_array(name, x)  # a list: named errors, int64 checked below
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array of token ids, got dtype {dtype}")
    # int64 ids beyond int32 would wrap (x64 off) to other, valid ids: refused.
    _validation.check_int32_ids(name, x)
    return jnp.asarray(x)


def _check_pad(pad, name: str, vocab: int | None = None) -> int:
    """The padding id: an int32 that is neither the invalid id nor (when ``vocab`` is
    known) a token id, so that padding and kept ids cannot be confused."""
    if not isinstance(pad, numbers.Integral) or isinstance(pad, bool):
        raise TypeError(f"{name} must be an int, got {pad!r}")
    pad = int(pad)
    if not _INT32_MIN <= pad < INVALID_ID:
        raise ValueError(
            f"{name} must be an int32 other than {INVALID_ID} (the invalid id), got {pad}"
        )
    if vocab is not None and 0 <= pad < vocab:
        raise ValueError(
            f"{name} = {pad} is a token id of the vocabulary [0, {vocab}): its entries would "
            "remove that token from every kept set; use a padding id outside it (default -1)"
        )
    return pad


_INT32_MIN = int(np.iinfo(np.int32).min)


def check_support(
    support, support_pad, batch_shape: tuple[int, ...], vocab: int
) -> tuple[jax.Array, int]:
    """Validates ``support`` (int ``[..., T, K]``, ``K >= 1``) against ``[..., T]`` and
    ``support_pad`` against the vocabulary ``[0, vocab)``."""
    support = _integer_array("support", support)
    pad = _check_pad(support_pad, "support_pad", vocab)
    if support.ndim != len(batch_shape) + 1 or support.shape[:-1] != tuple(batch_shape):
        raise ValueError(
            f"support must have shape [..., T, K] with [..., T] = {tuple(batch_shape)}, got "
            f"{support.shape}"
        )
    if support.shape[-1] < 1:
        raise ValueError(f"support must hold K >= 1 ids per token, got shape {support.shape}")
    return support, pad


def prepare(support: jax.Array, pad: int, vocab: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(ids, valid, broken)``: the ids with duplicates turned into padding, the
    ``[..., T, K]`` mask of real in-range ids, and ``[..., T]`` rows holding an id that
    is neither padding nor in ``[0, vocab)`` (their log-prob is NaN)."""
    ids = jnp.sort(support.astype(jnp.int32), axis=-1)
    repeat = jnp.concatenate(
        [jnp.zeros_like(ids[..., :1], bool), ids[..., 1:] == ids[..., :-1]], axis=-1
    )
    real = (ids != pad) & ~repeat
    in_range = (ids >= 0) & (ids < vocab)
    return ids, real & in_range, jnp.any(real & ~in_range, axis=-1)


def _log_normaliser(z: jax.Array, keep: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(m, log s)`` with ``log Σ_keep e^z = m + log s``, ``m`` the kept maximum (0 for
    an empty set, where ``log s`` is 0 too), without the NaN gradient
    ``jax.nn.logsumexp`` gives a row of −inf.

    The two are kept apart: callers subtract ``m`` first, ``(z − m) − log s``. The kept
    set's maximum may sit far below the row's (or be large itself, from hidden
    states), and ``m + log s`` rounds to an ulp of ``m`` (0.016 at 1.6e5).
    """
    m = jnp.max(jnp.where(keep, z, -jnp.inf), axis=-1)
    nonempty = jnp.isfinite(m)
    m = jax.lax.stop_gradient(jnp.where(nonempty, m, 0.0))
    s = jnp.sum(jnp.where(keep, jnp.exp(jnp.where(keep, z, 0.0) - m[..., None]), 0.0), axis=-1)
    return m, jnp.log(jnp.where(nonempty, s, 1.0))


def finish(raw, tokens, ids, valid, broken, vocab):
    """``raw = z_y − lse`` where the token is in the kept set, ``−inf`` where it is not,
    NaN for an out-of-range token or a row with an invalid id."""
    hit = jnp.any(valid & (ids == tokens[..., None]), axis=-1)
    ok = (tokens >= 0) & (tokens < vocab) & ~broken
    return jnp.where(ok, jnp.where(hit, raw, -jnp.inf), jnp.nan)


def logprobs_over_support(z, tokens, support, pad, return_entropy):
    """:func:`~offpolicy_jax.token_logprobs` with ``support``: ``z`` the scaled float32
    logits ``[..., T, V]``; autodiff through the gathers."""
    vocab = z.shape[-1]
    ids, valid, broken = prepare(support, pad, vocab)
    zk = jnp.take_along_axis(z, jnp.where(valid, ids, 0), axis=-1)
    m, log_s = _log_normaliser(zk, valid)
    target = jnp.sum(jnp.where(valid & (ids == tokens[..., None]), zk, 0.0), axis=-1)
    logp = finish((target - m) - log_s, tokens, ids, valid, broken, vocab)
    if not return_entropy:
        return logp
    shifted = jnp.where(valid, (zk - m[..., None]) - log_s[..., None], 0.0)
    entropy = -jnp.sum(jnp.where(valid, jnp.exp(shifted) * shifted, 0.0), axis=-1)
    return logp, entropy


# ------------------------------------------------------------ from the hidden states


def _kept_logits(h, w, ids, valid, inv_t, offset):
    """``z [c, K]`` of the rows' kept ids held by this device (``mine``), the gathered
    columns ``[D, c, K]`` and their local indices."""
    local = ids - offset
    mine = valid & (local >= 0) & (local < w.shape[1])
    index = jnp.where(mine, local, 0)
    cols = jnp.take(w, index, axis=1, mode="clip")  # [D, c, K]: only the kept columns
    z = jnp.einsum("cd,dck->ck", h, cols, preferred_element_type=jnp.float32) * inv_t
    return jnp.where(mine, z, 0.0), mine, cols, index


def _offset(w, axis_name):
    return 0 if axis_name is None else jax.lax.axis_index(axis_name) * w.shape[1]


def _chunk_stats(h, w, tok, ids, valid, inv_t, axis_name):
    """``[5, c]``: ``z_y − lse``, entropy, and the residuals ``m``, ``log s`` and
    ``E[z − m]`` over the kept set (``lse = m + log s``, ``m`` the kept maximum; the
    vocabulary shards combined by one ``pmax`` and one ``psum`` of ``[c]`` vectors).

    Everything is relative to ``m``: ``(z_y − m) − log s`` is exact to float32
    rounding of the log-prob, where ``z_y − (m + log s)`` would round ``lse`` to an
    ulp of the logits (0.016 at 1.6e5); likewise the entropy ``log s − E[z − m]``."""
    z, mine, _, _ = _kept_logits(h, w, ids, valid, inv_t, _offset(w, axis_name))
    m = jnp.max(jnp.where(mine, z, -jnp.inf), axis=-1)
    if axis_name is not None:
        m = jax.lax.pmax(m, axis_name)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    shifted = jnp.where(mine, z - m[:, None], 0.0)
    e = jnp.where(mine, jnp.exp(shifted), 0.0)
    sums = (
        jnp.sum(e, axis=-1),
        jnp.sum(e * shifted, axis=-1),
        jnp.sum(jnp.where(mine & (ids == tok[:, None]), shifted, 0.0), axis=-1),
    )
    if axis_name is not None:
        sums = jax.lax.psum(sums, axis_name)
    s, t, zt = sums
    some = s > 0
    s1 = jnp.where(some, s, 1.0)
    log_s = jnp.log(s1)
    expected = t / s1
    return jnp.stack([zt - log_s, jnp.where(some, log_s - expected, 0.0), m, log_s, expected])


def _forward(h, w, tok, ids, valid, inv_t, chunk, axis_name):
    n = h.shape[0]
    num, c = chunks(n, chunk)
    axes = vma(h) | vma(w) | vma(tok) | vma(ids)
    out_axes = axes - {axis_name}

    def body(out, start, lo):
        del lo  # overlap rows are recomputed to the same values

        def rows(x):
            return jax.lax.dynamic_slice_in_dim(x, start, c, axis=0)

        stats = _chunk_stats(rows(h), w, rows(tok), rows(ids), rows(valid), inv_t, axis_name)
        return jax.lax.dynamic_update_slice_in_dim(out, vary(stats, out_axes), start, axis=1)

    return loop(num, c, n, body, vary(jnp.zeros((5, n), jnp.float32), out_axes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _kept(h, w, tok, ids, valid, inv_t, chunk, axis_name, with_entropy):
    out = _forward(h, w, tok, ids, valid, inv_t, chunk, axis_name)
    return out[0], out[1]


def _kept_fwd(h, w, tok, ids, valid, inv_t, chunk, axis_name, with_entropy):
    out = _forward(h, w, tok, ids, valid, inv_t, chunk, axis_name)
    # Residuals: the inputs and three [N] vectors; the [N, K] logits are recomputed.
    return (out[0], out[1]), (h, w, tok, ids, valid, inv_t, out[2], out[3], out[4])


def _chunk_grads(h, w, tok, ids, valid, inv_t, stats, g_logp, g_ent, axis_name):
    """(dh ``[c, D]``, the ``[D, c, K]`` dW terms of the kept columns, their indices);
    ``stats``: the rows' ``(m, log s, E[z − m])`` of the forward pass."""
    m, log_s, expected = stats
    z, mine, cols, index = _kept_logits(h, w, ids, valid, inv_t, _offset(w, axis_name))
    shifted = jnp.where(mine, z - m[:, None], 0.0)
    prob = jnp.where(mine, jnp.exp(shifted - log_s[:, None]), 0.0)
    onehot = jnp.where(mine & (ids == tok[:, None]), 1.0, 0.0)
    # d logp / dz = onehot − p;  dH / dz = −p (z − E[z]), on the kept set only.
    dz = g_logp[:, None] * (onehot - prob)
    if g_ent is not None:
        dz = dz - g_ent[:, None] * prob * (shifted - expected[:, None])
    dz = jnp.where(mine, dz * inv_t, 0.0)
    dh = jnp.einsum("ck,dck->cd", dz, cols, preferred_element_type=jnp.float32)
    dw_terms = jnp.einsum("cd,ck->dck", h.astype(jnp.float32), dz)
    return dh, dw_terms, index


def _kept_bwd(chunk, axis_name, with_entropy, residuals, cotangents):
    h, w, tok, ids, valid, inv_t, m, log_s, expected = residuals
    g_logp, g_ent = cotangents
    n = h.shape[0]
    num, c = chunks(n, chunk)
    axes = vma(h) | vma(w) | vma(tok) | vma(ids) | vma(g_logp) | vma(g_ent)

    def body(carry, start, lo):
        dh, dw = carry

        def rows(x):
            return jax.lax.dynamic_slice_in_dim(x, start, c, axis=0)

        # Overlap rows (below lo) belong to the previous chunk: a zero cotangent keeps
        # dW from counting them twice, and their dh is kept from that chunk.
        own = start + jnp.arange(c) >= lo
        dh_c, dw_terms, index = _chunk_grads(
            rows(h),
            w,
            rows(tok),
            rows(ids),
            rows(valid),
            inv_t,
            (rows(m), rows(log_s), rows(expected)),
            jnp.where(own, rows(g_logp), 0.0),
            jnp.where(own, rows(g_ent), 0.0) if with_entropy else None,
            axis_name,
        )
        dh_c = jnp.where(own[:, None], dh_c, rows(dh))
        dh = jax.lax.dynamic_update_slice_in_dim(dh, dh_c, start, axis=0)
        # Scatter-add into exactly the kept columns (padding adds 0 to column 0).
        dw = dw.at[:, index].add(dw_terms)
        return vary((dh, dw), axes)

    init = vary((jnp.zeros(h.shape, jnp.float32), jnp.zeros(w.shape, jnp.float32)), axes)
    dh, dw = loop(num, c, n, body, init)
    dh, dw = match_cotangent_axes(dh, dw, h, w, axis_name)
    return (
        dh,
        dw,
        np.zeros(tok.shape, jax.dtypes.float0),
        np.zeros(ids.shape, jax.dtypes.float0),
        np.zeros(valid.shape, jax.dtypes.float0),
        jnp.zeros_like(inv_t),
    )


_kept.defvjp(_kept_fwd, _kept_bwd)


def kept_logprobs_from_hidden(hidden, unembedding, tokens, support, pad, inv_t, **kw):
    """``(logp, entropy)`` ``[N]`` over the kept ids of rows ``hidden [N, D]``.

    ``kw``: ``chunk_size``, ``axis_name`` (the vocabulary's mesh axis inside
    ``shard_map``; ids are global, each device gathers the ones it holds) and
    ``return_entropy``. Values and gradients as :func:`logprobs_over_support` on
    ``hidden @ unembedding``; see the module docstring for memory.
    """
    axis_name = kw["axis_name"]
    vocab = unembedding.shape[1]
    if axis_name is not None:
        vocab = vocab * jax.lax.psum(1, axis_name)
    ids, valid, broken = prepare(support, pad, vocab)
    # typing.cast: custom_vjp's call loses its type (see logprobs.token_logprobs_from_hidden).
    raw, entropy = typing.cast(
        tuple[jax.Array, jax.Array],
        _kept(
            hidden,
            unembedding,
            tokens,
            ids,
            valid,
            inv_t,
            int(kw["chunk_size"]),
            axis_name,
            bool(kw["return_entropy"]),
        ),
    )
    return finish(raw, tokens, ids, valid, broken, vocab), entropy
