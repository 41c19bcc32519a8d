"""Configuration: ``CorrectionConfig`` (the reference ``mis.yaml``), ``VanillaTIS``, ``LossConfig``.

Configs are frozen, hashable dataclasses, validated when built, so that they can
be passed to ``jax.jit`` as static arguments and a bad value fails before any
array is touched, with a ``ValueError`` that names the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import pathlib
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any, Literal

import numpy as np
import yaml

Level = Literal["token", "sequence", "geometric"]
Mode = Literal["truncate", "clip", "mask", "icepop", "none"]

LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
MODES: tuple[str, ...] = ("truncate", "clip", "mask", "icepop", "none")
ALGORITHMS: tuple[str, ...] = ("ppo", "bypass_ppo", "decoupled_ppo", "reinforce_is")
AGGREGATIONS: tuple[str, ...] = ("sequence_mean", "token_mean", "sequence_sum")
METRIC_REDUCTIONS: tuple[str, ...] = ("sequence", "token")


# --------------------------------------------------------------------------- helpers


def _check_bool(owner: str, key: str, value: Any) -> bool:
    # numpy.bool_ is accepted; strings such as "yes" and 0/1 integers are not, since
    # silently reading "false" as truthy is exactly the bug this check prevents.
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise ValueError(f"{owner}.{key} must be true or false, got {value!r}")


def _check_choice(owner: str, key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if isinstance(value, str) and value in allowed:
        return value
    hint = ""
    if isinstance(value, str):
        close = [a for a in allowed if a.startswith(value)] if value else []
        close = close or difflib.get_close_matches(value, allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"{owner}.{key} must be one of {list(allowed)}, got {value!r}{hint}")


def _check_number(owner: str, key: str, value: Any, *, optional: bool) -> float | None:
    """A finite float; numeric strings are accepted because YAML reads ``1e-4`` as one."""
    if value is None:
        if optional:
            return None
        raise ValueError(f"{owner}.{key} must be a number, got None")
    if isinstance(value, bool):
        raise ValueError(f"{owner}.{key} must be a number, got {value!r}")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{owner}.{key} must be a number, got {value!r}") from None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{owner}.{key} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{owner}.{key} must be finite, got {value!r}")
    return number


def _check_positive(owner: str, key: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{owner}.{key} must be > 0, got {value!r}")


# The library computes in float32: a config value is checked as the float32 it becomes,
# not as the Python float it was written as (1e-46 is a positive float64 but a float32 0).
_F32 = np.finfo(np.float32)


def _f32(value: float) -> float:
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float32(value))


def _check_f32_ratio(
    owner: str, key: str, value: float | None, *, shown: str | None = None
) -> None:
    """A ratio bound must be a normal, finite float32: not 0 (underflow), subnormal or inf.

    Its log is then within ±88.8, representable too. ``shown`` names a derived value
    (``1 / tis_upper_bound``) in the message.
    """
    if value is None:
        return
    as_f32 = _f32(value)
    if not (_F32.tiny <= as_f32 <= _F32.max):
        raise ValueError(
            f"{owner}.{key}: {shown or key} = {value!r} is {as_f32!r} in float32, the library's "
            f"compute dtype; ratio bounds must lie in [{float(_F32.tiny):.4g}, "
            f"{float(_F32.max):.4g}] (a normal, finite float32)"
        )


def _check_f32_less(owner: str, message: str, lower: float, upper: float) -> None:
    """``lower < upper`` as float32 (two distinct float64 values can round to one float32)."""
    if not _f32(lower) < _f32(upper):
        raise ValueError(f"{owner}: {message} (compared in float32, the compute dtype)")


def _reject_unknown_keys(owner: str, data: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"unknown {owner} key {key!r}{hint} (allowed keys: {', '.join(allowed)})"
            )


def _load_yaml_mapping(source: str | os.PathLike[str], owner: str) -> dict[str, Any]:
    """Reads a YAML mapping from a path or from YAML text, with ``yaml.safe_load``."""
    if isinstance(source, os.PathLike):
        text = pathlib.Path(source).read_text()
        origin = os.fspath(source)
    elif isinstance(source, str):
        looks_like_text = "\n" in source or ":" in source.split("/")[-1] or "{" in source
        if not looks_like_text or os.path.isfile(source):
            path = pathlib.Path(source)
            if not path.is_file():
                raise FileNotFoundError(f"{owner} YAML file not found: {source!r}")
            text, origin = path.read_text(), source
        else:
            text, origin = source, "<yaml text>"
    else:
        raise TypeError(
            f"{owner}.from_yaml expects a path or YAML text, got {type(source).__name__}"
        )
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(
            f"{owner} YAML {origin} must be a mapping of keys to values, got {type(data).__name__}"
        )
    return data


# --------------------------------------------------------------------------- correction


@dataclasses.dataclass(frozen=True)
class CorrectionConfig:
    """Rollout-correction settings: the keys of the reference ``mis.yaml``.

    See docs/semantics.md §1. ``use_tis=False`` computes the mismatch metrics only.

    Attributes:
      use_tis: apply importance weights (and rejection); False = metrics only.
      tis_level: ``"token"``, ``"sequence"`` (product of ratios) or ``"geometric"``
        (geometric mean) aggregation of the log-ratio for the IS weight.
      tis_mode: ``"truncate"`` (``min(w, U)``), ``"clip"`` (``clip(w, L, U)``),
        ``"mask"`` (reject tokens with ``w`` outside ``[L, U]``), ``"icepop"`` (IcePop:
        weight ``w`` inside ``[L, U]``, 0 outside, the token stays in the mask and the
        loss denominator) or ``"none"`` (no IS weight: ``w = 1``; the rejection rules
        below still apply).
      tis_lower_bound: ``L``; ``None`` means ``1 / tis_upper_bound``. Unused by truncate.
      tis_upper_bound: ``U``.
      tis_batch_normalize: rescale the weights to mean 1 over what stays in the loss.
      use_rs: rejection sampling: drop tokens/sequences whose ratio at ``rs_level``
        leaves ``[rs_lower_bound, rs_upper_bound]``.
      rs_level: level of the rejection ratio.
      rs_lower_bound: ``None`` means the resolved ``tis_lower_bound``.
      rs_upper_bound: ``None`` means ``tis_upper_bound``.
      rs_veto_threshold: reject a sequence with any token ratio below this; ``None``
        disables the veto. Like every rejection, it acts only when ``use_tis`` is
        true (with or without ``use_rs``, D1); a metrics-only config ignores it.
      rs_criteria: KL-estimator rejection criteria (docs/semantics.md §8), each a string
        ``"criterion:threshold"`` with verl's names and threshold syntax, e.g.
        ``("seq_max_k2:2.5", "seq_mean_k3:0.01")``; a token stays only if every
        criterion keeps it. ``k1`` criteria take ``"lo_hi"`` (or ``hi`` for
        ``[1/hi, hi]``) bounds on π_rollout / π_old, ``k2`` / ``k3`` an upper bound.
      seq_logprob_error_threshold: NeMo-RL's rule: drop a sequence whose mean over its
        tokens of ``exp(|δ|)`` exceeds this (``≥ 1``); ``None`` disables it.
      m2po_tau: M2PO second-moment budget ``τ > 0``: drop the tokens with the largest
        ``δ²`` until the batch mean of ``δ²`` over the kept tokens is ``≤ τ``; ``None``
        disables it.

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

    def __post_init__(self):
        owner = "CorrectionConfig"
        set_ = lambda key, value: object.__setattr__(self, key, value)  # noqa: E731 (frozen)
        for key in ("use_tis", "tis_batch_normalize", "use_rs"):
            set_(key, _check_bool(owner, key, getattr(self, key)))
        set_("tis_level", _check_choice(owner, "tis_level", self.tis_level, LEVELS))
        set_("tis_mode", _check_choice(owner, "tis_mode", self.tis_mode, MODES))
        set_("rs_level", _check_choice(owner, "rs_level", self.rs_level, LEVELS))
        set_(
            "tis_upper_bound",
            _check_number(owner, "tis_upper_bound", self.tis_upper_bound, optional=False),
        )
        for key in ("tis_lower_bound", "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold"):
            set_(key, _check_number(owner, key, getattr(self, key), optional=True))
        for key in ("tis_upper_bound", "tis_lower_bound", "rs_veto_threshold"):
            _check_positive(owner, key, getattr(self, key))
            _check_f32_ratio(owner, key, getattr(self, key))
        # The resolved lower bound 1 / U is used by clip / mask and, as the RS default, by RS.
        lower_used = self.tis_mode in ("clip", "mask", "icepop") or (
            self.use_rs and self.rs_lower_bound is None
        )
        if lower_used and self.tis_lower_bound is None:
            _check_f32_ratio(
                owner, "tis_upper_bound", self.lower_bound, shown="1 / tis_upper_bound"
            )
        self._check_rules(owner)
        if self.tis_mode == "icepop" and self.lower_bound > self.upper_bound:
            raise ValueError(
                f"{owner}: tis_lower_bound must be <= tis_upper_bound for tis_mode='icepop', "
                f"got {self.lower_bound!r} > tis_upper_bound = {self.upper_bound!r}"
            )
        if self.tis_mode in ("clip", "mask"):
            source = (
                "tis_lower_bound" if self.tis_lower_bound is not None else "1 / tis_upper_bound"
            )
            _check_f32_less(
                owner,
                f"tis_lower_bound must be < tis_upper_bound for tis_mode={self.tis_mode!r}, got "
                f"{source} = {self.lower_bound!r} >= tis_upper_bound = {self.upper_bound!r}",
                self.lower_bound,
                self.upper_bound,
            )
        if self.use_rs:
            for key in ("rs_lower_bound", "rs_upper_bound"):
                _check_positive(owner, key, getattr(self, key))
                _check_f32_ratio(owner, key, getattr(self, key))
            _check_f32_less(
                owner,
                f"rs_lower_bound must be < rs_upper_bound, got resolved rs_lower_bound = "
                f"{self.rs_lower!r} >= rs_upper_bound = {self.rs_upper!r}",
                self.rs_lower,
                self.rs_upper,
            )

    def _check_rules(self, owner: str) -> None:
        """Validates and canonicalises the keys of docs/semantics.md §8."""
        from offpolicy_jax import criteria  # the formulas module; imported late to stay light

        key = f"{owner}.rs_criteria"
        specs = self.rs_criteria
        if isinstance(specs, str):
            specs = (specs,)
        if not isinstance(specs, (tuple, list)):
            raise ValueError(
                f"{key} must be a list of 'criterion:threshold' strings, got {specs!r}"
            )
        parsed = [criteria.parse_spec(spec, key) for spec in specs]
        names = [c.name for c in parsed]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"{key} lists {name!r} twice; give each criterion once")
        object.__setattr__(self, "rs_criteria", tuple(c.spec for c in parsed))
        for name in ("seq_logprob_error_threshold", "m2po_tau"):
            value = _check_number(owner, name, getattr(self, name), optional=True)
            _check_positive(owner, name, value)
            object.__setattr__(self, name, value)
        if not self.use_tis:
            for name in ("rs_criteria", "seq_logprob_error_threshold", "m2po_tau"):
                if getattr(self, name):
                    raise ValueError(
                        f"{owner}.{name} rejects tokens, but use_tis is false (metrics only); "
                        "set use_tis: true (with tis_mode: none for rejection without IS "
                        "weights)"
                    )
        threshold = self.seq_logprob_error_threshold
        if threshold is not None and threshold < 1.0:
            raise ValueError(
                f"{owner}.seq_logprob_error_threshold must be >= 1 (exp|δ| >= 1, so a smaller "
                f"threshold rejects every sequence), got {threshold!r}"
            )

    @property
    def criteria(self):
        """The parsed ``rs_criteria`` (:class:`offpolicy_jax.criteria.Criterion` tuples)."""
        from offpolicy_jax import criteria

        return tuple(criteria.parse_spec(spec, "rs_criteria") for spec in self.rs_criteria)

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
        _reject_unknown_keys("CorrectionConfig", data, cls.keys())
        return cls(**dict(data))

    @classmethod
    def from_yaml(cls, source: str | os.PathLike[str]) -> CorrectionConfig:
        """Builds a config from a YAML file path or YAML text (read with ``yaml.safe_load``)."""
        return cls.from_dict(_load_yaml_mapping(source, "CorrectionConfig"))

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["rs_criteria"] = list(self.rs_criteria)  # YAML (safe_dump) has lists, not tuples
        return data

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_verl(cls, rollout_correction: Mapping[str, Any]) -> CorrectionConfig:
        """Builds the native config from verl's ``algorithm.rollout_correction`` block.

        Takes verl's own keys and values (``rollout_is``, ``rollout_is_threshold`` incl.
        ``"lo_hi"`` IcePop strings, ``rollout_is_batch_normalize``, ``rollout_rs`` incl.
        comma lists, ``rollout_rs_threshold``); the loss-only keys ``bypass_mode`` and
        ``loss_type`` are ignored here (``LossConfig.from_verl`` reads them). The mapping
        is in :mod:`offpolicy_jax.verl`. Invalid values raise ``ValueError`` naming the
        verl key.
        """
        from offpolicy_jax import verl

        return cls(**verl.correction_kwargs(rollout_correction))

    @classmethod
    def preset(cls, name: str) -> CorrectionConfig:
        """A named recipe: a configuration shipped with the package (``"mis"`` is the
        reference ``mis.yaml``) or any of verl's ``RolloutCorrectionConfig`` preset names
        (``"decoupled_token_icepop"``, ``"decoupled_geo_rs"``, ``"bypass_pg_is"``, ...;
        their correction part, see :data:`offpolicy_jax.verl.VERL_PRESETS`).

        Examples:
          >>> import offpolicy_jax as opj
          >>> cfg = opj.CorrectionConfig.preset("mis")
          >>> cfg.use_tis, cfg.tis_mode, cfg.rs_veto_threshold
          (True, 'truncate', 0.0001)
          >>> opj.CorrectionConfig.preset("decoupled_token_icepop").tis_mode
          'icepop'
        """
        from offpolicy_jax import verl

        shipped = sorted(
            p.name[: -len(".yaml")]
            for p in resources.files("offpolicy_jax").joinpath("configs").iterdir()
            if p.name.endswith(".yaml")
        )
        if name in shipped:
            return cls.from_yaml(resources.files("offpolicy_jax") / "configs" / f"{name}.yaml")
        if name in verl.VERL_PRESETS:
            return cls.from_verl(verl.preset_block(name))
        known = shipped + sorted(verl.VERL_PRESETS)
        close = difflib.get_close_matches(str(name), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"preset must be one of {known}, got {name!r}{hint}")


