"""``policy_loss`` inside ``jax.shard_map``: data parallelism x context parallelism.

Each device holds a ``[B / data, T / seq]`` block of the loss inputs. With
``axis_names=opj.MeshAxes(batch="data", token="seq")`` every reduction (sequence
sums of the sequence/geometric levels, the veto, batch normalisation, metric
means, the loss numerator and denominator) is ``psum``-ed: only per-sequence
``[B / data]`` values and scalars cross devices, and the result is the unsharded
call's. Run: ``python examples/shard_map_loss.py`` (8 virtual CPU devices).
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # CPU only: 8 virtual devices; set before jax

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import offpolicy_jax as opj

B, T = 8, 29  # 29 tokens: padded (masked) to a multiple of the seq axis below

LOSS = opj.LossConfig(
    algorithm="decoupled_ppo",
    correction=opj.CorrectionConfig(
        use_tis=True,
        tis_level="sequence",
        tis_mode="truncate",
        tis_upper_bound=2.0,
        tis_batch_normalize=True,
        use_rs=True,
        rs_level="geometric",
        rs_lower_bound=0.9,
        rs_upper_bound=1.1,
        rs_veto_threshold=1e-4,
    ),
)

n = jax.device_count()
seq = 2 if n % 2 == 0 else 1
mesh = jax.make_mesh((n // seq, seq), ("data", "seq"))  # data parallel x context parallel
TOKENS, ROWS = P("data", "seq"), P("data")
AXES = opj.MeshAxes(batch="data", token="seq")


def per_shard_loss(logp, old_logp, rollout_logp, advantages, mask):
    """Sees one block; axis_names makes every sum and mean global."""
    return opj.policy_loss(logp, old_logp, rollout_logp, advantages, mask, LOSS, axis_names=AXES)


# Default check_vma=True: JAX verifies the scalar outputs are the same on every
# device, and the gradient of the psum-ed loss w.r.t. a block is that block's.
sharded_loss = jax.shard_map(
    per_shard_loss, mesh=mesh, in_specs=(TOKENS, TOKENS, TOKENS, ROWS, TOKENS), out_specs=(P(), P())
)


@jax.jit
def train_step(params, opt_state, batch):
    """A stand-in policy: ``params`` are per-token logits offsets, sharded like the tokens."""

    def loss_fn(params):
        logp = jax.nn.log_sigmoid(params["logits"])  # your model's log π(token), [B, T]
        return sharded_loss(
            logp, batch["old_logp"], batch["rollout_logp"], batch["advantages"], batch["mask"]
        )

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, metrics


def pad_tokens(x, multiple):
    """Pads the token axis with masked zeros up to a multiple of the seq shards."""
    extra = -x.shape[-1] % multiple
    return np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


optimizer = optax.adam(1e-2)

if __name__ == "__main__":
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 1.0, (B, T)).astype(np.float32)
    old = np.asarray(jax.nn.log_sigmoid(logits))
    batch = {
        "old_logp": old,
        "rollout_logp": old + rng.normal(0.0, 0.3, (B, T)).astype(np.float32),
        "advantages": rng.normal(size=B).astype(np.float32),  # one per sequence
        "mask": (np.arange(T) < rng.integers(1, T + 1, (B, 1))).astype(np.float32),  # ragged
    }
    want, want_metrics = opj.policy_loss(
        jnp.asarray(old),
        **{k: batch[k] for k in ("old_logp", "rollout_logp", "advantages", "mask")},
        config=LOSS,
    )  # unsharded

    with jax.set_mesh(mesh):

        def put(x):
            return jax.device_put(x, NamedSharding(mesh, ROWS if x.ndim == 1 else TOKENS))

        sharded = {k: put(v if v.ndim == 1 else pad_tokens(v, seq)) for k, v in batch.items()}
        params = {"logits": put(pad_tokens(logits, seq))}
        opt_state = optimizer.init(params)
        for step in range(3):
            params, opt_state, loss, metrics = train_step(params, opt_state, sharded)
            if step == 0:  # same policy as the unsharded call: same numbers
                np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-7)
                np.testing.assert_allclose(
                    metrics["mis_batch_norm_factor"],
                    want_metrics["mis_batch_norm_factor"],
                    rtol=1e-5,
                )
            rejected = metrics["mis_rs_mask_fraction_low"] + metrics["mis_rs_mask_fraction_high"]
            print(
                f"step {step}: loss {float(loss):+.5f}  rs-rejected {float(rejected):.3f}  "
                f"params {jax.typeof(params['logits'])}"
            )
