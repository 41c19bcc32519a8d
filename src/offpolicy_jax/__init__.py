"""offpolicy-jax: rollout correction for LLM reinforcement learning in JAX.

Importance weights (token / sequence / geometric; truncate / clip / mask),
rejection sampling, the catastrophic-token veto, batch normalisation and
mismatch metrics between the inference engine that sampled a rollout and the
training engine, composed into PPO-family losses. Pure functions, jit/vmap/grad
and sharding safe.
"""

from offpolicy_jax._reduce import MeanParts, MeshAxes
from offpolicy_jax.config import CorrectionConfig, VanillaTIS
from offpolicy_jax.correction import CorrectionResult, compute_correction

__version__ = "0.1.0"

__all__ = [
    "CorrectionConfig",
    "CorrectionResult",
    "MeanParts",
    "MeshAxes",
    "VanillaTIS",
    "compute_correction",
]
