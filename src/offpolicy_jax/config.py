"""Configuration: ``CorrectionConfig`` (the reference ``mis.yaml``), ``VanillaTIS``, ``LossConfig``.

Configs are frozen, hashable dataclasses, validated when built, so that they can
be passed to ``jax.jit`` as static arguments and a bad value fails before any
array is touched, with a ``ValueError`` that names the key.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
import warnings
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any, Literal, TypeVar

import numpy as np
import yaml

from offpolicy_jax._messages import close_match, shown
from offpolicy_jax._validation import check_staleness_limit
from offpolicy_jax.losses import registry
from offpolicy_jax.losses.algorithms import ALGORITHMS as ALGORITHM_SPECS

Level = Literal["token", "sequence", "geometric", "minpro"]
Mode = Literal["truncate", "clip", "mask", "band", "none"]

LEVELS: tuple[str, ...] = ("token", "sequence", "geometric", "minpro")
MODES: tuple[str, ...] = ("truncate", "clip", "mask", "band", "none")
ALGORITHMS: tuple[str, ...] = tuple(ALGORITHM_SPECS)
AGGREGATIONS: tuple[str, ...] = (
    "sequence_mean",
    "token_mean",
    "sequence_sum",
    "sequence_sum_norm",
    "token_sum",
    "row_mean",
)
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
METRIC_REDUCTIONS: tuple[str, ...] = ("sequence", "token")
NONFINITE_ROLLOUT: tuple[str, ...] = ("reject", "neutral")
PROX_LOGP_METHODS: tuple[str, ...] = ("recompute", "loglinear", "linear", "metrics")
STALENESS_LEVELS: tuple[str, ...] = ("token", "sequence")


# --------------------------------------------------------------------------- helpers


def _check_bool(owner: str, key: str, value: Any) -> bool:
    # numpy.bool_ is accepted; strings such as "yes" and 0/1 integers are not, since
    # silently reading "false" as truthy is exactly the bug this check prevents.
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise ValueError(f"{owner}.{key} must be true or false, got {shown(value)}")


def _check_choice(owner: str, key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if isinstance(value, str) and value in allowed:
        return value
    hint = ""
    if isinstance(value, str):
        close = [a for a in allowed if a.startswith(value)] if value else []
        close = close or [c for c in [close_match(value, allowed)] if c]
        hint = f" (did you mean {shown(close[0])}?)" if close else ""
    raise ValueError(f"{owner}.{key} must be one of {list(allowed)}, got {shown(value)}{hint}")


def _check_number(owner: str, key: str, value: Any, *, optional: bool) -> float | None:
    """A finite float; numeric strings are accepted because YAML reads ``1e-4`` as one."""
    if value is None:
        if optional:
            return None
        raise ValueError(f"{owner}.{key} must be a number, got None")
    if isinstance(value, bool):
        raise ValueError(f"{owner}.{key} must be a number, got {shown(value)}")
    if isinstance(value, str):
        # float() accepts Python's digit separators ("2_0" is 20.0): not a number here.
        if "_" in value:
            raise ValueError(f"{owner}.{key} must be a number, got {shown(value)}")
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{owner}.{key} must be a number, got {shown(value)}") from None
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range (a 401-digit bound)
        raise ValueError(f"{owner}.{key} must be finite, got {shown(value)}") from None
    except (TypeError, ValueError):
        raise ValueError(f"{owner}.{key} must be a number, got {shown(value)}") from None
    if not math.isfinite(number):
        raise ValueError(f"{owner}.{key} must be finite, got {shown(value)}")
    return number


def _check_positive(owner: str, key: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{owner}.{key} must be > 0, got {shown(value)}")


# The library computes in float32: a config value is checked as the float32 it becomes,
# not as the Python float it was written as (1e-46 is a positive float64 but a float32 0).
_F32 = np.finfo(np.float32)


def _f32(value: float) -> float:
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float32(value))


def _check_f32_ratio(
    owner: str, key: str, value: float | None, *, label: str | None = None
) -> None:
    """A ratio bound must be a normal, finite float32: not 0 (underflow), subnormal or inf.

    Its log is then within ±88.8, representable too. ``label`` names a derived value
    (``1 / tis_upper_bound``) in the message.
    """
    if value is None:
        return
    as_f32 = _f32(value)
    if not (_F32.tiny <= as_f32 <= _F32.max):
        raise ValueError(
            f"{owner}.{key}: {label or key} = {shown(value)} is {as_f32!r} in float32, the library's "
            f"compute dtype; ratio bounds must lie in [{float(_F32.tiny):.4g}, "
            f"{float(_F32.max):.4g}] (a normal, finite float32)"
        )


def check_f32_coefficient(owner: str, key: str, value: float | None) -> None:
    """A loss coefficient must be 0 or a normal, finite float32 in magnitude.

    ``1e39`` is ``inf`` in float32 (``inf · 0`` is a NaN gradient) and ``1e-39`` a
    subnormal that XLA flushes to 0 (a divisor of 0 returned the un-normalised sum):
    either makes the loss non-finite or wrong on finite inputs. Reusable by every
    surrogate's hyperparameters.
    """
    if value is None or value == 0:
        return
    as_f32 = abs(_f32(value))
    if not (_F32.tiny <= as_f32 <= _F32.max):
        raise ValueError(
            f"{owner}.{key} = {shown(value)} is {_f32(value)!r} in float32, the library's "
            f"compute dtype; it must be 0 or have magnitude in [{float(_F32.tiny):.4g}, "
            f"{float(_F32.max):.4g}] (a normal, finite float32)"
        )


def _check_f32_less(owner: str, message: str, lower: float, upper: float) -> None:
    """``lower < upper`` as float32 (two distinct float64 values can round to one float32)."""
    if not _f32(lower) < _f32(upper):
        raise ValueError(f"{owner}: {message} (compared in float32, the compute dtype)")


_Config = TypeVar("_Config")


def keyword_hints(cls: type[_Config]) -> type[_Config]:
    """Class decorator for a config dataclass: an unknown keyword argument raises
    ``TypeError`` with a did-you-mean hint, as the YAML / dict path does, instead of
    Python's bare ``__init__() got an unexpected keyword argument``.

    Reusable for any dataclass (apply it above ``@dataclasses.dataclass``).
    """
    init = cls.__init__
    allowed = tuple(f.name for f in dataclasses.fields(cls))  # pyright: ignore[reportArgumentType]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for key in kwargs:
            if key not in allowed:
                close = close_match(key, allowed)
                hint = f"; did you mean {close!r}?" if close else ""
                raise TypeError(
                    f"{cls.__name__}() got an unexpected keyword argument {shown(key)}{hint} "
                    f"(allowed: {', '.join(allowed)})"
                )
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # pyright: ignore[reportAttributeAccessIssue]
    return cls


def _reject_unknown_keys(owner: str, data: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    for key in data:
        if key not in allowed:
            close = [c for c in [close_match(str(key), allowed)] if c]
            hint = f"; did you mean {shown(close[0])}?" if close else ""
            raise ValueError(
                f"unknown {owner} key {shown(key)}{hint} (allowed keys: {', '.join(allowed)})"
            )


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (``safe_load``
    keeps the last silently: a config that says two things means one of them)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)  # pyright: ignore[reportArgumentType]
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: construct_mapping reports it
                    continue
                if first is not key_node:
                    raise ValueError(
                        f"duplicate YAML key {shown(key)} (line {first.start_mark.line + 1} and "
                        f"line {key_node.start_mark.line + 1}); give each key once"
                    )
        return super().construct_mapping(node, deep=deep)


def _parse_yaml(text: str, owner: str, origin: str) -> Any:
    """``yaml.safe_load`` with duplicate keys refused and every failure a ``ValueError``."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except ValueError as err:
        raise ValueError(f"{owner} YAML {origin}: {err}") from None
    except RecursionError:
        raise ValueError(f"{owner} YAML {origin} is nested too deeply to be a config") from None
    except yaml.YAMLError as err:
        reason = " ".join(str(err).split())
        raise ValueError(f"{owner} YAML {origin} is not valid YAML: {shown(reason)}") from None


