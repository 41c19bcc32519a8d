"""The field's rejection rules as pipeline stages (docs/semantics.md §8).

Each rule is a :class:`~offpolicy_jax._src.correction.stages.Stage` that tests the valid tokens on its
own (its keep mask is ANDed into ``m'`` by the pipeline) and reports, with prefix ``P``:

* ``P_mean``: its statistic over the valid tokens (a per-sequence statistic broadcast
  to its tokens), with the call's reduction;
* ``P_max`` / ``P_min``: the batch extremes of the statistic (over valid tokens, or over
  non-empty sequences for a per-sequence statistic), as
  :class:`~offpolicy_jax._src.correction.stages.Extreme` parts: pooled micro-batches (``+``) report the
  extreme of their extremes;
* ``P_fraction_low`` (two-sided bounds only) / ``P_fraction_high``: the share of valid
  tokens below / above the bound;
* ``P_seq_fraction``: the share of sequences the rule rejects tokens of.

Stages: :class:`KLCriterion` (verl ``rollout_rs``, ``P = mis_rs_<criterion>``),
:class:`SeqLogprobError` (NeMo-RL, ``P = mis_seq_logprob_error``), :class:`M2PO`
(``P = mis_m2po``), :class:`AReaLRejection` (AReaL's mask / clamp grid, a weighting
stage, ``P = mis_rs_areal``), :class:`MinPROMetrics` (the ``minpro`` level's prefix
factor) and :class:`ProbabilityMetrics` (``mis_token_mult_prob_error``,
``mis_js_divergence``). Per-sequence quantities go through ``t.layout`` only, so packed
layouts work unchanged. Formulas: :mod:`offpolicy_jax._src.correction.criteria`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from offpolicy_jax._src import reduction as _reduce
from offpolicy_jax._src.config.rejection import RejectionSamplingConfig
from offpolicy_jax._src.correction import criteria, ratios
from offpolicy_jax._src.correction.binary_kl import bidirectional_binary_kl
from offpolicy_jax._src.correction.criteria import Criterion
from offpolicy_jax._src.correction.ratios import METRIC_LOG_CAP
from offpolicy_jax._src.correction.stages import (
    Decision,
    Mean,
    Stage,
    batch_extreme,
    prefix_min_delta,
)

RuleFactory = Callable[[float], Stage]


def _indicator(x: jax.Array) -> jax.Array:
    return jnp.where(x, 1.0, 0.0)


def _batch_axes(layout) -> tuple[str, ...]:
    return tuple(getattr(getattr(layout, "axes", None), "batch", ()) or ())


def _all_axes(t) -> tuple[str, ...]:
    axes = getattr(t.layout, "axes", None)
    if axes is None:
        return ()
    return tuple(axes.batch) + tuple(axes.token)


@dataclasses.dataclass(frozen=True)
class KLCriterion(Stage):
    """verl's KL-estimator rejection criterion (``rollout_rs``), e.g. ``seq_max_k2 ≤ 2.5``.

    Per token ``k1 = −λ``, ``k2 = ½λ²``, ``k3 = e^λ − 1 − λ`` (``λ = clip(δ, −S, S)``),
    tested per token or as the per-sequence sum, mean or max; keep iff
    ``lower ≤ stat ≤ upper`` (k1: ``[log lo, log hi]``; k2/k3: ``stat ≤ hi``). KPop's
    ``binary_kl`` (verl PR 6800) is a per-token one: ``stat = max(D_B(o‖b), D_B(b‖o))``
    (never negative), kept iff ``stat ≤ φ``.
    """

    criterion: Criterion

    @property
    def prefix(self) -> str:
        return f"mis_rs_{self.criterion.name}"

    def _stat(self, t) -> jax.Array:
        if self.criterion.estimator == criteria.BINARY_KL:
            # KPop: a decision, never differentiated (o may be sg(θ), garbage off the mask).
            stat = bidirectional_binary_kl(t.old, t.rollout)
            return jax.lax.stop_gradient(stat)
        return criteria.kl_statistic(t.delta, self.criterion.estimator)

    def _outside(self, value):
        c = self.criterion
        low = value < c.lower if c.lower is not None else None
        high = value > c.upper
        return low, high

    def columns(self, t):
        stat, c = self._stat(t), self.criterion
        if c.aggregate == "token":
            # Everything the metrics need, in pass 1: the counts and the sum over the
            # valid tokens are those pass 2 would take (pass 1's sums are restricted to
            # the finite sequences), so this stage adds no column to pass 2.
            low, high = self._outside(stat)
            columns = {
                "high": _reduce.count_where(high, t.population),
                "sum": _reduce.total(stat, t.population),
                "max": _reduce.maximum(stat, t.population),
                "min": _reduce.minimum(stat, t.population),
            }
            if low is not None:
                columns["low"] = _reduce.count_where(low, t.population)
            return columns
        if c.aggregate == "seq_max":
            return {"agg": _reduce.maximum(stat, t.population)}
        return {"agg": _reduce.total(stat, t.population)}

    def decide(self, t, sums):
        c, count = self.criterion, sums["count"]
        if c.aggregate == "token":
            return self._decide_tokens(t, sums)
        agg = sums["agg"]
        if c.aggregate == "seq_mean":
            agg = _reduce.safe_divide(agg, count)
        # An empty sequence has statistic 0 (verl's convention); it has no token to drop.
        value = jnp.where(count > 0, agg, 0.0)
        low, high = self._outside(value)
        keep = ~high if low is None else ~(low | high)
        p = self.prefix
        metrics = {
            f"{p}_mean": Mean(value, per_seq=True),
            f"{p}_max": batch_extreme(t.layout, value, count, "max"),
            f"{p}_min": batch_extreme(t.layout, value, count, "min"),
            f"{p}_fraction_high": Mean(_indicator(high), per_seq=True),
            f"{p}_seq_fraction": Mean(_indicator(~keep), per_seq=True),
        }
        if low is not None:
            metrics[f"{p}_fraction_low"] = Mean(_indicator(low), per_seq=True)
        return Decision(keep=keep, per_seq=True, metrics=metrics)

    def _decide_tokens(self, t, sums):
        """A per-token criterion: the keep mask from the statistic, the metrics from
        pass 1's sums (token means over the valid tokens, as pass 2 would take them)."""
        count, p, how = sums["count"], self.prefix, t.reduction
        low, high = self._outside(self._stat(t))
        keep = ~high if low is None else ~(low | high)
        # Below and above are disjoint (lower <= upper): a sequence loses a token iff
        # their counts add up to more than 0.
        out = sums["high"] if low is None else sums["high"] + sums["low"]
        metrics = {
            f"{p}_mean": _reduce.seq_mean(sums["sum"], count, how),
            f"{p}_max": batch_extreme(t.layout, sums["max"], count, "max"),
            f"{p}_min": batch_extreme(t.layout, sums["min"], count, "min"),
            f"{p}_fraction_high": _reduce.seq_mean(sums["high"], count, how),
            f"{p}_seq_fraction": Mean(_indicator(out > 0), per_seq=True),
        }
        if low is not None:
            metrics[f"{p}_fraction_low"] = _reduce.seq_mean(sums["low"], count, how)
        return Decision(keep=keep, per_seq=False, metrics=metrics)


