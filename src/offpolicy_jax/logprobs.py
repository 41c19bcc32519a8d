"""Token log-probs as a sampler computes them, without ``[..., T, V]`` logits."""

from offpolicy_jax._src.logprobs import (
    TopKLogprobs,
    support_from_csr,
    token_logprobs,
    token_logprobs_from_hidden,
    topk_logprobs,
)

__all__ = [
    "TopKLogprobs",
    "support_from_csr",
    "token_logprobs",
    "token_logprobs_from_hidden",
    "topk_logprobs",
]
