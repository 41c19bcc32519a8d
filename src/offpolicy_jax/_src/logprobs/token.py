"""Token log-probs from the model: sampler-consistent, and without ``[..., T, V]`` logits.

Every use of the library starts from ``log π(y_t)``, the log-prob of each sampled
token. Two functions compute it:

* :func:`token_logprobs` from logits ``[..., T, V]``, optionally renormalised over the
  support the inference engine sampled from (temperature, top-k, top-p), so that
  ``π_old`` and ``π_rollout`` compare like with like.
* :func:`token_logprobs_from_hidden` from the last hidden states ``[..., T, D]`` and the
  unembedding ``[D, V]``: the same values and gradients, chunked over tokens (and
  optionally vocabulary) with a custom VJP that recomputes each chunk's logits in the
  backward pass, so no ``[..., T, V]`` array ever exists (the idea of Liger Kernel's
  fused linear cross-entropy and of Cut Cross-Entropy, Wijmans et al. 2024,
  "Cut Your Losses in Large-Vocabulary Language Models", arXiv:2411.09009). It also
  runs with the vocabulary sharded over a mesh axis (tensor-parallel unembedding).

Sampler semantics (vLLM ``vllm/v1/sample/ops/topk_topp_sampler.py::apply_top_k_top_p``
and SGLang's torch sampler apply the same order): with ``z = logits / temperature``,

1. **top-k**: keep every token whose ``z`` is ``>=`` the k-th largest ``z``. Tokens tied
   with the k-th value are all kept (vLLM's ``logits_sort < kth`` mask does the same),
   so the support may hold more than k tokens. ``k >= V`` keeps everything.
2. **top-p** over the distribution ``q`` renormalised after top-k: keep token ``i`` iff
   the mass of the tokens *strictly more probable* than ``i`` is ``< p``. This is vLLM's
   rule (drop a token when the ascending cumulative mass up to it is ``<= 1 - p``) with
   ties at the boundary resolved by keeping the whole tied group, so the result does
   not depend on a sort's order (vLLM's unstable sort keeps an arbitrary part of a tied
   group). The most probable token is always kept; ``p = 1`` keeps everything.
3. ``log π(y) = z_y − logsumexp(z over the support)``.

Rounding: the support is decided in float32 on ``z``. A token whose cumulative mass sits
within float32 rounding of ``p`` may be decided differently by an engine summing in
another order; such cases are measure-zero for real logits.

Non-finite outputs (documented, never silent):

* a token **outside the support** gets ``−inf`` (the sampler could not have drawn it;
  ``compute_correction`` rejects the sequence as non-finite, ``mis_nonfinite_seq_fraction``,
  docs/semantics.md §0);
* a token id **out of range** (``< 0`` or ``>= V``) gets ``NaN``: invalid input, which
  the correction rejects the same way. Masked positions may hold any id: mask the
  result with ``jnp.where(mask, logp, 0)`` and the gradient there is exactly 0.
"""

from __future__ import annotations

import functools
import numbers
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from offpolicy_jax._src import validation as _validation
from offpolicy_jax._src.logprobs import sampling_support
from offpolicy_jax._src.logprobs._rowchunks import chunks as _chunks
from offpolicy_jax._src.logprobs._rowchunks import loop as _loop
from offpolicy_jax._src.logprobs._rowchunks import match_cotangent_axes
from offpolicy_jax._src.logprobs._rowchunks import vary as _vary
from offpolicy_jax._src.logprobs._rowchunks import vma as _vma

__all__ = ["token_logprobs", "token_logprobs_from_hidden"]

DEFAULT_CHUNK_SIZE = 512


# --------------------------------------------------------------------------- checks


def _check_tokens(tokens, batch_shape, logits_name: str) -> jax.Array:
    tokens = _validation.as_array("tokens", tokens)  # a list: named errors, int64 checked
    dtype = jnp.result_type(tokens)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"tokens must be an integer array of token ids, got dtype {dtype}")
    # int64 ids beyond int32 would wrap (x64 off) to another, valid id: refused.
    _validation.check_int32_ids("tokens", tokens)
    tokens = jnp.asarray(tokens)
    if tokens.shape != tuple(batch_shape):
        raise ValueError(
            f"tokens has shape {tokens.shape} but {logits_name} implies [..., T] = "
            f"{tuple(batch_shape)}"
        )
    return tokens


def _check_float(name: str, x, shape_doc: str, min_rank: int) -> jax.Array:
    if x is None:
        raise ValueError(f"{name} is required but got None")
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array {shape_doc}, got dtype {dtype}")
    x = jnp.asarray(x)
    if x.ndim < min_rank:
        raise ValueError(f"{name} must have shape {shape_doc} (rank >= {min_rank}), got {x.shape}")
    return x


def _is_python_number(x) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, bool)


