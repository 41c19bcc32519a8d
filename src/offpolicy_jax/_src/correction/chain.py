"""A correction as a chain of rules: :class:`Correction`, :func:`chain`, :func:`from_config`.

The composable form of :func:`~offpolicy_jax.compute_correction`: the rules
(:mod:`offpolicy_jax._src.correction.constructors`, the rules that read policy versions in
:mod:`~offpolicy_jax._src.correction.versioned`, or a stage of your own) run through the
same two-pass stage pipeline (``compute.run_stages``), in the order given, and give the
same :class:`~offpolicy_jax.CorrectionResult`. :func:`from_config` is the chain a
:class:`~offpolicy_jax.CorrectionConfig` (or :class:`~offpolicy_jax.VanillaTIS`) names.
"""

from __future__ import annotations

import dataclasses

import jax

from offpolicy_jax._src import reduction as _reduce
from offpolicy_jax._src.checks import check_choice
from offpolicy_jax._src.config import CorrectionConfig, VanillaTIS
from offpolicy_jax._src.config.correction import NONFINITE_ROLLOUT
from offpolicy_jax._src.correction import compute, normalize, staleness
from offpolicy_jax._src.correction.bounds import TISWeights
from offpolicy_jax._src.correction.compute import CorrectionResult
from offpolicy_jax._src.correction.constructors import (
    BatchNormalize,
    RejectionSampling,
    is_metric_group,
)
from offpolicy_jax._src.correction.rejection import Veto
from offpolicy_jax._src.correction.rules import M2PO, AReaLRejection, KLCriterion, SeqLogprobError
from offpolicy_jax._src.correction.stages import Stage
from offpolicy_jax._src.correction.vanilla import VanillaIS, vanilla_tis
from offpolicy_jax._src.correction.versioned import OffPolicyPrefix, Staleness, VersionedRule
from offpolicy_jax._src.reduction import AxisNames, MeanParts, Reduction
from offpolicy_jax._src.validation import check_split_over

Rule = Stage | BatchNormalize | VersionedRule | VanillaIS
_RULE_TYPES = (Stage, BatchNormalize, VersionedRule, VanillaIS)


def _weighting_level(stages: tuple[Stage, ...]) -> str:
    """The level of the chain's (last) weighting rule, ``"token"`` without one."""
    level = "token"
    for stage in stages:
        if isinstance(stage, TISWeights):
            level = stage.level
        elif isinstance(stage, AReaLRejection):
            level = stage.config.level
    return level


_WEIGHTING = "set the importance weights"
# The built-in rules a chain holds at most once: with a second one of a kind the later
# would silently override the earlier (the weights: the pipeline keeps the last weighting
# rule's; the others: the metrics, whose names the two share, keep the last rule's values).
_ONCE: tuple[tuple[type, str, str], ...] = (
    (TISWeights, "importance_weights", _WEIGHTING),
    (AReaLRejection, "areal_rejection", _WEIGHTING),
    (RejectionSampling, "rejection_sampling", "report mis_rs_mask_fraction_low / _high"),
    (Veto, "veto", "report mis_rs_catastrophic_token_fraction / _seq_fraction"),
    (SeqLogprobError, "seq_logprob_error", "report mis_seq_logprob_error_*"),
    (M2PO, "m2po", "report mis_m2po_*"),
    (Staleness, "staleness", "report mis_staleness_*"),
    (OffPolicyPrefix, "offpolicy_prefix", "report mis_offpolicy_prefix_*"),
)


def _role(rule: object) -> tuple[str, str] | None:
    """``(rule's name, what it does that a second rule of its kind would silently
    override)``, or None for a rule that may repeat."""
    if isinstance(rule, KLCriterion):
        return f"criterion({rule.criterion.name!r})", f"report {rule.prefix}_*"
    return next(((name, role) for kind, name, role in _ONCE if isinstance(rule, kind)), None)


