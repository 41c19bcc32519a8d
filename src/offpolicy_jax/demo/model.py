"""A tiny causal transformer policy in Flax NNX, with optional reduced-precision numerics.

The same module serves the trainer (float32) and the rollout engine: the engine passes a
rounding function that is applied to the weights and to every activation the way a
lower-precision inference kernel stores them (see ``round_mantissa``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array
Rounder = Callable[[Array], Array]


def _identity(x: Array) -> Array:
    return x


def round_mantissa(x: Array, bits: int) -> Array:
    """Round float32 ``x`` to ``bits`` mantissa bits (round-to-nearest-even), keeping the
    float32 exponent range. ``bits=7`` reproduces bfloat16 exactly; ``bits=3`` has the
    mantissa of fp8-e4m3; ``bits>=23`` is the identity."""
    if bits >= 23:
        return x
    shift = 23 - bits
    u = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    lsb = (u >> shift) & 1
    u = (u + ((1 << (shift - 1)) - 1) + lsb) & jnp.uint32(~((1 << shift) - 1) & 0xFFFFFFFF)
    return jax.lax.bitcast_convert_type(u, jnp.float32)


class Block(nnx.Module):
    def __init__(self, d_model: int, n_heads: int, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=n_heads, in_features=d_model, decode=False, rngs=rngs
        )
        self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
        self.up = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
        self.down = nnx.Linear(4 * d_model, d_model, rngs=rngs)

    def __call__(self, x: Array, mask: Array, rnd: Rounder) -> Array:
        h = rnd(self.ln1(x))
        x = rnd(x + rnd(self.attn(h, mask=mask)))
        h = rnd(self.ln2(x))
        h = rnd(nnx.gelu(rnd(self.up(h))))
        return rnd(x + rnd(self.down(h)))


class Policy(nnx.Module):
    """Decoder-only transformer: ``tokens [..., L] -> next-token logits [..., L, vocab]``."""

    def __init__(
        self,
        vocab: int,
        max_len: int,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        *,
        rngs: nnx.Rngs,
    ):
        self.tok = nnx.Embed(vocab, d_model, rngs=rngs)
        self.pos = nnx.Embed(max_len, d_model, rngs=rngs)
        self.blocks = nnx.List([Block(d_model, n_heads, rngs=rngs) for _ in range(n_layers)])
        self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, rngs=rngs)

    def __call__(self, tokens: Array, rnd: Rounder | None = None) -> Array:
        """``rnd``, if given, rounds the weights' products and every stored activation."""
        rnd = rnd or _identity
        length = tokens.shape[-1]
        x = rnd(self.tok(tokens) + self.pos(jnp.arange(length)))
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask, rnd)
        return rnd(self.head(rnd(self.ln_f(x))))
