"""Alias of :mod:`offpolicy_jax.reduction` under its former module name.

The engine moved into the ``reduction`` sub-package (issue 25); this name stays
importable for code written against it. New code imports ``offpolicy_jax.reduction``.
"""

from offpolicy_jax.reduction import *  # noqa: F403
from offpolicy_jax.reduction import __all__  # noqa: F401
