"""Integrations of offpolicy-jax with RL frameworks.

Each integration is a submodule that imports its framework, installed through the
extra of the same name; this package itself imports nothing, so
``import offpolicy_jax`` never needs a framework:

* :mod:`offpolicy_jax.integrations.tunix`: a tunix policy loss, config and GRPO
  learner (``pip install "offpolicy-jax[tunix]"``).
"""

__all__: list[str] = []
