"""Packed batches for the tests, and the harness that checks packed == one-per-row.

:func:`packed_batch` draws rows of several ragged sequences each, with everything
the packed layout must survive: length-1 sequences, prompt tokens (mask 0 but
inside their sequence), holes, rows holding one sequence, all-padding rows,
padding whose mask says 1 (padding is never trained on, whatever the mask says)
and garbage (NaN, ±inf, 1e30) wherever a token is not trained on.

:func:`one_per_row` is the oracle side: it unpacks the packed inputs with
:func:`offpolicy_jax.unpack_sequences` to the one-sequence-per-row layout (``R · K``
rows; a segment a row does not use is an empty sequence, which every function
ignores), runs any function of the unpacked API there, and :func:`repack` puts
its per-token outputs back at the packed positions. Log-probs are multiples of
1/16 (as in ``strategies.py``), so sums are exact and keep/reject decisions agree.
"""

from __future__ import annotations

import jax
import mesh_cases as mc
import numpy as np

import offpolicy_jax as opj

NUM_SEGMENTS = 4  # per packed row, in the tests that pack
GARBAGE = (np.nan, np.inf, -np.inf, 1e30, -1e30)
TOKEN_ARRAYS = ("logp", "old_logp", "rollout_logp", "advantages")


def packed_batch(
    seed: int,
    rows: int = 4,
    length: int = 24,
    num_segments: int = 4,
    *,
    garbage: bool = True,
    spikes: bool = True,
) -> dict[str, np.ndarray]:
    """A packed ``[rows, length]`` batch: float32 arrays, bool ``mask``, int32 ``segment_ids``."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((rows, length), np.int32)
    mask = np.zeros((rows, length), bool)
    for r in range(rows):
        kind = rng.integers(0, 6)
        if kind == 0:  # all padding
            continue
        n_seg = 1 if kind == 1 else int(rng.integers(1, num_segments + 1))
        t = 0
        for k in range(1, n_seg + 1):
            if t >= length:
                break
            room = length - t
            n = int(rng.choice([1, 1, 2, rng.integers(1, max(room, 1) + 1)]))
            n = min(n, room)
            ids[r, t : t + n] = k
            prompt = int(rng.integers(0, n)) if n > 1 and rng.random() < 0.5 else 0
            mask[r, t + prompt : t + n] = True  # prompt tokens: their id, mask 0
            t += n
    # holes inside responses, and padding that claims to be trained on
    mask &= rng.random(mask.shape) > 0.1
    mask |= (ids == 0) & (rng.random(mask.shape) < 0.5)
    old = rng.integers(-96, 0, size=mask.shape) / 16.0
    delta = rng.integers(-8, 9, size=mask.shape) / 16.0
    if spikes:
        spike = rng.random(mask.shape) < 0.08
        delta = np.where(spike, rng.integers(-200, 40, size=mask.shape) / 16.0, delta)
    out = {
        "old_logp": old,
        "rollout_logp": old - delta,
        "logp": old + rng.integers(-6, 7, size=mask.shape) / 16.0,
        "advantages": rng.integers(-16, 17, size=mask.shape) / 8.0,
    }
    trained = mask & (ids > 0)
    out = {k: v.astype(np.float32) for k, v in out.items()}
    if garbage:
        for k in out:
            junk = rng.choice(np.array(GARBAGE, np.float32), size=mask.shape)
            out[k] = np.where(trained, out[k], junk).astype(np.float32)
        # a NaN at a trained token rejects its whole sequence
        if trained.any() and rng.random() < 0.5:
            r, t = np.argwhere(trained)[rng.integers(0, trained.sum())]
            out["old_logp"][r, t] = np.nan
    out["mask"] = mask
    out["segment_ids"] = ids
    return out


def unpack(batch: dict[str, np.ndarray], num_segments: int) -> dict[str, np.ndarray]:
    """The one-per-row layout: ``[R · K, T]`` arrays; padding dropped."""
    arrays = {k: v for k, v in batch.items() if k != "segment_ids"}
    padded = opj.unpack_sequences(arrays, batch["segment_ids"], num_segments)
    return {k: v.reshape(-1, v.shape[-1]) for k, v in padded.items()}


def repack(values: np.ndarray, segment_ids: np.ndarray, num_segments: int, fill=0.0) -> np.ndarray:
    """Puts one-per-row ``[R · K, T]`` per-token values back at their packed positions."""
    rows, length = segment_ids.shape
    values = np.asarray(values).reshape(rows, num_segments, -1)
    out = np.full(segment_ids.shape, fill, values.dtype)
    for r in range(rows):
        for k in range(1, num_segments + 1):
            where = np.flatnonzero(segment_ids[r] == k)
            out[r, where] = values[r, k - 1, : where.size]
    return out


def evaluate(batch, corrections, losses, segments=None, axis_names=None, num_segments=NUM_SEGMENTS):
    """Every correction (both reductions) and loss (value, metrics, gradient) of a
    :func:`packed_batch` (``segments`` given) or of its :func:`unpack` (``segments=None``)."""
    packed = {} if segments is None else {"segment_ids": segments, "num_segments": num_segments}
    out = {}
    for name, config in corrections.items():
        for reduction in ("sequence", "token"):
            res = opj.compute_correction(
                batch["old_logp"],
                batch["rollout_logp"],
                batch["mask"],
                config,
                reduction=reduction,
                axis_names=axis_names,
                **packed,
            )
            out[f"c/{name}/{reduction}"] = dict(w=res.weights, m=res.mask, metrics=res.metrics)
    for name, config in losses.items():
        old = None if config.algorithm in ("bypass_ppo", "reinforce_is") else batch["old_logp"]

        extra = mc.regulariser_inputs(
            config, batch["logp"], batch["rollout_logp"], batch["advantages"]
        )

        def loss_fn(logp, config=config, old=old, extra=extra):
            return opj.policy_loss(
                logp,
                old,
                batch["rollout_logp"],
                batch["advantages"],
                batch["mask"],
                config,
                axis_names=axis_names,
                key=jax.random.key(mc.KEY_SEED),
                **packed,
                **extra,
            )

        (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(batch["logp"])
        out[f"l/{name}"] = dict(loss=loss, grad=grad, metrics=metrics)
    return out
