"""A tiny causal transformer policy in Flax NNX, with optional reduced-precision numerics
and an optional mixture-of-experts FFN.

The same module serves the trainer (float32) and the rollout engine: the engine passes a
rounding function that is applied to the weights and to every activation the way a
lower-precision inference kernel stores them (see ``round_mantissa``), a quantizer of the
matmul inputs (``quantize_fp8``: what an fp8 engine feeds its GEMMs), and, for a routed
model, its own router perturbation; the trainer may replay the engine's routes (R3).
"""

from __future__ import annotations

import dataclasses
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


#: The fp8 formats of ``quantize_fp8`` (ml_dtypes' types, as jax exposes them).
FP8_FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def quantize_fp8(x: Array, fmt: str) -> Array:
    """Per-tensor scaled fp8 round trip, as fp8 inference kernels quantize a tensor.

    ``s = max|x| / F_max`` (``F_max`` = 448 for e4m3, 57344 for e5m2), then
    ``q(x) = s · fp8(x / s)`` with round-to-nearest-even: the largest magnitude maps to
    ``F_max``, and values below ``s`` times the smallest subnormal flush to 0 (the dynamic
    range a single per-tensor scale leaves). All-zero ``x`` stays 0. Returns float32.
    """
    dtype = FP8_FORMATS[fmt]
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x))
    scale = jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)
    return (x / scale).astype(dtype).astype(jnp.float32) * scale


@dataclasses.dataclass(frozen=True)
class Routing:
    """How a routed FFN picks its experts in one forward pass (all fields optional).

    Attributes:
      noise: ``[n_layers, ..., L, n_experts]`` standard-normal-shaped perturbation of the
        router logits used to *pick* experts, in units of each token's router-logit
        standard deviation (the engine's own router numerics; the gate values still
        come from the unperturbed logits). None: pick by the logits themselves.
      routes: ``[n_layers, ..., L, top_k]`` expert indices to use instead of the router's
        own pick (routing replay, R3), where ``replay`` is true.
      replay: bool (may be traced): use ``routes``.
    """

    noise: Array | None = None
    routes: Array | None = None
    replay: Array | bool = False