def _read_yaml_file(path: pathlib.Path, owner: str) -> str:
    if path.is_dir():
        raise IsADirectoryError(f"{owner} YAML path is a directory, not a file: {shown(str(path))}")
    if not path.is_file():
        raise FileNotFoundError(f"{owner} YAML file not found: {shown(str(path))}")
    return path.read_text()


def _load_yaml_mapping(source: str | os.PathLike[str], owner: str) -> dict[str, Any]:
    """Reads a YAML mapping from a path or from YAML text (``yaml.safe_load``, with
    duplicate keys refused)."""
    if isinstance(source, os.PathLike):
        text = _read_yaml_file(pathlib.Path(source), owner)
        origin = os.fspath(source)
    elif isinstance(source, str):
        looks_like_text = "\n" in source or ":" in source.split("/")[-1] or "{" in source
        if not looks_like_text or os.path.isfile(source):
            text, origin = _read_yaml_file(pathlib.Path(source), owner), source
        else:
            text, origin = source, "<yaml text>"
    else:
        raise TypeError(
            f"{owner}.from_yaml expects a path or YAML text, got {type(source).__name__}"
        )
    data = _parse_yaml(text, owner, shown(origin) if origin != "<yaml text>" else origin)
    if not isinstance(data, dict):
        raise ValueError(
            f"{owner} YAML {origin} must be a mapping of keys to values, got {type(data).__name__}"
        )
    return data


# --------------------------------------------------------------------------- AReaL's grid

AREAL_LEVELS: tuple[str, ...] = ("token", "sequence")
AREAL_ACTIONS: tuple[str, ...] = ("mask", "clamp")
AREAL_METRICS: tuple[str, ...] = ("ratio", "kl_k1", "kl_k2", "kl_k3")
AREAL_AGGS: tuple[str, ...] = ("sum", "mean", "max")


