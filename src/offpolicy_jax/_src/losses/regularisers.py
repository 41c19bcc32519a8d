"""Regularisers as values: the per-token terms a loss adds beside its policy term.

:func:`kl_penalty`, :func:`entropy_bonus` and :func:`positive_example_nll` build small
frozen values with keyword-only hyperparameters named, defaulted and validated as the
:class:`~offpolicy_jax.LossConfig` keys of the same names; the loss entries of
:mod:`offpolicy_jax.objectives` take them as ``regularisers=(...)``. Each term joins the
policy term per token, ``ℓ' + c·term``, before the one aggregation over the final mask
``m'`` (docs/semantics.md §5.2), exactly as the config's keys add it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from offpolicy_jax._src.checks import check_bool, check_choice
from offpolicy_jax._src.losses.plan import KL_ESTIMATORS, check_coefficient

__all__ = [
    "EntropyBonus",
    "KLPenalty",
    "PositiveExampleNLL",
    "Regulariser",
    "Regularisers",
    "check_needed",
    "entropy_bonus",
    "kl_penalty",
    "plan_fields",
    "positive_example_nll",
]

_OWNER = "objectives"


class Regulariser:
    """The type of the regulariser values (:class:`KLPenalty`, :class:`EntropyBonus`,
    :class:`PositiveExampleNLL`), whose fields are the loss plan's of the same names.

    Not an extension point: the loss pipeline computes these three terms. A per-token
    term of your own joins the loss through :func:`~offpolicy_jax.policy_loss_terms`
    and :func:`~offpolicy_jax.aggregate` over the same final mask.
    """

    #: the input array the term reads (an argument of the loss entries).
    needs: str = ""
    #: the builder's name, for messages.
    builder: str = ""
    #: the term's coefficient's key.
    coefficient_key: str = ""

    @property
    def coefficient(self) -> float:
        """The term's coefficient (0: only its metric is reported)."""
        return getattr(self, self.coefficient_key)

    def plan_fields(self) -> dict[str, Any]:
        """The :class:`~offpolicy_jax._src.losses.plan.LossPlan` fields this value sets."""
        return dict(vars(self))  # a frozen dataclass's instance holds its fields only


