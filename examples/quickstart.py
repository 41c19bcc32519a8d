"""Quick start: correct a synthetic training/rollout mismatch and print the metrics.

A bf16-like inference engine reports log-probs that differ from the trainer's
fp32 recomputation by a little noise, and a few tokens by a lot (a router flip,
a sampling trick). ``compute_correction`` with the reference mis.yaml settings
turns that into IS weights, a rejection mask and mismatch metrics.

    python examples/quickstart.py
"""

from importlib import resources

import jax
import jax.numpy as jnp

import offpolicy_jax as opj


def synthetic_logps(key, batch=8, max_len=32):
    k_len, k_logp, k_noise, k_spike = jax.random.split(key, 4)
    lengths = jax.random.randint(k_len, (batch,), 4, max_len + 1)
    mask = jnp.arange(max_len)[None, :] < lengths[:, None]
    old_logp = -jax.random.exponential(k_logp, (batch, max_len))  # trainer, fp32
    noise = 0.05 * jax.random.normal(k_noise, (batch, max_len))  # low-precision sampler
    spikes = jnp.where(jax.random.uniform(k_spike, (batch, max_len)) < 0.02, 3.0, 0.0)
    rollout_logp = old_logp + noise + spikes
    # Padding holds garbage, as real batches do; it never reaches any output.
    rollout_logp = jnp.where(mask, rollout_logp, jnp.nan)
    return old_logp, rollout_logp, mask


def main():
    config_path = resources.files("offpolicy_jax") / "configs" / "mis.yaml"
    config = opj.CorrectionConfig.from_yaml(str(config_path))
    old_logp, rollout_logp, mask = synthetic_logps(jax.random.key(0))
    correct = jax.jit(opj.compute_correction, static_argnames=("config", "reduction"))
    result = correct(old_logp, rollout_logp, mask, config=config)
    print(f"config: {config}")
    print(f"tokens kept: {int(result.mask.sum())} of {int(mask.sum())}")
    print(f"{'metric':40s} {'value':>12s}")
    for key, value in sorted(result.metrics.items()):
        print(f"{key:40s} {float(value):12.6f}")


if __name__ == "__main__":
    main()
