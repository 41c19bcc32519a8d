"""What the benchmark measures: inputs, the reference configuration, and every variant.

One workload is a padded ``[B, T]`` float32 batch with ragged lengths and three
computations on it:

* ``loss``: forward + backward of :func:`offpolicy_jax.policy_loss` for
  ``decoupled_ppo`` with the reference ``mis.yaml`` correction (token-level
  truncated IS, token-level rejection sampling, veto at 1e-4, batch
  normalisation) and every metric;
* ``correction``: forward of :func:`offpolicy_jax.compute_correction` with the
  same configuration;
* ``loss_trm_icepop``: the ``loss`` step with Trust Region Masking (``seq_max_k2`` +
  ``seq_mean_k3``) and IcePop weights instead of ``mis.yaml`` (docs/semantics.md §8);
  its time per token is compared with ``loss``'s in the same run.

Each computation comes in four variants, all measured in the same run:

* ``floor``: a jitted function that reads each input array once (``sum`` of
  each): the memory-bound lower bound every other time is divided by;
* ``jit``: the library under ``jax.jit`` (what a training step runs);
* ``op_by_op``: the same JAX code without ``jit`` (every primitive dispatched
  on its own, under ``jax.disable_jit()``);
* ``numpy``: the test suite's independent NumPy oracle
  (``tests/numpy_reference.py``; float64, analytic gradient).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
from collections.abc import Callable
from importlib import resources
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np

import offpolicy_jax as opj

REPO = pathlib.Path(__file__).resolve().parents[1]


def reference_correction() -> opj.CorrectionConfig:
    """The reference ``mis.yaml`` shipped with the package."""
    return opj.CorrectionConfig.from_yaml(resources.files("offpolicy_jax") / "configs" / "mis.yaml")


def reference_loss_config() -> opj.LossConfig:
    """decoupled PPO with the reference correction and every metric turned on."""
    return opj.LossConfig(
        algorithm="decoupled_ppo", correction=reference_correction(), get_mismatch_metrics=True
    )


def trm_icepop_loss_config() -> opj.LossConfig:
    """decoupled PPO with Trust Region Masking (``seq_max_k2`` + ``seq_mean_k3``) and
    token-level IcePop weights (docs/semantics.md §8), every metric turned on."""
    correction = opj.CorrectionConfig(
        use_tis=True,
        tis_mode="band",
        tis_lower_bound=0.5,
        tis_upper_bound=5.0,
        rs_criteria=("seq_max_k2:2.5", "seq_mean_k3:0.01"),
    )
    return opj.LossConfig(
        algorithm="decoupled_ppo", correction=correction, get_mismatch_metrics=True
    )


def make_inputs(batch: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A ragged padded batch: lengths uniform in ``[T/8, T]``, garbage-free padding.

    ``rollout_logp`` differs from ``old_logp`` by small noise plus a few large
    spikes (so rejection, truncation and the veto all fire); ``logp`` is a few
    optimiser steps away from ``old_logp``; advantages are per token.
    """
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(length // 8, 1), length + 1, batch)
    mask = np.arange(length)[None, :] < lengths[:, None]
    old = -rng.exponential(1.0, (batch, length))
    spikes = np.where(
        rng.random((batch, length)) < 1e-3, rng.normal(0.0, 6.0, (batch, length)), 0.0
    )
    rollout = old + rng.normal(0.0, 0.05, (batch, length)) + spikes
    logp = old + rng.normal(0.0, 0.02, (batch, length))
    advantages = rng.normal(0.0, 1.0, (batch, length))
    f32 = np.float32
    return {
        "logp": logp.astype(f32),
        "old_logp": old.astype(f32),
        "rollout_logp": rollout.astype(f32),
        "advantages": advantages.astype(f32),
        "mask": mask,
    }


TOPK = 20
"""``K`` of the engine's top-k log-probs in the top-k loss cases (TRL's default)."""


def make_topk_inputs(batch: int, length: int, k: int = TOPK, seed: int = 1) -> dict:
    """The engine's top-``k`` support per position for :func:`topk_loss_step`: ``ids``,
    the engine's log-probs (a Dirichlet draw over the ``k`` ids and the rest of the
    vocabulary, so they sum below 1) and the trainer's (a little noise away)."""
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(k + 1, 0.5), (batch, length))[..., :k]
    rollout = np.log(np.maximum(probs, 1e-30))
    trainer = rollout + rng.normal(0.0, 0.05, rollout.shape)
    return {
        "topk_ids": rng.integers(0, 32768, (batch, length, k)).astype(np.int32),
        "topk_rollout_logp": rollout.astype(np.float32),
        "topk_logp": np.minimum(trainer, 0.0).astype(np.float32),
    }


TOPK_INPUTS = ("topk_ids", "topk_rollout_logp", "topk_logp")


# Token counts that are odd or prime, each beside the nearest multiple of 128: time per
# token must stay within 1.25x of it (a 7x cliff at T = 131071 was found once).
RAGGED_SIZES = "8x131071,8x131072,64x8191,64x8192,256x4093,256x4096"


def nearest_aligned(length: int, multiple: int = 128) -> int:
    """The multiple of ``multiple`` nearest to ``length`` (at least ``multiple``)."""
    return max(multiple, round(length / multiple) * multiple)


LOSS_INPUTS = ("logp", "old_logp", "rollout_logp", "advantages", "mask")
CORRECTION_INPUTS = ("old_logp", "rollout_logp", "mask")