def _check_temperature(temperature, batch_shape, *, scalar_only: bool) -> jax.Array:
    if isinstance(temperature, bool):
        raise TypeError("temperature must be a positive number, got a bool")
    if _is_python_number(temperature) or (
        isinstance(temperature, np.ndarray | np.generic) and np.ndim(temperature) == 0
    ):
        value = float(temperature)
        if not (np.isfinite(value) and _TINY <= value <= _HUGE):
            raise ValueError(
                f"temperature must be a finite number > 0 and a normal float32 (>= {_TINY:.4g}: "
                f"a subnormal flushes to 0), got {temperature}"
            )
        return jnp.float32(value)
    dtype = jnp.result_type(temperature)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"temperature must be a float or a float array, got dtype {dtype}")
    temperature = jnp.asarray(temperature, jnp.float32)
    _refuse_concrete(
        "temperature", temperature, _bad_temperature, "finite and >= the smallest normal float32"
    )
    if scalar_only and temperature.ndim != 0:
        raise ValueError(f"temperature must be a scalar here, got shape {temperature.shape}")
    try:
        jnp.broadcast_shapes(temperature.shape, tuple(batch_shape))
    except ValueError:
        raise ValueError(
            f"temperature of shape {temperature.shape} does not broadcast to [..., T] = "
            f"{tuple(batch_shape)}"
        ) from None
    return temperature


@_validation.read_now
def _refuse_concrete(name: str, x, invalid, rule: str) -> None:
    """Raises ``ValueError`` naming ``name`` if a concrete array ``x`` has an entry for
    which ``invalid`` holds; under jit (a tracer) such an entry gives NaN instead."""
    if _validation.is_concrete(x) and bool(jnp.any(invalid(x))):
        raise ValueError(
            f"{name} must hold values {rule}; got an array with {int(jnp.sum(invalid(x)))} "
            "entries outside (under jax.jit such an entry makes its log-prob NaN)"
        )


_TINY = float(np.finfo(np.float32).tiny)
_HUGE = float(np.finfo(np.float32).max)


def _bad_temperature(t):
    return ~(jnp.isfinite(t) & (t >= _TINY))  # a subnormal T flushes to 0 in XLA


def _bad_top_p(p):
    return ~((p > 0) & (p <= 1))  # NaN fails both comparisons


def _check_top_k(top_k, batch_shape):
    if top_k is None:
        return None
    if isinstance(top_k, bool):
        raise TypeError("top_k must be a positive int or None, got a bool")
    if isinstance(top_k, numbers.Integral) or (
        isinstance(top_k, np.ndarray | np.generic) and np.ndim(top_k) == 0
    ):
        if not jnp.issubdtype(np.asarray(top_k).dtype, jnp.integer):
            raise TypeError(f"top_k must be an int, got {top_k!r}")
        if int(top_k) < 1:
            raise ValueError(f"top_k must be >= 1 (None disables it), got {top_k}")
        return int(top_k)
    if _is_python_number(top_k):
        raise TypeError(f"top_k must be an int, got {top_k!r}")
    dtype = jnp.result_type(top_k)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"top_k must be an int or an integer array, got dtype {dtype}")
    top_k = jnp.asarray(top_k)
    try:
        jnp.broadcast_shapes(top_k.shape, tuple(batch_shape))
    except ValueError:
        raise ValueError(
            f"top_k of shape {top_k.shape} does not broadcast to [..., T] = {tuple(batch_shape)}"
        ) from None
    return top_k


def _check_top_p(top_p, batch_shape):
    if top_p is None:
        return None
    if isinstance(top_p, bool):
        raise TypeError("top_p must be a float in (0, 1] or None, got a bool")
    if _is_python_number(top_p) or (
        isinstance(top_p, np.ndarray | np.generic) and np.ndim(top_p) == 0
    ):
        value = float(top_p)
        if not (0.0 < value <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (None disables it), got {top_p}")
        return value
    dtype = jnp.result_type(top_p)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"top_p must be a float or a float array, got dtype {dtype}")
    top_p = jnp.asarray(top_p, jnp.float32)
    _refuse_concrete("top_p", top_p, _bad_top_p, "in (0, 1] (not NaN)")
    try:
        jnp.broadcast_shapes(top_p.shape, tuple(batch_shape))
    except ValueError:
        raise ValueError(
            f"top_p of shape {top_p.shape} does not broadcast to [..., T] = {tuple(batch_shape)}"
        ) from None
    return top_p


# ------------------------------------------------------------------ from the logits


def _gather_target(z: jax.Array, tokens: jax.Array) -> jax.Array:
    """``z[..., tokens]``, NaN where the id is out of range (never a wrapped index)."""
    vocab = z.shape[-1]
    in_range = (tokens >= 0) & (tokens < vocab)
    safe = jnp.where(in_range, tokens, 0)
    picked = jnp.take_along_axis(z, safe[..., None], axis=-1)[..., 0]
    return jnp.where(in_range, picked, jnp.nan)