@dataclasses.dataclass(frozen=True)
class SeqLogprobError(Stage):
    """NeMo-RL's sequence log-prob error: drop a sequence iff
    ``Σ_t exp(|δ_t|) m_t / N > threshold``."""

    threshold: float
    prefix: str = "mis_seq_logprob_error"

    def columns(self, t):
        return {"e": _reduce.total(criteria.mult_prob_error(t.delta), t.population)}

    def decide(self, t, sums):
        count, p = sums["count"], self.prefix
        value = _reduce.safe_divide(sums["e"], count)
        high = value > self.threshold
        return Decision(
            keep=~high,
            per_seq=True,
            metrics={
                f"{p}_mean": Mean(value, per_seq=True),
                f"{p}_max": batch_extreme(t.layout, value, count, "max"),
                f"{p}_min": batch_extreme(t.layout, value, count, "min"),
                f"{p}_fraction_high": Mean(_indicator(high), per_seq=True),
                f"{p}_seq_fraction": Mean(_indicator(high), per_seq=True),
            },
        )


@dataclasses.dataclass(frozen=True)
class M2PO(Stage):
    """M2PO's second-moment budget: keep the valid tokens with ``δ² ≤ c``, ``c`` the
    largest cut-off with ``mean{δ² ≤ c} ≤ τ`` over the whole batch the call sees
    (:func:`offpolicy_jax._src.correction.criteria.m2po_cutoff`: a bisection of scalar ``psum`` s, so a
    sharded call decides exactly as the unsharded one)."""

    tau: float
    prefix: str = "mis_m2po"

    def columns(self, t):
        v = t.delta * t.delta
        return {
            "max": _reduce.maximum(v, t.population),
            "min": _reduce.minimum(v, t.population),
        }

    def decide(self, t, sums):
        count, p = sums["count"], self.prefix
        v = t.delta * t.delta
        valid = t.population > 0
        axes = _all_axes(t)

        def psum(x):
            return jax.lax.psum(x, axes) if axes else x

        def pmax(x):
            return jax.lax.pmax(x, axes) if axes else x

        cut = criteria.m2po_cutoff(v, valid, self.tau, psum, pmax)
        keep = v <= cut
        kept = jnp.where(keep, t.population, 0.0)
        after = t.layout.reduce(
            {
                "dropped": _reduce.count_where(~keep, t.population),
                "v": _reduce.total(v, kept),
                "n": _reduce.count(kept),
            }
        )
        return Decision(
            keep=keep,
            metrics={
                f"{p}_mean": Mean(v),
                f"{p}_max": batch_extreme(t.layout, sums["max"], count, "max"),
                f"{p}_min": batch_extreme(t.layout, sums["min"], count, "min"),
                f"{p}_fraction_high": Mean(_indicator(~keep)),
                f"{p}_seq_fraction": Mean(_indicator(after["dropped"] > 0), per_seq=True),
                # The quantity the budget bounds: a token mean whatever the reduction.
                f"{p}_m2_after": _reduce.seq_mean(after["v"], after["n"], "token"),
            },
        )