def _instead(first: str, second: str, role: str) -> str:
    """What to do instead of chaining ``first`` and ``second`` (both doing ``role``)."""
    if role != _WEIGHTING:
        return (
            "the later one's metrics would silently replace the earlier one's; give the rule "
            "once, with one bound (the stricter one rejects what both would), and a second "
            "test as a criterion(...) or a Stage of your own"
        )
    if "areal_rejection" in (first, second):
        return (
            "areal_rejection brings AReaL's own IS weight (behave_imp_weight: the ratio, "
            "clamped by action='clamp') and a chain has one weight, so the later rule's "
            "would silently replace the earlier one's; give areal_rejection(...) without "
            "importance_weights(...) (as CorrectionConfig.rejection_sampling needs "
            "tis_mode: none)"
        )
    return (
        "a chain has one weight, so the later rule's would silently replace the earlier "
        "one's; give one weighting rule (and rejection_sampling(...) / criterion(...) to "
        "reject by a second ratio)"
    )


def _check_overrides(rules: tuple) -> None:
    """Refuses two rules where the later would silently override the earlier."""
    seen: dict[str, tuple[int, str]] = {}
    for i, rule in enumerate(rules):
        named = _role(rule)
        if named is None:
            continue
        name, role = named
        if role in seen:
            j, first = seen[role]
            raise ValueError(
                f"rules[{j}] ({first}) and rules[{i}] ({name}) both {role}: "
                f"{_instead(first, name, role)}"
            )
        seen[role] = (i, name)


def _check_rules(rules: tuple, nonfinite_rollout: object) -> str:
    """Validates a chain's rules; returns its ``nonfinite_rollout``."""
    for i, rule in enumerate(rules):
        if not isinstance(rule, _RULE_TYPES):
            raise TypeError(
                f"rules[{i}] must be a rule (a Stage, e.g. opj.rules.veto(threshold=1e-4), "
                f"or opj.rules.batch_normalize()), got {type(rule).__name__}"
            )
    if sum(isinstance(r, BatchNormalize) for r in rules) > 1:
        raise ValueError("rules: batch_normalize() may be given at most once")
    how = check_choice("rules.chain", "nonfinite_rollout", nonfinite_rollout, NONFINITE_ROLLOUT)
    vanilla = [i for i, r in enumerate(rules) if isinstance(r, VanillaIS)]
    if vanilla and (len(rules) > 1 or how != "reject"):
        raise ValueError(
            f"rules[{vanilla[0]}]: vanilla_tis() is a correction of its own (the reference's "
            "truncated IS): a chain holding it holds no other rule and reads a non-finite "
            "rollout_logp as 'reject'"
        )
    _check_overrides(rules)
    return how


