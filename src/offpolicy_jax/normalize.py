"""Batch normalisation of importance weights (semantics.md §3.6).

``w ← w / μ`` so that the mean weight over what stays in the loss is 1. At the
token level ``μ = Σ w m' / Σ m'``; at the sequence and geometric levels (D4) ``μ``
is the mean over sequences with ``Σ m' > 0`` of their masked mean weight. The
mean is over the final mask ``m'`` only (D6): a rejected token, whose unbounded
mask-mode ratio may be ``e^20``, must not shrink the weights that remain.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from offpolicy_jax import _reduce
from offpolicy_jax._reduce import MeshAxes

MIN_NORMALIZER = 1e-8
"""Below this ``μ`` the weights are left unchanged (and ``μ`` reported as 1)."""


def batch_normalize(
    weights: jax.Array, mask: jax.Array, level: str, axes: MeshAxes = MeshAxes()
) -> tuple[jax.Array, jax.Array]:
    """Rescales ``weights`` to mean 1 over ``mask``.

    Args:
      weights: ``[..., T]`` (or per-sequence ``[..., 1]``) bounded IS weights.
      mask: ``[..., T]`` float final mask ``m'``.
      level: the TIS level; ``"token"`` normalises per token, ``"sequence"`` and
        ``"geometric"`` per sequence.
      axes: mesh axes to combine the mean over inside ``shard_map``.

    Returns:
      ``(normalised_weights, mu)``; ``mu`` is 1 when the batch keeps nothing.
    """
    mu = normalizer(_reduce.reduce_mean(weights, mask, normalizer_reduction(level), axes))
    return weights / mu, mu


def normalizer_reduction(level: str) -> str:
    """How ``μ`` averages: per token at the token level, per sequence otherwise (D4)."""
    return "token" if level == "token" else "sequence"


def normalizer(mean_weight: jax.Array) -> jax.Array:
    """``μ``: the mean kept weight, or 1 when it is not above :data:`MIN_NORMALIZER`."""
    return jnp.where(mean_weight > MIN_NORMALIZER, mean_weight, 1.0)
