"""A correction as a chain of rules: :class:`Correction`, :func:`chain`, :func:`from_config`.

The composable form of :func:`~offpolicy_jax.compute_correction`: the rules
(:mod:`offpolicy_jax._src.correction.constructors`, or a stage of your own) run through the
same two-pass stage pipeline (``compute.run_stages``), in the order given, and give the
same :class:`~offpolicy_jax.CorrectionResult`. :func:`from_config` is the chain a
:class:`~offpolicy_jax.CorrectionConfig` names.
"""

from __future__ import annotations

import dataclasses

import jax

from offpolicy_jax._src import reduction as _reduce
from offpolicy_jax._src.config import CorrectionConfig
from offpolicy_jax._src.correction import compute, normalize
from offpolicy_jax._src.correction.bounds import TISWeights
from offpolicy_jax._src.correction.compute import CorrectionResult
from offpolicy_jax._src.correction.constructors import BatchNormalize, is_metric_group
from offpolicy_jax._src.correction.rules import AReaLRejection
from offpolicy_jax._src.correction.stages import Stage
from offpolicy_jax._src.reduction import AxisNames, MeanParts, Reduction

Rule = Stage | BatchNormalize


def _weighting_level(stages: tuple[Stage, ...]) -> str:
    """The level of the chain's (last) weighting rule, ``"token"`` without one."""
    level = "token"
    for stage in stages:
        if isinstance(stage, TISWeights):
            level = stage.level
        elif isinstance(stage, AReaLRejection):
            level = stage.config.level
    return level


@dataclasses.dataclass(frozen=True)
class Correction:
    """A chain of correction rules (a frozen, hashable value; build it with :func:`chain`).

    Calling it is :func:`~offpolicy_jax.correct` with these rules. It is also a
    correction callable for ``LossConfig(correction=...)`` and for
    :func:`offpolicy_jax.objectives.decoupled_ppo`, where its metrics stay poolable parts.

    Attributes:
      rules: the stages in order, and at most one
        :func:`~offpolicy_jax.rules.batch_normalize` marker.
    """

    rules: tuple[Rule, ...] = ()

    def __post_init__(self):
        rules = tuple(self.rules)
        markers = [r for r in rules if isinstance(r, BatchNormalize)]
        for i, rule in enumerate(rules):
            if not isinstance(rule, (Stage, BatchNormalize)):
                raise TypeError(
                    f"rules[{i}] must be a rule (a Stage, e.g. opj.rules.veto(threshold=1e-4), "
                    f"or opj.rules.batch_normalize()), got {type(rule).__name__}"
                )
        if len(markers) > 1:
            raise ValueError("rules: batch_normalize() may be given at most once")
        object.__setattr__(self, "rules", rules)

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The stages, in order (without the batch-normalisation marker)."""
        return tuple(r for r in self.rules if isinstance(r, Stage))

    @property
    def reweights(self) -> bool:
        """Whether a rule weights or rejects tokens (else the chain only reports metrics)."""
        return any(not is_metric_group(s) for s in self.stages)

    @property
    def batch_normalize(self) -> str | None:
        """How ``μ`` averages (``"token"`` / ``"sequence"``), or None: no normalisation."""
        for rule in self.rules:
            if isinstance(rule, BatchNormalize):
                level = _weighting_level(self.stages)
                return rule.reduction or normalize.normalizer_reduction(level)
        return None

    def parts(
        self,
        old: jax.Array,
        rollout: jax.Array,
        mask: jax.Array,
        *,
        reduction: Reduction,
        layout: _reduce.Rows,
    ) -> tuple[jax.Array, jax.Array, dict[str, MeanParts]]:
        """The pipeline on checked float32 inputs: ``(w, m', metric parts)`` (``w`` not yet
        multiplied by ``m'``), as ``compute.run_stages``."""
        return compute.run_stages(
            list(self.stages),
            old,
            rollout,
            mask,
            reweights=self.reweights,
            batch_normalize=self.batch_normalize,
            reduction=reduction,
            layout=layout,
        )

    def __call__(
        self,
        old_logp: jax.typing.ArrayLike,
        rollout_logp: jax.typing.ArrayLike,
        mask: jax.typing.ArrayLike,
        *,
        reduction: Reduction = "sequence",
        axis_names: AxisNames = None,
        segment_ids: jax.typing.ArrayLike | None = None,
        num_segments: int | None = None,
    ) -> CorrectionResult:
        """:func:`~offpolicy_jax.correct` with this chain's rules."""
        compute._check_reduction(reduction)
        axes = _reduce.as_mesh_axes(axis_names)
        old, rollout, valid, layout = compute.checked_inputs(
            old_logp, rollout_logp, mask, axes, segment_ids, num_segments
        )
        weights, final, parts = self.parts(old, rollout, valid, reduction=reduction, layout=layout)
        return compute.as_result(weights, final, parts, old.shape)


def chain(*rules: Rule) -> Correction:
    """Chains correction rules into one :class:`Correction` (like ``optax.chain``).

    Args:
      *rules: stages (:func:`~offpolicy_jax.rules.importance_weights`,
        :func:`~offpolicy_jax.rules.rejection_sampling`, :func:`~offpolicy_jax.rules.veto`,
        metric groups, your own :class:`~offpolicy_jax.rules.Stage`) and at most one
        :func:`~offpolicy_jax.rules.batch_normalize`, in the order they decide.

    Returns:
      The :class:`Correction`.

    Raises:
      TypeError: a rule that is not a stage (naming its position, ``rules[i]``).
    """
    return Correction(rules)


def from_config(config: CorrectionConfig) -> Correction:
    """The chain of rules a :class:`~offpolicy_jax.CorrectionConfig` names (the config path's).

    Add or reorder rules from here: ``opj.rules.chain(*opj.rules.from_config(cfg).rules,
    my_metric)``.

    Args:
      config: a CorrectionConfig without the keys that need per-token policy versions or
        rewrite the rollout log-probs (``max_weight_staleness``,
        ``mask_offpolicy_in_partial_rollout``, ``nonfinite_rollout="neutral"``).

    Returns:
      The :class:`Correction`.

    Raises:
      ValueError: a config with one of those keys (naming it).
    """
    if not isinstance(config, CorrectionConfig):
        raise TypeError(f"config must be a CorrectionConfig, got {type(config).__name__}")
    for key, off in (
        ("max_weight_staleness", None),
        ("mask_offpolicy_in_partial_rollout", False),
        ("nonfinite_rollout", "reject"),
    ):
        if getattr(config, key) != off:
            raise ValueError(
                f"from_config: CorrectionConfig.{key} needs compute_correction (per-token "
                f"versions or rollout log-probs it rewrites); got {getattr(config, key)!r}"
            )
    rules: list[Rule] = list(compute.correction_stages(config))
    if config.use_tis and config.tis_batch_normalize:
        rules.append(BatchNormalize())
    return Correction(tuple(rules))
