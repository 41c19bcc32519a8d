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
from typing import Any, Literal, Union

import yaml

Level = Literal["token", "sequence", "geometric"]
Mode = Literal["truncate", "clip", "mask"]

LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
MODES: tuple[str, ...] = ("truncate", "clip", "mask")
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
        raise TypeError(f"{owner}.from_yaml expects a path or YAML text, got {type(source).__name__}")
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(
            f"{owner} YAML {origin} must be a mapping of keys to values, "
            f"got {type(data).__name__}"
        )
    return data


# --------------------------------------------------------------------------- correction


@dataclasses.dataclass(frozen=True)
class CorrectionConfig:
    """Rollout-correction settings: the keys of the reference ``mis.yaml``.

    See ``semantics.md`` §1. ``use_tis=False`` computes the mismatch metrics only.

    Attributes:
      use_tis: apply importance weights (and rejection); False = metrics only.
      tis_level: ``"token"``, ``"sequence"`` (product of ratios) or ``"geometric"``
        (geometric mean) aggregation of the log-ratio for the IS weight.
      tis_mode: ``"truncate"`` (``min(w, U)``), ``"clip"`` (``clip(w, L, U)``) or
        ``"mask"`` (reject tokens with ``w`` outside ``[L, U]``).
      tis_lower_bound: ``L``; ``None`` means ``1 / tis_upper_bound``. Unused by truncate.
      tis_upper_bound: ``U``.
      tis_batch_normalize: rescale the weights to mean 1 over what stays in the loss.
      use_rs: rejection sampling: drop tokens/sequences whose ratio at ``rs_level``
        leaves ``[rs_lower_bound, rs_upper_bound]``.
      rs_level: level of the rejection ratio.
      rs_lower_bound: ``None`` means the resolved ``tis_lower_bound``.
      rs_upper_bound: ``None`` means ``tis_upper_bound``.
      rs_veto_threshold: reject a sequence with any token ratio below this; ``None``
        disables the veto (which works with or without ``use_rs``).
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

    def __post_init__(self):
        owner = "CorrectionConfig"
        set_ = lambda key, value: object.__setattr__(self, key, value)  # noqa: E731 (frozen)
        for key in ("use_tis", "tis_batch_normalize", "use_rs"):
            set_(key, _check_bool(owner, key, getattr(self, key)))
        set_("tis_level", _check_choice(owner, "tis_level", self.tis_level, LEVELS))
        set_("tis_mode", _check_choice(owner, "tis_mode", self.tis_mode, MODES))
        set_("rs_level", _check_choice(owner, "rs_level", self.rs_level, LEVELS))
        set_("tis_upper_bound", _check_number(owner, "tis_upper_bound", self.tis_upper_bound, optional=False))
        for key in ("tis_lower_bound", "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold"):
            set_(key, _check_number(owner, key, getattr(self, key), optional=True))
        for key in ("tis_upper_bound", "tis_lower_bound", "rs_veto_threshold"):
            _check_positive(owner, key, getattr(self, key))
        if self.tis_mode in ("clip", "mask") and self.lower_bound >= self.upper_bound:
            source = "tis_lower_bound" if self.tis_lower_bound is not None else "1 / tis_upper_bound"
            raise ValueError(
                f"{owner}: tis_lower_bound must be < tis_upper_bound for tis_mode="
                f"{self.tis_mode!r}, got {source} = {self.lower_bound!r} >= "
                f"tis_upper_bound = {self.upper_bound!r}"
            )
        if self.use_rs:
            _check_positive(owner, "rs_lower_bound", self.rs_lower_bound)
            _check_positive(owner, "rs_upper_bound", self.rs_upper_bound)
            if self.rs_lower >= self.rs_upper:
                raise ValueError(
                    f"{owner}: rs_lower_bound must be < rs_upper_bound, got resolved "
                    f"rs_lower_bound = {self.rs_lower!r} >= rs_upper_bound = {self.rs_upper!r}"
                )

    # Resolved bounds (semantics.md §1: the nulls fall back in this order).
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
            raise ValueError(f"CorrectionConfig.from_dict expects a mapping, got {type(data).__name__}")
        _reject_unknown_keys("CorrectionConfig", data, cls.keys())
        return cls(**dict(data))

    @classmethod
    def from_yaml(cls, source: str | os.PathLike[str]) -> CorrectionConfig:
        """Builds a config from a YAML file path or YAML text (read with ``yaml.safe_load``)."""
        return cls.from_dict(_load_yaml_mapping(source, "CorrectionConfig"))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


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
        if not 0 <= low < high:
            raise ValueError(
                f"VanillaTIS requires 0 <= clip_low < clip, got clip_low={low!r}, clip={high!r}"
            )
        object.__setattr__(self, "clip_low", low)
        object.__setattr__(self, "clip", high)


CorrectionFn = Callable[..., Any]
Correction = Union[CorrectionConfig, VanillaTIS, CorrectionFn, None]
