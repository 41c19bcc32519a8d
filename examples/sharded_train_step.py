"""A sharded Flax NNX + optax train step with ``policy_loss``: the batch split over a mesh.

The loss needs nothing mesh-specific under ``jax.jit``: its batch means, sequence
sums and batch normalisation see the global batch, and XLA inserts the (scalar
and per-sequence) collectives. Runs as is on 8 virtual CPU devices, a GPU host or
a TPU slice: ``python examples/sharded_train_step.py [--auto]``.
"""

import os
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # CPU only: 8 virtual devices; set before jax

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import offpolicy_jax as opj

VOCAB, PROMPT, RESPONSE = 32, 4, 12


class TinyLM(nnx.Module):
    """Stand-in for your policy: tokens [B, L] -> logits [B, L, V]."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Linear(VOCAB, 64, use_bias=False, rngs=rngs)
        self.hidden = nnx.Linear(64, 64, rngs=rngs)
        self.head = nnx.Linear(64, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        # A one-hot matmul instead of nnx.Embed: under an Explicit mesh, a gather
        # from batch-sharded indices needs an explicit out_sharding.
        x = self.embed(jax.nn.one_hot(tokens, VOCAB))
        return self.head(nnx.gelu(self.hidden(x)))


def response_logp(model, tokens):
    """log π(token) of each response token, float32 [B, RESPONSE]."""
    logits = model(tokens)[:, PROMPT - 1 : -1].astype(jnp.float32)  # position t predicts t + 1
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, tokens[:, PROMPT:, None], axis=-1)[..., 0]


# Decoupled PPO, geometric-mean IS weights that mask sequences outside [0.5, 2],
# a catastrophic-token veto and batch-normalised weights (a global-batch mean).
LOSS = opj.LossConfig(
    algorithm="decoupled_ppo",
    correction=opj.CorrectionConfig(
        use_tis=True,
        tis_level="geometric",
        tis_mode="mask",
        tis_lower_bound=0.5,
        tis_upper_bound=2.0,
        tis_batch_normalize=True,
        rs_veto_threshold=1e-4,
    ),
)


@nnx.jit
def train_step(model, optimizer, batch):
    old_logp = jax.lax.stop_gradient(response_logp(model, batch["tokens"]))  # π_old

    def loss_fn(model):
        logp = response_logp(model, batch["tokens"])
        return opj.policy_loss(
            logp, old_logp, batch["rollout_logp"], batch["advantages"], batch["mask"], LOSS
        )

    (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss, metrics


@nnx.jit(static_argnums=2)
def fake_rollout_batch(key, model, size):
    """Stand-in for your inference engine: tokens, its log-probs, advantages, mask."""
    k_tokens, k_noise, k_adv, k_len = jax.random.split(key, 4)
    tokens = jax.random.randint(k_tokens, (size, PROMPT + RESPONSE), 0, VOCAB)
    lengths = jax.random.randint(k_len, (size, 1), 1, RESPONSE + 1)  # ragged responses
    return {
        "tokens": tokens,
        "rollout_logp": response_logp(model, tokens)
        + 0.2 * jax.random.normal(k_noise, (size, RESPONSE)),
        "advantages": jax.random.normal(k_adv, (size,)),
        "mask": (jnp.arange(RESPONSE) < lengths).astype(jnp.float32),
    }


def main(steps=3, axis_type=AxisType.Explicit):
    # One data-parallel axis over every device. Explicit (jax.make_mesh's default
    # now): shardings are part of the types; Auto: the XLA partitioner decides.
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(axis_type,))
    batch_sharding = NamedSharding(mesh, P("data"))  # rows split, tokens whole
    with jax.set_mesh(mesh):
        model = nnx.jit(lambda: TinyLM(nnx.Rngs(0)))()  # parameters replicated
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        for step in range(steps):
            batch = fake_rollout_batch(jax.random.key(step), model, 4 * jax.device_count())
            batch = jax.device_put(batch, batch_sharding)  # e.g. make_array_from_process_local_data
            loss, metrics = train_step(model, optimizer, batch)
            print(
                f"step {step}: loss {float(loss):+.4f}  "
                f"k3-KL {float(metrics['mis_k3_kl']):.4f}  "
                f"batch-norm {float(metrics['mis_batch_norm_factor']):.3f}  "
                f"mask {jax.typeof(batch['mask'])}"
            )
    return loss, metrics


if __name__ == "__main__":
    main(axis_type=AxisType.Auto if "--auto" in sys.argv else AxisType.Explicit)
