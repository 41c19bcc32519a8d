"""The trainer: GRPO-style RL on the digit task, with a separate rollout engine.

Every (algorithm, seed) run is one row of a batched state, trained by ONE jitted step:
the engine samples a batch and reports its log-probs, the trainer recomputes float32
log-probs of the same tokens, and the policy is updated with ``opj.policy_loss`` on a few
minibatches. The algorithms differ only in their (static) ``LossConfig``; a
``lax.switch`` on each row's algorithm index picks its loss, so all runs share one
compiled program and advance together. Steps are ``lax.scan``-ned in chunks so that a
progress bar can follow.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import offpolicy_jax as opj
from offpolicy_jax.demo import engine, task
from offpolicy_jax.demo.model import Policy

Array = jax.Array

MISMATCH_SOURCES = ("precision", "stale", "sampling")
#: Default severity per source. The stale default is deliberately severe: in this tiny
#: problem milder mismatches give smaller gaps (README.md has the numbers).
DEFAULT_SEVERITY = {"stale": 64.0, "precision": 1.0, "sampling": 1.0}
MAX_STALENESS = 256

#: The reference rollout-correction settings, as shipped with the package (mis.yaml).
MIS = opj.CorrectionConfig.from_yaml(
    importlib.resources.files("offpolicy_jax").joinpath("configs", "mis.yaml").read_text()
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
        Algorithm(
            "decoupled_tis",
            "decoupled_ppo + VanillaTIS",
            opj.LossConfig(
                algorithm="decoupled_ppo", correction=opj.VanillaTIS(clip_low=0.0, clip=2.0)
            ),
        ),
        Algorithm(
            "decoupled_mis",
            "decoupled_ppo + MIS (mis.yaml)",
            opj.LossConfig(algorithm="decoupled_ppo", correction=MIS),
        ),
        Algorithm(
            "reinforce_is",
            "reinforce_is + MIS (mis.yaml)",
            opj.LossConfig(algorithm="reinforce_is", correction=MIS),
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """Where the engine's numerics differ from the trainer's, and how much.

    ``severity`` 0 is no mismatch, larger is worse:

    - ``precision``: weights and activations keep ``8 - severity`` mantissa bits
      (1 = bfloat16's 7 bits, 5 = the 3 bits of fp8-e4m3; 7 and above keep 1 bit);
    - ``stale``: the engine samples with weights ``severity`` optimizer updates old,
      as an asynchronous RL system does (at most ``MAX_STALENESS``: the engine keeps
      that many copies of the weights per run);
    - ``sampling``: the engine samples at temperature ``1 + 0.25 * severity`` with
      top-p ``1 - 0.05 * severity`` (at least 0.05), which the trainer does not apply.
    """

    source: str = "stale"
    severity: float = DEFAULT_SEVERITY["stale"]

    def numerics(self) -> engine.Numerics:
        s = self.severity
        if self.source == "precision" and s > 0:
            return engine.Numerics(mantissa_bits=max(1, 8 - round(s)))
        if self.source == "sampling" and s > 0:
            return engine.Numerics(temperature=1.0 + 0.25 * s, top_p=max(0.05, 1.0 - 0.05 * s))
        return engine.Numerics()

    def staleness(self) -> int:
        return round(self.severity) if self.source == "stale" else 0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Model, batch and optimiser sizes."""

    prompt_len: int = 4
    d_model: int = 32
    n_heads: int = 2
    n_layers: int = 1
    prompts_per_step: int = 16
    group_size: int = 8
    minibatches: int = 2
    learning_rate: float = 1e-3
    max_grad_norm: float = 1.0
    eval_prompts: int = 64


def make_model(cfg: TrainConfig, seed: int | Array) -> Policy:
    return Policy(
        task.VOCAB,
        2 * cfg.prompt_len + 1,
        cfg.d_model,
        cfg.n_heads,
        cfg.n_layers,
        rngs=nnx.Rngs(jax.random.key(seed)),
    )


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), optax.adam(cfg.learning_rate))


def token_logp(graphdef: nnx.GraphDef, params: nnx.State, tokens: Array, n: int) -> Array:
    """float32 log-prob of each response token under the trainer's policy, ``[B, n]``."""
    logits = nnx.merge(graphdef, params)(tokens)[:, n : 2 * n]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, n + 1 :, None], axis=-1)[..., 0]


def group_advantages(rewards: Array, group_size: int) -> Array:
    """GRPO: reward minus its group mean, over the group std (one value per sequence)."""
    r = rewards.reshape(-1, group_size)
    adv = (r - r.mean(-1, keepdims=True)) / (r.std(-1, keepdims=True) + 1e-6)
    return adv.reshape(-1)


def init_state(cfg: TrainConfig, mismatch: Mismatch, seeds: Sequence[int]):
    """``(graphdef, state)``: one state row per seed, stacked on a leading axis."""
    tx = make_optimizer(cfg)
    k = mismatch.staleness()
    graphdef = nnx.graphdef(make_model(cfg, 0))

    def init(seed):
        params = nnx.state(make_model(cfg, seed), nnx.Param)
        # The engine's copies of the weights, a ring buffer: slot step % k holds the
        # weights of k updates ago, which the engine samples with.
        ring = jax.tree.map(lambda p: jnp.stack([p] * k), params) if k else None
        return {
            "params": params,
            "opt": tx.init(params),
            "ring": ring,
            "step": jnp.zeros((), jnp.int32),
        }

    return graphdef, jax.jit(jax.vmap(init))(jnp.asarray(seeds))


