"""The rollout engine: samples responses and reports its *own* log-probs.

It is deliberately separate from the trainer and may compute differently, the way an
inference server (vLLM, SGLang) differs from the training framework:

- ``mantissa_bits < 23``: weights and activations rounded to that many mantissa bits
  (7 = bfloat16) — the ``precision`` mismatch;
- ``temperature != 1`` / ``top_p < 1``: the sampler draws from a distorted distribution
  the trainer does not apply — the ``sampling`` mismatch;
- the ``stale`` mismatch is the engine holding weights that are k updates old (the
  trainer decides which weights it hands over, see ``train.py``);
- ``router_noise > 0`` (a routed, MoE policy): the engine picks experts by router logits
  perturbed by ``router_noise`` times each token's router-logit spread, so near-ties
  flip — the ``router`` mismatch; ``return_routes`` hands the routes it used to the
  trainer (routing replay, R3);
- ``fp8 = "e4m3" | "e5m2"``: the matmul weights and inputs in fp8 with per-tensor
  scales (``model.quantize_fp8``), everything else in bfloat16, as fp8 rollout engines
  (vLLM, SGLang) run: embeddings, norms, biases, the router and the output head stay
  bfloat16 — the ``fp8`` mismatch.

``generate_topk`` also returns the engine's ``k`` most probable ids at every sampled
position and its log-probs of them (vLLM's ``SamplingParams(logprobs=k)``), the input of
DPPO's top-k trust region.

The reported log-prob of each token is log q(token) under the engine's own sampling
distribution, exactly what an inference server returns. With a sampling mismatch it is
``opj.token_logprobs(..., temperature=T, top_p=P)``: the library's sampler-consistent
log-prob, the one a trainer that applies the same T and P computes (tokens are still
drawn from the engine's own nucleus, :func:`_sampling_log_probs`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import offpolicy_jax as opj
from offpolicy_jax.demo import task
from offpolicy_jax.demo.model import Routing, quantize_fp8, round_mantissa

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Numerics:
    """How the engine computes and samples (hashable: a static jit argument)."""

    mantissa_bits: int = 23
    temperature: float = 1.0
    top_p: float = 1.0
    router_noise: float = 0.0
    fp8: str = ""


#: Weights an fp8 engine runs in fp8: the kernels of the attention projections and of the
#: FFN / experts (the router, embeddings and head stay in bfloat16, as in vLLM's fp8).
def _name(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def _fp8_weight(path: tuple) -> bool:
    name = _name(path)
    if "router" in name or name.startswith("head"):
        return False
    return name.endswith(("kernel", "kernel/value", "w_up", "w_up/value", "w_down", "w_down/value"))


def _fp8_numerics(params: Any, fmt: str, active: Array | bool):
    """``(params, rnd, quant)`` of an fp8 engine: fp8 weights and matmul inputs, bf16 rest."""

    def bf16(x):
        return jnp.where(active, round_mantissa(x, 7), x)

    def fp8(x):
        return jnp.where(active, quantize_fp8(x, fmt), x)

    def weight(path, p):
        if not (_fp8_weight(path) and p.ndim >= 2):
            return bf16(p)
        # One scale per expert, as fp8 MoE kernels keep them; per tensor otherwise.
        return jax.vmap(fp8)(p) if "/w_" in _name(path) else fp8(p)

    params = jax.tree.map_with_path(weight, params)
    return params, bf16, fp8


def router_noise(model: nnx.Module, key: Array, shape: tuple[int, ...], scale: Array) -> Array:
    """The engine's router perturbation ``[n_layers, *shape, n_experts]`` (``Routing.noise``)."""
    n_experts = model.blocks[0].moe.router.out_features  # type: ignore[attr-defined]
    z = jax.random.normal(key, (len(model.blocks), *shape, n_experts))  # type: ignore[arg-type]
    return scale * z


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


class Sample(NamedTuple):
    """:func:`generate_topk`'s result, ``B`` responses of ``n`` tokens."""

    responses: Array  # [B, n] int32
    rollout_logp: Array  # [B, n]: the engine's log-prob of each sampled token
    #: The experts the engine used, ``int32 [n_layers, B, 2n + 1, top_k]``; None unless
    #: asked for (a routed policy).
    routes: Array | None
    #: ``int32 [B, n, k]``: the engine's k most probable ids at each position, in
    #: decreasing probability; the sampled token replaces the k-th when it is not among
    #: them (TRL's support ``TopK(μ, k) ∪ {a_t}``).
    topk_ids: Array
    #: ``[B, n, k]``: the engine's log-probs of ``topk_ids`` under the distribution it
    #: sampled from.
    topk_logp: Array


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
    out = _generate(graphdef, params, prompts, key, numerics, active, False, 0)
    return out.responses, out.rollout_logp