@dataclasses.dataclass(frozen=True)
class ProbabilityMetrics(Stage):
    """NeMo-RL's probability-space mismatch metrics over the valid tokens:
    ``mis_token_mult_prob_error`` (``exp|δ|``) and ``mis_js_divergence``
    (:func:`offpolicy_jax._src.correction.criteria.js_divergence`)."""

    def decide(self, t, sums):
        mult, js = criteria.probability_errors(t.delta)
        own = t.layout.reduce(
            {"mult": _reduce.total(mult, t.population), "js": _reduce.total(js, t.population)}
        )
        count, how = sums["count"], t.reduction
        return Decision(
            metrics={
                "mis_token_mult_prob_error": _reduce.seq_mean(own["mult"], count, how),
                "mis_js_divergence": _reduce.seq_mean(own["js"], count, how),
            }
        )


# A statistic is reported capped at e^50 (the metric rule of ratios.METRIC_LOG_CAP): the
# decisions take the exact value, which may be inf past float32's range.
_STAT_CAP = math.exp(METRIC_LOG_CAP)


def _reported(x: jax.Array) -> jax.Array:
    return jnp.clip(x, -_STAT_CAP, _STAT_CAP)


@dataclasses.dataclass(frozen=True)
class AReaLRejection(Stage):
    """AReaL's rejection grid (``RejectionSamplingConfig``): the IS weight, masked or clamped.

    inclusionAI/AReaL ``apply_rejection_sampling`` (``areal/utils/functional/
    functional.py``, commit ``4aef98d8``), as a weighting stage: with ``δ = o − b``, the
    weight is ``w = exp(clip(δ, −S, S))`` per token, or at ``level="sequence"`` with
    ``metric="ratio"`` the geometric mean ``exp(clip(Σ δ m / N, −S, S))`` of the
    sequence. The statistic (:func:`offpolicy_jax._src.correction.criteria.areal_statistic`, unclamped)
    is tested per token, or aggregated per sequence by ``agg`` (in log space for
    ``ratio``), and is in bounds iff ``lower ≤ stat ≤ upper`` (no lower test when
    ``lower`` is None). ``action="mask"`` rejects what is out of bounds and keeps the
    unbounded ``w``; ``action="clamp"`` keeps every token and clips ``w`` to
    ``[lower or 0, upper]``: all tokens at the token level, the out-of-bounds sequences
    at the sequence level. Its weight replaces the TIS weight (``tis_mode: none``).
    With ``metric="binary_kl"`` (KPop) the statistic is
    :func:`~offpolicy_jax._src.correction.criteria.areal_binary_kl` of ``o`` and ``b``, and a
    token where AReaL's value is NaN (a probability that rounds to 1) is out of bounds,
    counted as above ``upper``; at the sequence level it takes its sequence with it.

    Metrics (``P = mis_rs_areal``): ``P_filtered_fraction`` (AReaL's
    ``rs_filtered_fraction``: the share of valid tokens masked, or whose weight the clamp
    changed), ``P_mean`` / ``P_max`` / ``P_min`` (the statistic, capped at ``±e^50``),
    ``P_fraction_high`` (and ``P_fraction_low`` with a lower bound): the share of valid
    tokens whose statistic is above / below its bound, ``P_seq_fraction`` (the share of
    sequences it masks or clamps tokens of), and the weight before and after it as
    ``mis_tis_weight_before_bound`` / ``mis_tis_weight_after_bound``.
    """

    config: RejectionSamplingConfig

    @property
    def prefix(self) -> str:
        return "mis_rs_areal"

    def _statistic(self, t) -> tuple[jax.Array, jax.Array | None]:
        """The per-token statistic, and for ``binary_kl`` where AReaL's is NaN (None
        otherwise): such a token fails AReaL's bounds, counted here as above ``upper``."""
        if self.config.metric == "binary_kl":
            return criteria.areal_binary_kl(t.old, t.rollout)
        return criteria.areal_statistic(t.delta, self.config.metric), None

    def _aggregated_values(self, t) -> jax.Array:
        """What ``agg`` reduces per sequence: ``δ`` for ``ratio`` (log space), else the
        statistic."""
        if self.config.metric == "ratio":
            return t.delta
        return self._statistic(t)[0]

    def _bounds(self, value, undefined=None):
        """``(low, high)`` out-of-bounds flags (``low`` None without a lower bound)."""
        c = self.config
        high = value > c.upper if undefined is None else (value > c.upper) | undefined
        return (None if c.lower is None else value < c.lower), high

    def _clamped(self, weights):
        """``clip(w, lower or 0, upper)`` and whether it moved each weight."""
        c = self.config
        lo, hi = c.clamp_lower, c.upper
        return jnp.clip(weights, lo, hi), (weights < lo) | (weights > hi)

    def columns(self, t):
        c = self.config
        if c.level == "sequence":
            out = {}
            if c.metric == "binary_kl":  # one undefined token rejects its sequence
                undefined = criteria.areal_binary_kl(t.old, t.rollout)[1]
                out["undefined"] = _reduce.count_where(undefined, t.population)
            if c.agg == "max":
                return out | {"agg": _reduce.maximum(self._aggregated_values(t), t.population)}
            if c.metric == "ratio":  # Σ δ m is the pipeline's own sums["delta"]
                return out
            return out | {"agg": _reduce.total(self._aggregated_values(t), t.population)}
        stat, undefined = self._statistic(t)
        low, high = self._bounds(stat, undefined)
        out = high if low is None else low | high
        if c.action == "clamp":
            out = self._clamped(ratios.clamped_exp(t.delta))[1]
        reported = _reported(stat)
        return {
            "affected": _reduce.count_where(out, t.population),
            "max": _reduce.maximum(reported, t.population),
            "min": _reduce.minimum(reported, t.population),
        }

    def _sequence_value(self, sums) -> jax.Array:
        """The per-sequence statistic: ``agg`` of the values, ``exp`` of it for ``ratio``;
        an empty sequence has aggregate 0 (AReaL's)."""
        c, count = self.config, sums["count"]
        if c.agg == "max":
            agg = sums["agg"]
        else:
            agg = sums["delta"] if c.metric == "ratio" else sums["agg"]
            if c.agg == "mean":
                agg = _reduce.safe_divide(agg, count)
        agg = jnp.where(count > 0, agg, 0.0)
        return jnp.exp(agg) if c.metric == "ratio" else agg

    def decide(self, t, sums):
        c, count, p = self.config, sums["count"], self.prefix
        token_weights = ratios.clamped_exp(t.delta)
        if c.level == "token":
            (value, undefined), per_seq = self._statistic(t), False
            high_ext, low_ext = sums["max"], sums["min"]
            weights = token_weights
        else:
            value, per_seq = self._sequence_value(sums), True
            undefined = sums["undefined"] > 0 if "undefined" in sums else None
            high_ext = low_ext = _reported(value)
            geometric = ratios.sequence_log_ratio(sums["delta"], count, "geometric")
            weights = ratios.clamped_exp(geometric) if c.metric == "ratio" else token_weights
        low, high = self._bounds(value, undefined)
        outside = high if low is None else low | high
        weights_per_seq = per_seq and c.metric == "ratio"
        keep, after = None, weights
        if c.action == "mask":
            keep, filtered = ~outside, outside
            seq_hit = outside if per_seq else sums["affected"] > 0
        else:
            clipped, moved = self._clamped(weights)
            if per_seq:  # only the out-of-bounds sequences are clamped
                moved = moved & outside
            after, filtered = jnp.where(moved, clipped, weights), moved
            seq_hit = moved if per_seq else sums["affected"] > 0
        if keep is not None and per_seq and not weights_per_seq:
            keep = t.layout.broadcast(keep)  # KL at the sequence level: token weights
        metrics = {
            "mis_tis_weight_before_bound": Mean(weights, per_seq=weights_per_seq),
            "mis_tis_weight_after_bound": Mean(after, "kept", weights_per_seq),
            f"{p}_filtered_fraction": Mean(_indicator(filtered), per_seq=per_seq),
            f"{p}_mean": Mean(_reported(value), per_seq=per_seq),
            f"{p}_max": batch_extreme(t.layout, high_ext, count, "max"),
            f"{p}_min": batch_extreme(t.layout, low_ext, count, "min"),
            f"{p}_fraction_high": Mean(_indicator(high), per_seq=per_seq),
            f"{p}_seq_fraction": Mean(_indicator(seq_hit), per_seq=True),
        }
        if low is not None:
            metrics[f"{p}_fraction_low"] = Mean(_indicator(low), per_seq=per_seq)
        return Decision(keep=keep, weights=after, per_seq=weights_per_seq, metrics=metrics)


