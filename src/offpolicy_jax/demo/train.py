"""The trainer: GRPO-style RL on the digit task, with a separate rollout engine.

One jitted ``train_step`` per algorithm (``LossConfig`` is static): the engine samples a
batch and reports its log-probs, the trainer recomputes float32 log-probs of the same
tokens, and the policy is updated with ``opj.policy_loss`` on a few minibatches.
Seeds are vmapped, steps are ``lax.scan``-ned in chunks (so a progress bar can advance).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import offpolicy_jax as opj
from offpolicy_jax.demo import engine, task
from offpolicy_jax.demo.model import Policy

Array = jax.Array

MISMATCH_SOURCES = ("precision", "stale", "sampling")

# The reference mis.yaml of the miles/slime frameworks.
MIS = opj.CorrectionConfig(
    use_tis=True, tis_level="token", tis_mode="truncate", tis_lower_bound=0.5,
    tis_upper_bound=2.0, tis_batch_normalize=True, use_rs=True, rs_level="token",
    rs_veto_threshold=1e-4,
)


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One line of the comparison: a loss configuration, and whether the engine mismatches."""

    name: str
    label: str
    loss: opj.LossConfig
    mismatch: bool = True


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("reference", "no mismatch (ppo)", opj.LossConfig(algorithm="ppo"), False),
        Algorithm("ppo", "ppo, mismatch ignored", opj.LossConfig(algorithm="ppo")),
        Algorithm("bypass_ppo", "bypass_ppo", opj.LossConfig(algorithm="bypass_ppo")),
        Algorithm("decoupled_tis", "decoupled_ppo + VanillaTIS", opj.LossConfig(
            algorithm="decoupled_ppo", correction=opj.VanillaTIS(clip_low=0.0, clip=2.0))),
        Algorithm("decoupled_mis", "decoupled_ppo + MIS (mis.yaml)",
                  opj.LossConfig(algorithm="decoupled_ppo", correction=MIS)),
        Algorithm("reinforce_is", "reinforce_is + MIS (mis.yaml)",
                  opj.LossConfig(algorithm="reinforce_is", correction=MIS)),
    )
}


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """Where the engine's numerics differ from the trainer's, and how much.

    ``severity`` 0 is no mismatch; 1 is the realistic setting; larger is worse:

    - ``precision``: weights and activations keep ``8 - severity`` mantissa bits
      (1 = bfloat16, 5 = the 3 bits of fp8-e4m3);
    - ``stale``: the engine's weights are ``severity`` optimizer updates behind;
    - ``sampling``: temperature ``1 + 0.25 * severity`` and top-p ``1 - 0.05 * severity``.
    """

    source: str = "precision"
    severity: float = 1.0

    def numerics(self) -> engine.Numerics:
        s = self.severity
        if self.source == "precision" and s > 0:
            return engine.Numerics(mantissa_bits=max(1, 8 - int(round(s))))
        if self.source == "sampling" and s > 0:
            return engine.Numerics(temperature=1.0 + 0.25 * s, top_p=max(0.05, 1.0 - 0.05 * s))
        return engine.Numerics()

    def staleness(self) -> int:
        return int(round(self.severity)) if self.source == "stale" else 0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Model, batch and optimiser sizes (hashable: closed over by the jitted step)."""

    prompt_len: int = 4
    d_model: int = 32
    n_heads: int = 2
    n_layers: int = 1
    prompts_per_step: int = 16
    group_size: int = 8
    minibatches: int = 2
    learning_rate: float = 1e-3
    max_grad_norm: float = 1.0

    @property
    def batch(self) -> int:
        return self.prompts_per_step * self.group_size


def make_model(cfg: TrainConfig, seed: int) -> Policy:
    return Policy(task.VOCAB, 2 * cfg.prompt_len + 1, cfg.d_model, cfg.n_heads, cfg.n_layers,
                  rngs=nnx.Rngs(seed))


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm),
                       optax.adam(cfg.learning_rate))


def token_logp(graphdef: nnx.GraphDef, params: nnx.State, tokens: Array, n: int) -> Array:
    """float32 log-prob of each response token under the trainer's policy, ``[B, n]``."""
    logits = nnx.merge(graphdef, params)(tokens)[:, n:2 * n]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, n + 1:, None], axis=-1)[..., 0]


def group_advantages(rewards: Array, group_size: int) -> Array:
    """GRPO: reward minus its group mean, over the group std (one value per sequence)."""
    r = rewards.reshape(-1, group_size)
    adv = (r - r.mean(-1, keepdims=True)) / (r.std(-1, keepdims=True) + 1e-6)
    return adv.reshape(-1)


