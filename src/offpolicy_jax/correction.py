"""The correction pipeline: π_old / π_rollout ratios to weights, masks and metrics."""

from offpolicy_jax._src.correction import (
    effective_sample_size,
    k3,
    normalizer,
    normalizer_reduction,
    pool,
    topk_divergence,
    topk_divergences,
)

__all__ = [
    "effective_sample_size",
    "k3",
    "normalizer",
    "normalizer_reduction",
    "pool",
    "topk_divergence",
    "topk_divergences",
]
