"""Rollout-correction configs: :class:`CorrectionConfig` (the keys of the reference
``mis.yaml``) and :class:`VanillaTIS` (the reference's built-in truncated IS).

Configs are frozen, hashable dataclasses, validated when built, so that they can be
passed to ``jax.jit`` as static arguments and a bad value fails before any array is
touched, with a ``ValueError`` that names the key. Their readers of other systems'
formats (verl, AReaL, YAML, presets) live in :mod:`offpolicy_jax.interop`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np

from offpolicy_jax._src.checks import (
    check_bool,
    check_choice,
    check_f32_coefficient,
    check_f32_less,
    check_f32_ratio,
    check_number,
    check_positive,
    keyword_hints,
    reject_unknown_keys,
)
from offpolicy_jax._src.config import _formats
from offpolicy_jax._src.config.rejection import RejectionSamplingConfig
from offpolicy_jax._src.correction import criteria as _criteria
from offpolicy_jax._src.messages import shown
from offpolicy_jax._src.validation import check_staleness_limit

__all__ = [
    "LEVELS",
    "MODES",
    "NONFINITE_ROLLOUT",
    "STALENESS_LEVELS",
    "Correction",
    "CorrectionConfig",
    "CorrectionFn",
    "VanillaTIS",
]

Level = Literal["token", "sequence", "geometric", "minpro"]
Mode = Literal["truncate", "clip", "mask", "band", "none"]

LEVELS: tuple[str, ...] = ("token", "sequence", "geometric", "minpro")
MODES: tuple[str, ...] = ("truncate", "clip", "mask", "band", "none")
NONFINITE_ROLLOUT: tuple[str, ...] = ("reject", "neutral")
STALENESS_LEVELS: tuple[str, ...] = ("token", "sequence")


@keyword_hints
@dataclasses.dataclass(frozen=True)
class CorrectionConfig:
    """Rollout-correction settings: the keys of the reference ``mis.yaml``.

    See docs/semantics.md §1. ``use_tis=False`` computes the mismatch metrics only.

    Attributes:
      use_tis: apply importance weights (and rejection); False = metrics only.
      tis_level: ``"token"``, ``"sequence"`` (product of ratios), ``"geometric"``
        (geometric mean) or ``"minpro"`` (per token, the smallest ratio of the
        preceding prefix times the token's: MinPRO) aggregation of the log-ratio for
        the IS weight.
      tis_mode: ``"truncate"`` (``min(w, U)``), ``"clip"`` (``clip(w, L, U)``),
        ``"mask"`` (reject tokens with ``w`` outside ``[L, U]``), ``"band"`` (IcePop:
        weight ``w`` inside ``[L, U]``, 0 outside, the token stays in the mask and the
        loss denominator) or ``"none"`` (no IS weight: ``w = 1``; the rejection rules
        below still apply).
      tis_lower_bound: ``L``; ``None`` means ``1 / tis_upper_bound``. Unused by truncate
        and none, but a value given there must still be below ``tis_upper_bound``.
      tis_upper_bound: ``U``.
      tis_batch_normalize: rescale the weights to mean 1 over what stays in the loss.
      use_rs: rejection sampling: drop tokens/sequences whose ratio at ``rs_level``
        leaves ``[rs_lower_bound, rs_upper_bound]``. Acts only when ``use_tis`` is true;
        with ``use_tis`` false the config is metrics only (as miles'
        ``compute_mis_weights``) and building it warns.
      rs_level: level of the rejection ratio (the same four levels).
      rs_lower_bound: ``None`` means the resolved ``tis_lower_bound``.
      rs_upper_bound: ``None`` means ``tis_upper_bound``.
      rs_veto_threshold: reject a sequence with any token ratio below this; ``None``
        disables the veto. Like every rejection, it acts only when ``use_tis`` is
        true (with or without ``use_rs``, D1); a metrics-only config ignores it, with a
        warning.
      rs_criteria: KL-estimator rejection criteria (docs/semantics.md §8), each a string
        ``"criterion:threshold"`` with verl's names and threshold syntax, e.g.
        ``("seq_max_k2:2.5", "seq_mean_k3:0.01")``; a token stays only if every
        criterion keeps it. ``k1`` criteria take ``"lo_hi"`` (or ``hi`` for
        ``[1/hi, hi]``) bounds on π_rollout / π_old, ``k2`` / ``k3`` an upper bound;
        ``"binary_kl:φ"`` (KPop, verl's ``rollout_rs: binary_kl``) keeps a token iff
        ``max(D_B(o‖b), D_B(b‖o)) ≤ φ``, the binary KL of its probability.
      seq_logprob_error_threshold: NeMo-RL's rule: drop a sequence whose mean over its
        tokens of ``exp(|δ|)`` exceeds this (``≥ 1``); ``None`` disables it.
      m2po_tau: M2PO second-moment budget ``τ > 0``: drop the tokens with the largest
        ``δ²`` until the batch mean of ``δ²`` over the kept tokens is ``≤ τ``; ``None``
        disables it.
      probability_metrics: also report NeMo-RL's probability-space metrics
        ``mis_token_mult_prob_error`` and ``mis_js_divergence`` (docs/semantics.md §8).
        Off by default: their ``exp`` and ``log`` per token cost a pass of their own
        (about a quarter of ``compute_correction``'s time on CPU).
      nonfinite_rollout: what a non-finite ``rollout_logp`` at a valid token does:
        ``"reject"`` (default) rejects its sequence like any non-finite input (§0);
        ``"neutral"`` reads it as ``π_rollout = π_old`` there (ratio 1, ``δ = 0``),
        keeps the sequence and counts such tokens in
        ``mis_nonfinite_rollout_token_fraction`` (engines that return None/NaN for
        some tokens, TRL #6297). A non-finite ``old_logp`` is always rejected.
      max_weight_staleness: asynchronous RL (docs/guide/async.md): with per-token
        ``versions`` and the ``current_version``, reject what is older than this many
        policy versions, ``current_version − version > max_weight_staleness`` (miles
        ``--max-weight-staleness``; AReaL ``max_head_offpolicyness``, prime-rl
        ``max_off_policy_steps``). An int ``>= 0``; ``None`` disables it.
      staleness_level: ``"sequence"`` (default; a sequence is rejected when its oldest
        valid token is too stale, as miles drops stale samples) or ``"token"``.
      mask_offpolicy_in_partial_rollout: reject the off-policy prefix of a partial
        rollout, the tokens sampled by an older version than the newest one of their
        sequence (miles ``--mask-offpolicy-in-partial-rollout``); needs ``versions``.
      rejection_sampling: AReaL's rejection grid, a :class:`RejectionSamplingConfig`
        (or a mapping of its keys: ``level``, ``action``, ``metric``, ``agg``,
        ``lower``, ``upper``): the IS weight AReaL multiplies the loss by
        (``exp(δ)``, or the sequence's geometric mean), masked or clamped by a ratio
        or KL statistic at the token or sequence level (docs/semantics.md §8). It
        needs ``use_tis: true`` and ``tis_mode: none`` (it is the weight);
        :meth:`from_areal` builds it from AReaL's block. ``None`` disables it.

    Levels (``tis_level``, ``rs_level``) also include ``"minpro"``: MinPRO's per-token
    ratio ``ρ̲_t · ρ_t``, ``ρ̲_t = min_{s<t} ρ_s`` over the earlier valid tokens of the
    sequence (Lei et al. 2026, arXiv:2601.22718; docs/semantics.md §2).

    Ratio bounds and the veto threshold are checked as the float32 values the
    computation uses: each must be a normal, finite float32 (``1.2e-38`` to
    ``3.4e38``), and ``lower < upper`` must hold after rounding to float32.
    """

    use_tis: bool = False
    tis_level: Level = "token"
    tis_mode: Mode = "truncate"
    tis_lower_bound: float | None = None
    tis_upper_bound: float = 2.0
    tis_batch_normalize: bool = False
    use_rs: bool = False
    rs_level: Level = "token"
    rs_lower_bound: float | None = None
    rs_upper_bound: float | None = None
    rs_veto_threshold: float | None = None
    rs_criteria: tuple[str, ...] = ()
    seq_logprob_error_threshold: float | None = None
    m2po_tau: float | None = None
    probability_metrics: bool = False
    nonfinite_rollout: Literal["reject", "neutral"] = "reject"
    max_weight_staleness: int | None = None
    staleness_level: Literal["token", "sequence"] = "sequence"
    mask_offpolicy_in_partial_rollout: bool = False
    rejection_sampling: RejectionSamplingConfig | None = None

    def __post_init__(self):
        owner = "CorrectionConfig"
        set_ = lambda key, value: object.__setattr__(self, key, value)  # noqa: E731 (frozen)
        for key in ("use_tis", "tis_batch_normalize", "use_rs", "probability_metrics"):
            set_(key, check_bool(owner, key, getattr(self, key)))
        set_("tis_level", check_choice(owner, "tis_level", self.tis_level, LEVELS))
        set_("tis_mode", check_choice(owner, "tis_mode", self.tis_mode, MODES))
        set_("rs_level", check_choice(owner, "rs_level", self.rs_level, LEVELS))
        set_(
            "tis_upper_bound",
            check_number(owner, "tis_upper_bound", self.tis_upper_bound, optional=False),
        )
        for key in ("tis_lower_bound", "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold"):
            set_(key, check_number(owner, key, getattr(self, key), optional=True))
        for key in ("tis_upper_bound", "tis_lower_bound", "rs_veto_threshold"):
            check_positive(owner, key, getattr(self, key))
            check_f32_ratio(owner, key, getattr(self, key))
        # The resolved lower bound 1 / U is used by clip / mask and, as the RS default, by RS.
        lower_used = self.tis_mode in ("clip", "mask", "band") or (
            self.use_rs and self.rs_lower_bound is None
        )
        if lower_used and self.tis_lower_bound is None:
            check_f32_ratio(owner, "tis_upper_bound", self.lower_bound, label="1 / tis_upper_bound")
        self._check_rules(owner)
        self._check_async(owner)
        self._check_bounds(owner)
        self._warn_metrics_only(owner)

    def _check_bounds(self, owner: str) -> None:
        """``lower < upper`` (``<=`` for band) for the TIS bounds and the resolved RS bounds."""
        if self.tis_mode == "band" and self.lower_bound > self.upper_bound:
            raise ValueError(
                f"{owner}: tis_lower_bound must be <= tis_upper_bound for tis_mode='band', "
                f"got {shown(self.lower_bound)} > tis_upper_bound = {shown(self.upper_bound)}"
            )
        if self.tis_mode in ("clip", "mask"):
            source = (
                "tis_lower_bound" if self.tis_lower_bound is not None else "1 / tis_upper_bound"
            )
            check_f32_less(
                owner,
                f"tis_lower_bound must be < tis_upper_bound for tis_mode={shown(self.tis_mode)}, got "
                f"{source} = {shown(self.lower_bound)} >= tis_upper_bound = {shown(self.upper_bound)}",
                self.lower_bound,
                self.upper_bound,
            )
        elif self.tis_mode in ("truncate", "none") and self.tis_lower_bound is not None:
            # The weight does not read L here, but a config with L >= U contradicts itself
            # (and RS falls back to L): refused at build time as in every other mode.
            check_f32_less(
                owner,
                f"tis_lower_bound must be < tis_upper_bound, got tis_lower_bound = "
                f"{shown(self.tis_lower_bound)} >= tis_upper_bound = {shown(self.upper_bound)} "
                f"(tis_mode={shown(self.tis_mode)} does not use the lower bound: leave it null)",
                self.tis_lower_bound,
                self.upper_bound,
            )
        if self.use_rs:
            for key in ("rs_lower_bound", "rs_upper_bound"):
                check_positive(owner, key, getattr(self, key))
                check_f32_ratio(owner, key, getattr(self, key))
            check_f32_less(
                owner,
                f"rs_lower_bound must be < rs_upper_bound, got resolved rs_lower_bound = "
                f"{shown(self.rs_lower)} >= rs_upper_bound = {shown(self.rs_upper)}",
                self.rs_lower,
                self.rs_upper,
            )

    def _warn_metrics_only(self, owner: str) -> None:
        """``use_rs`` / ``rs_veto_threshold`` with ``use_tis: false`` reject nothing.

        As in miles' ``compute_mis_weights``, which returns before any rejection when
        ``use_tis`` is false (and the reference ``mis.yaml`` with ``use_tis: false`` keeps
        ``use_rs: true``): the config builds, as metrics only, and says so.
        """
        if self.use_tis:
            return
        idle = [
            key
            for key in ("use_rs", "rs_veto_threshold")
            if getattr(self, key) not in (None, False)
        ]
        if idle:
            warnings.warn(
                f"{owner}: {' and '.join(idle)} "
                f"{'reject' if len(idle) > 1 else 'rejects'} nothing because use_tis is false "
                "(metrics only: weights 1, mask unchanged, as in miles); set use_tis: true "
                "(with tis_mode: none for rejection without IS weights) to apply them",
                UserWarning,
                stacklevel=5,
            )

    def _check_rules(self, owner: str) -> None:
        """Validates and canonicalises the keys of docs/semantics.md §8."""
        key = f"{owner}.rs_criteria"
        specs = self.rs_criteria
        if isinstance(specs, str):
            specs = (specs,)
        if not isinstance(specs, (tuple, list)):
            raise ValueError(
                f"{key} must be a list of 'criterion:threshold' strings, got {shown(specs)}"
            )
        parsed = [_criteria.parse_spec(spec, key) for spec in specs]
        names = [c.name for c in parsed]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"{key} lists {shown(name)} twice; give each criterion once")
        object.__setattr__(self, "rs_criteria", tuple(c.spec for c in parsed))
        for name in ("seq_logprob_error_threshold", "m2po_tau"):
            value = check_number(owner, name, getattr(self, name), optional=True)
            check_positive(owner, name, value)
            check_f32_coefficient(owner, name, value)
            object.__setattr__(self, name, value)
        if not self.use_tis:
            for name in ("rs_criteria", "seq_logprob_error_threshold", "m2po_tau"):
                if getattr(self, name):
                    raise ValueError(
                        f"{owner}.{name} rejects tokens, but use_tis is false (metrics only); "
                        "set use_tis: true (with tis_mode: none for rejection without IS "
                        "weights)"
                    )
        self._check_rejection_sampling(owner)
        threshold = self.seq_logprob_error_threshold
        if threshold is not None and threshold < 1.0:
            raise ValueError(
                f"{owner}.seq_logprob_error_threshold must be >= 1 (exp|δ| >= 1, so a smaller "
                f"threshold rejects every sequence), got {shown(threshold)}"
            )

    def _check_rejection_sampling(self, owner: str) -> None:
        """AReaL's grid (:class:`RejectionSamplingConfig`): a mapping of its keys is read
        as one; it brings its own IS weight, so the config's ``tis_mode`` must be none."""
        block = self.rejection_sampling
        if block is None:
            return
        if isinstance(block, Mapping):
            block = RejectionSamplingConfig.from_dict(block)
            object.__setattr__(self, "rejection_sampling", block)
        if not isinstance(block, RejectionSamplingConfig):
            raise ValueError(
                f"{owner}.rejection_sampling must be a RejectionSamplingConfig, a mapping of "
                f"AReaL's keys or None, got {type(block).__name__}"
            )
        if not self.use_tis:
            raise ValueError(
                f"{owner}.rejection_sampling reweights and rejects tokens, but use_tis is false "
                "(metrics only); set use_tis: true (and tis_mode: none)"
            )
        if self.tis_mode != "none":
            raise ValueError(
                f"{owner}.rejection_sampling brings AReaL's own IS weight (behave_imp_weight: "
                "the ratio, clamped by action='clamp'), which would multiply a second one; "
                f"set tis_mode: none, got tis_mode={shown(self.tis_mode)}"
            )

    def _check_async(self, owner: str) -> None:
        """The asynchronous-RL keys (docs/guide/async.md)."""
        set_ = lambda key, value: object.__setattr__(self, key, value)  # noqa: E731 (frozen)
        set_(
            "nonfinite_rollout",
            check_choice(owner, "nonfinite_rollout", self.nonfinite_rollout, NONFINITE_ROLLOUT),
        )
        set_(
            "staleness_level",
            check_choice(owner, "staleness_level", self.staleness_level, STALENESS_LEVELS),
        )
        set_(
            "mask_offpolicy_in_partial_rollout",
            check_bool(
                owner, "mask_offpolicy_in_partial_rollout", self.mask_offpolicy_in_partial_rollout
            ),
        )
        limit = self.max_weight_staleness
        if limit is not None:
            check_staleness_limit(owner, limit)
            whole = isinstance(limit, int | np.integer) and not isinstance(limit, bool)
            if not whole or limit < 0:
                raise ValueError(
                    f"{owner}.max_weight_staleness must be an int >= 0 (policy versions) or "
                    f"None, got {shown(limit)}"
                )
            set_("max_weight_staleness", int(limit))
        if not self.use_tis:
            for name in ("max_weight_staleness", "mask_offpolicy_in_partial_rollout"):
                if getattr(self, name) not in (None, False):
                    raise ValueError(
                        f"{owner}.{name} rejects tokens, but use_tis is false (metrics only); "
                        "set use_tis: true (with tis_mode: none for rejection without IS "
                        "weights)"
                    )

    @property
    def uses_versions(self) -> bool:
        """Whether a rule of this config reads the per-token policy ``versions``."""
        return self.max_weight_staleness is not None or self.mask_offpolicy_in_partial_rollout

    @property
    def criteria(self):
        """The parsed ``rs_criteria`` (:class:`offpolicy_jax._src.correction.criteria.Criterion` tuples)."""
        return tuple(_criteria.parse_spec(spec, "rs_criteria") for spec in self.rs_criteria)

    # Resolved bounds (docs/semantics.md §1: the nulls fall back in this order).
    @property
    def upper_bound(self) -> float:
        return self.tis_upper_bound

    @property
    def lower_bound(self) -> float:
        if self.tis_lower_bound is not None:
            return self.tis_lower_bound
        return 1.0 / self.tis_upper_bound

    @property
    def rs_lower(self) -> float:
        return self.rs_lower_bound if self.rs_lower_bound is not None else self.lower_bound

    @property
    def rs_upper(self) -> float:
        return self.rs_upper_bound if self.rs_upper_bound is not None else self.upper_bound

    # YAML / dict I/O
    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CorrectionConfig:
        """Builds a config from a mapping, rejecting unknown keys with a did-you-mean hint."""
        if not isinstance(data, Mapping):
            raise ValueError(
                f"CorrectionConfig.from_dict expects a mapping, got {type(data).__name__}"
            )
        reject_unknown_keys("CorrectionConfig", data, cls.keys())
        return cls(**dict(data))

    @classmethod
    def from_yaml(cls, source: str | os.PathLike[str]) -> CorrectionConfig:
        """Builds a config from a YAML file path or YAML text (read with ``yaml.safe_load``)."""
        return cls.from_dict(_formats.reader("yaml.load_mapping")(source, "CorrectionConfig"))

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["rs_criteria"] = list(self.rs_criteria)  # YAML (safe_dump) has lists, not tuples
        return data

    def to_yaml(self) -> str:
        """The config as YAML text, the inverse of :meth:`from_yaml`."""
        return _formats.reader("yaml.dump")(self.to_dict())

    @classmethod
    def from_verl(cls, rollout_correction: Mapping[str, Any]) -> CorrectionConfig:
        """Builds the native config from verl's ``algorithm.rollout_correction`` block.

        Takes verl's own keys and values (``rollout_is``, ``rollout_is_threshold`` incl.
        ``"lo_hi"`` IcePop strings, ``rollout_is_batch_normalize``, ``rollout_rs`` incl.
        comma lists, ``rollout_rs_threshold``: one entry per ``rollout_rs`` criterion, or a
        single entry shared by every criterion, as verl's ``_parse_rollout_rs_thresholds``
        does; docs/semantics.md §8); the loss-only keys ``bypass_mode`` and
        ``loss_type`` are ignored here (``LossConfig.from_verl`` reads them). The mapping
        is in :mod:`offpolicy_jax.interop.verl`, which names the verl release it follows;
        it also reads the keys of verl v0.6.1 and v0.7.0 (``rollout_rs`` as a level
        ``token`` / ``sequence`` / ``geometric`` with ``rollout_rs_threshold_lower``,
        ``rollout_token_veto_threshold``, ``use_policy_gradient``). Invalid values raise
        ``ValueError`` naming the verl key.
        """
        return _formats.reader("CorrectionConfig.from_verl")(cls, rollout_correction)

    @classmethod
    def from_areal(cls, rejection_sampling: Mapping[str, Any] | None) -> CorrectionConfig:
        """Builds the native config from AReaL's ``actor.rejection_sampling`` block.

        AReaL (inclusionAI/AReaL ``areal/api/cli_args.py``, ``RejectionSamplingConfig``)
        weights the decoupled loss by ``behave_imp_weight`` and masks or clamps it with
        this block; ``None`` disables both (AReaL then applies no IS weight: a
        metrics-only config here). The keys ``level``, ``action``, ``metric``,
        ``agg``, ``lower``, ``upper`` are read with AReaL's defaults and checks
        (:class:`RejectionSamplingConfig`); the result is ``use_tis: true``,
        ``tis_mode: none`` and ``rejection_sampling`` set. AReaL keeps the tokens a
        ``mask`` rejects in the loss denominator: pair it with
        ``LossConfig(algorithm="decoupled_ppo", aggregation="token_mean",
        rejected_in_denominator=True)`` to reproduce AReaL's loss
        (docs/coming_from.md).

        Examples:
          >>> import offpolicy_jax as opj
          >>> cfg = opj.CorrectionConfig.from_areal(
          ...     {"level": "sequence", "action": "clamp", "metric": "ratio", "upper": 5.0}
          ... )
          >>> cfg.tis_mode, cfg.rejection_sampling.agg, cfg.rejection_sampling.clamp_lower
          ('none', 'mean', 0.0)
        """
        return _formats.reader("CorrectionConfig.from_areal")(cls, rejection_sampling)

    @classmethod
    def preset(cls, name: str) -> CorrectionConfig:
        """A named recipe: a configuration shipped with the package (``"mis"`` is the
        reference ``mis.yaml``) or any of verl's ``RolloutCorrectionConfig`` preset names
        (``"decoupled_token_icepop"``, ``"decoupled_geo_rs"``, ``"bypass_pg_is"``, ...;
        their correction part, see :data:`offpolicy_jax.interop.verl.VERL_PRESETS`).

        Examples:
          >>> import offpolicy_jax as opj
          >>> cfg = opj.CorrectionConfig.preset("mis")
          >>> cfg.use_tis, cfg.tis_mode, cfg.rs_veto_threshold
          (True, 'truncate', 0.0001)
          >>> opj.CorrectionConfig.preset("decoupled_token_icepop").tis_mode
          'band'
        """
        return _formats.reader("CorrectionConfig.preset")(cls, name)


# --------------------------------------------------------------------------- VanillaTIS


@keyword_hints
@dataclasses.dataclass(frozen=True)
class VanillaTIS:
    """The reference's built-in truncated IS: ``w = clip(exp(o - b), clip_low, clip)``.

    The mask is left unchanged; metrics ``tis``, ``tis_clipfrac``, ``tis_abs``.
    ``clip=math.inf`` means no cap: the untruncated ("vanilla") IS weight.
    """

    clip_low: float = 0.0
    clip: float = 2.0

    def __post_init__(self):
        low, high = check_vanilla_tis("VanillaTIS", self.clip_low, self.clip)
        object.__setattr__(self, "clip_low", low)
        object.__setattr__(self, "clip", high)


def check_vanilla_tis(owner: str, clip_low: object, clip: object) -> tuple[float, float]:
    """The validated ``(clip_low, clip)`` of the reference's truncated IS, ``0 <= clip_low
    < clip`` (``clip`` may be ``math.inf``); ``ValueError`` naming ``<owner>.<key>``."""
    low = check_number(owner, "clip_low", clip_low, optional=False)
    no_cap = not isinstance(clip, bool) and clip == math.inf
    high = math.inf if no_cap else check_number(owner, "clip", clip, optional=False)
    assert low is not None and high is not None  # optional=False never returns None
    if not 0 <= low < high:
        raise ValueError(
            f"{owner} requires 0 <= clip_low < clip, got clip_low={shown(low)}, clip={shown(high)}"
        )
    if not no_cap:
        check_f32_ratio(owner, "clip", high)
    if low != 0:
        check_f32_ratio(owner, "clip_low", low)
    check_f32_less(
        owner,
        f"clip_low must be < clip, got clip_low={shown(low)}, clip={shown(high)}",
        low,
        high,
    )
    return low, high


CorrectionFn = Callable[..., Any]
Correction = CorrectionConfig | VanillaTIS | CorrectionFn | None
