"""Batch normalisation of importance weights (docs/semantics.md §3.6).

``w ← w / μ`` so that the mean weight over what stays in the loss is 1. At the
token level ``μ = Σ w m' / Σ m'``; at the sequence and geometric levels (D4) ``μ``
is the mean over sequences with ``Σ m' > 0`` of their masked mean weight. The
mean is over the final mask ``m'`` only (D6): a rejected token, whose unbounded
mask-mode ratio may be ``e^20``, must not shrink the weights that remain.
``stages.run`` applies it after its second pass, from the same per-sequence sums
that give ``mis_is_ratio_mean_after_tis_rs``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MIN_NORMALIZER = 1e-8
"""Below this ``μ`` the weights are left unchanged (and ``μ`` reported as 1)."""


def normalizer_reduction(level: str) -> str:
    """How ``μ`` averages: per token at the per-token levels (token, minpro), per
    sequence otherwise (D4)."""
    return "token" if level in ("token", "minpro") else "sequence"


def normalizer(mean_weight: jax.Array) -> jax.Array:
    """``μ``: the mean kept weight, or 1 when it is not above :data:`MIN_NORMALIZER`."""
    return jnp.where(mean_weight > MIN_NORMALIZER, mean_weight, 1.0)