class MoE(nnx.Module):
    """Top-k routed FFN (Shazeer et al. 2017; Switch / DeepSeek-style gates).

    ``g = softmax(W_r h)``; the experts ``E = top_k(W_r h [+ noise])`` (or replayed
    routes); ``out = Σ_{e ∈ E} g_e · FFN_e(h)`` with unnormalised gates, so the router
    gets a gradient for k = 1 too. Every expert is computed densely (few, small experts)
    and masked: exact, and the same program for any routing. Fine-grained experts: each
    has hidden size ``4 · d_model / n_experts``, so together they hold the dense FFN's
    parameters and cost its compute.
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int, *, rngs: nnx.Rngs):
        hidden = max(1, 4 * d_model // n_experts)
        init = nnx.initializers.lecun_normal()
        self.top_k = top_k
        self.router = nnx.Linear(d_model, n_experts, rngs=rngs)
        self.w_up = nnx.Param(init(rngs.params(), (n_experts, d_model, hidden)))
        self.b_up = nnx.Param(jnp.zeros((n_experts, hidden)))
        self.w_down = nnx.Param(init(rngs.params(), (n_experts, hidden, d_model)))
        self.b_down = nnx.Param(jnp.zeros((n_experts, d_model)))

    def __call__(
        self, h: Array, rnd: Rounder, quant: Rounder, noise: Array | None, routing: Routing
    ) -> tuple[Array, Array, Array]:
        """``(out [..., L, d], routes used, own routes [..., L, top_k])``."""
        logits = rnd(self.router(h)).astype(jnp.float32)
        gates = jax.nn.softmax(logits, axis=-1)
        pick = logits
        if noise is not None:
            spread = jax.lax.stop_gradient(jnp.std(logits, axis=-1, keepdims=True))
            pick = logits + noise * spread
        _, own = jax.lax.top_k(jax.lax.stop_gradient(pick), self.top_k)
        used = own if routing.routes is None else jnp.where(routing.replay, routing.routes, own)
        combine = jnp.sum(
            jax.nn.one_hot(used, gates.shape[-1]) * jnp.take_along_axis(gates, used, -1)[..., None],
            axis=-2,
        )  # [..., L, n_experts]: the gate of each chosen expert, 0 elsewhere
        up = rnd(jnp.einsum("...d,edh->...eh", h, self.w_up[...]) + self.b_up[...])
        act = quant(rnd(nnx.gelu(up)))
        down = rnd(jnp.einsum("...eh,ehd->...ed", act, self.w_down[...]) + self.b_down[...])
        return rnd(jnp.einsum("...e,...ed->...d", combine, down)), used, own


class Block(nnx.Module):
    def __init__(
        self, d_model: int, n_heads: int, n_experts: int = 0, top_k: int = 1, *, rngs: nnx.Rngs
    ):
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=n_heads, in_features=d_model, decode=False, rngs=rngs
        )
        self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
        if n_experts:
            self.moe = MoE(d_model, n_experts, top_k, rngs=rngs)
        else:
            self.up = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
            self.down = nnx.Linear(4 * d_model, d_model, rngs=rngs)

    def __call__(
        self,
        x: Array,
        mask: Array,
        rnd: Rounder,
        quant: Rounder = _identity,
        noise: Array | None = None,
        routing: Routing = Routing(),
    ) -> tuple[Array, Array | None, Array | None]:
        """``(x, routes used, own routes)``; the routes are None in a dense block."""
        h = quant(rnd(self.ln1(x)))
        x = rnd(x + rnd(self.attn(h, mask=mask)))
        h = quant(rnd(self.ln2(x)))
        if hasattr(self, "moe"):
            out, used, own = self.moe(h, rnd, quant, noise, routing)
            return rnd(x + out), used, own
        h = quant(rnd(nnx.gelu(rnd(self.up(h)))))
        return rnd(x + rnd(self.down(h))), None, None


class Policy(nnx.Module):
    """Decoder-only transformer: ``tokens [..., L] -> next-token logits [..., L, vocab]``.

    ``n_experts > 0`` replaces every block's FFN by a top-``top_k`` routed
    mixture of ``n_experts`` experts (:class:`MoE`).
    """

    def __init__(
        self,
        vocab: int,
        max_len: int,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        n_experts: int = 0,
        top_k: int = 1,
        *,
        rngs: nnx.Rngs,
    ):
        if n_experts and not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k}")
        self.tok = nnx.Embed(vocab, d_model, rngs=rngs)
        self.pos = nnx.Embed(max_len, d_model, rngs=rngs)
        self.blocks = nnx.List(
            [Block(d_model, n_heads, n_experts, top_k, rngs=rngs) for _ in range(n_layers)]
        )
        self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, rngs=rngs)

    def __call__(
        self,
        tokens: Array,
        rnd: Rounder | None = None,
        *,
        quant: Rounder | None = None,
        routing: Routing = Routing(),
        return_routes: bool = False,
    ) -> Array | tuple[Array, Array, Array]:
        """Logits; with ``return_routes``, also the routes used and the router's own pick
        (``int32 [n_layers, ..., L, top_k]`` each; a dense model has none: not allowed).

        ``rnd``, if given, rounds the weights' products and every stored activation;
        ``quant``, if given, quantizes every matmul input (after ``rnd``); ``routing``
        perturbs or replays the experts' choice (:class:`Routing`).
        """
        rnd = rnd or _identity
        quant = quant or _identity
        length = tokens.shape[-1]
        x = rnd(self.tok(tokens) + self.pos(jnp.arange(length)))
        mask = nnx.make_causal_mask(tokens)
        used, own = [], []
        for i, block in enumerate(self.blocks):
            noise = None if routing.noise is None else routing.noise[i]
            layer = Routing(
                None, None if routing.routes is None else routing.routes[i], routing.replay
            )
            x, u, o = block(x, mask, rnd, quant, noise, layer)
            used.append(u)
            own.append(o)
        logits = rnd(self.head(rnd(self.ln_f(x))))
        if not return_routes:
            return logits
        if used[0] is None:
            raise ValueError("return_routes: this policy has no routed (MoE) blocks")
        return logits, jnp.stack(used), jnp.stack(own)
