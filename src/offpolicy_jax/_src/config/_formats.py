"""Where the configs' foreign-format constructors find their readers.

``CorrectionConfig.from_verl``, ``.from_yaml``, ``.preset``, ``LossConfig.from_flags``
and the other classmethods that read another system's format are implemented in
:mod:`offpolicy_jax.interop`, which sits above the configs: it imports them and
registers each reader here under the classmethod's name. The configs look the reader
up when the classmethod is called, so they never import :mod:`offpolicy_jax.interop`
(no import cycle); ``import offpolicy_jax`` registers every reader.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

_Reader = TypeVar("_Reader", bound=Callable[..., Any])
_READERS: dict[str, Callable[..., Any]] = {}


def register(name: str) -> Callable[[_Reader], _Reader]:
    """Registers the decorated function as the reader behind the classmethod ``name``
    (e.g. ``"CorrectionConfig.from_verl"``); a second registration replaces the first."""

    def decorator(fn: _Reader) -> _Reader:
        _READERS[name] = fn
        return fn

    return decorator


def reader(name: str) -> Callable[..., Any]:
    """The reader registered for the classmethod ``name``."""
    try:
        return _READERS[name]
    except KeyError:
        raise RuntimeError(
            f"{name} is implemented in offpolicy_jax.interop, which is not imported; "
            "import offpolicy_jax (or offpolicy_jax.interop) first"
        ) from None
