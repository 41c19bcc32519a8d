"""Value checks shared by the configs and the registered surrogates' hyperparameters.

Each check names its owner and key in the ``ValueError`` it raises (``LossConfig.clip_eps
must be ...``). This module sits below both :mod:`offpolicy_jax._src.config` and
:mod:`offpolicy_jax._src.losses`, so that a surrogate's hyperparameters (registered in the
core) and the configs above them validate numbers the same way without importing
each other.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np

from offpolicy_jax._src.messages import close_match, shown


def check_bool(owner: str, key: str, value: Any) -> bool:
    # numpy.bool_ is accepted; strings such as "yes" and 0/1 integers are not, since
    # silently reading "false" as truthy is exactly the bug this check prevents.
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise ValueError(f"{owner}.{key} must be true or false, got {shown(value)}")


def check_choice(owner: str, key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if isinstance(value, str) and value in allowed:
        return value
    hint = ""
    if isinstance(value, str):
        close = [a for a in allowed if a.startswith(value)] if value else []
        close = close or [c for c in [close_match(value, allowed)] if c]
        hint = f" (did you mean {shown(close[0])}?)" if close else ""
    raise ValueError(f"{owner}.{key} must be one of {list(allowed)}, got {shown(value)}{hint}")


def check_number(owner: str, key: str, value: Any, *, optional: bool) -> float | None:
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


def check_positive(owner: str, key: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{owner}.{key} must be > 0, got {shown(value)}")


# The library computes in float32: a config value is checked as the float32 it becomes,
# not as the Python float it was written as (1e-46 is a positive float64 but a float32 0).
F32 = np.finfo(np.float32)


def f32(value: float) -> float:
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float32(value))


def check_f32_ratio(owner: str, key: str, value: float | None, *, label: str | None = None) -> None:
    """A ratio bound must be a normal, finite float32: not 0 (underflow), subnormal or inf.

    Its log is then within ±88.8, representable too. ``label`` names a derived value
    (``1 / tis_upper_bound``) in the message.
    """
    if value is None:
        return
    as_f32 = f32(value)
    if not (F32.tiny <= as_f32 <= F32.max):
        raise ValueError(
            f"{owner}.{key}: {label or key} = {shown(value)} is {as_f32!r} in float32, the library's "
            f"compute dtype; ratio bounds must lie in [{float(F32.tiny):.4g}, "
            f"{float(F32.max):.4g}] (a normal, finite float32)"
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
    as_f32 = abs(f32(value))
    if not (F32.tiny <= as_f32 <= F32.max):
        raise ValueError(
            f"{owner}.{key} = {shown(value)} is {f32(value)!r} in float32, the library's "
            f"compute dtype; it must be 0 or have magnitude in [{float(F32.tiny):.4g}, "
            f"{float(F32.max):.4g}] (a normal, finite float32)"
        )


def check_f32_less(owner: str, message: str, lower: float, upper: float) -> None:
    """``lower < upper`` as float32 (two distinct float64 values can round to one float32)."""
    if not f32(lower) < f32(upper):
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


def reject_unknown_keys(owner: str, data: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    for key in data:
        if key not in allowed:
            close = [c for c in [close_match(str(key), allowed)] if c]
            hint = f"; did you mean {shown(close[0])}?" if close else ""
            raise ValueError(
                f"unknown {owner} key {shown(key)}{hint} (allowed keys: {', '.join(allowed)})"
            )
