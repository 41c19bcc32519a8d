"""The rollout engine: samples responses and reports its *own* log-probs.

It is deliberately separate from the trainer and may compute differently, the way an
inference server (vLLM, SGLang) differs from the training framework:

- ``mantissa_bits < 23``: weights and activations rounded to that many mantissa bits
  (7 = bfloat16) — the ``precision`` mismatch;
- ``temperature != 1`` / ``top_p < 1``: the sampler draws from a distorted distribution
  the trainer does not apply — the ``sampling`` mismatch;
- the ``stale`` mismatch is the engine holding weights that are k updates old (the
  trainer decides which weights it hands over, see ``train.py``).

The reported log-prob of each token is log q(token) under the engine's own sampling
distribution, exactly what an inference server returns. With a sampling mismatch it is
``opj.token_logprobs(..., temperature=T, top_p=P)``: the library's sampler-consistent
log-prob, the one a trainer that applies the same T and P computes (tokens are still
drawn from the engine's own nucleus, :func:`_sampling_log_probs`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import offpolicy_jax as opj
from offpolicy_jax.demo import task
from offpolicy_jax.demo.model import round_mantissa

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Numerics:
    """How the engine computes and samples (hashable: a static jit argument)."""

    mantissa_bits: int = 23
    temperature: float = 1.0
    top_p: float = 1.0


def _sampling_log_probs(logits: Array, temperature: Array, top_p: Array) -> Array:
    """Log-probs of the distribution actually sampled: softmax(logits / T) restricted to
    the smallest set of tokens whose probability reaches ``top_p``, renormalised.
    ``temperature = top_p = 1`` returns ``log_softmax(logits)`` bit for bit."""
    logq = jax.nn.log_softmax(logits / temperature, axis=-1)
    probs = jnp.exp(logq)
    order = jnp.argsort(-probs, axis=-1)
    sorted_p = jnp.take_along_axis(probs, order, axis=-1)
    above = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass of the more likely tokens
    keep = jnp.put_along_axis(
        jnp.zeros(order.shape, bool), order, above < top_p, axis=-1, inplace=False
    )
    nucleus = jax.nn.log_softmax(jnp.where(keep, logq, -jnp.inf), axis=-1)
    return jnp.where(top_p < 1.0, nucleus, logq)


def generate(
    graphdef: nnx.GraphDef,
    params: Any,  # the model's nnx.State, or that pytree as optax.apply_updates returns it
    prompts: Array,
    key: Array,
    numerics: Numerics,
    active: Array | bool = True,
) -> tuple[Array, Array]:
    """Sample one response per prompt with the engine's numerics (plain float32
    sampling where ``active`` is false). Returns ``(responses [B, n], rollout_logp [B, n])``."""
    rnd = None  # model(rnd=None): exact float32
    if numerics.mantissa_bits < 23:

        def rounded(x):
            return jnp.where(active, round_mantissa(x, numerics.mantissa_bits), x)

        rnd = rounded
        params = jax.tree.map(rnd, params)
    temperature = jnp.where(active, numerics.temperature, 1.0)
    top_p = jnp.where(active, numerics.top_p, 1.0)
    model = nnx.merge(graphdef, params)
    n = prompts.shape[-1]
    tokens = task.join(prompts, jnp.zeros_like(prompts))

    # Static: only a sampling mismatch reports through token_logprobs, so the other
    # settings keep their float32 rounding (and the docs' tables) bit for bit.
    sampler = numerics.temperature != 1.0 or numerics.top_p < 1.0

    def step(tokens, xs):
        i, k = xs
        logits = model(tokens, rnd=rnd)[:, n + i].astype(jnp.float32)
        logq = _sampling_log_probs(logits, temperature, top_p)
        tok = jax.random.categorical(k, logq, axis=-1).astype(jnp.int32)
        tokens = tokens.at[:, n + 1 + i].set(tok)
        if sampler:
            scored = opj.token_logprobs(
                logits[:, None, :],
                tok[:, None],
                temperature=temperature,
                top_p=jnp.where(top_p < 1, top_p, 1.0),
            )
            assert isinstance(scored, jax.Array)  # return_entropy=False: log-probs alone
            reported = scored[:, 0]
        else:
            reported = jnp.take_along_axis(logq, tok[:, None], axis=-1)[:, 0]
        return tokens, reported

    tokens, logq = jax.lax.scan(step, tokens, (jnp.arange(n), jax.random.split(key, n)))
    return tokens[:, n + 1 :], logq.T
