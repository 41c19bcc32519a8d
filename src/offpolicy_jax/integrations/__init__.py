"""Integrations of offpolicy-jax with RL frameworks and optimizer libraries.

Each integration is a submodule that imports its framework, installed through the
extra of the same name; this package itself imports nothing, so
``import offpolicy_jax`` never needs a framework:

* :mod:`offpolicy_jax.integrations.tunix`: a tunix policy loss, config and GRPO
  learner (``pip install "offpolicy-jax[tunix]"``).
* :mod:`offpolicy_jax.integrations.optax`: VCPO's ESS-guided step scaling as an optax
  gradient transformation, ``scale_by_ess`` (``pip install "offpolicy-jax[optax]"``).
"""

__all__: list[str] = []
