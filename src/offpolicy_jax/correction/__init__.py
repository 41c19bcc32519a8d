"""The correction pipeline: π_old / π_rollout ratios to weights, masks and metrics.

Layered bottom to top: ``ratios`` (log-ratios, levels, clamped exponentials),
``bounds`` / ``rejection`` / ``normalize`` / ``criteria`` (the primitives), ``stages``
and ``rules`` (each rule one stage declaring its per-token columns), ``staleness``
(asynchronous RL), ``metrics``, and ``compute`` (:func:`~offpolicy_jax.compute_correction`,
which composes the stages a :class:`~offpolicy_jax.CorrectionConfig` names). The public
names are re-exported by :mod:`offpolicy_jax`.
"""
