"""The engine's top-k log-probs per position, and the trainer's log-probs on the same ids.

DPPO's top-k trust region (TRL ``DPPOConfig(divergence_type="topk_tv" | "topk_kl")``)
compares the two policies over the engine's ``K`` most probable ids at each position.
The engine returns them with the sample (vLLM ``SamplingParams(logprobs=K)``); the
trainer evaluates its own log-probs on the same ids from the logits of the same forward
pass (:func:`topk_logprobs`, TRL's ``selective_log_softmax(logits / T, topk_ids)``).
:class:`TopKLogprobs` carries the three ``[..., T, K]`` arrays into
:func:`~offpolicy_jax.policy_loss` (``topk=``); the divergence itself is
:func:`offpolicy_jax._src.correction.topk_divergence.topk_divergence`.
"""

from __future__ import annotations

import typing
from typing import NamedTuple

import jax
import jax.numpy as jnp

from offpolicy_jax._src import validation as _validation
from offpolicy_jax._src.logprobs import token as _token

__all__ = ["TopKLogprobs", "topk_logprobs"]


class TopKLogprobs(NamedTuple):
    """The engine's top-k support per position and both policies' log-probs on it.

    All three are ``[..., T, K]``, aligned with the ``[..., T]`` sampled tokens; a
    padded position (outside the loss's ``mask``) may hold anything, NaN included.

    Attributes:
      ids: int, the engine's ``K`` most probable token ids (TRL keeps the sampled
        token among them: it replaces the ``K``-th when it is not in the top ``K``).
      rollout_logp: float, the engine's log-probs of ``ids`` (over the whole
        vocabulary, as vLLM returns them).
      logp: float, the trainer's log-probs of ``ids`` (:func:`topk_logprobs`); a
        stop-gradient input of the loss. None where only the engine's side is known
        yet; the loss and the metrics need it.
    """

    ids: typing.Any
    rollout_logp: typing.Any
    logp: typing.Any = None


def _check_ids(ids, batch_shape, logits_name: str) -> jax.Array:
    ids = _validation.as_array("ids", ids)
    dtype = jnp.result_type(ids)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"ids must be an integer array of token ids [..., T, K], got dtype {dtype}")
    _validation.check_int32_ids("ids", ids)
    ids = jnp.asarray(ids)
    if ids.ndim < 2 or ids.shape[:-1] != tuple(batch_shape) or ids.shape[-1] < 1:
        raise ValueError(
            f"ids has shape {ids.shape} but {logits_name} implies [..., T, K] with [..., T] = "
            f"{tuple(batch_shape)} and K >= 1"
        )
    return ids


@_validation.read_now
def _refuse_out_of_vocab(ids: jax.Array, keep: jax.Array, vocab: int) -> None:
    if not (_validation.is_concrete(ids) and _validation.is_concrete(keep)):
        return
    bad = keep[..., None] & ((ids < 0) | (ids >= vocab))
    if bool(jnp.any(bad)):
        raise ValueError(
            f"ids holds a token id outside the vocabulary [0, {vocab}) at a position of mask "
            f"(e.g. {int(ids[bad][0])}); padded positions may hold any id"
        )


