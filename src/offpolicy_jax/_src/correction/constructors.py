"""The correction's rules as public values: small frozen stages with keyword-only hyperparameters.

Each function here validates its hyperparameters (a bad one raises ``ValueError`` naming
the argument) and returns a :class:`~offpolicy_jax._src.correction.stages.Stage` (or, for
:func:`batch_normalize`, a marker the chain reads). :func:`offpolicy_jax.correct` and
:func:`offpolicy_jax.rules.chain` run them in the order given; a
:class:`~offpolicy_jax.CorrectionConfig` builds exactly these values
(:func:`offpolicy_jax._src.correction.compute.correction_stages`). Formulas:
docs/semantics.md §2-§4 and §8.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping

import jax
import numpy as np

from offpolicy_jax._src.config.rejection import RejectionSamplingConfig
from offpolicy_jax._src.correction import criteria, metrics, rejection, rules
from offpolicy_jax._src.correction.bounds import TISWeights
from offpolicy_jax._src.correction.stages import Decision, Stage, Tokens
from offpolicy_jax._src.messages import shown

LEVELS: tuple[str, ...] = ("token", "sequence", "geometric", "minpro")
MODES: tuple[str, ...] = ("truncate", "clip", "mask", "band", "none")
REDUCTIONS: tuple[str, ...] = ("token", "sequence")


def _choice(owner: str, key: str, value: object, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{owner}: {key} must be one of {list(allowed)}, got {shown(value)}")
    return value


def _positive(owner: str, key: str, value: object) -> float:
    """``value`` as a float if it is a finite real number > 0, else ``ValueError``."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    number = float(value) if ok else math.nan  # type: ignore[arg-type]
    if not (math.isfinite(number) and number > 0 and np.isfinite(np.float32(number))):
        raise ValueError(f"{owner}: {key} must be a finite number > 0, got {shown(value)}")
    return number


def _resolved_lower(owner: str, lower: object, upper: float) -> float:
    """``lower``, or ``1 / upper`` when None (the configs' convention)."""
    return 1.0 / upper if lower is None else _positive(owner, "lower", lower)


def importance_weights(
    *,
    level: str = "token",
    mode: str = "truncate",
    lower: float | None = None,
    upper: float = 2.0,
) -> TISWeights:
    """The truncated / clipped / masked importance weight ``w = ρ`` at one level.

    ``ρ = exp(clip(λ, −20, 20))`` with ``λ`` the log-ratio ``δ = log π_old − log π_rollout``
    at ``level`` (token: ``δ_t``; sequence: ``Σ δ m``; geometric: ``Σ δ m / N``; minpro:
    ``δ_t + min_{s<t} δ_s``), bounded by ``mode``: ``"truncate"`` ``min(ρ, U)`` (Ionides,
    2008; Yao et al., 2025), ``"clip"`` ``clip(ρ, L, U)``, ``"mask"`` (tokens or sequences
    with ``ρ ∉ [L, U]`` are rejected), ``"band"`` (IcePop: weight 0 outside ``[L, U]``, the
    token stays in the mask) or ``"none"`` (``w = 1``). docs/semantics.md §3.2.

    Args:
      level: ``"token"``, ``"sequence"``, ``"geometric"`` or ``"minpro"``.
      mode: ``"truncate"``, ``"clip"``, ``"mask"``, ``"band"`` or ``"none"``.
      lower: ``L > 0``; None means ``1 / upper``. Unused by ``truncate`` and ``none``.
      upper: ``U > 0``.

    Returns:
      The weighting stage (a frozen, hashable value). Metrics:
      ``mis_tis_weight_before_bound``, ``mis_tis_weight_after_bound`` and the mode's
      fractions (``mis_tis_truncate_fraction``, ``mis_tis_<mode>_fraction_low/high``).

    Raises:
      ValueError: naming ``level``, ``mode``, ``lower`` or ``upper``.
    """
    owner = "importance_weights"
    level = _choice(owner, "level", level, LEVELS)
    mode = _choice(owner, "mode", mode, MODES)
    upper = _positive(owner, "upper", upper)
    low = _resolved_lower(owner, lower, upper)
    if mode in ("clip", "mask") and not np.float32(low) < np.float32(upper):
        raise ValueError(
            f"{owner}: lower must be < upper for mode={mode!r}, got lower = {shown(low)} "
            f">= upper = {shown(upper)}"
        )
    if mode == "band" and low > upper:
        raise ValueError(
            f"{owner}: lower must be <= upper for mode='band', got lower = {shown(low)} > "
            f"upper = {shown(upper)}"
        )
    return TISWeights(level, mode, low, upper)


