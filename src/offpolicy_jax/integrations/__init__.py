"""Integrations of offpolicy-jax with RL frameworks and optimizer libraries.

Each integration is a submodule that imports its framework, installed through the
extra of the same name; this package itself imports nothing, so
``import offpolicy_jax`` never needs a framework:

* :mod:`offpolicy_jax.integrations.tunix`: a tunix policy loss, config and GRPO
  learner (the ``tunix`` extra: ``pip install -e ".[tunix]"`` in a clone).
* :mod:`offpolicy_jax.integrations.optax`: VCPO's ESS-guided step scaling as an optax
  gradient transformation, ``scale_by_ess`` (the ``optax`` extra).

offpolicy-jax is not on PyPI: install it from a clone (``pip install -e ".[EXTRA]"``) or
from a wheel built from one (``pip install "offpolicy_jax-VERSION-py3-none-any.whl[EXTRA]"``).
"""

__all__: list[str] = []
