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
    """How the batch normaliser ``μ`` averages the kept weights at an IS ``level``.

    Per token (``"token"``) at the per-token levels (``"token"``, ``"minpro"``), per
    sequence (``"sequence"``) at the others (docs/semantics.md §3.6, D4): ``μ`` is the
    ``mis_is_ratio_mean_after_tis_rs`` of that reduction.
    """
    return "token" if level in ("token", "minpro") else "sequence"


def normalizer(mean_weight: jax.Array) -> jax.Array:
    """The batch normaliser ``μ`` from the mean kept weight (docs/semantics.md §3.6).

    ``tis_batch_normalize`` divides the weights by ``μ``: the mean kept weight itself,
    or 1 when it is not above :data:`MIN_NORMALIZER` (1e-8; the weights are then left
    unchanged). Pool the mean over micro-batches or chunks first, then take ``μ``.
    """
    return jnp.where(mean_weight > MIN_NORMALIZER, mean_weight, 1.0)