@dataclasses.dataclass(frozen=True)
class RejectionSampling(Stage):
    """Rejection sampling: keep iff ``lower ≤ ρ ≤ upper`` at ``level`` (docs/semantics.md §3.3).

    Built by :func:`rejection_sampling`. A per-token level tests each token, the others
    whole sequences. Metrics: ``mis_rs_mask_fraction_low`` / ``_high``.
    """

    level: str
    lower: float
    upper: float

    def _bounded(self) -> Stage:
        return rejection.rejection_sampling(self.level, self.lower, self.upper)

    def columns(self, t: Tokens):
        return self._bounded().columns(t)

    def decide(self, t: Tokens, sums: Mapping[str, jax.Array]) -> Decision:
        return self._bounded().decide(t, sums)


def rejection_sampling(
    *, level: str = "token", lower: float | None = None, upper: float = 2.0
) -> RejectionSampling:
    """Rejects the tokens (or sequences) whose ratio ``ρ`` at ``level`` leaves ``[lower, upper]``.

    ``ρ`` as in :func:`importance_weights` (Liu et al., "When Speed Kills Stability",
    2025). Only the mask shrinks; the weights are left to the weighting rule.

    Args:
      level: ``"token"``, ``"sequence"``, ``"geometric"`` or ``"minpro"``.
      lower: ``L > 0``; None means ``1 / upper``.
      upper: ``U > 0`` with ``L < U``.

    Returns:
      The rejection stage (metrics ``mis_rs_mask_fraction_low`` / ``_high``).

    Raises:
      ValueError: naming ``level``, ``lower`` or ``upper``.
    """
    owner = "rejection_sampling"
    level = _choice(owner, "level", level, LEVELS)
    upper = _positive(owner, "upper", upper)
    low = _resolved_lower(owner, lower, upper)
    if not np.float32(low) < np.float32(upper):
        raise ValueError(
            f"{owner}: lower must be < upper, got lower = {shown(low)} >= upper = {shown(upper)}"
        )
    return RejectionSampling(level, low, upper)


def veto(*, threshold: float) -> rejection.Veto:
    """The catastrophic-token veto: reject a sequence holding a valid token with ``ρ_t < threshold``.

    Tested on the raw, unclamped ``δ_t < log(threshold)`` (docs/semantics.md §3.4).

    Args:
      threshold: the token ratio below which a whole sequence is rejected, ``> 0``.

    Returns:
      The veto stage (metrics ``mis_rs_catastrophic_token_fraction`` /
      ``mis_rs_catastrophic_seq_fraction``).

    Raises:
      ValueError: naming ``threshold``.
    """
    return rejection.Veto(_positive("veto", "threshold", threshold))


def criterion(name: str, *, threshold: float | str | None = None) -> Stage:
    """A rejection criterion by name: verl's ``rollout_rs`` options or a registered rule.

    verl's KL names (``token_k1`` ... ``seq_max_k3``, docs/semantics.md §8): per token
    ``k1 = −λ``, ``k2 = ½λ²``, ``k3 = e^λ − 1 − λ`` (``λ = clip(δ, −20, 20)``), tested per
    token or on the per-sequence sum, mean or max; ``"binary_kl"`` (KPop, verl's
    ``rollout_rs: binary_kl``): keep a token iff ``max(D_B(o‖b), D_B(b‖o)) ≤ φ``, the
    binary KL of the sampled token's probability under π_old and π_rollout; or a name
    registered with :func:`offpolicy_jax.rules.register_rule`.

    Args:
      name: the criterion, e.g. ``"seq_max_k2"`` or ``"binary_kl"``.
      threshold: ``hi`` (k2 / k3: ``stat ≤ hi``; k1: the ratio in ``[1/hi, hi]``;
        binary_kl: ``φ > 0``), or verl's ``"lo_hi"`` string for k1; a registered rule's
        own threshold. None only for ``binary_kl``, whose default is verl's φ = 2.0.

    Returns:
      The rule's stage; ``criterion(n, threshold=t)`` equals the stage of a
      :class:`~offpolicy_jax.CorrectionConfig` with ``rs_criteria=("n:t",)``.

    Raises:
      ValueError: an unknown ``name``, a missing or malformed ``threshold`` (the message
        names it).
    """
    if threshold is None:
        if name != criteria.BINARY_KL:
            raise ValueError(
                f"criterion: threshold is required for {shown(name)} (only 'binary_kl' has "
                f"a default, {criteria.BINARY_KL_DEFAULT_THRESHOLD!r})"
            )
        threshold = criteria.BINARY_KL_DEFAULT_THRESHOLD
    parsed = criteria.parse_spec(f"{name}:{threshold}", "criterion")
    if parsed.aggregate == "rule":
        return criteria.RULES[parsed.name](parsed.hi)  # type: ignore[return-value]
    return rules.KLCriterion(parsed)