@keyword_hints
@dataclasses.dataclass(frozen=True)
class RejectionSamplingConfig:
    """AReaL's rejection grid: filter or bound the π_old / π_rollout weight by a divergence.

    The fields, defaults and checks of AReaL's ``RejectionSamplingConfig``
    (inclusionAI/AReaL ``areal/api/cli_args.py``, applied by
    ``apply_rejection_sampling`` in ``areal/utils/functional/functional.py``, commit
    ``4aef98d8``); the value of :attr:`CorrectionConfig.rejection_sampling`, which
    brings AReaL's IS weight (``behave_imp_weight``) and decision into the pipeline
    (docs/semantics.md §8). With ``δ_t = log π_old − log π_rollout``:

    * weight ``w_t = exp(δ_t)``; at ``level="sequence"`` with ``metric="ratio"`` the
      geometric mean ``exp(Σ δ m / N)`` of the sequence, whatever ``agg``;
    * statistic per token: ``ratio = e^δ``, ``kl_k1 = δ``, ``kl_k2 = ½δ²``,
      ``kl_k3 = e^{−δ} − 1 + δ`` (AReaL's ``KLEstimator`` with π_old as ``log_probs``);
      at ``level="sequence"`` its per-sequence ``agg``: for ``ratio`` in log space
      (``sum``: ``exp(Σ δ m)``, ``mean``: ``exp(Σ δ m / N)``, ``max``: ``exp(max δ)``),
      for the KL metrics of the values (``Σ k m``, ``Σ k m / N``, ``max k``); an empty
      sequence has aggregate 0;
    * in bounds iff ``lower ≤ stat ≤ upper`` (``stat ≤ upper`` when ``lower`` is None);
    * ``action="mask"``: tokens (sequences) out of bounds are rejected; the weight is
      the unbounded ``w``. ``action="clamp"`` (``metric="ratio"`` only): nothing is
      rejected; ``w ← clip(w, lower or 0, upper)``, every token at the token level and
      the tokens of out-of-bounds sequences at the sequence level.

    Validated as AReaL does: ``ValueError`` for a choice outside the grid, ``lower >
    upper``, ``upper ≤ 1`` or ``lower ≤ 0`` with ``metric="ratio"``, ``upper ≤ 0`` with
    ``kl_k2`` / ``kl_k3``, or ``clamp`` with a KL metric (a bound on a divergence is not
    a bound on a weight); a ``UserWarning`` when ``agg`` is not ``"mean"`` at the token
    level (where it is ignored). Bounds must also be normal, finite float32 values (0
    allowed for ``kl_k1``), compared as float32.

    Attributes:
      level: ``"token"`` (each token judged alone) or ``"sequence"`` (a sequence shares
        one fate).
      action: ``"mask"`` (reject) or ``"clamp"`` (bound the weight).
      metric: ``"ratio"``, ``"kl_k1"``, ``"kl_k2"`` or ``"kl_k3"``.
      agg: the per-sequence aggregation at ``level="sequence"``: ``"sum"``, ``"mean"``
        or ``"max"``.
      upper: upper bound of the statistic (AReaL's default 5.0).
      lower: lower bound, or None (none; ``clamp`` then clips at 0).
    """

    level: Literal["token", "sequence"] = "token"
    action: Literal["mask", "clamp"] = "mask"
    metric: Literal["ratio", "kl_k1", "kl_k2", "kl_k3"] = "ratio"
    agg: Literal["sum", "mean", "max"] = "mean"
    upper: float = 5.0
    lower: float | None = None

    def __post_init__(self):
        owner = "CorrectionConfig.rejection_sampling"
        set_ = lambda key, value: object.__setattr__(self, key, value)  # noqa: E731 (frozen)
        for key, allowed in (
            ("level", AREAL_LEVELS),
            ("action", AREAL_ACTIONS),
            ("metric", AREAL_METRICS),
            ("agg", AREAL_AGGS),
        ):
            set_(key, _check_choice(owner, key, getattr(self, key), allowed))
        set_("upper", _check_number(owner, "upper", self.upper, optional=False))
        set_("lower", _check_number(owner, "lower", self.lower, optional=True))
        self._check_bounds(owner)
        if self.action == "clamp" and self.metric != "ratio":
            raise ValueError(
                f"{owner}.action='clamp' only supports metric='ratio' (it clips the importance "
                f"weight to [lower, upper]; a bound on {self.metric!r} is not a bound on a "
                "weight), got metric={self.metric!r}; use action='mask' for KL-based filtering"
            )
        if self.level == "token" and self.agg != "mean":
            warnings.warn(
                f"{owner}.agg={self.agg!r} is ignored when level='token'; aggregation is only "
                "used for sequence-level filtering",
                UserWarning,
                stacklevel=3,
            )

    def _check_bounds(self, owner: str) -> None:
        upper, lower = self.upper, self.lower
        assert upper is not None  # optional=False never returns None
        if lower is not None and lower > upper:
            raise ValueError(
                f"{owner}: lower ({shown(lower)}) cannot be greater than upper ({shown(upper)})"
            )
        if self.metric == "ratio":
            if upper <= 1.0:
                raise ValueError(
                    f"{owner}.upper must be > 1.0 for metric='ratio' (otherwise every token whose "
                    f"policies differ is filtered), got {shown(upper)}"
                )
            if lower is not None and lower <= 0:
                raise ValueError(
                    f"{owner}.lower must be > 0 for metric='ratio', got {shown(lower)}"
                )
            for key in ("upper", "lower"):
                _check_f32_ratio(owner, key, getattr(self, key))
        else:
            if self.metric in ("kl_k2", "kl_k3") and upper <= 0:
                raise ValueError(
                    f"{owner}.upper must be > 0 for metric={self.metric!r}, got {shown(upper)}"
                )
            for key in ("upper", "lower"):
                check_f32_coefficient(owner, key, getattr(self, key))

    @property
    def clamp_lower(self) -> float:
        """The lower clip of ``action="clamp"``: ``lower``, or 0 (AReaL's default)."""
        return 0.0 if self.lower is None else self.lower

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RejectionSamplingConfig:
        """From a mapping of AReaL's keys, unknown keys refused with a did-you-mean hint."""
        if not isinstance(data, Mapping):
            raise ValueError(
                "CorrectionConfig.rejection_sampling must be a mapping of AReaL's "
                f"RejectionSamplingConfig keys or None, got {type(data).__name__}"
            )
        _reject_unknown_keys("CorrectionConfig.rejection_sampling", data, cls.keys())
        return cls(**dict(data))