# --------------------------------------------------------------------------- VanillaTIS


@dataclasses.dataclass(frozen=True)
class VanillaTIS:
    """The reference's built-in truncated IS: ``w = clip(exp(o - b), clip_low, clip)``.

    The mask is left unchanged; metrics ``tis``, ``tis_clipfrac``, ``tis_abs``.
    """

    clip_low: float = 0.0
    clip: float = 2.0

    def __post_init__(self):
        low = _check_number("VanillaTIS", "clip_low", self.clip_low, optional=False)
        high = _check_number("VanillaTIS", "clip", self.clip, optional=False)
        assert low is not None and high is not None  # optional=False never returns None
        if not 0 <= low < high:
            raise ValueError(
                f"VanillaTIS requires 0 <= clip_low < clip, got clip_low={low!r}, clip={high!r}"
            )
        _check_f32_ratio("VanillaTIS", "clip", high)
        if low != 0:
            _check_f32_ratio("VanillaTIS", "clip_low", low)
        _check_f32_less(
            "VanillaTIS", f"clip_low must be < clip, got clip_low={low!r}, clip={high!r}", low, high
        )
        object.__setattr__(self, "clip_low", low)
        object.__setattr__(self, "clip", high)


CorrectionFn = Callable[..., Any]
Correction = CorrectionConfig | VanillaTIS | CorrectionFn | None