def make_train_step(
    graphdef: nnx.GraphDef, cfg: TrainConfig, algorithms: Sequence[Algorithm], mismatch: Mismatch
) -> Callable:
    """``train_step(state, key, algo_index, mismatched) -> (state, metrics)`` for one run
    (vmap it over runs). ``algo_index`` picks ``algorithms[algo_index].loss``;
    ``mismatched`` turns the engine's mismatch on."""
    tx = make_optimizer(cfg)
    numerics, stale = mismatch.numerics(), mismatch.staleness()
    n, g, mbs = cfg.prompt_len, cfg.group_size, cfg.minibatches
    # Runs that share a loss share a switch branch (e.g. reference and ppo).
    loss_configs = list(dict.fromkeys(a.loss for a in algorithms))
    loss_index = jnp.array([loss_configs.index(a.loss) for a in algorithms], jnp.int32)
    # The correction each algorithm applies, run once per batch to monitor the mismatch
    # and count rejected tokens (use_tis=False: metrics only, nothing rejected).
    applied = [
        a.loss.correction
        if isinstance(a.loss.correction, opj.CorrectionConfig)
        else opj.CorrectionConfig()
        for a in algorithms
    ]
    monitors = list(dict.fromkeys(applied))
    monitor_index = jnp.array([monitors.index(c) for c in applied], jnp.int32)

    def policy_loss(lcfg: opj.LossConfig):
        needs_old = lcfg.algorithm in ("ppo", "decoupled_ppo")

        def loss(logp, old_logp, rollout_logp, adv, mask):
            loss, met = opj.policy_loss(
                logp, old_logp if needs_old else None, rollout_logp, adv, mask, lcfg
            )
            return loss, met.get("pg_clipfrac", jnp.float32(0.0))

        return loss

    losses = [policy_loss(c) for c in loss_configs]

    def loss_fn(params, algo_index, tokens, old_logp, rollout_logp, adv, mask):
        logp = token_logp(graphdef, params, tokens, n)
        return jax.lax.switch(
            loss_index[algo_index], losses, logp, old_logp, rollout_logp, adv, mask
        )

    def monitor(algo_index, old_logp, rollout_logp, mask):
        def run(c):
            res = opj.compute_correction(old_logp, rollout_logp, mask, c, reduction="token")
            return res.metrics["mis_k3_kl"], (mask.sum() - res.mask.sum()) / mask.sum()

        return jax.lax.switch(monitor_index[algo_index], [lambda c=c: run(c) for c in monitors])

    def train_step(state, key, algo_index, mismatched):
        params = state["params"]
        k_prompt, k_sample, k_eval_prompt, k_eval = jax.random.split(key, 4)
        prompts = jnp.repeat(task.sample_prompts(k_prompt, cfg.prompts_per_step, n), g, axis=0)
        if stale:
            slot = state["step"] % stale
            old = jax.tree.map(lambda r: r[slot], state["ring"])
            engine_params = jax.tree.map(lambda o, p: jnp.where(mismatched, o, p), old, params)
        else:
            engine_params = params
        responses, rollout_logp = engine.generate(
            graphdef, engine_params, prompts, k_sample, numerics, active=mismatched
        )
        rewards = task.reward(prompts, responses)
        tokens = task.join(prompts, responses)
        old_logp = jax.lax.stop_gradient(token_logp(graphdef, params, tokens, n))
        mask = jnp.ones_like(old_logp)
        k3, rejected = monitor(algo_index, old_logp, rollout_logp, mask)

        def update(carry, mb):
            params, opt = carry
            (_, clipfrac), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, algo_index, *mb
            )
            updates, opt = tx.update(grads, opt, params)
            return (optax.apply_updates(params, updates), opt), (clipfrac, optax.tree.norm(grads))

        # Minibatches are whole groups, in order: one PPO epoch over the batch.
        batch = (tokens, old_logp, rollout_logp, group_advantages(rewards, g), mask)
        batch = jax.tree.map(lambda x: x.reshape((mbs, -1) + x.shape[1:]), batch)
        (params, opt), (clipfrac, grad_norm) = jax.lax.scan(update, (params, state["opt"]), batch)
        # The trained policy itself, sampled with exact float32 numerics on fresh prompts:
        # the model you would ship, free of the engine's distortion and lag.
        eval_prompts = task.sample_prompts(k_eval_prompt, cfg.eval_prompts, n)
        eval_responses, _ = engine.generate(
            graphdef, params, eval_prompts, k_eval, engine.Numerics(), active=False
        )
        eval_rewards = task.reward(eval_prompts, eval_responses)
        ring = state["ring"]
        if stale:
            ring = jax.tree.map(lambda r, p: r.at[slot].set(p), ring, params)
        metrics = {
            "reward": rewards.mean(),
            "policy_reward": eval_rewards.mean(),
            "policy_exact_match": (eval_rewards == 1.0).mean(),
            "mis_k3_kl": k3,
            "rejected_fraction": rejected,
            "pg_clipfrac": clipfrac.mean(),
            "grad_norm": grad_norm.mean(),
        }
        return {"params": params, "opt": opt, "ring": ring, "step": state["step"] + 1}, metrics

    return train_step


def make_chunk_runner(train_step: Callable) -> Callable:
    """Jitted ``run(state, keys [n, R], algo_index [R], mismatched [R]) -> (state,
    metrics [n, R])``: ``n`` steps of all R runs at once (one compile per chunk length)."""
    vstep = jax.vmap(train_step)

    @functools.partial(jax.jit, donate_argnums=0)
    def run(state, keys, algo_index, mismatched):
        return jax.lax.scan(lambda s, k: vstep(s, k, algo_index, mismatched), state, keys)

    return run
