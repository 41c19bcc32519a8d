"""Error-message helpers: user values shown bounded in size and cost, did-you-mean hints.

Free of JAX so that the config module can use them without importing it.
"""

from __future__ import annotations

import difflib
import reprlib

# --------------------------------------------------------------- bounded error messages

_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict = 3, 6, 6, 6
_SHOWN.maxset = _SHOWN.maxfrozenset = _SHOWN.maxdeque = _SHOWN.maxarray = 6
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 80, 80, 40
SHOWN_LIMIT = 200
"""The most characters an error message spends on one user value."""

MATCH_LIMIT = 100
"""Did-you-mean hints compare only strings up to this long (difflib is quadratic)."""


def shown(value) -> str:
    """``repr(value)`` bounded in size and cost, for error messages.

    A YAML document can share one list under many aliases (``safe_load`` builds each
    anchor once): its ``repr`` is exponential in the document's size (371 bytes gave a
    ``MemoryError``). :mod:`reprlib` stops at a fixed depth and width.
    """
    text = _SHOWN.repr(value)
    return text if len(text) <= SHOWN_LIMIT else text[: SHOWN_LIMIT - 3] + "..."


def close_match(value, allowed) -> str | None:
    """The closest of ``allowed`` to the string ``value`` (difflib), or None; a long
    ``value`` is not compared (no key is that long, and matching a 10 MB string took
    seconds)."""
    if not isinstance(value, str) or not value or len(value) > MATCH_LIMIT:
        return None
    close = difflib.get_close_matches(value, [str(a) for a in allowed], n=1)
    return close[0] if close else None
