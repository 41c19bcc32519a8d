"""Alias of :mod:`offpolicy_jax.reduction` under its former module name.

The engine moved into the ``reduction`` sub-package (issue 25); this name stays
importable for code written against it. New code imports ``offpolicy_jax.reduction``.
"""

from offpolicy_jax.reduction import *  # noqa: F403


def dispatch(fn, segment_ids, num_segments, *args, axes=None):
    """Former entry point of the packed path's ``cond`` (removed: a packed call now
    compiles once); kept for code written against it: simply ``fn(*args)``."""
    del segment_ids, num_segments, axes
    return fn(*args)