def seq_logprob_error(*, threshold: float) -> rules.SeqLogprobError:
    """NeMo-RL's sequence log-prob error: drop a sequence iff ``Σ_t exp(|δ_t|) m_t / N > threshold``.

    Args:
      threshold: ``≥ 1`` (``exp|δ| ≥ 1``, so a smaller one rejects every sequence).

    Returns:
      The rule's stage (metrics ``mis_seq_logprob_error_*``).

    Raises:
      ValueError: naming ``threshold``.
    """
    value = _positive("seq_logprob_error", "threshold", threshold)
    if value < 1.0:
        raise ValueError(f"seq_logprob_error: threshold must be >= 1, got {shown(threshold)}")
    return rules.SeqLogprobError(value)


def m2po(*, tau: float) -> rules.M2PO:
    """M2PO's second-moment budget: keep the tokens with ``δ² ≤ c``, ``c`` the largest cut-off
    with ``mean{δ² ≤ c} ≤ τ`` over the batch.

    Zheng et al. (2025), "Prosperity before Collapse", arXiv:2510.01161.

    Args:
      tau: the budget ``τ > 0``.

    Returns:
      The rule's stage (metrics ``mis_m2po_*``).

    Raises:
      ValueError: naming ``tau``.
    """
    return rules.M2PO(_positive("m2po", "tau", tau))


class MetricGroup(Stage):
    """A stage that only reports metrics: it keeps every token and weights none.

    Subclass it for a metric of your own (docs/guide/adding_a_metric.md): ``columns``
    (optional) and ``decide`` returning a :class:`~offpolicy_jax.rules.Decision` with
    ``metrics`` only. A chain of metric groups alone leaves the weights at 1 and the mask
    as it is (metrics only), as ``CorrectionConfig(use_tis=False)`` does.
    """


_BUILTIN_METRIC_GROUPS = (metrics.MismatchMetrics, rules.ProbabilityMetrics, rules.MinPROMetrics)


def is_metric_group(stage: object) -> bool:
    """Whether ``stage`` only reports metrics (:class:`MetricGroup` or a built-in group)."""
    return isinstance(stage, (MetricGroup, *_BUILTIN_METRIC_GROUPS))


def mismatch_metrics() -> metrics.MismatchMetrics:
    """The eleven training–rollout mismatch metrics (docs/semantics.md §4).

    Log-perplexities and perplexities of both engines, ``mis_kl``, ``mis_k3_kl``, the
    log-perplexity difference (and its absolute value), the perplexity ratio and the
    token and sequence χ². Every ``CorrectionConfig`` reports them.

    Returns:
      The metric group's stage.
    """
    return metrics.MismatchMetrics()


def probability_metrics() -> rules.ProbabilityMetrics:
    """NeMo-RL's probability-space metrics ``mis_token_mult_prob_error`` (``exp|δ|``) and
    ``mis_js_divergence`` over the valid tokens (docs/semantics.md §8).

    Returns:
      The metric group's stage.
    """
    return rules.ProbabilityMetrics()


def minpro_metrics() -> rules.MinPROMetrics:
    """MinPRO's prefix factor ``exp(clip(min_{s<t} δ_s, −20, 20))`` (Lei et al. 2026,
    arXiv:2601.22718): ``mis_minpro_prefix_ratio_mean`` / ``_min`` /
    ``mis_minpro_prefix_fraction_low``.

    Returns:
      The metric group's stage.
    """
    return rules.MinPROMetrics()