@dataclasses.dataclass(frozen=True)
class KLPenalty(Regulariser):
    """The KL-to-reference term (build it with :func:`kl_penalty`, which validates it).

    Attributes:
      kl_coef: its coefficient ``β >= 0``.
      kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
      kl_off_policy: weight the estimator by ``π_θ / π_d``.
    """

    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_off_policy: bool = False
    needs = "ref_logp"
    builder = "kl_penalty"
    coefficient_key = "kl_coef"

    def __post_init__(self):
        owner = f"{_OWNER}.kl_penalty"
        coef = check_coefficient(owner, "kl_coef", self.kl_coef, nonnegative=True)
        estimator = check_choice(owner, "kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        object.__setattr__(self, "kl_coef", coef)
        object.__setattr__(self, "kl_estimator", estimator)
        object.__setattr__(
            self, "kl_off_policy", check_bool(owner, "kl_off_policy", self.kl_off_policy)
        )


@dataclasses.dataclass(frozen=True)
class EntropyBonus(Regulariser):
    """The entropy bonus ``−c·H`` (build it with :func:`entropy_bonus`).

    Attributes:
      entropy_coef: its coefficient ``c`` (any sign; negative penalises entropy).
    """

    entropy_coef: float = 0.0
    needs = "entropy"
    builder = "entropy_bonus"
    coefficient_key = "entropy_coef"

    def __post_init__(self):
        owner = f"{_OWNER}.entropy_bonus"
        coef = check_coefficient(owner, "entropy_coef", self.entropy_coef, nonnegative=False)
        object.__setattr__(self, "entropy_coef", coef)


@dataclasses.dataclass(frozen=True)
class PositiveExampleNLL(Regulariser):
    """VAPO's NLL on positive examples (build it with :func:`positive_example_nll`).

    Attributes:
      positive_example_nll_weight: its weight ``μ >= 0``.
    """

    positive_example_nll_weight: float = 0.0
    needs = "rewards"
    builder = "positive_example_nll"
    coefficient_key = "positive_example_nll_weight"

    def __post_init__(self):
        owner = f"{_OWNER}.positive_example_nll"
        weight = check_coefficient(
            owner, "positive_example_nll_weight", self.positive_example_nll_weight, nonnegative=True
        )
        object.__setattr__(self, "positive_example_nll_weight", weight)


Regularisers = Sequence[Regulariser] | Regulariser
"""What the loss entries take as ``regularisers=``: a sequence of values, or one."""


def kl_penalty(
    *, kl_coef: float = 0.0, kl_estimator: str = "k3", kl_off_policy: bool = False
) -> KLPenalty:
    """The KL-to-reference term ``β · k(π_θ, π_ref)`` per token (docs/semantics.md §5.2).

    ``k`` estimates ``KL(π_θ ‖ π_ref)`` from the sampled token's log-ratio
    ``δ = log π_ref − log π_θ`` (Schulman, "Approximating KL divergence", 2020):
    ``k1 = −δ``, ``k2 = δ²/2``, ``k3 = e^δ − δ − 1`` (unbiased and low-variance; GRPO's,
    Shao et al. 2024; capped at 10 as verl's ``low_var_kl``). With ``kl_off_policy`` it is weighted by ``π_θ / π_d``, the
    unbiased estimate for tokens sampled from ``π_d`` (DeepSeek-V3.2). The loss then
    needs ``ref_logp=`` ``[..., T]`` (stop-gradient); with ``kl_coef = 0`` (or without
    this value) a given ``ref_logp`` only adds the ``kl_loss`` metric. As
    ``LossConfig(kl_coef=, kl_estimator=, kl_off_policy=)``.

    Args:
      kl_coef: ``β >= 0``.
      kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
      kl_off_policy: weight the estimator by ``π_θ / π_d`` (``π_d`` the ratio denominator).

    Returns:
      A :class:`KLPenalty`.

    Raises:
      ValueError: a bad value (naming ``objectives.kl_penalty.<argument>``).

    Examples:
      >>> import offpolicy_jax as opj
      >>> opj.objectives.kl_penalty(kl_coef=1e-3, kl_estimator="k2")
      KLPenalty(kl_coef=0.001, kl_estimator='k2', kl_off_policy=False)
    """
    return KLPenalty(kl_coef, kl_estimator, kl_off_policy)


def entropy_bonus(*, entropy_coef: float = 0.0) -> EntropyBonus:
    """The entropy bonus ``−c · H`` per token (docs/semantics.md §5.2).

    Mnih et al. (2016), "Asynchronous Methods for Deep Reinforcement Learning". The loss
    then needs ``entropy=`` ``[..., T]``, the per-token entropies ``H`` of π_θ
    (differentiable); with ``entropy_coef = 0`` a given ``entropy`` only adds the
    ``entropy`` metric. As ``LossConfig(entropy_coef=)``.

    Args:
      entropy_coef: ``c`` (a finite number; negative penalises entropy).

    Returns:
      An :class:`EntropyBonus`.

    Raises:
      ValueError: a bad value (naming ``objectives.entropy_bonus.entropy_coef``).

    Examples:
      >>> import jax.numpy as jnp, offpolicy_jax as opj
      >>> lp = jnp.log(jnp.array([[0.5, 0.4]]))
      >>> parts, _ = opj.objectives.ppo(
      ...     lp, lp, jnp.zeros(1), jnp.ones((1, 2), bool), entropy=jnp.array([[1.0, 3.0]]),
      ...     regularisers=[opj.objectives.entropy_bonus(entropy_coef=0.1)])
      >>> round(float(parts.value()), 6)  # the policy term 0 (A = 0) − 0.1 · mean H
      -0.2
    """
    return EntropyBonus(entropy_coef)


def positive_example_nll(*, positive_example_nll_weight: float = 0.0) -> PositiveExampleNLL:
    """VAPO's NLL on positive examples: ``μ · (−log π_θ)`` on the tokens of sequences
    with ``reward > 0``.

    Yue et al. (2025), "VAPO" (NeMo-RL's ``positive_example_nll_weight``). The loss then
    needs ``rewards=``, ``[...]`` per sequence or ``[..., T]`` per token (per token with
    ``segment_ids``); the term is aggregated like the policy term. With
    ``positive_example_nll_weight = 0`` given ``rewards`` only add the ``nll_loss``
    metric. As ``LossConfig(positive_example_nll_weight=)``.

    Args:
      positive_example_nll_weight: ``μ >= 0``.

    Returns:
      A :class:`PositiveExampleNLL`.

    Raises:
      ValueError: a bad value (naming ``objectives.positive_example_nll.<argument>``).
    """
    return PositiveExampleNLL(positive_example_nll_weight)


def plan_fields(owner: str, regularisers: Regularisers) -> dict[str, Any]:
    """The loss plan's regulariser fields of ``regularisers`` (each kind at most once).

    Raises:
      TypeError: an entry that is not a regulariser value (naming ``regularisers[i]``).
      ValueError: a kind given twice.
    """
    if isinstance(regularisers, Regulariser):
        regularisers = (regularisers,)
    fields: dict[str, Any] = {}
    seen: set[type] = set()
    for i, value in enumerate(regularisers):
        if not isinstance(value, Regulariser):
            raise TypeError(
                f"{owner}.regularisers[{i}] must be a regulariser (opj.objectives.kl_penalty, "
                f"entropy_bonus or positive_example_nll), got {type(value).__name__}"
            )
        if type(value) in seen:
            raise ValueError(f"{owner}.regularisers: {value.builder} given more than once")
        seen.add(type(value))
        fields.update(value.plan_fields())
    return fields


def check_needed(regularisers: Regularisers, given: Mapping[str, object]) -> None:
    """``ValueError`` when a regulariser with a non-zero coefficient lacks its input
    (``given``: the loss call's inputs by name)."""
    if isinstance(regularisers, Regulariser):
        regularisers = (regularisers,)
    for value in regularisers:
        if value.coefficient != 0 and given.get(value.needs) is None:
            raise ValueError(
                f"{value.needs} is required: {_OWNER}.{value.builder}("
                f"{value.coefficient_key}={value.coefficient}) adds a term that reads it"
            )