def init_state(cfg: TrainConfig, mismatch: Mismatch, seeds: list[int]):
    """Per-seed trainer state stacked on a leading axis, plus the graphdef."""
    tx = make_optimizer(cfg)
    states = []
    for seed in seeds:
        graphdef, params = nnx.split(make_model(cfg, seed), nnx.Param)
        k = mismatch.staleness()
        # The engine's weight queue: the weights it samples with are queue[0].
        queue = jax.tree.map(lambda p: jnp.stack([p] * k), params) if k else None
        states.append({"params": params, "opt": tx.init(params), "queue": queue})
    return graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states)


def make_train_step(graphdef: nnx.GraphDef, cfg: TrainConfig, algo: Algorithm,
                    mismatch: Mismatch) -> Callable:
    """``train_step(state, key) -> (state, metrics)`` for one seed (vmap it for many)."""
    tx = make_optimizer(cfg)
    lcfg = algo.loss
    numerics = mismatch.numerics() if algo.mismatch else engine.Numerics()
    stale = mismatch.staleness() if algo.mismatch else 0
    n, g, mbs = cfg.prompt_len, cfg.group_size, cfg.minibatches
    needs_old = lcfg.algorithm in ("ppo", "decoupled_ppo")
    monitor = lcfg.correction if isinstance(lcfg.correction, opj.CorrectionConfig) \
        else opj.CorrectionConfig()

    def loss_fn(params, tokens, old_logp, rollout_logp, adv, mask):
        logp = token_logp(graphdef, params, tokens, n)
        return opj.policy_loss(logp, old_logp if needs_old else None, rollout_logp, adv, mask,
                               lcfg)

    def minibatch_update(carry, mb):
        params, opt = carry
        (loss, met), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, *mb)
        updates, opt = tx.update(grads, opt, params)
        met = {k: met[k] for k in ("pg_clipfrac",) if k in met}
        met["grad_norm"] = optax.global_norm(grads)
        return (optax.apply_updates(params, updates), opt), met

    def train_step(state, key):
        params, opt, queue = state["params"], state["opt"], state["queue"]
        k_prompt, k_sample = jax.random.split(key)
        prompts = jnp.repeat(task.sample_prompts(k_prompt, cfg.prompts_per_step, n), g, axis=0)
        engine_params = jax.tree.map(lambda q: q[0], queue) if stale else params
        responses, rollout_logp = engine.generate(graphdef, engine_params, prompts, k_sample,
                                                  numerics)
        rewards = task.reward(prompts, responses)
        adv = group_advantages(rewards, g)
        tokens = task.join(prompts, responses)
        old_logp = jax.lax.stop_gradient(token_logp(graphdef, params, tokens, n))
        mask = jnp.ones_like(old_logp)

        # What the correction sees when the batch arrives: mismatch metrics and rejections.
        res = opj.compute_correction(old_logp, rollout_logp, mask, monitor, reduction="token")

        # Minibatches are whole groups, in order.
        batch = (tokens, old_logp, rollout_logp, adv, mask)
        batch = jax.tree.map(lambda x: x.reshape((mbs, -1) + x.shape[1:]), batch)
        (params, opt), met = jax.lax.scan(minibatch_update, (params, opt), batch)
        if stale:
            queue = jax.tree.map(lambda q, p: jnp.concatenate([q[1:], p[None]]), queue, params)
        metrics = {k: v.mean() for k, v in met.items()}
        metrics.update(
            reward=rewards.mean(),
            exact_match=(rewards == 1.0).mean(),
            mis_k3_kl=res.metrics["mis_k3_kl"],
            mis_kl=res.metrics["mis_kl"],
            rejected_fraction=1.0 - res.mask.sum() / mask.sum(),
        )
        return {"params": params, "opt": opt, "queue": queue}, metrics

    return train_step


def make_chunk_runner(train_step: Callable, chunk: int) -> Callable:
    """Jitted ``(state, keys [chunk, seeds], n_active) -> (state, metrics [chunk, seeds])``:
    ``chunk`` steps for all seeds at once; steps at index >= n_active are skipped, so a
    last, shorter chunk reuses the same compiled program."""
    vstep = jax.vmap(train_step)

    def skip(state, keys):
        _, met = jax.eval_shape(vstep, state, keys)
        return state, jax.tree.map(lambda s: jnp.full(s.shape, jnp.nan, s.dtype), met)

    @jax.jit
    def run(state, keys, n_active):
        def body(state, xs):
            i, k = xs
            return jax.lax.cond(i < n_active, vstep, skip, state, k)

        return jax.lax.scan(body, state, (jnp.arange(chunk), keys))

    return run


def step_keys(seeds: list[int], steps: int) -> np.ndarray:
    """Keys ``[steps, seeds]``: the same for every algorithm (common random numbers)."""
    keys = jnp.stack([jax.random.split(jax.random.key(s), steps) for s in seeds], axis=1)
    return keys


def n_chunks(steps: int, chunk: int) -> int:
    return math.ceil(steps / chunk)