@dataclasses.dataclass(frozen=True)
class BatchNormalize:
    """Batch normalisation of the weights, a marker of the chain (built by :func:`batch_normalize`).

    Attributes:
      reduction: how ``μ`` averages (``"token"`` / ``"sequence"``), or None for the
        weighting rule's level's own (token and minpro: per token; else per sequence).
    """

    reduction: str | None = None


def batch_normalize(*, reduction: str | None = None) -> BatchNormalize:
    """Rescales the final weights by ``1 / μ`` so that the mean kept weight is 1.

    ``μ = Σ w m' / Σ m'`` (per token) or the mean over sequences with ``Σ m' > 0`` of
    their masked mean weight (per sequence), over the final mask ``m'`` only; ``μ ≤ 1e-8``
    leaves the weights as they are. docs/semantics.md §3.6; reported as
    ``mis_batch_norm_factor``.

    Args:
      reduction: ``"token"``, ``"sequence"`` or None (the weighting rule's level decides:
        per token at the token and minpro levels, per sequence otherwise).

    Returns:
      A marker for :func:`~offpolicy_jax.rules.chain` / :func:`~offpolicy_jax.correct`.

    Raises:
      ValueError: naming ``reduction``.
    """
    if reduction is not None:
        reduction = _choice("batch_normalize", "reduction", reduction, REDUCTIONS)
    return BatchNormalize(reduction)


def areal_rejection(
    *,
    level: str = "token",
    action: str = "mask",
    metric: str = "ratio",
    agg: str = "mean",
    upper: float = 5.0,
    lower: float | None = None,
) -> rules.AReaLRejection:
    """AReaL's rejection grid: the IS weight ``exp(δ)``, masked or clamped by a statistic.

    With ``δ = log π_old − log π_rollout`` the weight is ``w = exp(δ)`` per token (at
    ``level="sequence"`` with ``metric="ratio"`` the sequence's geometric mean
    ``exp(Σ δ m / N)``); the statistic (``ratio = e^δ``, ``kl_k1 = δ``, ``kl_k2 = ½δ²``,
    ``kl_k3 = e^{−δ} − 1 + δ`` or ``binary_kl``), per token or aggregated per sequence by
    ``agg``, is in bounds iff ``lower ≤ stat ≤ upper``. ``action="mask"`` rejects what is
    out of bounds; ``action="clamp"`` clips ``w`` to ``[lower or 0, upper]``
    (docs/semantics.md §8). It is the chain's weighting rule: use it instead of
    :func:`importance_weights`. ``CorrectionConfig(use_tis=True, tis_mode="none",
    rejection_sampling={...})`` builds this rule from the same keys.

    Args:
      level: ``"token"`` or ``"sequence"``.
      action: ``"mask"`` or ``"clamp"`` (``metric="ratio"`` only).
      metric: ``"ratio"``, ``"kl_k1"``, ``"kl_k2"``, ``"kl_k3"`` or ``"binary_kl"``.
      agg: the per-sequence aggregation at ``level="sequence"``: ``"sum"``, ``"mean"``
        or ``"max"``.
      upper: the statistic's upper bound (``> 1`` for ``ratio``).
      lower: its lower bound, or None (no lower test).

    Returns:
      The weighting stage (a frozen, hashable value). Metrics ``mis_rs_areal_*`` and
      ``mis_tis_weight_before_bound`` / ``mis_tis_weight_after_bound``.

    Raises:
      ValueError: the config's message with ``rules.areal_rejection`` as owner, naming
        the keyword.
    """
    keys = {"level": level, "action": action, "metric": metric, "agg": agg}
    keys |= {"upper": upper, "lower": lower}
    owner, config_owner = "rules.areal_rejection", "CorrectionConfig.rejection_sampling"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            block = RejectionSamplingConfig(**keys)  # type: ignore[arg-type]
        except ValueError as error:
            raise ValueError(str(error).replace(config_owner, owner)) from None
    for warning in caught:
        message = str(warning.message).replace(config_owner, owner)
        warnings.warn(message, warning.category, stacklevel=2)
    return rules.AReaLRejection(block)