def _support(z: jax.Array, top_k, top_p) -> jax.Array:
    """``[..., V]`` bool: the tokens the sampler could draw (see the module docstring)."""
    vocab = z.shape[-1]
    z = jax.lax.stop_gradient(z)
    if top_p is None and isinstance(top_k, int):
        # A partial sort is enough for the k-th value.
        kth = jax.lax.top_k(z, min(top_k, vocab))[0][..., -1]
        return z >= kth[..., None]
    z_sorted = -jnp.sort(-z, axis=-1)  # descending
    threshold = jnp.full(z.shape[:-1], -jnp.inf, jnp.float32)
    if top_k is not None:
        # An entry <= 0 is vLLM's per-request "off" (-1): every token, like k >= V.
        k = jnp.broadcast_to(top_k, z.shape[:-1])
        k = jnp.where(k <= 0, vocab, jnp.minimum(k, vocab))
        threshold = jnp.take_along_axis(z_sorted, (k - 1)[..., None], axis=-1)[..., 0]
        z_sorted = jnp.where(z_sorted >= threshold[..., None], z_sorted, -jnp.inf)
    if top_p is not None:
        q = jax.nn.softmax(z_sorted, axis=-1)
        inclusive = jnp.cumsum(q, axis=-1)
        exclusive = jnp.concatenate([jnp.zeros_like(inclusive[..., :1]), inclusive[..., :-1]], -1)
        p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), z.shape[:-1])
        p = jnp.where(_bad_top_p(p), 1.0, p)  # NaN-ed by the caller; keep the rest finite
        # The kept positions of the sorted row are a prefix (exclusive mass is
        # non-decreasing), at least one long; its last value is the cut, and
        # comparing values (not positions) keeps the whole group tied with it.
        count = jnp.maximum(jnp.sum(exclusive < p[..., None], axis=-1), 1)
        cut = jnp.take_along_axis(z_sorted, (count - 1)[..., None], axis=-1)[..., 0]
        cut = jnp.where(p >= 1.0, -jnp.inf, cut)
        threshold = jnp.maximum(threshold, cut)
    return z >= threshold[..., None]


