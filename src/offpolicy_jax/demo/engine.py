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
distribution, exactly what an inference server returns.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from offpolicy_jax.demo import task
from offpolicy_jax.demo.model import round_mantissa

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Numerics:
    """How the engine computes and samples (hashable: a static jit argument)."""

    mantissa_bits: int = 23
    temperature: float = 1.0
    top_p: float = 1.0


def _nucleus_log_probs(logits: Array, temperature: float, top_p: float) -> Array:
    """Log-probs of the distribution actually sampled: softmax(logits / T) restricted to
    the smallest set of tokens whose probability reaches ``top_p``, renormalised."""
    logq = jax.nn.log_softmax(logits / temperature, axis=-1)
    if top_p >= 1.0:
        return logq
    probs = jnp.exp(logq)
    order = jnp.argsort(-probs, axis=-1)
    sorted_p = jnp.take_along_axis(probs, order, axis=-1)
    before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above this token
    keep_sorted = before < top_p
    keep = jnp.zeros_like(keep_sorted).at[
        tuple(jnp.indices(order.shape)[:-1]) + (order,)
    ].set(keep_sorted)
    return jax.nn.log_softmax(jnp.where(keep, logq, -jnp.inf), axis=-1)


def generate(graphdef: nnx.GraphDef, params: nnx.State, prompts: Array, key: Array,
             numerics: Numerics) -> tuple[Array, Array]:
    """Sample one response per prompt. Returns ``(responses [B, n], rollout_logp [B, n])``."""
    rnd = functools.partial(round_mantissa, bits=numerics.mantissa_bits)
    if numerics.mantissa_bits < 23:
        params = jax.tree.map(rnd, params)
    model = nnx.merge(graphdef, params)
    n = prompts.shape[-1]
    tokens = task.join(prompts, jnp.zeros_like(prompts))

    def step(tokens, xs):
        i, k = xs
        logits = model(tokens, rnd=rnd)[:, n + i].astype(jnp.float32)
        logq = _nucleus_log_probs(logits, numerics.temperature, numerics.top_p)
        tok = jax.random.categorical(k, logq, axis=-1).astype(jnp.int32)
        tokens = tokens.at[:, n + 1 + i].set(tok)
        return tokens, jnp.take_along_axis(logq, tok[:, None], axis=-1)[:, 0]

    tokens, logq = jax.lax.scan(step, tokens, (jnp.arange(n), jax.random.split(key, n)))
    return tokens[:, n + 1:], logq.T
