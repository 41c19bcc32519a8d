"""The verifiable task: reverse a string of digits.

A sequence is ``prompt (n digits) · SEP · response (n digits)``. The reward of a
response is the fraction of its digits that match the reversed prompt (exact match per
position), so it is 1.0 only for the exact answer and random guessing scores 0.1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

N_DIGITS = 10
SEP = 10
VOCAB = 11

Array = jax.Array


def sample_prompts(key: Array, n: int, length: int) -> Array:
    """``n`` random prompts of ``length`` digits, int32 ``[n, length]``."""
    return jax.random.randint(key, (n, length), 0, N_DIGITS, dtype=jnp.int32)


def target(prompts: Array) -> Array:
    """The correct response for each prompt."""
    return prompts[..., ::-1]


def reward(prompts: Array, responses: Array) -> Array:
    """Per-sequence reward in [0, 1]: fraction of response digits equal to the target."""
    return jnp.mean((responses == target(prompts)).astype(jnp.float32), axis=-1)


def join(prompts: Array, responses: Array) -> Array:
    """Full token sequence ``prompt · SEP · response``, int32 ``[..., 2 * length + 1]``."""
    sep = jnp.full(prompts.shape[:-1] + (1,), SEP, jnp.int32)
    return jnp.concatenate([prompts, sep, responses], axis=-1)
