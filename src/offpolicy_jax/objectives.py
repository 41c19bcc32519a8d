"""Policy losses from core values (``opj.objectives``): a correction, a surrogate, an aggregation.

The composable form of :func:`offpolicy_jax.policy_loss`: the loss entries take the
correction as a chain of rules (:mod:`offpolicy_jax.rules`) or a precomputed
:class:`~offpolicy_jax.CorrectionResult`, the surrogate as a value (:func:`ppo_clip`,
or any registered one by :func:`surrogate`) and the aggregation by name, and return the
same poolable parts as :func:`~offpolicy_jax.policy_loss_parts` with the ``LossConfig``
that names the same pieces::

    loss_parts, metric_parts = opj.objectives.decoupled_ppo(
        logp, old_logp, rollout_logp, advantages, mask,
        correction=opj.rules.from_config(opj.CorrectionConfig.preset("mis")),
        surrogate=opj.objectives.ppo_clip(clip_eps=0.2),
        aggregation="sequence_mean",
    )

The regularisers are values too (:func:`kl_penalty`, :func:`entropy_bonus`,
:func:`positive_example_nll`, passed as ``regularisers=(...)`` with the arrays they read),
and every other ``LossConfig`` setting is a keyword of the same name (``opsm_delta``,
``prox_logp_method``, ``get_mismatch_metrics``); :func:`reinforce_is` is the fourth
algorithm.

A surrogate of your own is registered with :func:`offpolicy_jax.register_surrogate`
(docs/guide/adding_a_loss.md) and is then a value like the built-ins.
"""

from offpolicy_jax._src.losses.entries import bypass_ppo, decoupled_ppo, ppo, reinforce_is
from offpolicy_jax._src.losses.regularisers import (
    EntropyBonus,
    KLPenalty,
    PositiveExampleNLL,
    Regulariser,
    entropy_bonus,
    kl_penalty,
    positive_example_nll,
)
from offpolicy_jax._src.losses.surrogate_values import SurrogateSpec, ppo_clip, surrogate

__all__ = [
    "EntropyBonus",
    "KLPenalty",
    "PositiveExampleNLL",
    "Regulariser",
    "SurrogateSpec",
    "bypass_ppo",
    "decoupled_ppo",
    "entropy_bonus",
    "kl_penalty",
    "positive_example_nll",
    "ppo",
    "ppo_clip",
    "reinforce_is",
    "surrogate",
]
