"""Correction rules as values: compose a correction without a config (``opj.rules``).

Every rule is a small frozen value built by a function with keyword-only
hyperparameters; :func:`chain` (like ``optax.chain``) or :func:`offpolicy_jax.correct`
runs them in order through the pipeline of :func:`offpolicy_jax.compute_correction`,
which builds exactly these values from a :class:`~offpolicy_jax.CorrectionConfig`
(:func:`from_config`)::

    correction = opj.rules.chain(
        opj.rules.mismatch_metrics(),
        opj.rules.importance_weights(level="token", mode="truncate", upper=2.0),
        opj.rules.rejection_sampling(level="token", lower=0.5, upper=2.0),
        opj.rules.veto(threshold=1e-4),
        opj.rules.batch_normalize(),
    )  # == opj.rules.from_config(opj.CorrectionConfig.preset("mis"))

Every :class:`~offpolicy_jax.CorrectionConfig` has its chain: the asynchronous-RL keys
are the rules :func:`staleness` (``max_weight_staleness``, ``staleness_level``) and
:func:`offpolicy_prefix` (``mask_offpolicy_in_partial_rollout``), which read the
``versions`` given to the call; ``nonfinite_rollout`` is a keyword of :func:`chain`;
AReaL's ``rejection_sampling`` grid is :func:`areal_rejection`; a
:class:`~offpolicy_jax.VanillaTIS` is :func:`vanilla_tis`.

A rule of your own subclasses :class:`Stage` (or :class:`Bounded`, or
:class:`MetricGroup` for a metric): it declares per-token columns (:func:`total`,
:func:`count`, :func:`count_where`, :func:`minimum`, :func:`maximum`) and turns their
per-sequence sums into a :class:`Decision` (docs/guide/adding_a_rule.md,
docs/guide/adding_a_metric.md).
"""

from offpolicy_jax._src.correction.chain import Correction, chain, from_config
from offpolicy_jax._src.correction.constructors import (
    BatchNormalize,
    MetricGroup,
    RejectionSampling,
    areal_rejection,
    batch_normalize,
    criterion,
    importance_weights,
    m2po,
    minpro_metrics,
    mismatch_metrics,
    probability_metrics,
    rejection_sampling,
    seq_logprob_error,
    veto,
)
from offpolicy_jax._src.correction.rules import batch_extreme, register_rule
from offpolicy_jax._src.correction.stages import Bounded, Decision, Extreme, Mean, Stage, Tokens
from offpolicy_jax._src.correction.vanilla import VanillaIS, vanilla_tis
from offpolicy_jax._src.correction.versioned import (
    OffPolicyPrefix,
    Staleness,
    VersionedRule,
    offpolicy_prefix,
    staleness,
)
from offpolicy_jax._src.reduction import (
    Column,
    MeanParts,
    count,
    count_where,
    maximum,
    minimum,
    total,
)

__all__ = [
    "BatchNormalize",
    "Bounded",
    "Column",
    "Correction",
    "Decision",
    "Extreme",
    "Mean",
    "MeanParts",
    "MetricGroup",
    "OffPolicyPrefix",
    "RejectionSampling",
    "Stage",
    "Staleness",
    "Tokens",
    "VanillaIS",
    "VersionedRule",
    "areal_rejection",
    "batch_extreme",
    "batch_normalize",
    "chain",
    "count",
    "count_where",
    "criterion",
    "from_config",
    "importance_weights",
    "m2po",
    "maximum",
    "minimum",
    "minpro_metrics",
    "mismatch_metrics",
    "offpolicy_prefix",
    "probability_metrics",
    "register_rule",
    "rejection_sampling",
    "seq_logprob_error",
    "staleness",
    "total",
    "vanilla_tis",
    "veto",
]
