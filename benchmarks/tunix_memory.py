"""Peak memory of the policy-loss gradient in tunix: tunix's own log-prob pass vs ours.

Compiles (never runs) ``jax.grad`` of one GRPO loss step on a one-layer Qwen3 from
tunix's model zoo and reads XLA's ``memory_analysis()``: the temporaries (the peak
working set beyond arguments and outputs) of

* tunix's ``grpo`` loss (its ``compute_per_token_logps``: ``[B, T, V]`` float32 logits,
  a log-softmax, and the entropy of those logits for its aux metrics),
* the offpolicy-jax loss on the same logits path (``logps_from_hidden=False``),
* the offpolicy-jax loss with ``logps_from_hidden=True``
  (``token_logprobs_from_hidden``: no ``[B, T, V]`` array).

    python -m benchmarks.tunix_memory            # needs the [tunix] extra
"""

import argparse
from typing import Any, cast

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.models.qwen3 import model as qwen3
from tunix.rl import algo_core
from tunix.rl.grpo import grpo_learner

import offpolicy_jax as opj
from offpolicy_jax.integrations import tunix as otx


def _example(batch: int, prompt: int, length: int):
    ids = jnp.full((batch, length), 5, jnp.int32)
    return otx.OffPolicyTrainExample(
        prompt_ids=jnp.full((batch, prompt), 5, jnp.int32),
        prompt_mask=jnp.ones((batch, prompt), bool),
        completion_ids=ids,
        completion_mask=jnp.ones((batch, length), bool),
        advantages=jnp.ones((batch,), jnp.float32),
        ref_per_token_logps=None,
        old_per_token_logps=jnp.zeros((batch, length), jnp.float32),
        rollout_per_token_logps=jnp.zeros((batch, length), jnp.float32),
    )


def temp_bytes(loss_fn, model_config, config, example) -> int:
    abstract = nnx.eval_shape(lambda: qwen3.Qwen3(model_config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)

    def loss(state, example):
        model = nnx.merge(graphdef, state)
        return loss_fn(model, example, config, 0, 1)[0]

    compiled = jax.jit(jax.grad(loss)).lower(state, example).compile()
    return int(cast(Any, compiled.memory_analysis()).temp_size_in_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--embed", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=256, help="hidden_chunk_size")
    parser.add_argument("--vocab-chunk", type=int, default=None, help="vocab_chunk_size")
    args = parser.parse_args()
    example = _example(args.batch, args.prompt, args.length)
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}; B={args.batch}, "
        f"prompt={args.prompt}, T={args.length}, D={args.embed}, 1 layer, float32; "
        f"hidden_chunk_size={args.chunk}, vocab_chunk_size={args.vocab_chunk}"
    )
    print("| V | tunix grpo | opj, logits path | opj, from hidden | ratio tunix / from hidden |")
    print("|---|---|---|---|---|")
    for vocab in args.vocab:
        model_config = qwen3.ModelConfig(
            num_layers=1,
            vocab_size=vocab,
            embed_dim=args.embed,
            hidden_dim=2 * args.embed,
            num_heads=4,
            head_dim=args.embed // 4,
            num_kv_heads=2,
            rope_theta=10_000,
            norm_eps=1e-6,
            use_tied_embedding=True,
        )
        tunix_config = grpo_learner.GRPOConfig(beta=0.0)
        tunix_config.temperature = 1.0
        mis = opj.CorrectionConfig.preset("mis")
        logits = otx.OffPolicyGRPOConfig(correction=mis)
        hidden = otx.OffPolicyGRPOConfig(
            correction=mis,
            logps_from_hidden=True,
            hidden_chunk_size=args.chunk,
            vocab_chunk_size=args.vocab_chunk,
        )
        for config in (logits, hidden):
            config.temperature = 1.0
        sizes = [
            temp_bytes(algo_core.grpo_loss_fn, model_config, tunix_config, example),
            temp_bytes(otx.offpolicy_policy_loss, model_config, logits, example),
            temp_bytes(otx.offpolicy_policy_loss, model_config, hidden, example),
        ]
        mib = [f"{size / 2**20:.1f} MiB" for size in sizes]
        print(
            f"| {vocab} | {mib[0]} | {mib[1]} | {mib[2]} | {sizes[0] / sizes[2]:.1f}x |", flush=True
        )


if __name__ == "__main__":
    main()
