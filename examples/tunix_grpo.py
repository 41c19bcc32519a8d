"""A real tunix GRPO run with rollout correction, on CPU, in about a minute.

tunix's own pieces: a randomly initialised Qwen3 from its model zoo
(``tunix.models.dummy_model_creator``), its ``RLCluster``, its vanilla sampler as the
rollout engine and its GRPO learner. The sampler runs the policy in **bfloat16**
(``RolloutConfig(data_type=jnp.bfloat16)``, on a CPU device of its own) while the trainer
keeps float32: a real training-inference mismatch. offpolicy-jax adds the learner
that carries the sampler's log-probs into the train examples and the loss that
corrects for them (by default the reference ``mis`` preset: token TIS truncated at 2,
the catastrophic-token veto; ``--correction`` picks any preset, verl's included) and
reports the mismatch. The reward is a toy: the share of lowercase letters in the
completion.

    python -m pip install -e ".[tunix]"     # from a clone of offpolicy-jax
    python examples/tunix_grpo.py --steps 4
    python examples/tunix_grpo.py --steps 4 --correction decoupled_token_is
"""

import argparse
import os
import tempfile

# Two CPU devices: the trainer on one, the sampler on the other (tunix then gives the
# sampler its own, bf16, copy of the policy and syncs the weights after each step).
# Set, not defaulted: an inherited JAX_NUM_CPU_DEVICES (our test suite runs with 1)
# would otherwise win over any XLA flag.
os.environ["JAX_NUM_CPU_DEVICES"] = "2"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from tunix.models import dummy_model_creator  # noqa: E402
from tunix.models.qwen3 import model as qwen3  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

import offpolicy_jax as opj  # noqa: E402
from offpolicy_jax.integrations import tunix as otx  # noqa: E402

# Shown when the correction produces them (a preset without a veto has no
# catastrophic fraction; metrics only, no truncation).
SHOWN = (
    "opj/pg_loss",
    "opj/mis_k3_kl",
    "opj/mis_log_ppl_abs_diff",
    "opj/mis_tis_truncate_fraction",
    "opj/mis_rs_catastrophic_seq_fraction",
    "opj/mis_is_ratio_mean_final",
)


class CharTokenizer:
    """Byte-level: id = byte + 3; 0 pad, 1 end of sequence, 2 beginning."""

    def encode(self, text, **kwargs):
        return [b + 3 for b in text.encode()]

    def decode(self, ids, **kwargs):
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode(errors="replace")

    def bos_id(self):
        return 2

    def eos_id(self):
        return 1

    def pad_id(self):
        return 0


def share_of_lowercase(prompts, completions, **kwargs):
    return [sum("a" <= c <= "z" for c in text) / max(len(text), 1) for text in completions]


def build_learner(
    steps: int, log_dir: str, from_hidden: bool = False, correction: str = "mis"
) -> otx.OffPolicyGRPOLearner:
    config = qwen3.ModelConfig(
        num_layers=2,
        vocab_size=259,
        embed_dim=64,
        hidden_dim=128,
        num_heads=4,
        head_dim=16,
        num_kv_heads=2,
        rope_theta=10_000,
        norm_eps=1e-6,
        use_tied_embedding=True,
    )
    policy = dummy_model_creator.create_dummy_model(qwen3.Qwen3, config, scale=0.5)
    trainer_device, sampler_device = jax.devices()[:2]
    trainer_mesh = jax.sharding.Mesh(np.array([[trainer_device]]), ("fsdp", "tp"))
    sampler_mesh = jax.sharding.Mesh(np.array([[sampler_device]]), ("fsdp", "tp"))
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=16,
        max_prompt_length=8,
        kv_cache_size=32,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        data_type=jnp.bfloat16,
        return_logprobs=True,
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=policy,
        tokenizer=CharTokenizer(),
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={
                rl_cluster_lib.Role.ACTOR: trainer_mesh,
                rl_cluster_lib.Role.REFERENCE: trainer_mesh,
                rl_cluster_lib.Role.ROLLOUT: sampler_mesh,
            },
            rollout_engine="vanilla",
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.adam(3e-3),
                eval_every_n_steps=10_000,
                max_steps=steps,
                pbar_description=None,
                metrics_logging_options=opj_metrics_options(log_dir),
            ),
            rollout_config=rollout_config,
        ),
    )
    algo_config = otx.OffPolicyGRPOConfig(
        num_generations=4,
        num_iterations=1,
        correction=opj.CorrectionConfig.preset(correction),
        logps_from_hidden=from_hidden,
    )
    return otx.OffPolicyGRPOLearner(cluster, algo_config, share_of_lowercase)


def opj_metrics_options(log_dir: str):
    from tunix.sft import metrics_logger

    return metrics_logger.MetricsLoggerOptions(log_dir=log_dir, flush_every_n_steps=1)


def print_each_step(learner: otx.OffPolicyGRPOLearner) -> tuple[str, ...]:
    """Prints the loss and the mismatch metrics of every train step, through tunix's
    public training hooks; returns the metric names shown (those the config has)."""
    produced = set(otx.metric_keys(learner.algo_config.offpolicy_loss_config))
    shown = tuple(key for key in SHOWN if key in produced)

    def show(step: int, metrics: dict[str, float]) -> None:
        values = "  ".join(f"{key[4:]}={metrics[key]:.4f}" for key in shown if key in metrics)
        print(f"step {step}: {values}", flush=True)

    learner.rl_cluster.actor_trainer.with_training_hooks(otx.StepMetricsHook(shown, show))
    return shown


def describe(correction: opj.CorrectionConfig, name: str) -> str:
    """What the run corrected with, in words."""
    if not correction.use_tis:
        return f"no correction (preset {name!r}: the mismatch metrics only)"
    return f"the {name!r} correction"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="prompts per step")
    parser.add_argument(
        "--logps-from-hidden",
        action="store_true",
        help="score θ from the last hidden states (no [B, T, V] logits)",
    )
    parser.add_argument(
        "--correction",
        default="mis",
        help="a CorrectionConfig.preset name: mis (default) or one of verl's presets, "
        "e.g. decoupled_token_is, decoupled_geo_rs, disabled",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as log_dir:
        learner = build_learner(args.steps, log_dir, args.logps_from_hidden, args.correction)
        print_each_step(learner)
        prompts = ["say a", "aaa", "banana", "abc", "a a a", "cat"]
        batches = [  # tunix repeats each batch's arrays num_generations times
            {
                "prompts": np.array(
                    [prompts[(i * args.batch + j) % len(prompts)] for j in range(args.batch)]
                )
            }
            for i in range(args.steps)
        ]
        learner.train(batches)
    correction = opj.CorrectionConfig.preset(args.correction)
    print(f"done: trained {args.steps} steps with {describe(correction, args.correction)}")


if __name__ == "__main__":
    main()