@dataclasses.dataclass(frozen=True)
class MinPROMetrics(Stage):
    """MinPRO's prefix factor ``ρ̲_t = exp(clip(min_{s<t} δ_s, −S, S))`` (1 without a
    prefix) over the valid tokens, with a ``minpro`` level (arXiv:2601.22718):

    ``mis_minpro_prefix_ratio_mean`` (its mean, the call's reduction),
    ``mis_minpro_prefix_ratio_min`` (its batch minimum, an
    :class:`~offpolicy_jax._src.correction.stages.Extreme`) and ``mis_minpro_prefix_fraction_low`` (the
    share of valid tokens it down-weights, ``ρ̲_t < 1``).
    """

    prefix: str = "mis_minpro_prefix"

    def decide(self, t, sums):
        prefix_min = prefix_min_delta(t)  # the scan the minpro level took (cached)
        factor = ratios.clamped_exp(jnp.where(prefix_min < jnp.inf, prefix_min, 0.0))
        own = t.layout.reduce({"min": _reduce.minimum(factor, t.population)})
        p = self.prefix
        return Decision(
            metrics={
                f"{p}_ratio_mean": Mean(factor),
                f"{p}_ratio_min": batch_extreme(t.layout, own["min"], sums["count"], "min"),
                f"{p}_fraction_low": Mean(_indicator(factor < 1.0)),
            }
        )