def load_numpy_reference() -> ModuleType | None:
    """The test suite's NumPy oracle, or None when the tests are not beside the package."""
    path = REPO / "tests" / "numpy_reference.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("numpy_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_once(*arrays):
    """The read-once floor: the sum of each input, each array read exactly once."""
    return tuple(jnp.sum(x) for x in arrays)


def loss_step(config: opj.LossConfig, key: jax.Array | None = None) -> Callable:
    """``(loss, metrics), grad`` of ``policy_loss`` w.r.t. ``logp``: one training step's share
    (``key``: the PRNG key of the surrogates that draw tokens, ``clip_cov``)."""

    def step(logp, old_logp, rollout_logp, advantages, mask):
        def loss(lp):
            return opj.policy_loss(lp, old_logp, rollout_logp, advantages, mask, config, key=key)

        return jax.value_and_grad(loss, has_aux=True)(logp)

    return step


def topk_loss_step(config: opj.LossConfig, key: jax.Array | None = None) -> Callable:
    """:func:`loss_step` for a loss whose trust region takes the engine's top-k log-probs:
    three more arguments, :data:`TOPK_INPUTS` (from :func:`make_topk_inputs`)."""

    def step(logp, old_logp, rollout_logp, advantages, mask, ids, topk_rollout, topk_logp):
        topk = opj.TopKLogprobs(ids, topk_rollout, topk_logp)

        def loss(lp):
            return opj.policy_loss(
                lp, old_logp, rollout_logp, advantages, mask, config, key=key, topk=topk
            )

        return jax.value_and_grad(loss, has_aux=True)(logp)

    return step


def topk_floor_step(
    config: opj.LossConfig, key: jax.Array | None = None, *, exponentials: bool = False
) -> Callable:
    """The floor of a top-k case: :func:`loss_step` of ``config`` (a trust region of the
    sampled token alone) that also reads the engine's and the trainer's ``[B, T, K]``
    top-k log-probs once, ``Σ_k (a + b)`` per position, the least any top-k trust region
    must do beside the loss; with ``exponentials``, ``Σ_k |e^a − e^b|``, the least
    arithmetic of a top-k total variation (two exponentials per id). Arguments as
    :func:`topk_loss_step`'s; the ids are not read (no divergence reads them)."""
    base = loss_step(config, key)

    def step(logp, old_logp, rollout_logp, advantages, mask, ids, topk_rollout, topk_logp):
        del ids
        if exponentials:
            read = jnp.sum(jnp.abs(jnp.exp(topk_logp) - jnp.exp(topk_rollout)), axis=-1)
        else:
            read = jnp.sum(topk_logp + topk_rollout, axis=-1)
        return base(logp, old_logp, rollout_logp, advantages, mask), read

    return step


def correction_step(config: opj.CorrectionConfig) -> Callable:
    def step(old_logp, rollout_logp, mask):
        return opj.compute_correction(old_logp, rollout_logp, mask, config)

    return step


@dataclasses.dataclass
class Computation:
    """One computation (loss or correction) on one batch, in all its variants."""

    name: str
    inputs: dict[str, jax.Array]  # device arrays, in call order
    host_inputs: dict[str, np.ndarray]
    step: Callable  # the JAX function of the inputs
    numpy_step: Callable | None  # the NumPy oracle's equivalent, None if unavailable

    @property
    def args(self) -> tuple[jax.Array, ...]:
        return tuple(self.inputs.values())

    @property
    def input_bytes(self) -> int:
        return sum(int(x.nbytes) for x in self.inputs.values())

    def compile(self, fn: Callable) -> jax.stages.Compiled:
        return jax.jit(fn).lower(*self.args).compile()

    def op_by_op(self):
        with jax.disable_jit():
            return self.step(*self.args)


def computations(batch: int, length: int, numpy_reference: ModuleType | None) -> list[Computation]:
    """The loss and the correction workloads on one ``[batch, length]`` batch."""
    host = make_inputs(batch, length)
    device = {k: jnp.asarray(v) for k, v in host.items()}
    loss_config = reference_loss_config()
    correction_config = loss_config.correction
    trm_config = trm_icepop_loss_config()
    loss_numpy = correction_numpy = trm_numpy = None
    if numpy_reference is not None:
        ref = numpy_reference
        corr = correction_config.to_dict()

        def loss_numpy():
            return ref.policy_loss(
                *(host[k] for k in LOSS_INPUTS),
                algorithm="decoupled_ppo",
                correction=corr,
                get_mismatch_metrics=True,
            )

        def correction_numpy():
            return ref.correction(*(host[k] for k in CORRECTION_INPUTS), **corr)

        def trm_numpy():
            return ref.policy_loss(
                *(host[k] for k in LOSS_INPUTS),
                algorithm="decoupled_ppo",
                correction=trm_config.correction.to_dict(),
                get_mismatch_metrics=True,
            )

    return [
        Computation(
            "loss",
            {k: device[k] for k in LOSS_INPUTS},
            {k: host[k] for k in LOSS_INPUTS},
            loss_step(loss_config),
            loss_numpy,
        ),
        Computation(
            "correction",
            {k: device[k] for k in CORRECTION_INPUTS},
            {k: host[k] for k in CORRECTION_INPUTS},
            correction_step(correction_config),
            correction_numpy,
        ),
        Computation(
            "loss_trm_icepop",
            {k: device[k] for k in LOSS_INPUTS},
            {k: host[k] for k in LOSS_INPUTS},
            loss_step(trm_config),
            trm_numpy,
        ),
    ]
