"""Token log-probs as a sampler computes them, without ``[..., T, V]`` logits.

``token`` (:func:`~offpolicy_jax.token_logprobs`, :func:`~offpolicy_jax.token_logprobs_from_hidden`),
``topk`` (the engine's top-k ids and log-probs, :func:`~offpolicy_jax.topk_logprobs`),
``sampling_support`` (the sampler's exact kept set) and ``_rowchunks`` (the shared
row-chunked custom-VJP machinery).
"""

from offpolicy_jax._src.logprobs.sampling_support import support_from_csr
from offpolicy_jax._src.logprobs.token import token_logprobs, token_logprobs_from_hidden
from offpolicy_jax._src.logprobs.topk import TopKLogprobs, topk_logprobs

__all__ = [
    "TopKLogprobs",
    "support_from_csr",
    "token_logprobs",
    "token_logprobs_from_hidden",
    "topk_logprobs",
]
