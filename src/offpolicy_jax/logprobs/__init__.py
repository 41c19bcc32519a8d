"""Token log-probs as a sampler computes them, without ``[..., T, V]`` logits.

``token`` (:func:`~offpolicy_jax.token_logprobs`, :func:`~offpolicy_jax.token_logprobs_from_hidden`),
``sampling_support`` (the sampler's exact kept set) and ``_rowchunks`` (the shared
row-chunked custom-VJP machinery).
"""