# --------------------------------------------------------------------------- correction


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
      tis_lower_bound: ``L``; ``None`` means ``1 / tis_upper_bound``. Unused by truncate.
      tis_upper_bound: ``U``.
      tis_batch_normalize: rescale the weights to mean 1 over what stays in the loss.
      use_rs: rejection sampling: drop tokens/sequences whose ratio at ``rs_level``
        leaves ``[rs_lower_bound, rs_upper_bound]``.
      rs_level: level of the rejection ratio (the same four levels).
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
        lower_used = self.tis_mode in ("clip", "mask", "band") or (
            self.use_rs and self.rs_lower_bound is None
        )
        if lower_used and self.tis_lower_bound is None:
            _check_f32_ratio(
                owner, "tis_upper_bound", self.lower_bound, label="1 / tis_upper_bound"
            )
        self._check_rules(owner)
        self._check_async(owner)
        if self.tis_mode == "band" and self.lower_bound > self.upper_bound:
            raise ValueError(
                f"{owner}: tis_lower_bound must be <= tis_upper_bound for tis_mode='band', "
                f"got {shown(self.lower_bound)} > tis_upper_bound = {shown(self.upper_bound)}"
            )
        if self.tis_mode in ("clip", "mask"):
            source = (
                "tis_lower_bound" if self.tis_lower_bound is not None else "1 / tis_upper_bound"
            )
            _check_f32_less(
                owner,
                f"tis_lower_bound must be < tis_upper_bound for tis_mode={shown(self.tis_mode)}, got "
                f"{source} = {shown(self.lower_bound)} >= tis_upper_bound = {shown(self.upper_bound)}",
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
                f"{shown(self.rs_lower)} >= rs_upper_bound = {shown(self.rs_upper)}",
                self.rs_lower,
                self.rs_upper,
            )

    def _check_rules(self, owner: str) -> None:
        """Validates and canonicalises the keys of docs/semantics.md §8."""
        from offpolicy_jax.correction import (
            criteria,  # the formulas module; imported late to stay light
        )

        key = f"{owner}.rs_criteria"
        specs = self.rs_criteria
        if isinstance(specs, str):
            specs = (specs,)
        if not isinstance(specs, (tuple, list)):
            raise ValueError(
                f"{key} must be a list of 'criterion:threshold' strings, got {shown(specs)}"
            )
        parsed = [criteria.parse_spec(spec, key) for spec in specs]
        names = [c.name for c in parsed]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"{key} lists {shown(name)} twice; give each criterion once")
        object.__setattr__(self, "rs_criteria", tuple(c.spec for c in parsed))
        for name in ("seq_logprob_error_threshold", "m2po_tau"):
            value = _check_number(owner, name, getattr(self, name), optional=True)
            _check_positive(owner, name, value)
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
            _check_choice(owner, "nonfinite_rollout", self.nonfinite_rollout, NONFINITE_ROLLOUT),
        )
        set_(
            "staleness_level",
            _check_choice(owner, "staleness_level", self.staleness_level, STALENESS_LEVELS),
        )
        set_(
            "mask_offpolicy_in_partial_rollout",
            _check_bool(
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
        """The parsed ``rs_criteria`` (:class:`offpolicy_jax.correction.criteria.Criterion` tuples)."""
        from offpolicy_jax.correction import criteria

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
        comma lists, ``rollout_rs_threshold``: one entry per ``rollout_rs`` criterion, or a
        single entry shared by every criterion, as verl's ``_parse_rollout_rs_thresholds``
        does; docs/semantics.md §8); the loss-only keys ``bypass_mode`` and
        ``loss_type`` are ignored here (``LossConfig.from_verl`` reads them). The mapping
        is in :mod:`offpolicy_jax.interop.verl`. Invalid values raise ``ValueError`` naming the
        verl key.
        """
        from offpolicy_jax.interop import verl

        return cls(**verl.correction_kwargs(rollout_correction))

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
        if rejection_sampling is None:
            return cls()
        block = RejectionSamplingConfig.from_dict(rejection_sampling)
        return cls(use_tis=True, tis_mode="none", rejection_sampling=block)

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
        from offpolicy_jax.interop import verl

        shipped = sorted(
            p.name[: -len(".yaml")]
            for p in resources.files("offpolicy_jax").joinpath("configs").iterdir()
            if p.name.endswith(".yaml")
        )
        if name in shipped:
            # As YAML text: a packaged resource need not be a file on disk (e.g. a zip).
            shipped_file = resources.files("offpolicy_jax") / "configs" / f"{name}.yaml"
            return cls.from_yaml(shipped_file.read_text())
        if name in verl.VERL_PRESETS:
            return cls.from_verl(verl.preset_block(name))
        known = shipped + sorted(verl.VERL_PRESETS)
        close = [c for c in [close_match(str(name), known)] if c]
        hint = f" (did you mean {shown(close[0])}?)" if close else ""
        raise ValueError(f"preset must be one of {known}, got {shown(name)}{hint}")


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
        low = _check_number("VanillaTIS", "clip_low", self.clip_low, optional=False)
        no_cap = not isinstance(self.clip, bool) and self.clip == math.inf
        high = (
            math.inf if no_cap else _check_number("VanillaTIS", "clip", self.clip, optional=False)
        )
        assert low is not None and high is not None  # optional=False never returns None
        if not 0 <= low < high:
            raise ValueError(
                f"VanillaTIS requires 0 <= clip_low < clip, got clip_low={shown(low)}, clip={shown(high)}"
            )
        if not no_cap:
            _check_f32_ratio("VanillaTIS", "clip", high)
        if low != 0:
            _check_f32_ratio("VanillaTIS", "clip_low", low)
        _check_f32_less(
            "VanillaTIS",
            f"clip_low must be < clip, got clip_low={shown(low)}, clip={shown(high)}",
            low,
            high,
        )
        object.__setattr__(self, "clip_low", low)
        object.__setattr__(self, "clip", high)


CorrectionFn = Callable[..., Any]
Correction = CorrectionConfig | VanillaTIS | CorrectionFn | None


# --------------------------------------------------------------------------- losses


# The spec's order of LossConfig's arguments, which may be given positionally.
_LOSS_POSITIONAL: tuple[str, ...] = (
    "algorithm",
    "clip_eps",
    "clip_eps_high",
    "dual_clip_c",
    "correction",
    "aggregation",
    "rejected_in_denominator",
    "get_mismatch_metrics",
    "metric_reduction",
)


@dataclasses.dataclass(frozen=True, init=False)
class LossConfig:
    """Settings of :func:`~offpolicy_jax.policy_loss` (docs/semantics.md §5).

    Built from keywords, ``LossConfig(algorithm="decoupled_ppo", correction=cfg,
    policy_loss="gspo", clip_eps=3e-4)``: the fields below, plus the hyperparameters of
    the surrogate ``policy_loss`` names (its registered params, see
    :func:`~offpolicy_jax.register_surrogate` and the table in
    :mod:`offpolicy_jax.losses.builtins`), which it holds as ``params`` and reads flat
    (``cfg.clip_eps``). A hyperparameter left out or ``None`` takes the surrogate's
    default; one of another surrogate raises ``ValueError``. ``clip_eps`` is accepted
    whatever the surrogate (validated, and ignored by one without a clip range).

    Attributes:
      algorithm: ``"ppo"`` (old log-probs as the ratio denominator), ``"bypass_ppo"``
        (rollout log-probs as the denominator; ``old_logp`` may be None),
        ``"decoupled_ppo"`` (3-policy PPO: IS weights π_old/π_rollout multiply the
        clipped loss) or ``"reinforce_is"`` (``−sg(w)·A·log π_θ``, no clipping); see
        :mod:`offpolicy_jax.losses.algorithms`.
      correction: a :class:`CorrectionConfig`, a :class:`VanillaTIS`, a callable
        with the signature of ``compute_correction`` minus ``config``
        (``fn(old_logp, rollout_logp, mask, *, reduction, axis_names)``), or None.
      aggregation: how per-token losses become one number, over the final mask ``m'``
        (``m''`` = the denominator mask, see ``rejected_in_denominator``):
        ``"sequence_mean"`` (mean over non-empty sequences of ``Σ_t ℓ'/Σ_t m''``),
        ``"token_mean"`` (``Σ ℓ' / Σ m''``), ``"sequence_sum"`` (mean over non-empty
        sequences of ``Σ_t ℓ'``), ``"sequence_sum_norm"`` (``sequence_sum`` divided by
        ``loss_scale_factor``, by default the padded length ``T`` of the token axis),
        ``"token_sum"`` (``Σ ℓ'``, no normalisation) and ``"row_mean"`` (mean over every
        sequence slot of the batch, empty or rejected ones included, of
        ``Σ_t ℓ'/Σ_t m''``). verl's ``loss_agg_mode`` names map one to one:
        ``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-mean``,
        ``seq-mean-token-sum-norm``, ``token-sum``; ``row_mean`` is how verl averages
        GMPO (``torch.mean`` over the rows).
      rejected_in_denominator: keep rejected tokens in the loss denominator (the
        reference's behaviour); False = they leave it (D5).
      get_mismatch_metrics: add the §4 mismatch metrics without changing the loss.
      metric_reduction: ``"sequence"`` or ``"token"`` reduction of the metrics.
      policy_loss: the registered surrogate, orthogonal to ``algorithm`` (which decides
        the ratio denominator ``d`` and the IS weights): ``"ppo_clip"`` (default, the
        clipped PPO surrogate: ``clip_eps``, ``clip_eps_high``, ``dual_clip_c``),
        ``"gspo"``, ``"gspo_token"``, ``"cispo"``, ``"gmpo"``, ``"sapo"``, ``"gpg"``,
        ``"dppo_tv"``, ``"dppo_kl"``, ``"dro"``, prime-rl's ``"prime_dppo"`` and
        ``"ipo"``, INTELLECT-2's ``"two_sided_clip"``, TRL's ``"vespo"`` and ``"luspo"``
        or any registered name; formulas and papers in :mod:`offpolicy_jax.losses.policy_losses`.
        ``reinforce_is`` has its own term and takes only the default.
      params: the surrogate's hyperparameters (an instance of its registered params
        class); built from the flat keywords, or given whole.
      opsm_delta: DeepSeek-V3.2 off-policy sequence masking (docs/semantics.md §8): drop
        a sequence whose mean advantage is negative and whose mean
        ``log π_rollout − log π_θ`` over its tokens exceeds ``δ > 0``; None disables it.
      loss_scale_factor: the divisor of ``"sequence_sum_norm"`` (None = the padded
        length ``T``; a constant keeps the loss scale independent of padding).
      kl_coef: coefficient of the KL-to-reference term (needs ``ref_logp``); 0 = off.
      kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (low variance) per-token estimator
        of ``KL(π_θ ‖ π_ref)``.
      kl_off_policy: weight the estimator by ``π_θ/π_d`` (DeepSeek-V3.2's unbiased
        estimate for samples drawn from ``π_d``).
      entropy_coef: coefficient of the entropy bonus ``−c·H`` (needs ``entropy``); 0 = off.
      positive_example_nll_weight: VAPO's ``μ`` (NeMo-RL's key): adds ``μ·(−log π_θ)``
        on the tokens of sequences with ``reward > 0`` (needs ``rewards``), aggregated
        like the policy term; 0 = off.
      prox_logp_method: where decoupled PPO's proximal policy π_old comes from (AReaL's
        key, docs/guide/async.md): ``"recompute"`` (default: ``old_logp``, a forward
        pass), ``"loglinear"`` / ``"linear"`` (approximated from ``rollout_logp``,
        ``sg(logp)`` and the token ``versions``, so ``old_logp`` may be None) or
        ``"metrics"`` (``old_logp``, plus ``prox_*`` metrics of both approximations'
        errors). Anything but ``"recompute"`` needs ``algorithm="decoupled_ppo"`` and
        ``versions`` / ``current_version``.
    """

    algorithm: str = "ppo"
    correction: Correction = None
    aggregation: str = "sequence_mean"
    rejected_in_denominator: bool = False
    get_mismatch_metrics: bool = False
    metric_reduction: Literal["sequence", "token"] = "sequence"
    policy_loss: str = "ppo_clip"
    params: Any = None
    opsm_delta: float | None = None
    loss_scale_factor: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_off_policy: bool = False
    entropy_coef: float = 0.0
    prox_logp_method: str = "recompute"
    positive_example_nll_weight: float = 0.0

    def __init__(self, *args: Any, **settings: Any) -> None:
        if len(args) > len(_LOSS_POSITIONAL):
            raise TypeError(
                f"LossConfig takes at most {len(_LOSS_POSITIONAL)} positional arguments "
                f"({', '.join(_LOSS_POSITIONAL)}), got {len(args)}"
            )
        for key, value in zip(_LOSS_POSITIONAL, args, strict=False):
            if key in settings:
                raise TypeError(f"LossConfig got multiple values for argument {key!r}")
            settings[key] = value
        for field in dataclasses.fields(self):
            object.__setattr__(self, field.name, settings.pop(field.name, field.default))
        self._validate(settings)

    def __getattr__(self, name: str) -> Any:
        # Only reached when ordinary lookup fails: the surrogate's hyperparameters (and
        # their resolved properties, e.g. upper_clip_eps) read flat; a hyperparameter of
        # another registered surrogate reads None.
        params = self.__dict__.get("params")
        if params is not None and not name.startswith("_") and hasattr(params, name):
            return getattr(params, name)
        if params is not None and name in registry.hyperparameter_owners():
            return None
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The keywords the constructor and :meth:`from_dict` accept: the fields
        (``params`` aside) and every registered surrogate's hyperparameters."""
        own = tuple(f.name for f in dataclasses.fields(cls) if f.name != "params")
        extra = sorted(set(registry.hyperparameter_owners()) | set(registry.UNIVERSAL_KEYS))
        return own + tuple(k for k in extra if k not in own)

    def _validate(self, hyperparameters: Mapping[str, Any]) -> None:
        owner = "LossConfig"
        set_ = lambda key, value: object.__setattr__(self, key, value)  # noqa: E731 (frozen)
        set_("algorithm", _check_choice(owner, "algorithm", self.algorithm, ALGORITHMS))
        set_("aggregation", _check_choice(owner, "aggregation", self.aggregation, AGGREGATIONS))
        set_(
            "metric_reduction",
            _check_choice(owner, "metric_reduction", self.metric_reduction, METRIC_REDUCTIONS),
        )
        for key in ("rejected_in_denominator", "get_mismatch_metrics", "kl_off_policy"):
            set_(key, _check_bool(owner, key, getattr(self, key)))
        for key in ("opsm_delta", "loss_scale_factor"):
            set_(key, _check_number(owner, key, getattr(self, key), optional=True))
            _check_positive(owner, key, getattr(self, key))
        set_("kl_estimator", _check_choice(owner, "kl_estimator", self.kl_estimator, KL_ESTIMATORS))
        for key in ("kl_coef", "entropy_coef", "positive_example_nll_weight"):
            set_(key, _check_number(owner, key, getattr(self, key), optional=False))
        for key in ("kl_coef", "positive_example_nll_weight"):
            if getattr(self, key) < 0:
                raise ValueError(f"{owner}.{key} must be >= 0, got {shown(getattr(self, key))}")
        coefficients = ("kl_coef", "entropy_coef", "positive_example_nll_weight")
        for key in (*coefficients, "opsm_delta", "loss_scale_factor"):
            check_f32_coefficient(owner, key, getattr(self, key))
        if self.loss_scale_factor is not None and self.aggregation != "sequence_sum_norm":
            raise ValueError(
                f"{owner}.loss_scale_factor only applies to aggregation='sequence_sum_norm', "
                f"not {shown(self.aggregation)}; leave it None"
            )
        self._check_surrogate(hyperparameters)
        self._check_correction()
        self._check_proximal()

    def _check_proximal(self) -> None:
        """``prox_logp_method``: AReaL's values; an approximation is decoupled PPO's."""
        method = _check_choice(
            "LossConfig", "prox_logp_method", self.prox_logp_method, PROX_LOGP_METHODS
        )
        object.__setattr__(self, "prox_logp_method", method)
        if method != "recompute" and self.algorithm != "decoupled_ppo":
            raise ValueError(
                f"LossConfig.prox_logp_method={shown(method)} approximates decoupled PPO's "
                f"proximal policy; it needs algorithm='decoupled_ppo', not "
                f"{shown(self.algorithm)}"
            )

    @property
    def approximates_old(self) -> bool:
        """π_old is approximated (``old_logp`` is not needed)."""
        return self.prox_logp_method in ("loglinear", "linear")

    def _check_surrogate(self, hyperparameters: Mapping[str, Any]) -> None:
        """The surrogate's name (did-you-mean) and its hyperparameters, via the registry."""
        entry = registry.lookup(self.policy_loss)
        object.__setattr__(
            self, "params", registry.build_params(entry.name, hyperparameters, self.params)
        )
        if self.algorithm == "reinforce_is" and entry.name != "ppo_clip":
            raise ValueError(
                f"LossConfig.policy_loss: algorithm 'reinforce_is' has its own per-token term "
                f"−sg(w)·A·log π_θ, so policy_loss {shown(entry.name)} does not apply; use 'gpg' "
                "with 'bypass_ppo' or 'decoupled_ppo', or leave policy_loss at 'ppo_clip'"
            )

    def _check_correction(self) -> None:
        correction = self.correction
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
        algo = ALGORITHM_SPECS[self.algorithm]
        if algo.weighted and not self.reweights:
            what = "None" if correction is None else "a CorrectionConfig with use_tis: false"
            raise ValueError(
                f"LossConfig.correction: algorithm {shown(algo.name)} needs importance weights "
                f"(a CorrectionConfig with use_tis: true, a VanillaTIS or a callable), got {what}"
            )
        # bypass_ppo takes a rejection-only correction (tis_mode "none", weights 1): its
        # mask, decided on sg(π_θ)/π_rollout, is verl's bypass PPO-clip with rollout_rs.
        allowed = algo.rejection_only and self.rejects_only
        if not algo.weighted and self.reweights and not allowed:
            raise ValueError(
                f"LossConfig.correction: algorithm {shown(algo.name)} does not apply importance "
                f"weights, but the correction enables them; use "
                f"algorithm={shown(algo.weighted_variant)}, or a "
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
    def rejects_only(self) -> bool:
        """A CorrectionConfig that rejects tokens but leaves every weight at 1."""
        correction = self.correction
        return (
            isinstance(correction, CorrectionConfig)
            and correction.use_tis
            and getattr(correction, "tis_mode", None) == "none"
        )

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

        ==========================  ===========  ==========================
        ``use_rollout_logprobs``    ``use_tis``  algorithm
        ==========================  ===========  ==========================
        False                       False        ``ppo``
        True                        False        ``bypass_ppo``
        False                       True         ``decoupled_ppo``
        True                        True         ``reinforce_is`` (D9)
        ==========================  ===========  ==========================

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
                    f"in {shown(os.fspath(custom_config_path))}: "
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

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LossConfig:
        """Builds a config from a mapping of field names, rejecting unknown keys with a
        did-you-mean hint (``correction`` may be a mapping of ``CorrectionConfig`` keys)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"LossConfig.from_dict expects a mapping, got {type(data).__name__}")
        _reject_unknown_keys("LossConfig", data, cls.keys())
        fields = dict(data)
        if isinstance(fields.get("correction"), Mapping):
            fields["correction"] = CorrectionConfig.from_dict(fields["correction"])
        return cls(**fields)

    @classmethod
    def from_yaml(cls, source: str | os.PathLike[str]) -> LossConfig:
        """Builds a config from a YAML file path or YAML text (see :meth:`from_dict`)."""
        return cls.from_dict(_load_yaml_mapping(source, "LossConfig"))

    def to_dict(self) -> dict[str, Any]:
        """The config as flat keys (the surrogate's hyperparameters beside the fields),
        the inverse of :meth:`from_dict`. A ``VanillaTIS`` or callable correction has no
        mapping form: ``ValueError``."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data.update(dataclasses.asdict(data.pop("params")))
        if isinstance(self.correction, CorrectionConfig):
            data["correction"] = self.correction.to_dict()
        elif self.correction is not None:
            raise ValueError(
                f"LossConfig.to_dict: correction {type(self.correction).__name__} has no "
                "mapping form; only a CorrectionConfig (or None) does"
            )
        return data

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_verl(
        cls, rollout_correction: Mapping[str, Any] | None, actor: Mapping[str, Any] | None
    ) -> LossConfig:
        """Maps verl's ``algorithm.rollout_correction`` block and actor settings to a config.

        verl is an input format here: the result reproduces verl's loss and gradient.

        * Mode (``rollout_correction``): ``bypass_mode: false`` (decoupled, the default) uses
          π_old as the ratio denominator and the correction's IS weights and rejection
          (``decoupled_ppo``; plain ``ppo`` when the correction neither reweights nor
          rejects). ``bypass_mode: true`` sets π_old := π_rollout and, like verl, replaces
          ``loss_mode`` by ``loss_type``: ``"ppo_clip"`` (default) → ``bypass_ppo`` with the
          rejection mask but *without* IS weights (verl ignores ``rollout_is`` there: the
          PPO ratio already is π_θ/π_rollout); ``"reinforce"`` → ``reinforce_is`` (IS weights
          from sg(π_θ)/π_rollout), or ``bypass_ppo`` with ``gpg`` when ``rollout_is`` is off.
          The ``rollout_is*`` / ``rollout_rs*`` keys go to :meth:`CorrectionConfig.from_verl`.
        * Surrogate (``actor.loss_mode``, also read from ``actor.policy_loss.loss_mode``):
          ``vanilla`` → ``ppo_clip`` with dual clip ``c = clip_ratio_c`` (verl always
          applies it; default 3.0), ``gspo`` → ``gspo_token`` (verl implements the token
          form), ``cispo``, ``geo_mean`` → ``gmpo``, ``sapo``, ``gpg``, ``dppo_tv``,
          ``dppo_kl`` (``clip_ratio_c`` → ``dppo_ratio_cap``), ``dro``, ``clip_cov``,
          ``kl_cov``. ``clip_ratio_low`` / ``clip_ratio_high`` (default ``clip_ratio``,
          0.2) → ``clip_eps`` / ``clip_eps_high``; ``tau_pos``, ``tau_neg``, ``dro_beta``
          as named; ``actor.policy_loss``'s ``clip_cov_ratio``, ``clip_cov_lb``,
          ``clip_cov_ub``, ``kl_cov_ratio`` and ``ppo_kl_coef`` (default 0.1 as verl's
          config; an explicit null is 1.0, the fallback of verl's function) as named.
          ``clip_cov`` draws its tokens with ``policy_loss(..., key=...)``.
        * Aggregation (``actor.loss_agg_mode``, default ``token-mean``): ``token-mean`` →
          ``token_mean``, ``seq-mean-token-sum`` → ``sequence_sum``, ``seq-mean-token-mean``
          → ``sequence_mean``, ``seq-mean-token-sum-norm`` → ``sequence_sum_norm``
          (``loss_scale_factor``, default the padded length ``T``), ``token-sum`` →
          ``token_sum``. verl's ``gspo`` and ``sapo`` always use ``seq-mean-token-mean``
          and ``geo_mean`` the plain mean over rows, whatever ``loss_agg_mode`` says; so do
          the configs built here. Rejected tokens leave the denominator (verl replaces the
          response mask), as in this library's default.
        * Regularisers: ``use_kl_loss`` with ``kl_loss_coef`` (default 0.001) and
          ``kl_loss_type`` (``kl``/``k1``, ``mse``/``k2``, ``low_var_kl``/``k3``; default
          ``low_var_kl``) → ``kl_coef``, ``kl_estimator``; ``entropy_coeff`` →
          ``entropy_coef``. Difference: verl aggregates these two with ``loss_agg_mode``
          even where it forces the policy term's aggregation (gspo, sapo, geo_mean); here
          they share the policy term's aggregation.

        Other keys of verl's ``ActorConfig`` (batch sizes, optimiser, engine, ...) are
        accepted and ignored; a key verl does not have raises ``ValueError`` naming it,
        with a did-you-mean hint.

        Args:
          rollout_correction: verl's ``algorithm.rollout_correction`` mapping, or None.
          actor: verl's ``actor_rollout_ref.actor`` mapping (or its loss keys), or None.

        Returns:
          A validated :class:`LossConfig`.
        """
        rc = _verl_mapping("rollout_correction", rollout_correction)
        actor = _verl_mapping("actor", actor)
        _reject_unknown_keys("verl actor", actor, _VERL_ACTOR_KEYS)
        policy = _verl_mapping("actor.policy_loss", actor.get("policy_loss"))
        _reject_unknown_keys("verl actor.policy_loss", policy, _VERL_POLICY_LOSS_KEYS)

        bypass = _check_bool("rollout_correction", "bypass_mode", rc.get("bypass_mode", False))
        loss_type = rc.get("loss_type", "ppo_clip")
        _check_choice("rollout_correction", "loss_type", loss_type, ("ppo_clip", "reinforce"))
        loss_mode = actor.get("loss_mode", policy.get("loss_mode", "vanilla"))
        if "loss_mode" in actor and "loss_mode" in policy and policy["loss_mode"] != loss_mode:
            raise ValueError(
                f"actor.loss_mode {shown(loss_mode)} contradicts actor.policy_loss.loss_mode "
                f"{shown(policy['loss_mode'])}"
            )
        _check_choice("actor", "loss_mode", loss_mode, tuple(_VERL_LOSS_MODES))
        agg_mode = actor.get("loss_agg_mode", "token-mean")
        _check_choice("actor", "loss_agg_mode", agg_mode, tuple(_VERL_AGGREGATIONS))

        fields: dict[str, Any] = {}
        clip_ratio = _check_number(
            "actor", "clip_ratio", actor.get("clip_ratio", 0.2), optional=False
        )
        low = _check_number("actor", "clip_ratio_low", actor.get("clip_ratio_low"), optional=True)
        high = _check_number(
            "actor", "clip_ratio_high", actor.get("clip_ratio_high"), optional=True
        )
        low = clip_ratio if low is None else low
        high = clip_ratio if high is None else high
        # verl's ActorConfig default; vanilla's dual clip and DPPO's ratio cap both read it.
        clip_c = _check_number(
            "actor", "clip_ratio_c", actor.get("clip_ratio_c", 3.0), optional=False
        )
        assert clip_c is not None  # optional=False never returns None

        if bypass:
            # verl's apply_bypass_mode swaps loss_mode for its own "bypass_mode" loss.
            surrogate = "gpg" if loss_type == "reinforce" else "ppo_clip"
            aggregation = _VERL_AGGREGATIONS[agg_mode]
        else:
            surrogate = _VERL_LOSS_MODES[loss_mode]
            aggregation = _VERL_FORCED_AGGREGATIONS.get(loss_mode, _VERL_AGGREGATIONS[agg_mode])
        # verl's value of each native hyperparameter (clip_ratio_c is both vanilla's dual
        # clip and DPPO's ratio cap): the surrogate takes those its registered params have.
        verl_values = {
            "clip_eps": low,
            "clip_eps_high": high,
            "dual_clip_c": clip_c,
            "dppo_ratio_cap": clip_c,
            "tau_pos": actor.get("tau_pos"),
            "tau_neg": actor.get("tau_neg"),
            "dro_beta": actor.get("dro_beta"),
            **_verl_cov_values(policy),
        }
        takes = registry.lookup(surrogate).param_names
        if "dual_clip_c" in takes and clip_c <= 1:
            raise ValueError(
                f"actor.clip_ratio_c must be > 1 (verl's dual-clip constant), got {shown(clip_c)}"
            )
        fields.update(policy_loss=surrogate, aggregation=aggregation)
        fields.update({key: v for key, v in verl_values.items() if key in takes})
        if aggregation == "sequence_sum_norm" and actor.get("loss_scale_factor") is not None:
            fields["loss_scale_factor"] = actor["loss_scale_factor"]

        if _check_bool("actor", "use_kl_loss", actor.get("use_kl_loss", False)):
            kl_type = actor.get("kl_loss_type", "low_var_kl")
            _check_choice("actor", "kl_loss_type", kl_type, tuple(_VERL_KL_TYPES))
            fields["kl_coef"] = actor.get("kl_loss_coef", 0.001)
            fields["kl_estimator"] = _VERL_KL_TYPES[kl_type]
        fields["entropy_coef"] = actor.get("entropy_coeff", 0.0)

        correction_keys = dict(rc)
        if bypass and loss_type == "ppo_clip":
            correction_keys["rollout_is"] = None  # verl computes, then ignores, the weights
        correction = _verl_correction(correction_keys)
        reweights = correction.use_tis
        if not bypass:
            algorithm = "decoupled_ppo" if reweights else "ppo"
        elif loss_type == "reinforce" and reweights:
            algorithm, fields["policy_loss"] = "reinforce_is", "ppo_clip"
        else:
            algorithm = "bypass_ppo"
        return cls(algorithm=algorithm, correction=correction, **fields)


# A surrogate's hyperparameters become LossConfig keywords: they may not shadow its fields.
registry._RESERVED = tuple(f.name for f in dataclasses.fields(LossConfig))


# --------------------------------------------------------------------------- verl names

_VERL_LOSS_MODES: dict[str, str] = {
    "vanilla": "ppo_clip",
    "gspo": "gspo_token",
    "cispo": "cispo",
    "geo_mean": "gmpo",
    "sapo": "sapo",
    "gpg": "gpg",
    "dppo_tv": "dppo_tv",
    "dppo_kl": "dppo_kl",
    "dro": "dro",
    "clip_cov": "clip_cov",
    "kl_cov": "kl_cov",
}
_VERL_AGGREGATIONS: dict[str, str] = {
    "token-mean": "token_mean",
    "seq-mean-token-sum": "sequence_sum",
    "seq-mean-token-mean": "sequence_mean",
    "seq-mean-token-sum-norm": "sequence_sum_norm",
    "token-sum": "token_sum",
}
# verl's gspo / sapo call agg_loss with "seq-mean-token-mean" and geo_mean takes
# torch.mean over the rows, ignoring loss_agg_mode.
_VERL_FORCED_AGGREGATIONS: dict[str, str] = {
    "gspo": "sequence_mean",
    "sapo": "sequence_mean",
    "geo_mean": "row_mean",
}
_VERL_KL_TYPES: dict[str, str] = {
    "kl": "k1",
    "k1": "k1",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "k3",
    "k3": "k3",
}
_VERL_LOSS_KEYS: tuple[str, ...] = (
    "loss_mode",
    "loss_agg_mode",
    "clip_ratio",
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "tau_pos",
    "tau_neg",
    "dro_beta",
    "loss_scale_factor",
    "entropy_coeff",
    "use_kl_loss",
    "kl_loss_coef",
    "kl_loss_type",
    "policy_loss",
)
# The rest of verl's (FSDP / Megatron / VeOmni) ActorConfig: accepted, no effect on the loss.
_VERL_ACTOR_OTHER_KEYS: tuple[str, ...] = (
    "_target_",
    "strategy",
    "ppo_mini_batch_size",
    "ppo_micro_batch_size",
    "ppo_micro_batch_size_per_gpu",
    "ppo_infer_micro_batch_size_per_gpu",
    "use_dynamic_bsz",
    "ppo_max_token_len_per_gpu",
    "ppo_infer_max_token_len_per_gpu",
    "freeze_vision_tower",
    "calculate_entropy",
    "use_prefix_grouper",
    "use_torch_compile",
    "ppo_epochs",
    "shuffle",
    "data_loader_seed",
    "checkpoint",
    "optim",
    "use_fused_kernels",
    "profiler",
    "engine",
    "rollout_n",
    "model_config",
    "router_replay",
    "global_batch_info",
    "grad_clip",
    "ulysses_sequence_parallel_size",
    "entropy_from_logits_with_chunking",
    "entropy_checkpointing",
    "fsdp_config",
    "use_remove_padding",
    "use_rollout_log_probs",
    "calculate_sum_pi_squared",
    "sum_pi_squared_checkpointing",
    "load_weight",
    "megatron",
    "profile",
    "veomni",
)
_VERL_ACTOR_KEYS = _VERL_LOSS_KEYS + _VERL_ACTOR_OTHER_KEYS
_VERL_POLICY_LOSS_KEYS: tuple[str, ...] = (
    "_target_",
    "loss_mode",
    "clip_cov_ratio",
    "clip_cov_lb",
    "clip_cov_ub",
    "kl_cov_ratio",
    "ppo_kl_coef",
    "rollout_correction",
)


def _verl_cov_values(policy: Mapping[str, Any]) -> dict[str, Any]:
    """Clip-Cov / KL-Cov's keys of verl's ``actor.policy_loss`` (absent: the defaults of
    verl's config, which are this library's; ``ppo_kl_coef: null`` is 1.0, the fallback
    of verl's ``compute_policy_loss_kl_cov``, the others' null their config defaults)."""
    keys = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")
    values = {key: policy.get(key) for key in keys}
    if "ppo_kl_coef" in policy and policy["ppo_kl_coef"] is None:
        values["ppo_kl_coef"] = 1.0
    return values


def _verl_mapping(name: str, value: Any) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"verl {name} must be a mapping, got {type(value).__name__}")
    return value


def _verl_correction(rollout_correction: Mapping[str, Any]) -> CorrectionConfig:
    """``CorrectionConfig.from_verl``: the ``rollout_is*`` / ``rollout_rs*`` keys."""
    from_verl = getattr(CorrectionConfig, "from_verl", None)
    if from_verl is not None:
        return from_verl(rollout_correction)
    # Until the rollout_is / rollout_rs converter is merged: without IS or RS verl only
    # logs the mismatch metrics, which is the default CorrectionConfig.
    if (
        rollout_correction.get("rollout_is") is None
        and rollout_correction.get("rollout_rs") is None
    ):
        return CorrectionConfig()
    raise NotImplementedError("CorrectionConfig.from_verl is not available yet")
