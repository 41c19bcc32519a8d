"""offpolicy-jax: rollout correction for LLM reinforcement learning in JAX.

Importance weights (token / sequence / geometric / MinPRO; truncate / clip / mask;
AReaL's mask / clamp grid), rejection sampling, the catastrophic-token veto, batch
normalisation and mismatch metrics between the inference engine that sampled a
rollout and the training engine, composed into PPO-family losses. Pure functions, jit/vmap/grad
and sharding safe.
"""

from offpolicy_jax import objectives as objectives
from offpolicy_jax import rules as rules
from offpolicy_jax._src.config import (
    CorrectionConfig,
    LossConfig,
    RejectionSamplingConfig,
    VanillaTIS,
)
from offpolicy_jax._src.correction.composed import correct
from offpolicy_jax._src.correction.compute import CorrectionResult, compute_correction
from offpolicy_jax._src.correction.metrics import finalize as finalize_metrics
from offpolicy_jax._src.correction.ratios import METRIC_LOG_CAP
from offpolicy_jax._src.logprobs.sampling_support import support_from_csr
from offpolicy_jax._src.logprobs.token import token_logprobs, token_logprobs_from_hidden
from offpolicy_jax._src.logprobs.topk import TopKLogprobs, topk_logprobs
from offpolicy_jax._src.losses.oapl import oapl_advantages
from offpolicy_jax._src.losses.policy_loss import (
    LossParts,
    PolicyLossTerms,
    aggregate,
    policy_loss,
    policy_loss_parts,
    policy_loss_terms,
)
from offpolicy_jax._src.losses.registry import SurrogateInput, SurrogateTerms, register_surrogate
from offpolicy_jax._src.losses.surrogates import PPOTerms, ppo_surrogate
from offpolicy_jax._src.reduction import MeanParts, MeshAxes, pool_metric_parts
from offpolicy_jax._src.vcpo import (
    ess_learning_rate_scale,
    opob_advantages,
    opob_baseline,
    sequence_ess,
)
from offpolicy_jax.interop.packing import PackedSequences, pack_sequences, unpack_sequences

__version__ = "0.1.0"

__all__ = [
    "CorrectionConfig",
    "CorrectionResult",
    "LossConfig",
    "LossParts",
    "MeanParts",
    "METRIC_LOG_CAP",
    "MeshAxes",
    "PPOTerms",
    "PolicyLossTerms",
    "PackedSequences",
    "RejectionSamplingConfig",
    "SurrogateInput",
    "SurrogateTerms",
    "TopKLogprobs",
    "VanillaTIS",
    "aggregate",
    "compute_correction",
    "correct",
    "ess_learning_rate_scale",
    "finalize_metrics",
    "oapl_advantages",
    "opob_advantages",
    "opob_baseline",
    "pack_sequences",
    "policy_loss",
    "policy_loss_parts",
    "policy_loss_terms",
    "pool_metric_parts",
    "ppo_surrogate",
    "register_surrogate",
    "sequence_ess",
    "support_from_csr",
    "token_logprobs",
    "token_logprobs_from_hidden",
    "topk_logprobs",
    "unpack_sequences",
]
