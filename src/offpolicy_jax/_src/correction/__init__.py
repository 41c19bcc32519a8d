"""The correction pipeline: π_old / π_rollout ratios to weights, masks and metrics.

Layered bottom to top: ``ratios`` (log-ratios, levels, clamped exponentials),
``bounds`` / ``rejection`` / ``normalize`` / ``criteria`` (the primitives), ``stages``
and ``rules`` (each rule one stage declaring its per-token columns), ``staleness``
(asynchronous RL), ``metrics``, and ``compute`` (:func:`~offpolicy_jax.compute_correction`,
which composes the stages a :class:`~offpolicy_jax.CorrectionConfig` names). The entry
points and the rules are exported by :mod:`offpolicy_jax` and :mod:`offpolicy_jax.rules`;
this package exports the primitives that pool a correction's statistics by hand (as
``offpolicy_jax.diagnose`` does over chunks of a dump).
"""

# Only leaf modules here: the config layer imports ``correction.criteria``, so this
# package must not import anything that imports the configs (``compute``, ``chain``).
from offpolicy_jax._src.correction.criteria import effective_sample_size
from offpolicy_jax._src.correction.normalize import normalizer, normalizer_reduction
from offpolicy_jax._src.correction.ratios import k3
from offpolicy_jax._src.correction.stages import pool
from offpolicy_jax._src.correction.topk_divergence import topk_divergence, topk_divergences

__all__ = [
    "effective_sample_size",
    "k3",
    "normalizer",
    "normalizer_reduction",
    "pool",
    "topk_divergence",
    "topk_divergences",
]
