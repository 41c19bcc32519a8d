"""The policy losses built on the correction."""

from offpolicy_jax._src.losses import (
    PPOTerms,
    SurrogateInput,
    SurrogateTerms,
    ppo_surrogate,
    register_surrogate,
)

__all__ = [
    "PPOTerms",
    "SurrogateInput",
    "SurrogateTerms",
    "ppo_surrogate",
    "register_surrogate",
]
