"""Token log-probs as a sampler computes them, without ``[..., T, V]`` logits.

``token`` (:func:`~offpolicy_jax.token_logprobs`, :func:`~offpolicy_jax.token_logprobs_from_hidden`),
``sampling_support`` (the sampler's exact kept set) and ``_rowchunks`` (the shared
row-chunked custom-VJP machinery).
"""

from offpolicy_jax.logprobs.sampling_support import support_from_csr
from offpolicy_jax.logprobs.token import token_logprobs, token_logprobs_from_hidden

__all__ = ["support_from_csr", "token_logprobs", "token_logprobs_from_hidden"]