def register_rule(name: str) -> Callable[[RuleFactory], RuleFactory]:
    """Registers a rejection rule: ``factory(threshold)`` returns its :class:`Stage`.

    The rule is then configured like a built-in criterion, as an ``rs_criteria`` entry
    ``"name:threshold"`` of :class:`~offpolicy_jax.CorrectionConfig`, and runs after the
    KL criteria in the order given (docs/guide/adding_a_rule.md).

    Raises:
      ValueError: ``name`` is a built-in criterion, or registered to another factory.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"a rule name must be a non-empty string without ':', got {name!r}")
    if name in criteria.RS_CRITERIA:
        raise ValueError(f"{name!r} is a built-in rejection criterion")

    def register(factory: RuleFactory) -> RuleFactory:
        known = criteria.RULES.get(name)
        if known is not None and known is not factory:
            raise ValueError(f"a rejection rule named {name!r} is already registered")
        criteria.RULES[name] = factory
        return factory

    return register


@dataclasses.dataclass(frozen=True)
class OffPolicySequenceMask(Stage):
    """DeepSeek-V3.2 off-policy sequence masking (OPSM), a stage of ``policy_loss``.

    Run with ``o = sg(θ)`` and ``b`` the sampling policy's log-probs (π_rollout), so
    ``δ = sg(θ) − b``: a sequence is dropped iff its mean advantage is ``< 0`` and
    ``Σ_t (b_t − sg(θ_t)) m_t / N > δ``. No gradient flows through the decision. A
    sequence with a non-finite ``θ`` or ``b`` at a valid token is left to the loss's
    own non-finite rule and out of the metrics (the pipeline's own rule).

    Metrics (``P = mis_opsm``): ``P_mean/_max/_min`` (the statistic),
    ``P_fraction_high`` (share above ``δ``, whatever the advantage) and
    ``P_seq_fraction`` (share dropped).

    Attributes:
      delta: the threshold ``δ > 0``.
      advantages: ``[..., T]`` advantages (0 where not valid): data of the call, so the
        stage is built inside it.
    """

    delta: float
    advantages: jax.Array
    prefix: str = "mis_opsm"

    def columns(self, t):
        return {"adv": _reduce.total(self.advantages, t.population)}

    def decide(self, t, sums):
        count, p = sums["count"], self.prefix
        # Σ (b − o) m = −Σ δ m exactly (negation commutes with rounding).
        stat = _reduce.safe_divide(-sums["delta"], count)
        keep = criteria.opsm_keep(stat, _reduce.safe_divide(sums["adv"], count), self.delta)
        keep = keep | (count == 0)
        return Decision(
            keep=keep,
            per_seq=True,
            metrics={
                f"{p}_mean": Mean(stat, per_seq=True),
                f"{p}_max": batch_extreme(t.layout, stat, count, "max"),
                f"{p}_min": batch_extreme(t.layout, stat, count, "min"),
                f"{p}_fraction_high": Mean(_indicator(stat > self.delta), per_seq=True),
                f"{p}_seq_fraction": Mean(_indicator(~keep), per_seq=True),
            },
        )
