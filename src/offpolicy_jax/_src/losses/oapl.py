"""OAPL: off-policy training without importance sampling, as one registered surrogate.

Optimal Advantage-based Policy Optimization with Lagged Inference policy (Ritter et al.,
2026, "LLMs Can Learn to Reason Via Off-Policy RL", arXiv:2602.19362). OAPL does not
correct the lag between the trainer and the policy that sampled the data: it regresses
the sequence log-ratio onto the optimal advantage of the KL-regularised problem whose
reference is the sampling policy, so the minimiser does not depend on how stale that
policy is (the paper trains with more than 400 steps of lag). For a prompt ``x`` with a
group of ``G`` completions ``y_i`` and rewards ``r_i``:

* ``V̂*(x) = β₁·ln((1/G)·Σ_i exp(r_i/β₁))`` (paper Eq. 2; :func:`oapl_advantages`),
* ``Â*_i = r_i − V̂*(x)``,
* ``L = mean_i (β₂·ln(π_θ(y_i|x)/π_d(y_i|x)) − Â*_i)²`` (paper Eq. 3; surrogate
  ``oapl``), with ``ln(π_θ/π_d)(y_i|x) = Σ_t (log π_θ − log π_d)`` over the kept tokens.

The regression has no ratio, no clip and no IS weight. The authors' code
(``verl/trainer/oapl/core_algos.py``, ``compute_policy_loss``) takes ``π_d`` from a
trainer pass over the lagged policy (here ``algorithm="ppo"``: ``π_d = π_old``);
NeMo-RL's ``OAPLLossFn`` takes the inference engine's log-probs (``algorithm=
"bypass_ppo"``: ``π_d = π_rollout``). Both average the squared residual once per
sequence: ``aggregation="sequence_mean"`` (``token_mean`` weights each sequence by its
length instead). Hyperparameters keep the paper's and NeMo-RL's names: ``beta1``
(``V̂*``'s temperature, paper and NeMo-RL default 1) and ``beta2`` (the log-ratio scale,
default 1e-3).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from offpolicy_jax._src import reduction as _reduce
from offpolicy_jax._src.checks import check_f32_coefficient, check_number, check_positive
from offpolicy_jax._src.losses.registry import SurrogateInput, SurrogateTerms, register_surrogate

__all__ = ["OAPLRegression", "oapl", "oapl_advantages", "oapl_sequence_loss"]

OAPL_BETA1 = 1.0
"""The paper's (and NeMo-RL's) ``β₁``, the temperature of ``V̂*``."""

OAPL_BETA2 = 1e-3
"""The paper's (and NeMo-RL's) ``β₂``, the scale of the sequence log-ratio."""


def _coefficient(owner: str, key: str, value) -> float:
    """A finite float ``> 0`` that float32 represents, or ValueError naming ``owner.key``."""
    number = check_number(owner, key, value, optional=False)
    check_positive(owner, key, number)
    check_f32_coefficient(owner, key, number)
    assert number is not None
    return number


@dataclasses.dataclass(frozen=True)
class OAPLRegression:
    """OAPL's regression scale ``β₂`` (``LossConfig.beta2``; the paper's and NeMo-RL's
    ``beta2``, default 1e-3): ``β₂·ln(π_θ/π_d)`` is regressed onto ``Â*``."""

    beta2: float = OAPL_BETA2

    def __post_init__(self):
        object.__setattr__(self, "beta2", _coefficient("LossConfig", "beta2", self.beta2))


def oapl_sequence_loss(
    sequence_log_ratio: jax.Array, advantage: jax.Array, *, beta2: float
) -> tuple[jax.Array, jax.Array]:
    """OAPL's squared residual per sequence (paper Eq. 3).

    Args:
      sequence_log_ratio: ``[...]`` ``S_i = Σ_t (log π_θ − log π_d)`` over the
        sequence's kept tokens, differentiable w.r.t. ``log π_θ``.
      advantage: ``[...]`` ``Â*_i``; stop-gradient.
      beta2: ``β₂ > 0``.

    Returns:
      ``(L_i, residual_i)`` with ``residual_i = β₂·S_i − Â*_i`` and ``L_i = residual_i²``.
      ``∂L_i/∂ log π_θ(t) = 2·β₂·residual_i`` on every kept token of the sequence.
    """
    residual = beta2 * sequence_log_ratio - jax.lax.stop_gradient(advantage)
    return jnp.square(residual), residual


@register_surrogate("oapl", params=OAPLRegression, applies_weights=True)
def oapl(x: SurrogateInput, p: OAPLRegression) -> SurrogateTerms:
    """OAPL's regression (:func:`oapl_sequence_loss`): every kept token carries its
    sequence's ``L_i``, so ``aggregation="sequence_mean"`` is the paper's
    ``mean_i L_i``. ``Â*_i`` is the mean of ``A`` over the sequence's kept tokens (an
    estimator such as :func:`oapl_advantages` broadcasts one value per sequence). The
    IS weights are not applied (OAPL has none); a correction's rejection still drops
    tokens from ``S_i``. Metrics: ``oapl_residual`` (``β₂·S_i − Â*_i``) and
    ``oapl_log_ratio`` (``S_i``), averaged like ``pg_clipfrac``."""
    sums = x.layout.reduce(
        {
            "x": _reduce.total(x.log_ratio, x.mask),
            "adv": _reduce.total(x.advantages, x.mask),
            "n": _reduce.count(x.mask),
        }
    )
    advantage = sums["adv"] / jnp.maximum(sums["n"], 1.0)
    per_seq, residual = oapl_sequence_loss(sums["x"], advantage, beta2=p.beta2)
    shape = x.logp.shape
    loss = jnp.broadcast_to(x.layout.broadcast(per_seq), shape)
    metrics = {
        "oapl_residual": _reduce.total(
            jax.lax.stop_gradient(jnp.broadcast_to(x.layout.broadcast(residual), shape)), x.mask
        ),
        "oapl_log_ratio": _reduce.total(
            jax.lax.stop_gradient(jnp.broadcast_to(x.layout.broadcast(sums["x"]), shape)), x.mask
        ),
    }
    return SurrogateTerms(loss, metrics=metrics)


def oapl_advantages(
    rewards: jax.typing.ArrayLike,
    *,
    beta1: float = OAPL_BETA1,
    where: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    """OAPL's optimal advantages ``Â*_i = r_i − V̂*(x)`` of one prompt's group (paper Eq. 2).

    ``V̂*(x) = β₁·ln((1/G)·Σ_i exp(r_i/β₁))`` over the group's counted completions (the
    last axis), computed about the group's largest ``r/β₁`` so that large ``r/β₁`` stay finite.
    ``β₁ → 0`` gives ``max_i r_i``, ``β₁ → ∞`` the mean reward. Pass the result as the
    advantages of the ``oapl`` surrogate, broadcast over each completion's tokens.

    Args:
      rewards: ``[..., G]`` sequence rewards ``r_i``, one group per leading index.
      beta1: ``β₁ > 0`` (the paper's and NeMo-RL's ``beta1``, default 1).
      where: optional ``[..., G]`` bool: the completions that count (ragged groups).

    Returns:
      ``[..., G]`` float32 ``Â*``, 0 where a completion does not count; no gradient.

    Examples:
      >>> import jax.numpy as jnp, offpolicy_jax as opj
      >>> a = opj.oapl_advantages(jnp.array([1.0, 0.0, 0.0, 1.0]))
      >>> round(float(a[0]), 4)  # 1 − ln((2e + 2)/4)
      0.3799
    """
    beta1 = _coefficient("oapl_advantages", "beta1", beta1)
    r = jax.lax.stop_gradient(jnp.asarray(rewards, jnp.float32))
    counted = (
        jnp.ones(r.shape, bool)
        if where is None
        else jnp.broadcast_to(jnp.asarray(where, bool), r.shape)
    )
    counted = counted & jnp.isfinite(r)
    z = jnp.where(counted, r / beta1, -jnp.inf)
    shift = jnp.max(z, axis=-1, keepdims=True)
    shift = jnp.where(jnp.isfinite(shift), shift, 0.0)
    # ln mean exp(z) = shift + ln(1 + mean(expm1(z − shift))): the mean of expm1 keeps
    # the small differences a large β₁ leaves (exp rounds them to 1, V̂* to the max).
    excess = jnp.sum(jnp.where(counted, jnp.expm1(z - shift), 0.0), axis=-1, keepdims=True)
    n = jnp.maximum(jnp.sum(counted, axis=-1, keepdims=True), 1)
    log_mean = shift + jnp.log1p(excess / n)
    return jnp.where(counted, r - beta1 * log_mean, 0.0)