@dataclasses.dataclass(frozen=True)
class Correction:
    """A chain of correction rules (a frozen, hashable value; build it with :func:`chain`).

    Calling it is :func:`~offpolicy_jax.correct` with these rules. It is also a
    correction callable for ``LossConfig(correction=...)`` and for
    :func:`offpolicy_jax.objectives.decoupled_ppo`, where its metrics stay poolable parts.

    Attributes:
      rules: the stages and the rules that read ``versions``, in order, at most one
        weighting rule, one rule of each other built-in kind and one
        :func:`~offpolicy_jax.rules.batch_normalize` marker (see :func:`chain`); or one
        :func:`~offpolicy_jax.rules.vanilla_tis` alone.
      nonfinite_rollout: ``"reject"`` or ``"neutral"`` (see :func:`chain`).
    """

    rules: tuple[Rule, ...] = ()
    nonfinite_rollout: str = "reject"

    def __post_init__(self):
        rules = tuple(self.rules)
        object.__setattr__(self, "nonfinite_rollout", _check_rules(rules, self.nonfinite_rollout))
        object.__setattr__(self, "rules", rules)

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The stages, in order (without the batch-normalisation marker and the rules
        that read ``versions``)."""
        return tuple(r for r in self.rules if isinstance(r, Stage))

    @property
    def vanilla(self) -> VanillaIS | None:
        """The chain's :func:`~offpolicy_jax.rules.vanilla_tis` rule, or None."""
        return next((r for r in self.rules if isinstance(r, VanillaIS)), None)

    @property
    def reweights(self) -> bool:
        """Whether a rule weights or rejects tokens (else the chain only reports metrics)."""
        for rule in self.rules:
            if isinstance(rule, Stage) and not is_metric_group(rule):
                return True
            if isinstance(rule, OffPolicyPrefix | VanillaIS):
                return True
            if isinstance(rule, Staleness) and rule.max_weight_staleness is not None:
                return True
        return False

    @property
    def counts_nonfinite(self) -> bool:
        """Whether the chain rejects (and counts) the sequences with a non-finite
        log-prob itself: a reweighting pipeline does; ``vanilla_tis`` leaves it to the loss."""
        return self.reweights and self.vanilla is None

    @property
    def versions_key(self) -> str | None:
        """The rule that reads ``versions`` (named when they are missing), or None."""
        return next((r.key for r in self.rules if isinstance(r, VersionedRule)), None)

    @property
    def batch_normalize(self) -> str | None:
        """How ``μ`` averages (``"token"`` / ``"sequence"``), or None: no normalisation."""
        for rule in self.rules:
            if isinstance(rule, BatchNormalize):
                level = _weighting_level(self.stages)
                return rule.reduction or normalize.normalizer_reduction(level)
        return None

    def _pipeline(self, old, rollout, mask, versions, current_version) -> list[Stage]:
        """The stages of one call: the rules reading versions built from them, and the
        metric stages ``compute_correction`` adds (neutral reads, ages) before them."""
        added: list[Stage] = []
        if self.nonfinite_rollout == "neutral":
            added.append(staleness.NeutralRollout(staleness.neutral_rollout(old, rollout, mask)[1]))
        age = None
        if versions is not None:
            age = current_version - versions  # integers: exact at any version
            if not any(isinstance(r, Staleness) for r in self.rules):
                added.append(Staleness().stage(versions, current_version, age))
        elif self.versions_key is not None:
            raise ValueError(
                f"versions is required: {self.versions_key} reads the policy version of each "
                "token (int [..., T])"
            )
        out: list[Stage] = []
        for rule in self.rules:
            if isinstance(rule, VersionedRule):
                assert versions is not None and age is not None  # required above
                out.extend(added)
                added = []
                out.append(rule.stage(versions, current_version, age))
            elif isinstance(rule, Stage):
                out.append(rule)
        return out + added

    def parts(
        self,
        old: jax.Array,
        rollout: jax.Array,
        mask: jax.Array,
        *,
        reduction: Reduction,
        layout: _reduce.Rows,
        versions: jax.Array | None = None,
        current_version: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, dict[str, MeanParts]]:
        """The pipeline on checked float32 inputs: ``(w, m', metric parts)`` (``w`` not yet
        multiplied by ``m'``), as ``compute.run_stages``; ``versions`` /
        ``current_version``: integer arrays checked by ``staleness.check_versions``."""
        vanilla = self.vanilla
        if vanilla is not None:
            weights, parts = vanilla.parts(old, rollout, mask, reduction=reduction, layout=layout)
            return weights, mask, parts
        stages = self._pipeline(old, rollout, mask, versions, current_version)
        if self.nonfinite_rollout == "neutral":
            rollout = staleness.neutral_rollout(old, rollout, mask)[0]
        return compute.run_stages(
            stages,
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
        versions: jax.typing.ArrayLike | None = None,
        current_version: jax.typing.ArrayLike | None = None,
    ) -> CorrectionResult:
        """:func:`~offpolicy_jax.correct` with this chain's rules."""
        compute._check_reduction(reduction)
        axes = _reduce.as_mesh_axes(axis_names)
        old, rollout, valid, layout = compute.checked_inputs(
            old_logp, rollout_logp, mask, axes, segment_ids, num_segments
        )
        versions, current = staleness.check_versions(
            versions, current_version, old.shape, needed_by=self.versions_key, mask=valid
        )
        check_split_over(axes.batch + axes.token, versions=versions)
        weights, final, parts = self.parts(
            old,
            rollout,
            valid,
            reduction=reduction,
            layout=layout,
            versions=None if self.vanilla is not None else versions,
            current_version=current,
        )
        return compute.as_result(weights, final, parts, old.shape)