def generate_routed(
    graphdef: nnx.GraphDef,
    params: Any,
    prompts: Array,
    key: Array,
    numerics: Numerics,
    active: Array | bool = True,
) -> tuple[Array, Array, Array]:
    """:func:`generate` for a routed policy: also the experts the engine used for the
    full sequence, ``int32 [n_layers, B, 2n + 1, top_k]`` (what routing replay replays)."""
    out = _generate(graphdef, params, prompts, key, numerics, active, True, 0)
    assert out.routes is not None
    return out.responses, out.rollout_logp, out.routes


def generate_topk(
    graphdef: nnx.GraphDef,
    params: Any,
    prompts: Array,
    key: Array,
    numerics: Numerics,
    k: int,
    active: Array | bool = True,
    return_routes: bool = False,
) -> Sample:
    """:func:`generate` (or :func:`generate_routed` with ``return_routes``) that also
    returns the engine's top-``k`` ids and log-probs per sampled position (``k`` static,
    at most the vocabulary). The responses and their log-probs are those of
    :func:`generate` with the same arguments."""
    vocab = model_vocab(graphdef, params)
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, {vocab}] (the vocabulary), got {k}")
    return _generate(graphdef, params, prompts, key, numerics, active, return_routes, topk=k)


def model_vocab(graphdef: nnx.GraphDef, params: Any) -> int:
    """The policy's vocabulary size (its output head's width)."""
    return nnx.merge(graphdef, params).head.out_features  # type: ignore[attr-defined]


def topk_support(logq: Array, tok: Array, k: int) -> tuple[Array, Array]:
    """``(ids, log-probs)`` ``[..., k]`` of the ``k`` largest entries of ``logq [..., V]``,
    the sampled ``tok [...]`` in the k-th place when it is not among them."""
    _, ids = jax.lax.top_k(logq, k)
    ids = ids.astype(jnp.int32)
    missing = ~jnp.any(ids == tok[..., None], axis=-1)
    last = jnp.arange(k) == k - 1
    ids = jnp.where(missing[..., None] & last, tok[..., None], ids)
    return ids, jnp.take_along_axis(logq, ids, axis=-1)


def _generate(graphdef, params, prompts, key, numerics, active, return_routes, topk) -> Sample:
    """:func:`generate_topk`'s body (``k = 0``: no top-k, empty ``[B, n, 0]`` arrays)."""
    rnd = quant = None  # model(rnd=None): exact float32
    if numerics.fp8:
        params, rnd, quant = _fp8_numerics(params, numerics.fp8, active)
    elif numerics.mantissa_bits < 23:

        def rounded(x):
            return jnp.where(active, round_mantissa(x, numerics.mantissa_bits), x)

        rnd = rounded
        params = jax.tree.map(rnd, params)
    temperature = jnp.where(active, numerics.temperature, 1.0)
    top_p = jnp.where(active, numerics.top_p, 1.0)
    model = nnx.merge(graphdef, params)
    n = prompts.shape[-1]
    tokens = task.join(prompts, jnp.zeros_like(prompts))
    routing = Routing()
    if numerics.router_noise > 0:
        # One draw per rollout: every forward pass of the scan perturbs a position alike,
        # so a position's route is the same in every step (the model is causal).
        scale = jnp.where(active, numerics.router_noise, 0.0)
        key, k_noise = jax.random.split(key)
        routing = Routing(noise=router_noise(model, k_noise, tokens.shape, scale))

    # Static: only a sampling mismatch reports through token_logprobs, so the other
    # settings keep their float32 rounding (and the docs' tables) bit for bit.
    sampler = numerics.temperature != 1.0 or numerics.top_p < 1.0

    def step(tokens, xs):
        i, k = xs
        logits = model(tokens, rnd=rnd, quant=quant, routing=routing)
        assert isinstance(logits, jax.Array)  # return_routes=False: the logits alone
        logits = logits[:, n + i].astype(jnp.float32)
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
        if not topk:  # static: the other settings' programs stay as they were
            return tokens, reported
        return tokens, (reported, *topk_support(logq, tok, topk))

    tokens, out = jax.lax.scan(step, tokens, (jnp.arange(n), jax.random.split(key, n)))
    if topk:
        logq, ids, topk_logq = out
        ids, topk_logq = jnp.moveaxis(ids, 0, 1), jnp.moveaxis(topk_logq, 0, 1)
    else:
        logq = out
        assert isinstance(logq, jax.Array)  # k = 0: the sampled tokens' log-probs alone
        ids = jnp.zeros((len(tokens), n, 0), jnp.int32)
        topk_logq = jnp.zeros((len(tokens), n, 0), jnp.float32)
    routes = None
    if return_routes:
        # The routes of every position as sampling saw them (causal: a position's route
        # does not depend on later tokens, so one pass over the finished sequence
        # recomputes them).
        _, routes, _ = model(tokens, rnd=rnd, quant=quant, routing=routing, return_routes=True)
    return Sample(tokens[:, n + 1 :], logq.T, routes, ids, topk_logq)
