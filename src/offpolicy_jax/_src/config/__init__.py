"""The config layer: validated, hashable settings that name the core's pieces.

``correction`` (:class:`CorrectionConfig`, the keys of the reference ``mis.yaml``, and
:class:`VanillaTIS`), ``rejection`` (AReaL's grid, :class:`RejectionSamplingConfig`)
and ``loss`` (:class:`LossConfig`). Configs are frozen dataclasses, validated when
built, so that they can be passed to ``jax.jit`` as static arguments and a bad value
fails before any array is touched, with a ``ValueError`` that names the key.

The readers of other systems' formats (``from_verl``, ``from_areal``, ``from_yaml``,
``preset``, ``from_flags``) are classmethods here, implemented in
:mod:`offpolicy_jax.interop`, which sits above this package: interop imports the
configs, never the reverse.
"""

from offpolicy_jax._src.checks import check_f32_coefficient, keyword_hints
from offpolicy_jax._src.config.correction import (
    LEVELS,
    MODES,
    NONFINITE_ROLLOUT,
    STALENESS_LEVELS,
    Correction,
    CorrectionConfig,
    CorrectionFn,
    VanillaTIS,
)
from offpolicy_jax._src.config.loss import (
    AGGREGATIONS,
    ALGORITHMS,
    KL_ESTIMATORS,
    METRIC_REDUCTIONS,
    PROX_LOGP_METHODS,
    LossConfig,
)
from offpolicy_jax._src.config.rejection import (
    AREAL_ACTIONS,
    AREAL_AGGS,
    AREAL_LEVELS,
    AREAL_METRICS,
    RejectionSamplingConfig,
)

__all__ = [
    "AGGREGATIONS",
    "ALGORITHMS",
    "AREAL_ACTIONS",
    "AREAL_AGGS",
    "AREAL_LEVELS",
    "AREAL_METRICS",
    "KL_ESTIMATORS",
    "LEVELS",
    "METRIC_REDUCTIONS",
    "MODES",
    "NONFINITE_ROLLOUT",
    "PROX_LOGP_METHODS",
    "STALENESS_LEVELS",
    "Correction",
    "CorrectionConfig",
    "CorrectionFn",
    "LossConfig",
    "RejectionSamplingConfig",
    "VanillaTIS",
    "check_f32_coefficient",
    "keyword_hints",
]