def chain(*rules: Rule, nonfinite_rollout: str = "reject") -> Correction:
    """Chains correction rules into one :class:`Correction` (like ``optax.chain``).

    Args:
      *rules: stages (:func:`~offpolicy_jax.rules.importance_weights`,
        :func:`~offpolicy_jax.rules.rejection_sampling`, :func:`~offpolicy_jax.rules.veto`,
        metric groups, your own :class:`~offpolicy_jax.rules.Stage`), the rules that read
        ``versions`` (:func:`~offpolicy_jax.rules.staleness`,
        :func:`~offpolicy_jax.rules.offpolicy_prefix`) and at most one
        :func:`~offpolicy_jax.rules.batch_normalize`, in the order they decide; or
        :func:`~offpolicy_jax.rules.vanilla_tis` alone.
      nonfinite_rollout: what a non-finite ``rollout_logp`` at a valid token does (the
        ``CorrectionConfig`` key): ``"reject"`` rejects its sequence like any
        non-finite input; ``"neutral"`` reads it as ``π_rollout = π_old`` there (ratio
        1, ``δ = 0``), keeps the sequence, reports the share of such tokens as
        ``mis_nonfinite_rollout_token_fraction``, and makes a loss read it so too.

    Returns:
      The :class:`Correction`.

    A chain has one weight: it holds at most one weighting rule
    (:func:`~offpolicy_jax.rules.importance_weights` or
    :func:`~offpolicy_jax.rules.areal_rejection`, which brings AReaL's own IS weight and
    takes the place of ``importance_weights``) and every other built-in rule at most once
    (``rejection_sampling``, ``veto``, ``seq_logprob_error``, ``m2po``, ``staleness``,
    ``offpolicy_prefix``, ``batch_normalize``, a ``criterion`` per name), since a second
    one would silently replace the first one's weights or metrics. Rejection rules of
    different kinds and metric groups chain freely; every valid
    :class:`~offpolicy_jax.CorrectionConfig`'s chain (:func:`from_config`) is one. A
    stage of your own that sets the weights or a metric another stage set raises
    ``ValueError`` when the chain is traced.

    Raises:
      TypeError: a rule that is not a rule (naming its position, ``rules[i]``).
      ValueError: naming ``rules.chain.nonfinite_rollout``, or a rule that cannot be
        chained (naming both positions: a second weighting rule, a second rule of a
        built-in kind, a second ``batch_normalize``; ``vanilla_tis`` with another rule).
    """
    return Correction(rules, nonfinite_rollout)


def from_config(config: CorrectionConfig | VanillaTIS) -> Correction:
    """The chain of rules a :class:`~offpolicy_jax.CorrectionConfig` names (the config path's).

    Every valid config has one: ``chain(*from_config(cfg).rules,
    nonfinite_rollout=cfg.nonfinite_rollout)`` gives ``compute_correction(..., cfg)``'s
    weights, mask and metrics (with the same ``versions`` / ``current_version``), and as
    a loss's correction that config's loss. A :class:`~offpolicy_jax.VanillaTIS` is
    ``chain(vanilla_tis(clip_low=..., clip=...))``. Add or reorder rules from here:
    ``opj.rules.chain(*opj.rules.from_config(cfg).rules, my_metric)``.

    Args:
      config: a CorrectionConfig or a VanillaTIS.

    Returns:
      The :class:`Correction`.

    Raises:
      TypeError: anything else.
    """
    if isinstance(config, VanillaTIS):
        return Correction((vanilla_tis(clip_low=config.clip_low, clip=config.clip),))
    if not isinstance(config, CorrectionConfig):
        raise TypeError(f"config must be a CorrectionConfig, got {type(config).__name__}")
    rules: list[Rule] = list(compute.correction_stages(config))
    if config.max_weight_staleness is not None:
        rules.append(Staleness(config.max_weight_staleness, config.staleness_level))
    if config.mask_offpolicy_in_partial_rollout:
        rules.append(OffPolicyPrefix())
    if config.use_tis and config.tis_batch_normalize:
        rules.append(BatchNormalize())
    return Correction(tuple(rules), config.nonfinite_rollout)