def _chunked_logsumexp(z_max, logits, inv_t, chunk: int) -> jax.Array:
    """``log Σ_v exp((logits_v − max)·inv_t)`` one vocabulary block at a time: never a
    float32 copy of the whole ``[..., T, V]`` logits (bf16 logits stay bf16)."""
    vocab = logits.shape[-1]
    chunk = min(chunk, vocab)
    count = -(-vocab // chunk)

    def body(i, acc):
        # The last block is shifted left to stay in range; its overlap is not re-counted.
        start = jnp.minimum(i * chunk, vocab - chunk)
        block = jax.lax.dynamic_slice_in_dim(logits, start, chunk, axis=-1)
        z = (block.astype(jnp.float32) - z_max[..., None]) * inv_t[..., None]
        fresh = start + jnp.arange(chunk) >= i * chunk
        return acc + jnp.sum(jnp.where(fresh, jnp.exp(z), 0.0), axis=-1)

    total = jax.lax.fori_loop(0, count, body, jnp.zeros(z_max.shape, jnp.float32))
    return jnp.log(total)


def topk_logprobs(
    logits: jax.typing.ArrayLike,
    ids: jax.typing.ArrayLike,
    *,
    temperature: jax.typing.ArrayLike = 1.0,
    mask: jax.typing.ArrayLike | None = None,
    vocab_chunk_size: int | None = None,
) -> jax.Array:
    """The trainer's log-probs on the engine's top-k ids: ``log softmax(logits / T)[ids]``.

    Over the whole vocabulary (no top-k/top-p renormalisation: the engine's top-k
    log-probs are full-vocabulary log-probs too), in float32 whatever the logits'
    dtype, differentiable with respect to ``logits``. Pass the result as
    ``TopKLogprobs(ids, rollout_logp, logp=...)``.

    Args:
      logits: ``[..., T, V]`` float logits of the positions of the sampled tokens.
      ids: ``[..., T, K]`` integer ids (:attr:`TopKLogprobs.ids`).
      temperature: ``> 0``, a float or an array broadcastable to ``[..., T]``: the
        sampler's temperature (as :func:`~offpolicy_jax.token_logprobs`).
      mask: ``[..., T]`` bool, or None (every position): elsewhere the result is 0
        and the ids are not read (any padding id is fine).
      vocab_chunk_size: None: one pass over ``[..., T, V]``; an int ``>= 1``: the
        normaliser is summed over vocabulary blocks of that size, so no float32 copy
        of bf16 logits is made.

    Returns:
      ``[..., T, K]`` float32 log-probs.

    Raises:
      TypeError: non-integer ``ids``, integer ``logits``.
      ValueError: shapes that do not line up (naming ``ids`` / ``mask``), a concrete id
        outside ``[0, V)`` at a position of ``mask`` (under jit such an entry gives
        NaN), a bad ``temperature`` or ``vocab_chunk_size``.

    Examples:
      >>> import jax.numpy as jnp, offpolicy_jax as opj
      >>> logits = jnp.log(jnp.array([[[0.5, 0.3, 0.2]]]))
      >>> logp = opj.topk_logprobs(logits, jnp.array([[[0, 2]]]))  # [1, 1, 2]
      >>> [round(float(p), 4) for p in jnp.exp(logp).ravel()]
      [0.5, 0.2]
    """
    logits = _token._check_float("logits", logits, "[..., T, V]", 2)
    batch_shape, vocab = logits.shape[:-1], logits.shape[-1]
    ids = _check_ids(ids, batch_shape, "logits [..., T, V]")
    keep = jnp.ones(batch_shape, bool) if mask is None else jnp.asarray(mask) > 0
    if keep.shape != tuple(batch_shape):
        raise ValueError(f"mask has shape {keep.shape}; expected [..., T] = {tuple(batch_shape)}")
    _refuse_out_of_vocab(ids, keep, vocab)
    if vocab_chunk_size is not None and (
        isinstance(vocab_chunk_size, bool)
        or not isinstance(vocab_chunk_size, int)
        or vocab_chunk_size < 1
    ):
        raise ValueError(f"vocab_chunk_size must be None or an int >= 1, got {vocab_chunk_size!r}")
    temperature = _token._check_temperature(temperature, batch_shape, scalar_only=False)
    inv_t = jnp.broadcast_to(1.0 / temperature, batch_shape).astype(jnp.float32)
    z_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1).astype(jnp.float32))
    z_max = jnp.where(jnp.isfinite(z_max), z_max, 0.0)
    if vocab_chunk_size is None:
        z = (logits.astype(jnp.float32) - z_max[..., None]) * inv_t[..., None]
        lse = jax.nn.logsumexp(z, axis=-1)
    else:
        lse = _chunked_logsumexp(z_max, logits, inv_t, vocab_chunk_size)
    in_range = keep[..., None] & (ids >= 0) & (ids < vocab)
    picked = jnp.take_along_axis(logits, jnp.where(in_range, ids, 0), axis=-1)
    out = (picked.astype(jnp.float32) - z_max[..., None]) * inv_t[..., None] - lse[..., None]
    out = jnp.where(in_range, out, jnp.nan)
    return jnp.where(keep[..., None], out, 0.0)


def check_topk(
    topk: TopKLogprobs, shape: tuple[int, ...], *, owner: str = "topk"
) -> tuple[jax.Array, jax.Array]:
    """``(logp, rollout_logp)`` of ``topk`` as stop-gradient float32 ``[..., T, K]``,
    checked against the ``[..., T]`` ``shape`` of the sampled tokens."""
    if not isinstance(topk, TopKLogprobs):
        raise TypeError(
            f"{owner} must be an offpolicy_jax.TopKLogprobs(ids, rollout_logp, logp), got "
            f"{type(topk).__name__}"
        )
    ids = _check_ids(topk.ids, shape, "logp [..., T]")
    if topk.logp is None:
        raise ValueError(
            f"{owner}.logp is required: the trainer's log-probs on {owner}.ids "
            "(offpolicy_jax.topk_logprobs(logits, ids))"
        )
    arrays = []
    for name in ("logp", "rollout_logp"):
        x = _validation.as_float_logp(f"{owner}.{name}", getattr(topk, name))
        if x.shape != ids.shape:
            raise ValueError(
                f"{owner}.{name} has shape {x.shape}; expected {ids.shape}, the shape of "
                f"{owner}.ids ([..., T, K] with [..., T] = {tuple(shape)})"
            )
        arrays.append(jax.lax.stop_gradient(x))
    return arrays[0], arrays[1]