# --------------------------------------------------------------------------- losses


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Settings of :func:`~offpolicy_jax.policy_loss` (docs/semantics.md §5).

    Attributes:
      algorithm: ``"ppo"`` (old log-probs as the ratio denominator), ``"bypass_ppo"``
        (rollout log-probs as the denominator; ``old_logp`` may be None),
        ``"decoupled_ppo"`` (3-policy PPO: IS weights π_old/π_rollout multiply the
        clipped loss) or ``"reinforce_is"`` (``−sg(w)·A·log π_θ``, no clipping).
      clip_eps: PPO clip range ``ε`` in ``(0, 1)`` (lower side, and upper side
        unless ``clip_eps_high`` is set).
      clip_eps_high: upper clip range ``ε_high`` (DAPO-style clip-higher); None = ``ε``.
      dual_clip_c: dual-clip constant ``c > 1`` bounding the loss for negative
        advantages (Ye et al., 2020); None disables it.
      correction: a :class:`CorrectionConfig`, a :class:`VanillaTIS`, a callable
        with the signature of ``compute_correction`` minus ``config``
        (``fn(old_logp, rollout_logp, mask, *, reduction, axis_names)``), or None.
      aggregation: ``"sequence_mean"``, ``"token_mean"`` or ``"sequence_sum"``.
      rejected_in_denominator: keep rejected tokens in the loss denominator (the
        reference's behaviour); False = they leave it (D5).
      get_mismatch_metrics: add the §4 mismatch metrics without changing the loss.
      metric_reduction: ``"sequence"`` or ``"token"`` reduction of the metrics.
      opsm_delta: DeepSeek-V3.2 off-policy sequence masking (docs/semantics.md §8): drop
        a sequence whose mean advantage is negative and whose mean
        ``log π_rollout − log π_θ`` over its tokens exceeds ``δ > 0``; None disables it.
    """

    algorithm: str = "ppo"
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dual_clip_c: float | None = None
    correction: Correction = None
    aggregation: str = "sequence_mean"
    rejected_in_denominator: bool = False
    get_mismatch_metrics: bool = False
    metric_reduction: str = "sequence"
    opsm_delta: float | None = None

    def __post_init__(self):
        owner = "LossConfig"
        set_ = lambda key, value: object.__setattr__(self, key, value)  # noqa: E731 (frozen)
        set_("algorithm", _check_choice(owner, "algorithm", self.algorithm, ALGORITHMS))
        set_("aggregation", _check_choice(owner, "aggregation", self.aggregation, AGGREGATIONS))
        set_(
            "metric_reduction",
            _check_choice(owner, "metric_reduction", self.metric_reduction, METRIC_REDUCTIONS),
        )
        for key in ("rejected_in_denominator", "get_mismatch_metrics"):
            set_(key, _check_bool(owner, key, getattr(self, key)))
        set_("clip_eps", _check_number(owner, "clip_eps", self.clip_eps, optional=False))
        for key in ("clip_eps_high", "dual_clip_c", "opsm_delta"):
            set_(key, _check_number(owner, key, getattr(self, key), optional=True))
        _check_positive(owner, "opsm_delta", self.opsm_delta)
        # In float32 terms: the clip range [1 - ε, 1 + ε_high] must differ from 1 on both
        # sides and stay finite, and ε < 1 keeps the lower clip above 0 (at ε >= 1 every
        # ratio, being positive, would pass the lower clip: it would silently be off).
        one = np.float32(1)
        eps = _f32(self.clip_eps)
        if not (0 < self.clip_eps < 1 and 0 < np.float32(one - eps) < one < np.float32(one + eps)):
            raise ValueError(
                f"{owner}.clip_eps must be in (0, 1), with 0 < 1 - clip_eps < 1 < 1 + clip_eps "
                f"in float32, got {self.clip_eps!r}"
            )
        if self.clip_eps_high is not None and not (
            self.clip_eps_high > 0 and one < _f32(1 + self.clip_eps_high) <= _F32.max
        ):
            raise ValueError(
                f"{owner}.clip_eps_high must be > 0 with 1 < 1 + clip_eps_high < inf in float32, "
                f"got {self.clip_eps_high!r}"
            )
        if self.dual_clip_c is not None and not one < _f32(self.dual_clip_c) <= _F32.max:
            raise ValueError(
                f"{owner}.dual_clip_c must be > 1 and finite in float32 (or None), got "
                f"{self.dual_clip_c!r}"
            )
        self._check_correction()

    def _check_correction(self) -> None:
        correction, algorithm = self.correction, self.algorithm
        if isinstance(correction, Mapping):
            raise ValueError(
                "LossConfig.correction must be a CorrectionConfig, VanillaTIS or callable, got a "
                "mapping; build it with CorrectionConfig.from_dict(...)"
            )
        if correction is not None and not (
            isinstance(correction, (CorrectionConfig, VanillaTIS)) or callable(correction)
        ):
            raise ValueError(
                "LossConfig.correction must be a CorrectionConfig, VanillaTIS, callable or None, "
                f"got {type(correction).__name__}"
            )
        weights_on = self.reweights
        if algorithm in ("decoupled_ppo", "reinforce_is") and not weights_on:
            what = "None" if correction is None else "a CorrectionConfig with use_tis: false"
            raise ValueError(
                f"LossConfig.correction: algorithm {algorithm!r} needs importance weights "
                f"(a CorrectionConfig with use_tis: true, a VanillaTIS or a callable), got {what}"
            )
        if algorithm in ("ppo", "bypass_ppo") and weights_on:
            instead = "decoupled_ppo" if algorithm == "ppo" else "reinforce_is"
            raise ValueError(
                f"LossConfig.correction: algorithm {algorithm!r} does not apply importance "
                f"weights, but the correction enables them; use algorithm={instead!r}, or a "
                "CorrectionConfig with use_tis: false for mismatch metrics only"
            )

    @property
    def reweights(self) -> bool:
        """Whether the correction produces importance weights (not metrics only)."""
        correction = self.correction
        if correction is None:
            return False
        if isinstance(correction, CorrectionConfig):
            return correction.use_tis
        return True  # VanillaTIS or a user callable

    @property
    def upper_clip_eps(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    @property
    def wants_mismatch_metrics(self) -> bool:
        """§4 metrics: asked for, or part of a (possibly metrics-only) CorrectionConfig."""
        return self.get_mismatch_metrics or isinstance(self.correction, CorrectionConfig)

    @classmethod
    def from_flags(
        cls,
        use_rollout_logprobs: bool = False,
        use_tis: bool = False,
        custom_config_path: str | os.PathLike[str] | None = None,
        *,
        tis_clip: float = 2.0,
        tis_clip_low: float = 0.0,
        **other_fields: Any,
    ) -> LossConfig:
        """Maps the reference's command-line flags to a :class:`LossConfig`.

        ==========================  =========  ==================
        ``use_rollout_logprobs``    ``use_tis``  algorithm
        ==========================  =========  ==================
        False                       False      ``ppo``
        True                        False      ``bypass_ppo``
        False                       True       ``decoupled_ppo``
        True                        True       ``reinforce_is`` (D9)
        ==========================  =========  ==================

        With ``use_tis`` the correction is the YAML at ``custom_config_path`` (the
        reference ``mis.yaml``) or, without one, the built-in
        ``VanillaTIS(tis_clip_low, tis_clip)``. Without ``use_tis`` a YAML may only
        ask for metrics (``use_tis: false``), which turns on ``get_mismatch_metrics``.
        A YAML that contradicts the flags raises ``ValueError``.
        """
        use_rollout_logprobs = _check_bool(
            "from_flags", "use_rollout_logprobs", use_rollout_logprobs
        )
        use_tis = _check_bool("from_flags", "use_tis", use_tis)
        if "algorithm" in other_fields or "correction" in other_fields:
            raise ValueError(
                "from_flags derives 'algorithm' and 'correction' from the flags; "
                "pass them to LossConfig(...) directly instead"
            )
        algorithm = {
            (False, False): "ppo",
            (True, False): "bypass_ppo",
            (False, True): "decoupled_ppo",
            (True, True): "reinforce_is",
        }[(use_rollout_logprobs, use_tis)]
        correction: Correction = None
        if custom_config_path is not None:
            correction = CorrectionConfig.from_yaml(custom_config_path)
            if correction.use_tis != use_tis:
                raise ValueError(
                    f"use_tis={use_tis} contradicts use_tis: {str(correction.use_tis).lower()} "
                    f"in {os.fspath(custom_config_path)!r}: "
                    + (
                        "the flag enables importance sampling but the YAML only asks for metrics"
                        if use_tis
                        else "the YAML enables importance sampling but the flag is off"
                    )
                )
            if not use_tis:
                other_fields.setdefault("get_mismatch_metrics", True)
        elif use_tis:
            correction = VanillaTIS(clip_low=tis_clip_low, clip=tis_clip)
        return cls(algorithm=algorithm, correction=correction, **other_fields)
