"""The top-k divergence between the trainer and the engine at one position (DPPO's top-k).

The engine returns, for every generated position, its ``K`` most probable token ids and
their log-probs (vLLM's ``logprobs=K``); the trainer's log-probs on the same ids come
from its own logits (:func:`~offpolicy_jax.topk_logprobs`). Over that support plus one
"rest" bucket holding the remaining mass, DPPO (Qi et al., 2026, arXiv:2602.04879) and
TRL's ``DPPOConfig(divergence_type="topk_tv" | "topk_kl", divergence_topk=K)`` estimate
the divergence of the two next-token distributions, far less noisy than the sampled
token alone. With ``μ_k`` the engine's and ``π_k`` the trainer's probabilities on the
ids (``e^logp`` in float32, as TRL's ``.float()``):

    μ_rest = max(1 − Σ_k μ_k, 1e-12),   π_rest = max(1 − Σ_k π_k, 1e-12)
    topk_tv = ½·(Σ_k |π_k − μ_k| + |π_rest − μ_rest|)
    topk_kl = Σ_k μ_k·(log μ_k − log π_k) + μ_rest·(log μ_rest − log π_rest)

so ``topk_kl`` is ``KL(μ‖π)``, the engine's distribution first; neither is
renormalised over the support. TRL builds the support as ``TopK(μ, K) ∪ {a_t}``: when the
sampled token is not among the engine's top ``K``, it replaces the ``K``-th entry.

Two limits TRL's arithmetic leaves undefined are fixed here: an id the engine gives
probability 0 (``log μ_k = −inf``) adds 0 to ``topk_kl`` (``0·log 0 = 0``, not NaN), and
one it gives mass but the trainer does not (``log π_k = −inf``) makes ``topk_kl = +inf``;
``topk_kl`` is clamped to ``≥ 0`` (float32 rounding leaves it a few ulp below 0 where
the support holds nearly all the mass).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from offpolicy_jax._src.logprobs.topk import check_topk
from offpolicy_jax._src.reduction import Column, MeanParts, Reduction, count, seq_mean, total

__all__ = [
    "TOPK_DIVERGENCES",
    "TOPK_METRICS",
    "TOPK_REST_FLOOR",
    "TopKTerms",
    "topk_divergence",
    "topk_divergences",
]

TOPK_REST_FLOOR = 1e-12
"""The floor of both rest buckets (TRL's ``clamp(min=1e-12)``)."""

TOPK_DIVERGENCES: tuple[str, ...] = ("tv", "kl")
"""The divergences :func:`topk_divergence` computes."""


_MAX_LANES = 8
"""The most partial sums per position of :func:`_sums_over_k` (see :func:`_lanes`)."""


def _lanes(k: int) -> int:
    """How many partial sums :func:`_sums_over_k` takes per position: a divisor of ``K``
    up to :data:`_MAX_LANES`, 8 or 4 where one divides ``K`` (whole vector registers:
    4 for TRL's ``K = 20``), else the largest.

    A divisor, so that ``[..., K]`` is ``[..., K / L, L]`` without a copy (a padded copy
    of the operands costs more than the whole reduction). ``L`` sums of ``K / L`` terms,
    then added pairwise, keep the rounding of the rest buckets ``1 − Σ_k p_k`` (which
    cancel) at the level of XLA's vectorised ``jnp.sum``; ``K`` additions in one chain
    (a prime ``K`` above 8, the one case with ``L = 1``) lose about twice that.
    """
    divisors = [d for d in range(1, min(k, _MAX_LANES) + 1) if k % d == 0]
    return max(divisors, key=lambda d: (d % 4 == 0, d), default=1)


def _pairwise(parts: list[jax.Array]) -> jax.Array:
    """``parts`` added as a balanced tree: ``(p0 + p1) + (p2 + p3) + …``."""
    while len(parts) > 1:
        pairs = [parts[i] + parts[i + 1] for i in range(0, len(parts) - 1, 2)]
        parts = pairs + parts[len(parts) - len(parts) % 2 :]
    return parts[0]


@jax.custom_jvp
def _sums_over_k(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """``jnp.sum(x, axis=-1)`` of each of ``xs`` in one variadic reduction, one pass over
    the ``[..., T, K]`` operands: XLA fuses the exponentials that make them into it, so
    none is written to memory (separate sums each materialise their shared operands).

    Each row is reduced as ``[K / L, L]`` over its major axis (``L`` = :func:`_lanes`),
    ``L`` strided partial sums side by side, then the ``L`` partials pairwise: the
    reduction of a minor axis of ``K`` (or ``L``) runs element by element on XLA:CPU,
    exponentials included, while this one runs ``L`` lanes at a time and leaves nothing
    ``[..., T, L]`` to reduce again.
    """
    k = xs[0].shape[-1]
    lanes = _lanes(k)
    shape = xs[0].shape[:-1] + (k // lanes, lanes)
    partial = jax.lax.reduce(
        tuple(x.reshape(shape) for x in xs),
        tuple(jnp.zeros((), x.dtype) for x in xs),
        lambda a, b: tuple(u + v for u, v in zip(a, b, strict=True)),
        (xs[0].ndim - 1,),
    )
    return tuple(_pairwise([p[..., i] for i in range(lanes)]) for p in partial)


@_sums_over_k.defjvp
def _sums_over_k_jvp(primals, tangents):
    # A sum is linear; JAX's generic variadic reduce has no differentiation rule.
    return _sums_over_k(*primals), tuple(jnp.sum(t, axis=-1) for t in tangents)


def topk_divergence(
    logp: ArrayLike,
    rollout_logp: ArrayLike,
    valid: ArrayLike | None = None,
    *,
    divergence: str,
) -> jax.Array:
    """DPPO's top-k total variation or KL per position (the module docstring's formulas).

    Args:
      logp: ``[..., T, K]`` the trainer's log-probs on the engine's top-k ids.
      rollout_logp: ``[..., T, K]`` the engine's log-probs on the same ids.
      valid: ``[..., T]`` bool, or None (every position). Elsewhere the result is 0 and
        the inputs are never read (NaN there reaches neither the value nor a gradient).
      divergence: ``"tv"`` (``topk_tv``) or ``"kl"`` (``topk_kl``).

    Returns:
      ``[..., T]`` float32, ``≥ 0`` (``topk_tv ≤ 1``; ``topk_kl`` may be ``+inf``).

    Raises:
      ValueError: an unknown ``divergence``; shapes that differ, or of rank < 2.
    """
    if divergence not in TOPK_DIVERGENCES:
        raise ValueError(f"divergence must be 'tv' or 'kl', got {divergence!r}")
    tv, kl = topk_divergences(logp, rollout_logp, valid)
    return tv if divergence == "tv" else kl


def topk_divergences(
    logp: ArrayLike, rollout_logp: ArrayLike, valid: ArrayLike | None = None
) -> tuple[jax.Array, jax.Array]:
    """``(topk_tv, topk_kl)`` per position in one pass over the ``[..., T, K]`` inputs
    (both share the exponentials); arguments as :func:`topk_divergence`."""
    logp = jnp.asarray(logp, jnp.float32)
    rollout_logp = jnp.asarray(rollout_logp, jnp.float32)
    if logp.shape != rollout_logp.shape or logp.ndim < 2:
        raise ValueError(
            f"topk_divergence: logp {logp.shape} and rollout_logp {rollout_logp.shape} must "
            "have the same shape [..., T, K]"
        )
    keep = jnp.ones(logp.shape[:-1], bool) if valid is None else jnp.asarray(valid, bool)
    if keep.shape != logp.shape[:-1]:
        raise ValueError(f"valid has shape {keep.shape}; expected [..., T] = {logp.shape[:-1]}")
    # Equal stand-ins elsewhere: a divergence of exactly 0, with finite gradients.
    logp = jnp.where(keep[..., None], logp, 0.0)
    rollout_logp = jnp.where(keep[..., None], rollout_logp, 0.0)
    pi, mu = jnp.exp(logp), jnp.exp(rollout_logp)
    # μ_k = 0 contributes 0 (its −inf log would make 0·inf = NaN).
    present = mu > 0
    terms = jnp.where(present, mu * (jnp.where(present, rollout_logp, 0.0) - logp), 0.0)
    sum_pi, sum_mu, sum_abs, sum_kl = _sums_over_k(pi, mu, jnp.abs(pi - mu), terms)
    pi_rest = jnp.maximum(1.0 - sum_pi, TOPK_REST_FLOOR)
    mu_rest = jnp.maximum(1.0 - sum_mu, TOPK_REST_FLOOR)
    tv = 0.5 * (sum_abs + jnp.abs(pi_rest - mu_rest))
    kl = sum_kl + mu_rest * (jnp.log(mu_rest) - jnp.log(pi_rest))
    # Float32 rounding of supports whose mass sums to ~1 can leave it a few ulp below 0;
    # a KL never is (the trust region compares it with δ > 0 alike).
    kl = jnp.maximum(kl, 0.0)
    return jnp.where(keep, tv, 0.0), jnp.where(keep, kl, 0.0)


class TopKTerms(NamedTuple):
    """A call's ``topk=`` checked, as a surrogate sees it (``SurrogateInput.topk``).

    Attributes:
      logp: ``[..., T, K]`` float32 stop-gradient, the trainer's log-probs of the ids.
      rollout_logp: ``[..., T, K]`` float32 stop-gradient, the engine's.
      tv: ``[..., T]`` ``topk_tv`` of the two, 0 where not valid.
      kl: ``[..., T]`` ``topk_kl``, 0 where not valid.
    """

    logp: jax.Array
    rollout_logp: jax.Array
    tv: jax.Array
    kl: jax.Array

    @property
    def k(self) -> int:
        """``K``, the ids per position."""
        return self.logp.shape[-1]


def topk_terms(topk, shape: tuple[int, ...], valid: jax.Array) -> TopKTerms:
    """:class:`TopKTerms` of a :class:`~offpolicy_jax.TopKLogprobs` checked against the
    ``[..., T]`` ``shape`` of the sampled tokens (errors name ``topk``)."""
    logp, rollout = check_topk(topk, shape)
    tv, kl = topk_divergences(logp, rollout, valid)
    return TopKTerms(logp, rollout, tv, kl)


# --------------------------------------------------------------------------- metrics

TOPK_METRICS: tuple[str, ...] = ("mis_topk_tv", "mis_topk_kl")
"""The mismatch metrics of a call given ``topk=``: the token means of ``topk_tv`` and
``topk_kl`` of the trainer's top-k log-probs from the engine's."""

TOPK_COUNT = "mis_topk_count"
"""The per-sequence column counting the tokens both metrics average over (internal)."""


def topk_mismatch_columns(topk: TopKTerms, mask: jax.Array) -> dict[str, Column]:
    """The per-token columns of :data:`TOPK_METRICS` over the valid tokens (``mask > 0``)
    whose divergences are finite."""
    finite = (mask > 0) & jnp.isfinite(topk.tv) & jnp.isfinite(topk.kl)
    population = jnp.where(finite, mask, 0.0)
    return {
        "mis_topk_tv": total(jnp.where(finite, topk.tv, 0.0), population),
        "mis_topk_kl": total(jnp.where(finite, topk.kl, 0.0), population),
        TOPK_COUNT: count(population),
    }


def topk_mismatch_means(sums, ok: jax.Array, reduction: Reduction) -> dict[str, MeanParts]:
    """The :data:`TOPK_METRICS` parts from the per-sequence sums of
    :func:`topk_mismatch_columns`, over the sequences ``ok`` keeps."""
    counts = jnp.where(ok, sums[TOPK_COUNT], 0.0)
    return {k: seq_mean(jnp.where(ok, sums[k], 0.0), counts, reduction) for k in TOPK_METRICS}
