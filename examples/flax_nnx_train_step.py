"""A Flax NNX + optax train step with rollout correction: copy it into your own loop.

Your inference engine (vLLM, SGLang, a bf16 sampler, an async worker a few updates behind)
returns, for each sampled token, the log-prob it sampled with: ``rollout_logp``. The
trainer recomputes it with its own numerics as ``old_logp`` before the update. The only
line that differs from plain PPO is the ``LossConfig``; the loss is ``opj.policy_loss``.

Run it: ``python examples/flax_nnx_train_step.py`` (a few seconds on a CPU).
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import offpolicy_jax as opj

VOCAB, PROMPT, RESPONSE = 16, 4, 6


class TinyLM(nnx.Module):
    """Stand-in for your policy: any module mapping tokens [B, L] to logits [B, L, V]."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, 32, rngs=rngs)
        self.hidden = nnx.Linear(32, 32, rngs=rngs)
        self.head = nnx.Linear(32, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        return self.head(nnx.gelu(self.hidden(self.embed(tokens))))


def response_logp(model, tokens):
    """log π(token) of each response token, float32 [B, RESPONSE]."""
    logits = model(tokens)[:, PROMPT - 1 : -1].astype(jnp.float32)  # position t predicts t + 1
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, tokens[:, PROMPT:, None], axis=-1)[..., 0]


# Decoupled PPO with the reference mis.yaml correction (token-level truncated IS, token
# rejection outside [0.5, 2], catastrophic-token veto, batch-normalised weights).
# Other choices: opj.LossConfig(algorithm="bypass_ppo"), algorithm="decoupled_ppo" with
# correction=opj.VanillaTIS(clip_low=0.0, clip=2.0), algorithm="reinforce_is", ...
LOSS = opj.LossConfig(
    algorithm="decoupled_ppo",
    correction=opj.CorrectionConfig(
        use_tis=True,
        tis_level="token",
        tis_mode="truncate",
        tis_upper_bound=2.0,
        tis_batch_normalize=True,
        use_rs=True,
        rs_level="token",
        tis_lower_bound=0.5,
        rs_veto_threshold=1e-4,
    ),
)


@nnx.jit
def train_step(model, optimizer, batch):
    """One update on a batch of rollouts. ``batch`` holds ``tokens`` [B, L], the engine's
    ``rollout_logp`` [B, RESPONSE], ``advantages`` [B] and a response ``mask`` [B, RESPONSE]."""
    # π_old: the trainer's own log-probs of the sampled tokens, before this update. (With
    # several minibatches per rollout batch, compute it once for the whole batch.)
    old_logp = jax.lax.stop_gradient(response_logp(model, batch["tokens"]))

    def loss_fn(model):
        logp = response_logp(model, batch["tokens"])
        return opj.policy_loss(
            logp, old_logp, batch["rollout_logp"], batch["advantages"], batch["mask"], LOSS
        )

    (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss, metrics


def fake_rollout_batch(key, model, batch=64):
    """Stand-in for your inference engine and reward: sampled tokens, the log-probs the
    engine reports (here the trainer's plus noise, as if computed with other numerics),
    advantages, and a mask (some responses are shorter)."""
    k_tokens, k_noise, k_adv = jax.random.split(key, 3)
    tokens = jax.random.randint(k_tokens, (batch, PROMPT + RESPONSE), 0, VOCAB)
    noise = 0.2 * jax.random.normal(k_noise, (batch, RESPONSE))
    return {
        "tokens": tokens,
        "rollout_logp": response_logp(model, tokens) + noise,
        "advantages": jax.random.normal(k_adv, (batch,)),
        "mask": jnp.ones((batch, RESPONSE)).at[: batch // 4, -2:].set(0),
    }


def main(steps: int = 5):
    model = TinyLM(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    key = jax.random.key(1)
    for step in range(steps):
        key, k = jax.random.split(key)
        loss, m = train_step(model, optimizer, fake_rollout_batch(k, model))
        print(
            f"step {step}: loss {float(loss):+.4f}  mis_k3_kl {float(m['mis_k3_kl']):.4f}  "
            f"truncated {float(m['mis_tis_truncate_fraction']):.3f}  "
            f"rs-rejected low {float(m['mis_rs_mask_fraction_low']):.3f}"
        )
    return loss, m


if __name__ == "__main__":
    main()