def token_logprobs(
    logits: jax.typing.ArrayLike,
    tokens: jax.typing.ArrayLike,
    *,
    temperature: jax.typing.ArrayLike = 1.0,
    top_k: jax.typing.ArrayLike | None = None,
    top_p: jax.typing.ArrayLike | None = None,
    return_entropy: bool = False,
    support: jax.typing.ArrayLike | None = None,
    support_pad: int = -1,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Log-probs of the sampled tokens, optionally under the sampler's support.

    With ``z = logits / temperature`` and ``S`` the sampler's support (all tokens
    without top-k / top-p; the rules and tie handling are in the module docstring)::

        log π(y_t) = z_{t,y_t} − log Σ_{v∈S_t} exp z_{t,v}     (−inf if y_t ∉ S_t)
        H_t        = − Σ_{v∈S_t} π_t(v) log π_t(v)

    All arithmetic is float32 whatever the logits' dtype. Differentiable with respect
    to ``logits`` (the support itself is piecewise constant and carries no gradient).
    For large vocabularies prefer :func:`token_logprobs_from_hidden`, which never
    builds the ``[..., T, V]`` float32 array this function works on.

    Args:
      logits: ``[..., T, V]`` float (float32, bf16 or fp16) model outputs.
      tokens: ``[..., T]`` integer ids of the sampled tokens. An id outside
        ``[0, V)`` gives NaN (see the module docstring); mask such positions.
      temperature: ``> 0``; a Python float, or a float array broadcastable to
        ``[..., T]`` (e.g. ``[B, 1]`` per-sequence temperatures). A concrete array
        with an entry that is not finite and ``> 0`` raises ``ValueError``; under jit
        such an entry gives NaN at its positions. The logits are divided after their
        row maximum is subtracted, so any finite logits and temperature give finite
        log-probs (the argmax token's tends to 0 as ``T → 0``).
      top_k: ``None`` (off) or an int ``>= 1``, or an integer array broadcastable to
        ``[..., T]``. ``k >= V`` keeps every token; in an array an entry ``<= 0``
        disables top-k at its positions (vLLM's per-request ``top_k = -1``).
      top_p: ``None`` (off) or a float in ``(0, 1]``, or a float array broadcastable
        to ``[..., T]``. Applied after top-k, on the renormalised distribution. A
        concrete array with an entry outside ``(0, 1]`` (or NaN) raises
        ``ValueError``; under jit such an entry gives NaN at its positions.
      return_entropy: also return the entropy of the same distribution.
      support: the sampler's exact kept set instead of recomputing it: int
        ``[..., T, K]`` token ids, ``support_pad`` entries are padding (see
        :mod:`offpolicy_jax._src.logprobs.sampling_support`; :func:`~offpolicy_jax.support_from_csr`
        builds it from vLLM's CSR sampling mask). ``S_t`` is then exactly these ids
        (a repeated id counts once; an empty set gives ``−inf``); excludes ``top_k``
        and ``top_p``.
      support_pad: the padding id of ``support`` (default ``−1``), an int32 outside
        the vocabulary ``[0, V)``: a token id there raises ``ValueError`` (its
        entries could not be told from the kept token).

    Returns:
      ``logp`` ``[..., T]`` float32, or ``(logp, entropy)`` if ``return_entropy``.

    Raises:
      TypeError: float ``tokens``, integer ``logits``, a non-integer ``top_k``.
      ValueError: rank/shape mismatch, ``top_p`` outside ``(0, 1]``, a scalar
        ``top_k < 1``, ``temperature <= 0`` (arrays: where their values are concrete),
        ``tokens`` or ``support`` of a wider integer dtype holding ids beyond int32,
        a ``support_pad`` in ``[0, V)``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import offpolicy_jax as opj
      >>> logits = jnp.log(jnp.array([[[0.5, 0.3, 0.2]]]))
      >>> opj.token_logprobs(logits, jnp.array([[1]])).round(4)
      Array([[-1.204]], dtype=float32)
      >>> jnp.exp(opj.token_logprobs(logits, jnp.array([[1]]), top_k=2)).round(4)  # 0.3 / 0.8
      Array([[0.375]], dtype=float32)
      >>> opj.token_logprobs(logits, jnp.array([[2]]), top_p=0.6)  # outside {0, 1}
      Array([[-inf]], dtype=float32)
    """
    logits = _check_float("logits", logits, "[..., T, V]", 2)
    batch_shape = logits.shape[:-1]
    tokens = _check_tokens(tokens, batch_shape, "logits [..., T, V]")
    temperature = _check_temperature(temperature, batch_shape, scalar_only=False)
    top_k = _check_top_k(top_k, batch_shape)
    top_p = _check_top_p(top_p, batch_shape)
    if support is not None:
        support, support_pad = _check_given_support(
            support, support_pad, logits.shape, top_k, top_p
        )
    if isinstance(top_p, float) and top_p >= 1.0:
        top_p = None

    # Invalid per-position sampler settings (checked eagerly above; traced values are
    # not read): NaN at those positions, computed with harmless stand-ins meanwhile.
    invalid = jnp.broadcast_to(_bad_temperature(temperature), batch_shape)
    temperature = jnp.where(_bad_temperature(temperature), 1.0, temperature)
    if top_p is not None and not isinstance(top_p, float):
        invalid = invalid | jnp.broadcast_to(_bad_top_p(top_p), batch_shape)
    z = _scaled(logits, temperature)
    if support is not None:
        out = sampling_support.logprobs_over_support(
            z, tokens, support, support_pad, return_entropy
        )
        return jax.tree.map(lambda x: jnp.where(invalid, jnp.nan, x), out)
    if top_k is not None or top_p is not None:
        keep = _support(z, top_k, top_p)
        z = jnp.where(keep, z, -jnp.inf)
    lse = jax.nn.logsumexp(z, axis=-1)
    logp = jnp.where(invalid, jnp.nan, _gather_target(z, tokens) - lse)
    if not return_entropy:
        return logp
    shifted = z - lse[..., None]
    prob = jnp.exp(shifted)
    # 0 * (-inf) would be NaN for tokens outside the support: in the value, and in the
    # gradient of the branch jnp.where discards unless -inf is replaced inside it too.
    kept = prob > 0
    entropy = -jnp.sum(jnp.where(kept, prob * jnp.where(kept, shifted, 0.0), 0.0), axis=-1)
    return logp, jnp.where(invalid, jnp.nan, entropy)


def _scaled(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """``(logits − max) / T`` in float32: the row maximum is subtracted *before* dividing,
    so that finite logits cannot overflow (``3e38 / 0.5`` is inf, and inf − inf NaN;
    N(0, 2) logits at ``T = 1e-38`` too). Log-probs, entropy and support are invariant
    to the shift, and it carries no gradient (the shift's derivatives cancel)."""
    logits = logits.astype(jnp.float32)
    peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)  # all -inf rows, or a non-finite logit
    return (logits - peak) / temperature[..., None]


def _check_given_support(support, support_pad, logits_shape, top_k, top_p):
    if top_k is not None or top_p is not None:
        raise ValueError(
            "support is the sampler's kept set itself (the result of its top-k / top-p): "
            "pass support or top_k / top_p, not both"
        )
    return sampling_support.check_support(
        support, support_pad, tuple(logits_shape[:-1]), logits_shape[-1]
    )


# ------------------------------------------------------------ from the hidden states


def _block(h, w, v_start, v_size, v_lo, inv_t):
    """Scaled logits ``[c, v_size]`` of one vocabulary block, its column ids and the
    mask of its own (non-overlap) columns."""
    w_block = jax.lax.dynamic_slice_in_dim(w, v_start, v_size, axis=1)
    z = jnp.matmul(h, w_block, preferred_element_type=jnp.float32) * inv_t
    cols = v_start + jnp.arange(v_size)
    return z, cols, cols >= v_lo


def _row_stats(h, w, tok, inv_t, v_chunk, axis_name, with_entropy, axes):
    """(m, log s, target logit, E[z − m], token id in range) of the rows ``h [c, D]``,
    by an online log-sum-exp ``lse = m + log s`` over the vocabulary blocks.

    ``m`` (the row maximum) and ``log s`` stay apart, and the sum behind ``E[z − m]``
    is kept relative to the running maximum: the log-prob ``(z_y − m) − log s`` and
    the entropy ``log s − E[z − m]`` are then exact to their own float32 rounding,
    where ``z_y − (m + log s)`` rounds ``lse`` to an ulp of the logits (0.016 at
    1.6e5) as the logits path, which shifts first, does not."""
    vocab_local = w.shape[1]
    num_v, v_size = _chunks(vocab_local, v_chunk or vocab_local)
    offset, vocab = 0, vocab_local
    if axis_name is not None:
        offset = jax.lax.axis_index(axis_name) * vocab_local
        vocab = vocab_local * jax.lax.psum(1, axis_name)
    local_tok = tok - offset

    def body(carry, v_start, v_lo):
        m, s, t, zt = carry
        z, cols, own = _block(h, w, v_start, v_size, v_lo, inv_t)
        z = jnp.where(own, z, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(z, axis=-1))
        scale = jnp.exp(m - m_new)
        shifted = z - m_new[:, None]
        e = jnp.exp(shifted)
        if with_entropy:
            # Σ e^(z − m)(z − m) moved to the new maximum (s is 0 while m is −inf).
            moved = s * jnp.where(jnp.isfinite(m), m - m_new, 0.0)
            t = (t + moved) * scale + jnp.sum(jnp.where(own, e * shifted, 0.0), axis=-1)
        s = s * scale + jnp.sum(e, axis=-1)
        zt = zt + jnp.sum(jnp.where(own & (cols == local_tok[:, None]), z, 0.0), axis=-1)
        return _vary((m_new, s, t, zt), axes)

    zeros = jnp.zeros(h.shape[:1], jnp.float32)
    init = _vary((jnp.full(h.shape[:1], -jnp.inf, jnp.float32), zeros, zeros, zeros), axes)
    m, s, t, zt = _loop(num_v, v_size, vocab_local, body, init)
    if axis_name is not None:
        # Only [c]-sized values cross devices: the max, then the rescaled sums.
        m_all = jax.lax.pmax(m, axis_name)
        scale = jnp.exp(m - m_all)
        t = (t + s * jnp.where(jnp.isfinite(m), m - m_all, 0.0)) * scale
        s, t, zt = jax.lax.psum((s * scale, t, zt), axis_name)
        m = m_all
    return m, jnp.log(s), zt, t / s, (tok >= 0) & (tok < vocab)


def _row_grads(h, w, tok, inv_t, stats, g_logp, g_ent, v_chunk, axis_name, axes):
    """(dh ``[c, D]``, dW ``[D, V_local]``), float32 partial sums, of the rows ``h``;
    ``stats``: their ``(m, log s, E[z − m])`` of the forward pass."""
    m, log_s, expected = stats
    vocab_local = w.shape[1]
    num_v, v_size = _chunks(vocab_local, v_chunk or vocab_local)
    offset = 0 if axis_name is None else jax.lax.axis_index(axis_name) * vocab_local
    local_tok = tok - offset
    h32 = h.astype(jnp.float32)

    def body(carry, v_start, v_lo):
        dh, dw = carry
        z, cols, own = _block(h, w, v_start, v_size, v_lo, inv_t)
        shifted = z - m[:, None]
        prob = jnp.where(own, jnp.exp(shifted - log_s[:, None]), 0.0)
        onehot = (own & (cols == local_tok[:, None])).astype(jnp.float32)
        # d logp / dz = onehot - p;  d H / dz = -p (z - E[z]).  Overlap columns: 0.
        dz = g_logp[:, None] * (onehot - prob)
        if g_ent is not None:
            dz = dz - g_ent[:, None] * jnp.where(own, prob * (shifted - expected[:, None]), 0.0)
        dz = dz * inv_t
        w_block = jax.lax.dynamic_slice_in_dim(w, v_start, v_size, axis=1)
        dh = dh + jnp.matmul(dz, w_block.astype(jnp.float32).T)
        dw_block = jnp.matmul(h32.T, dz)
        if num_v > 1:
            dw_block = dw_block + jax.lax.dynamic_slice_in_dim(dw, v_start, v_size, axis=1)
        dw = jax.lax.dynamic_update_slice_in_dim(dw, dw_block, v_start, axis=1)
        return _vary((dh, dw), axes)

    init = _vary(
        (jnp.zeros(h.shape, jnp.float32), jnp.zeros((w.shape[0], vocab_local), jnp.float32)),
        axes,
    )
    return _loop(num_v, v_size, vocab_local, body, init)


def _forward_rows(h, w, tok, inv_t, chunk, v_chunk, axis_name, with_entropy):
    """``[5, N]``: logp, entropy, m, log s and E[z − m] of the rows of ``h [N, D]``."""
    n = h.shape[0]
    num_c, c = _chunks(n, chunk)
    axes = _vma(h) | _vma(w) | _vma(tok)
    out_axes = axes - {axis_name}

    def body(out, start, lo):
        del lo  # rows of the overlap get the same values again: rewriting is harmless
        hc = jax.lax.dynamic_slice_in_dim(h, start, c, axis=0)
        tc = jax.lax.dynamic_slice_in_dim(tok, start, c, axis=0)
        m, log_s, zt, expected, in_range = _row_stats(
            hc, w, tc, inv_t, v_chunk, axis_name, with_entropy, axes
        )
        logp = jnp.where(in_range, (zt - m) - log_s, jnp.nan)
        rows = _vary(jnp.stack([logp, log_s - expected, m, log_s, expected]), out_axes)
        return jax.lax.dynamic_update_slice_in_dim(out, rows, start, axis=1)

    return _loop(num_c, c, n, body, _vary(jnp.zeros((5, n), jnp.float32), out_axes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _fused(
    h, w, tok, inv_t, chunk, v_chunk, axis_name, with_entropy
) -> tuple[jax.Array, jax.Array]:
    out = _forward_rows(h, w, tok, inv_t, chunk, v_chunk, axis_name, with_entropy)
    return out[0], out[1]


def _fused_fwd(h, w, tok, inv_t, chunk, v_chunk, axis_name, with_entropy):
    out = _forward_rows(h, w, tok, inv_t, chunk, v_chunk, axis_name, with_entropy)
    # Residuals: the inputs and three [N] vectors, nothing of size V.
    return (out[0], out[1]), (h, w, tok, inv_t, out[2], out[3], out[4])


def _fused_bwd(chunk, v_chunk, axis_name, with_entropy, residuals, cotangents):
    h, w, tok, inv_t, m, log_s, expected = residuals
    g_logp, g_ent = cotangents
    n = h.shape[0]
    num_c, c = _chunks(n, chunk)
    axes = _vma(h) | _vma(w) | _vma(tok) | _vma(g_logp) | _vma(g_ent)

    def body(carry, start, lo):
        dh, dw = carry

        def rows(x):
            return jax.lax.dynamic_slice_in_dim(x, start, c, axis=0)

        # Overlap rows (below lo) were done by the previous chunk: a zero cotangent
        # keeps dW from counting them twice, and their dh is kept from that chunk.
        own = start + jnp.arange(c) >= lo
        dh_c, dw_c = _row_grads(
            rows(h),
            w,
            rows(tok),
            inv_t,
            (rows(m), rows(log_s), rows(expected)),
            jnp.where(own, rows(g_logp), 0.0),
            jnp.where(own, rows(g_ent), 0.0) if with_entropy else None,
            v_chunk,
            axis_name,
            axes,
        )
        dh_c = jnp.where(own[:, None], dh_c, rows(dh))
        dh = jax.lax.dynamic_update_slice_in_dim(dh, dh_c, start, axis=0)
        return _vary((dh, dw + dw_c), axes)

    init = _vary((jnp.zeros(h.shape, jnp.float32), jnp.zeros(w.shape, jnp.float32)), axes)
    dh, dw = _loop(num_c, c, n, body, init)

    dh, dw = match_cotangent_axes(dh, dw, h, w, axis_name)
    return (
        dh,
        dw,
        np.zeros(tok.shape, jax.dtypes.float0),
        jnp.zeros_like(inv_t),
    )


_fused.defvjp(_fused_fwd, _fused_bwd)


def _spec(x) -> tuple:
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = tuple(getattr(sharding, "spec", None) or ())
    return spec + (None,) * (jnp.ndim(x) - len(spec))


def _explicit_specs(hidden, unembedding, tokens):
    """For inputs sharded over *Explicit* mesh axes: ``(mesh, leading specs, vocab
    axis)`` to run the computation per shard, else ``None``.

    ``jax.jit`` over an Explicit mesh cannot slice row chunks out of a sharded axis,
    and should not: rows are independent, so each device works on its own rows,
    and a vocabulary split of the unembedding becomes ``axis_name``.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if (
        mesh is None
        or mesh.empty
        or not any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    ):
        return None
    h_spec, w_spec, t_spec = _spec(hidden), _spec(unembedding), _spec(tokens)
    if not any(h_spec + w_spec + t_spec):
        return None
    lead = h_spec[:-1]
    if h_spec[-1] is not None or w_spec[0] is not None:
        raise ValueError(
            "token_logprobs_from_hidden: the model dimension D of hidden / unembedding "
            f"must not be sharded (hidden {P(*h_spec)}, unembedding {P(*w_spec)}); "
            "reshard it first"
        )
    if t_spec != lead:
        raise ValueError(
            f"tokens is sharded as {P(*t_spec)} but hidden's [..., T] axes as {P(*lead)}; "
            "shard them alike"
        )
    vocab_axis = w_spec[1]
    if isinstance(vocab_axis, tuple):
        if len(vocab_axis) != 1:
            raise ValueError(
                f"unembedding's vocabulary axis is sharded over {vocab_axis}; one mesh axis "
                "is supported"
            )
        vocab_axis = vocab_axis[0]
    return mesh, lead, vocab_axis


def token_logprobs_from_hidden(
    hidden: jax.typing.ArrayLike,
    unembedding: jax.typing.ArrayLike,
    tokens: jax.typing.ArrayLike,
    *,
    temperature=1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_chunk_size: int | None = None,
    return_entropy: bool = False,
    axis_name: str | None = None,
    top_k=None,
    top_p=None,
    support=None,
    support_pad: int = -1,
):
    """Token log-probs straight from the last hidden states, never building ``[..., T, V]``.

    Computes, with ``z_t = hidden_t @ unembedding / temperature``,
    ``log π(y_t) = z_{t,y_t} − logsumexp_v z_{t,v}`` and optionally
    ``H_t = logsumexp_v z_{t,v} − Σ_v π_t(v) z_{t,v}``, equal in value and gradient
    (w.r.t. ``hidden`` and ``unembedding``) to
    ``jax.nn.log_softmax(hidden @ unembedding / temperature)[..., tokens]`` to float32
    rounding. The ``N = prod(...) · T`` rows are processed ``chunk_size`` at a time
    (and the vocabulary ``vocab_chunk_size`` columns at a time with an online
    log-sum-exp); a ``jax.custom_vjp`` stores only the inputs and three ``[N]`` vectors
    and recomputes each chunk's logits in the backward pass, where
    ``∂ log π / ∂z = onehot(y) − π`` and ``∂H / ∂z = −π (z − E_π[z])``. This is the
    chunked linear-cross-entropy of Liger Kernel and Cut Cross-Entropy (Wijmans et
    al. 2024, arXiv:2411.09009). Peak extra memory is about
    ``3 · chunk_size · min(V, vocab_chunk_size) · 4`` bytes plus a float32 ``dW``.

    Tensor-parallel unembedding: inside ``jax.shard_map`` pass ``axis_name``, the mesh
    axis the vocabulary is split over (each device holds ``unembedding[:, V/n]``); the
    log-sum-exp combines the shards by ``pmax`` and ``psum`` of ``[N]`` vectors and the
    target logit by a ``psum`` of each shard's hit. The backward adds one all-reduce
    of the ``[N, D]`` hidden-state gradient (as any tensor-parallel unembedding does).
    Under plain ``jax.jit`` with sharded inputs no argument is needed.

    top-k / top-p are not recomputed here (they need the sorted full row of logits).
    Pass the engine's kept set as ``support`` instead (the sampler's exact support,
    :mod:`offpolicy_jax._src.logprobs.sampling_support`): each row then gathers only its ``K`` kept
    columns of the unembedding (never ``[N, V]``: temporary memory ``O(N·K)`` plus
    ``O(chunk_size·K·D)``), ``log π(y_t) = z_{t,y_t} − logsumexp_{v∈S_t} z_{t,v}``, and the
    backward scatter-adds ``dW`` into those columns only.

    Args:
      hidden: ``[..., T, D]`` float hidden states (float32, bf16 or fp16).
      unembedding: ``[D, V]`` float output projection (``[D, V/n]`` per device under
        ``axis_name``). Transpose a ``[V, D]`` embedding table first.
      tokens: ``[..., T]`` integer token ids; out of ``[0, V)`` gives NaN.
      temperature: a float ``> 0`` (a scalar; it receives no gradient).
      chunk_size: rows (tokens over all leading axes) per chunk, ``>= 1``; need not
        divide ``N``.
      vocab_chunk_size: columns per vocabulary chunk (``None``: the whole local
        vocabulary); need not divide ``V``.
      return_entropy: also return the entropy per token.
      axis_name: inside ``shard_map``, the mesh axis the vocabulary is sharded over.
      top_k, top_p: must be ``None`` (see above).
      support: the sampler's kept ids, int ``[..., T, K]`` (as in
        :func:`token_logprobs`); ``vocab_chunk_size`` is then unused.
      support_pad: the padding id of ``support`` (default ``−1``), an int32 outside
        the vocabulary ``[0, V)``: a token id there raises ``ValueError`` (its
        entries could not be told from the kept token).

    Returns:
      ``logp`` ``[..., T]`` float32, or ``(logp, entropy)`` if ``return_entropy``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import offpolicy_jax as opj
      >>> hidden = jax.random.normal(jax.random.key(0), (2, 5, 8))
      >>> w = jax.random.normal(jax.random.key(1), (8, 11))
      >>> tokens = jnp.array([[0, 3, 10, 2, 7], [1, 1, 4, 9, 5]])
      >>> logp = opj.token_logprobs_from_hidden(hidden, w, tokens, chunk_size=3)
      >>> ref = jnp.take_along_axis(jax.nn.log_softmax(hidden @ w), tokens[..., None], -1)
      >>> bool(jnp.allclose(logp, ref[..., 0], atol=1e-5))
      True
    """
    if top_k is not None or top_p is not None:
        raise NotImplementedError(
            "token_logprobs_from_hidden does not recompute top_k / top_p (the support needs "
            "the sorted full row of logits); pass the engine's kept set as support=..., or "
            "use token_logprobs(logits, tokens, top_k=..., top_p=...)"
        )
    hidden, unembedding, tokens = _check_hidden_inputs(hidden, unembedding, tokens)
    batch_shape = hidden.shape[:-1]
    inv_t = 1.0 / _check_temperature(temperature, batch_shape, scalar_only=True)
    _check_chunk_sizes(chunk_size, vocab_chunk_size)
    if vocab_chunk_size is not None and vocab_chunk_size >= unembedding.shape[1]:
        vocab_chunk_size = None
    if support is not None:
        # The global vocabulary: inside shard_map each device holds V / n columns.
        vocab = unembedding.shape[1] * (1 if axis_name is None else jax.lax.axis_size(axis_name))
        support, support_pad = sampling_support.check_support(
            support, support_pad, batch_shape, vocab
        )
    explicit = _explicit_specs(hidden, unembedding, tokens) if axis_name is None else None
    if explicit is not None:
        kwargs: dict[str, typing.Any] = dict(
            temperature=temperature,
            chunk_size=chunk_size,
            vocab_chunk_size=vocab_chunk_size,
            return_entropy=return_entropy,
            support_pad=support_pad,
        )
        return _on_vocabulary_mesh(explicit, hidden, unembedding, tokens, support, kwargs)
    n = int(np.prod(batch_shape))
    if n == 0:
        empty = jnp.zeros(batch_shape, jnp.float32)
        return (empty, empty) if return_entropy else empty
    rows = (hidden.reshape(n, hidden.shape[-1]), unembedding, tokens.reshape(n))
    if support is not None:
        logp, entropy = sampling_support.kept_logprobs_from_hidden(
            *rows,
            support.reshape(n, support.shape[-1]),
            support_pad,
            inv_t,
            chunk_size=chunk_size,
            axis_name=axis_name,
            return_entropy=return_entropy,
        )
    else:
        # typing.cast: jax types custom_vjp's constructor as returning `custom_vjp3 | Self`,
        # so the call's type is lost; _fused returns (logp, entropy), two arrays.
        logp, entropy = typing.cast(
            tuple[jax.Array, jax.Array],
            _fused(
                *rows,
                inv_t,
                int(chunk_size),
                None if vocab_chunk_size is None else int(vocab_chunk_size),
                axis_name,
                bool(return_entropy),
            ),
        )
    logp = logp.reshape(batch_shape)
    return (logp, entropy.reshape(batch_shape)) if return_entropy else logp


def _check_hidden_inputs(hidden, unembedding, tokens):
    """``hidden [..., T, D]``, ``unembedding [D, V]`` and ``tokens [..., T]``, checked."""
    hidden = _check_float("hidden", hidden, "[..., T, D]", 2)
    unembedding = _check_float("unembedding", unembedding, "[D, V]", 2)
    if unembedding.ndim != 2:
        raise ValueError(f"unembedding must have shape [D, V], got {unembedding.shape}")
    if unembedding.shape[0] != hidden.shape[-1]:
        raise ValueError(
            f"unembedding has shape {unembedding.shape} but hidden has D = {hidden.shape[-1]}; "
            "unembedding must be [D, V] (transpose a [V, D] embedding table)"
        )
    tokens = _check_tokens(tokens, hidden.shape[:-1], "hidden [..., T, D]")
    return hidden, unembedding, tokens


def _check_chunk_sizes(chunk_size, vocab_chunk_size) -> None:
    for name, value in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if value is None and name == "vocab_chunk_size":
            continue
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _on_vocabulary_mesh(explicit, hidden, unembedding, tokens, support, kwargs):
    """Inputs sharded over a mesh under plain ``jax.jit``: the same call inside a
    ``shard_map`` whose vocabulary axis is the unembedding's sharded one."""
    mesh, lead, vocab_axis = explicit
    out_spec = P(*lead)
    in_specs = (P(*lead, None), P(None, vocab_axis), P(*lead))
    args = (hidden, unembedding, tokens)
    if support is not None:  # the kept ids travel with their tokens
        in_specs, args = in_specs + (P(*lead, None),), args + (support,)

    def fn(hidden, unembedding, tokens, support=None):
        return token_logprobs_from_hidden(
            hidden, unembedding, tokens, axis_name=vocab_axis, support=support, **kwargs
        )

    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=(out_spec, out_spec) if kwargs["return_entropy"] else out_spec,
    )(*args)
