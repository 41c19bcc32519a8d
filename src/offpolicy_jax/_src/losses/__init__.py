"""The policy losses built on the correction.

``registry`` (surrogates registered by name), ``surrogates`` and ``policy_losses``
(the per-token math), ``builtins`` (the built-in surrogates, registered like a user's),
``algorithms`` (ppo / bypass / decoupled / reinforce_is as data), ``proximal``
(asynchronous RL's proximal approximation) and ``policy_loss``
(:func:`~offpolicy_jax.policy_loss`: one pipeline for every algorithm and surrogate).
The public names are re-exported by :mod:`offpolicy_jax`.
"""

# The built-in surrogates register themselves on import: importing the package fills
# the registry, so a name is found wherever the registry is reachable.
from offpolicy_jax._src.losses import builtins as _builtins  # noqa: F401
from offpolicy_jax._src.losses import oapl as _oapl  # noqa: F401
from offpolicy_jax._src.losses.registry import SurrogateInput, SurrogateTerms, register_surrogate
from offpolicy_jax._src.losses.surrogates import PPOTerms, ppo_surrogate

# The entry points (policy_loss and its kin) import the config layer, which imports this
# package: they are exported by offpolicy_jax, above both.
__all__ = ["PPOTerms", "SurrogateInput", "SurrogateTerms", "ppo_surrogate", "register_surrogate"]
