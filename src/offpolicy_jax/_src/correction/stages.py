"""The correction pipeline: small stages, two passes over the tokens.

Every rule of the correction (the TIS weight at its level and bound mode, rejection
sampling, the veto, any further rejection criterion, the mismatch metric group) is a
:class:`Stage`: it declares the per-token :class:`~offpolicy_jax._src.reduction.Column` s it
needs (``columns``) and turns their per-sequence sums into a :class:`Decision` (a keep
mask, bounded weights, metrics). :func:`run` executes a list of stages:

1. **pass 1**: the pipeline's own facts (sequence size ``N``, non-finite count, ``Σδ``)
   and every stage's columns, reduced together over the valid tokens by the layout.
   A sequence with a non-finite log-prob at a valid token leaves every population.
2. **decide**: in order, each stage's ``decide``. Keep masks (per token or per
   sequence) are ANDed into the mask; at most one stage bounds the weights.
3. **pass 2**: the metrics that need per-token sums over populations only known now
   (the tokens kept after a stage, the final mask ``m'``) and the final weight
   statistics, reduced together.
4. **finish**: batch normalisation (``normalize``), weights on ``m'``.

All per-sequence values are whatever the layout produces (``[...]`` for one sequence
per row); stages broadcast them back to tokens only through ``t.layout.broadcast``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Literal

import jax
import jax.numpy as jnp

from offpolicy_jax._src import reduction as _reduce
from offpolicy_jax._src.correction import criteria, normalize, ratios
from offpolicy_jax._src.reduction import Column, MeanParts, Reduction, Rows

Population = Literal["valid", "kept", "final"]
_ESS_W, _ESS_N = "_ess_w", "_ess_n"  # batch totals taken with the metrics, then combined


@dataclasses.dataclass(frozen=True)
class Tokens:
    """What every stage sees of the batch; all token arrays are float32 ``[..., T]``.

    Attributes:
      old: ``o``, the IS numerator's log-probs (``sg(θ)`` in REINFORCE-IS).
      rollout: ``b``, the rollout engine's log-probs.
      delta: ``δ = o − b`` on valid tokens, 0 elsewhere (garbage in non-finite ones).
      population: the valid tokens: the mask in pass 1, and from ``decide`` on the
        mask without the sequences that hold a non-finite log-prob.
      layout: per-sequence reductions and broadcasts.
      reduction: how metrics reduce (``"sequence"`` or ``"token"``).
    """

    old: jax.Array
    rollout: jax.Array
    delta: jax.Array
    population: jax.Array
    layout: Rows
    reduction: Reduction


@dataclasses.dataclass(frozen=True)
class Mean:
    """A metric still to be reduced: a per-token (or per-sequence) value over a population.

    ``over``: ``"valid"`` (the valid tokens), ``"kept"`` (the tokens still kept after
    the stage's own decision), ``"final"`` (the final mask ``m'``). Requests with equal
    ``key`` are reduced once (e.g. truncation and RS testing the same ratio and bound).
    """

    value: jax.Array
    over: Population = "valid"
    per_seq: bool = False
    key: Hashable | None = None


@dataclasses.dataclass(frozen=True)
class Decision:
    """What a stage decides, from the per-sequence sums of pass 1.

    Attributes:
      keep: bool, per token ``[..., T]``, or per sequence when ``per_seq``; None keeps all.
      weights: bounded IS weights (per token, or per sequence when ``per_seq``), or None.
      per_seq: whether ``keep`` / ``weights`` hold one value per sequence.
      metrics: name -> :class:`Mean` (reduced by the pipeline) or per-sequence
        :class:`~offpolicy_jax.MeanParts` terms (already made from the sums).
    """

    keep: jax.Array | None = None
    weights: jax.Array | None = None
    per_seq: bool = False
    metrics: Mapping[str, Mean | MeanParts] = dataclasses.field(default_factory=dict)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EffectiveSampleSize(MeanParts):
    """``mis_ess = (Σ w)² / (n Σ w²)`` kept as its three batch sums, so that it pools exactly.

    The ESS is not a ratio of two sums, so it cannot be a plain :class:`MeanParts`
    (whose pooled value would be the mean of the micro-batches' ESS). Here
    ``numerator = Σ w``, ``denominator = Σ w²`` and ``count = n``: pooling the parts of
    micro-batches or devices (``+``, :func:`~offpolicy_jax.pool_metric_parts`) adds
    the sums, and :meth:`value` applies the formula once.
    """

    count: jax.Array

    def value(self) -> jax.Array:
        return criteria.effective_sample_size(self.numerator, self.denominator, self.count)

    def __add__(self, other: MeanParts) -> MeanParts:
        if not isinstance(other, EffectiveSampleSize):
            return NotImplemented
        return EffectiveSampleSize(
            self.numerator + other.numerator,
            self.denominator + other.denominator,
            self.count + other.count,
        )

    def all_reduce(self, axes: tuple[str, ...]) -> EffectiveSampleSize:
        return EffectiveSampleSize(
            *jax.lax.psum((self.numerator, self.denominator, self.count), axes)
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Extreme(MeanParts):
    """A batch maximum (``kind="max"``) or minimum, kept so that it pools exactly.

    ``numerator`` is the extreme over the batch's non-empty sequences (0 when it has
    none) and ``denominator`` their number. ``a + b`` (micro-batches) and
    :meth:`all_reduce` (devices: ``pmax`` / ``pmin``) give the extreme over the parts
    that hold a sequence, and :meth:`value` is 0 for an empty batch. Pool dicts of
    parts with :func:`~offpolicy_jax.pool_metric_parts`: ``jax.tree.map(jnp.add, ...)``
    adds the leaves, which pools a mean, not an extreme.
    """

    kind: str = dataclasses.field(default="max", metadata={"static": True})

    def value(self) -> jax.Array:
        return jnp.where(self.denominator > 0, self.numerator, 0.0)

    def __add__(self, other: MeanParts) -> MeanParts:
        if not isinstance(other, Extreme) or other.kind != self.kind:
            return NotImplemented
        pick = jnp.maximum if self.kind == "max" else jnp.minimum
        both = pick(self.numerator, other.numerator)
        value = jnp.where(
            self.denominator > 0,
            jnp.where(other.denominator > 0, both, self.numerator),
            other.numerator,
        )
        return Extreme(value, self.denominator + other.denominator, self.kind)

    def all_reduce(self, axes: tuple[str, ...]) -> Extreme:
        # A device without a sequence holds 0, which must not win the extreme.
        some = self.denominator > 0
        if self.kind == "max":
            extreme = jax.lax.pmax(jnp.where(some, self.numerator, -jnp.inf), axes)
        else:
            extreme = jax.lax.pmin(jnp.where(some, self.numerator, jnp.inf), axes)
        n = jax.lax.psum(self.denominator, axes)
        return Extreme(jnp.where(n > 0, extreme, 0.0), n, self.kind)


def batch_extreme(layout, per_seq: jax.Array, count: jax.Array, kind: str) -> Extreme:
    """The batch max (``kind="max"``) or min of per-sequence values over non-empty
    sequences (and devices), as an :class:`~offpolicy_jax._src.correction.stages.Extreme`: 0 for an empty
    batch, pooled over micro-batches as an extreme, not a mean."""
    nonempty = count > 0
    fill = -jnp.inf if kind == "max" else jnp.inf
    values = jnp.where(nonempty, per_seq, fill)
    extreme = jnp.max(values, initial=fill) if kind == "max" else jnp.min(values, initial=fill)
    n = jnp.sum(jnp.where(nonempty, 1.0, 0.0))
    axes = tuple(getattr(getattr(layout, "axes", None), "batch", ()) or ())
    if axes:
        extreme = (jax.lax.pmax if kind == "max" else jax.lax.pmin)(extreme, axes)
        n = jax.lax.psum(n, axes)
    extreme = jnp.where(jnp.isfinite(extreme), extreme, 0.0)
    return Extreme(extreme, n, kind)


def pool(a: Mapping[str, MeanParts], b: Mapping[str, MeanParts]) -> dict[str, MeanParts]:
    """Pools two dicts of metric parts (two micro-batches', devices' or chunks') key by key
    (:func:`~offpolicy_jax.pool_metric_parts` is the public form).

    Each part pools by its type's ``+``: a :class:`~offpolicy_jax.MeanParts` adds its
    numerator and denominator, an :class:`Extreme` keeps the larger maximum or smaller
    minimum. ``jax.tree.map(jnp.add, a, b)`` would add maxima instead. Both dicts must
    have the same keys (those of ``a`` are pooled); ``finalize_metrics`` divides out.
    """
    return {key: a[key] + b[key] for key in a}


class Stage:
    """One rule. ``columns`` runs before pass 1, ``decide`` after it.

    ``sums`` holds this stage's own columns (by the names it gave them), plus
    ``"count"`` (``N``, valid tokens per sequence) and ``"delta"`` (``Σ_t δ_t m_t``),
    all per sequence and 0 for sequences with a non-finite log-prob.
    """

    def columns(self, t: Tokens) -> dict[str, Column]:
        return {}

    def decide(self, t: Tokens, sums: Mapping[str, jax.Array]) -> Decision:
        raise NotImplementedError


TOKEN_LEVELS: tuple[str, ...] = ("token", "minpro")
"""The levels whose ratio is per token (the others give one ratio per sequence)."""


def prefix_min_delta(t: Tokens) -> jax.Array:
    """``min_{s<t} δ_s`` over each token's earlier valid tokens (``+inf``: none), through
    the layout (packed, sharded alike; taken once per call however many stages ask)."""
    return t.layout.exclusive_min(t.delta, t.population)


def level_log_ratio(level: str, t: Tokens, sums: Mapping[str, jax.Array]) -> jax.Array:
    """``agg(δ)`` before the ``±S`` clamp: ``[..., T]`` at a per-token level
    (:data:`TOKEN_LEVELS`), else per sequence."""
    if level == "token":
        return t.delta
    if level == "minpro":
        return ratios.minpro_log_ratio(t.delta, prefix_min_delta(t))
    return ratios.sequence_log_ratio(sums["delta"], sums["count"], level)


def level_ratio(level: str, t: Tokens, sums: Mapping[str, jax.Array]) -> jax.Array:
    """``ρ = exp(clip(agg(δ), −S, S))``: ``[..., T]`` at a per-token level
    (:data:`TOKEN_LEVELS`), else per sequence."""
    return ratios.clamped_exp(level_log_ratio(level, t, sums))


@dataclasses.dataclass(frozen=True)
class Bounded(Stage):
    """The generic rejection criterion: keep iff ``lower ≤ value ≤ upper`` (inclusive).

    ``statistic(t)`` is a per-token ``[..., T]`` value. With ``aggregate=None`` each
    token is tested; with ``"sum"`` / ``"mean"`` / ``"max"`` its masked per-sequence
    aggregate is (a whole sequence is kept or rejected), after ``finish`` when given
    (e.g. ``exp`` of a summed log-ratio). A ``statistic`` that needs the pass-1 sums
    (a sequence-level ratio) is given as ``from_sums(t, sums)`` instead, returning
    per-sequence values. Metrics: ``{prefix}_fraction_low`` / ``_high``, the share of
    valid tokens below / above the bound; stages with equal ``name`` share them.
    """

    prefix: str
    lower: float | None
    upper: float | None
    statistic: Callable[[Tokens], jax.Array] | None = None
    aggregate: Literal["sum", "mean", "max"] | None = None
    from_sums: Callable[[Tokens, Mapping[str, jax.Array]], jax.Array] | None = None
    finish: Callable[[jax.Array], jax.Array] | None = None
    name: Hashable = None

    def _statistic(self, t: Tokens) -> jax.Array:
        if self.statistic is None:
            raise TypeError(f"Bounded({self.prefix!r}) needs a statistic unless from_sums is given")
        return self.statistic(t)

    def columns(self, t):
        if self.aggregate is None:
            return {}
        return {
            "agg": Column(
                "max" if self.aggregate == "max" else "sum", self._statistic(t), t.population
            )
        }

    def decide(self, t, sums):
        per_seq = self.aggregate is not None or self.from_sums is not None
        if self.from_sums is not None:
            value = self.from_sums(t, sums)
        elif self.aggregate is None:
            value = self._statistic(t)
        elif self.aggregate == "mean":
            value = _reduce.safe_divide(sums["agg"], sums["count"])
        else:
            value = sums["agg"]
        if self.finish is not None:
            value = self.finish(value)
        keep, metrics = jnp.ones(jnp.shape(value), bool), {}
        for side, bound in (("low", self.lower), ("high", self.upper)):
            if bound is None:
                continue
            outside = value < bound if side == "low" else value > bound
            keep = keep & ~outside
            key = None if self.name is None else (self.name, side, bound)
            frac = Mean(jnp.where(outside, 1.0, 0.0), per_seq=per_seq, key=key)
            metrics[f"{self.prefix}_fraction_{side}"] = frac
        return Decision(keep=keep, per_seq=per_seq, metrics=metrics)


def _restrict(finite: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.where(finite, x, 0.0)


@dataclasses.dataclass
class _Decided:
    """What the decide step leaves for pass 2 (see :func:`run`).

    ``populations``: 0 = valid, then one more after each stage that keeps, and last
    the final mask ``m'``; ``requests``: ``(name, metric, population index)`` of the
    metrics still to reduce; ``parts``: the metrics already made.
    """

    populations: list[jax.Array]
    weights: jax.Array
    weights_per_seq: bool
    requests: list[tuple[str, Mean, int]]
    parts: dict[str, MeanParts]

    @property
    def final(self) -> jax.Array:
        return self.populations[-1]

    def index(self, metric: Mean, stage_population: int) -> int:
        """The population a metric is reduced over."""
        last = len(self.populations) - 1
        return {"valid": 0, "kept": stage_population, "final": last}[metric.over]


def _pass1(stages: Sequence[Stage], t: Tokens) -> tuple[Tokens, dict, jax.Array]:
    """Pass 1: the pipeline's facts and every stage's columns over the valid tokens.

    Returns ``t`` with the population narrowed to the sequences without a non-finite
    log-prob, the per-sequence sums (keys: the facts by name, each stage's columns by
    ``(stage index, name)``) and the per-sequence finite flag.
    """
    nonfinite = ~jnp.isfinite(t.old) | ~jnp.isfinite(t.rollout)
    columns: dict[str | tuple[int, str], Column] = {
        "count": _reduce.count(t.population),
        "nonfinite": _reduce.count_where(nonfinite, t.population),
        "delta": _reduce.total(t.delta, t.population),
    }
    for i, stage in enumerate(stages):
        columns.update({(i, k): c for k, c in stage.columns(t).items()})
    sums = t.layout.reduce(columns)
    finite = sums["nonfinite"] == 0
    valid = jnp.where(t.layout.broadcast(finite), t.population, 0.0)
    return dataclasses.replace(t, population=valid), sums, finite


def _check_unset(what: str, earlier: Stage | None, stage: Stage) -> None:
    """Refuses a stage setting ``what`` that another stage set already: the later would
    silently override the earlier."""
    if earlier is not None and earlier is not stage and earlier != stage:
        raise ValueError(
            f"rules: {type(earlier).__name__} and {type(stage).__name__} both set {what}, "
            "so the later would silently override the earlier; chain one rule that sets it"
        )


def _decide(stages: Sequence[Stage], t: Tokens, sums: Mapping, finite: jax.Array) -> _Decided:
    """Each stage's ``decide``, in order: keep masks ANDed, at most one weighting."""
    base = {k: _restrict(finite, sums[k]) for k in ("count", "delta")}
    kept, populations = t.population, [t.population]
    weights, weights_per_seq, weighted_by = None, False, None
    reported_by: dict[str, Stage] = {}  # equal stages report equal metrics: no override
    requests: list[tuple[str, Mean, int]] = []
    parts: dict[str, MeanParts] = {}
    for i, stage in enumerate(stages):
        own = {
            k[1]: _restrict(finite, v)
            for k, v in sums.items()
            if isinstance(k, tuple) and k[0] == i
        }
        d = stage.decide(t, {**base, **own})
        if d.weights is not None:
            _check_unset("the weights (Decision.weights)", weighted_by, stage)
            weights, weights_per_seq, weighted_by = d.weights, d.per_seq, stage
        if d.keep is not None:
            keep = t.layout.broadcast(d.keep) if d.per_seq else d.keep
            kept = jnp.where(keep, kept, 0.0)
            populations.append(kept)
        for name, metric in d.metrics.items():
            _check_unset(f"the metric {name!r}", reported_by.get(name, stage), stage)
            reported_by[name] = stage
            if isinstance(metric, MeanParts):
                parts[name] = metric
            else:
                requests.append((name, metric, len(populations) - 1))
    populations.append(kept)  # the final mask m'
    if weights is None:  # no weighting stage: every weight is 1
        weights = jnp.ones(t.delta.shape, jnp.float32)
    return _Decided(populations, weights, weights_per_seq, requests, parts)


def _pass2(t: Tokens, d: _Decided, weight_stats: bool) -> dict:
    """Pass 2: per-token sums over the populations known now and the final weight
    statistics. Keys: ``("n", population)``, ``("sum", metric key, population)``, or a
    name (``w``, ``w2``, ``lo``, ``hi``)."""
    columns: dict[Hashable, Column] = {}
    for name, metric, at in d.requests:
        p = d.index(metric, at)
        if p:
            columns[("n", p)] = _reduce.count(d.populations[p])
        if not metric.per_seq:
            key = metric.key if metric.key is not None else name
            columns[("sum", key, p)] = _reduce.total(metric.value, d.populations[p])
    if weight_stats:
        columns[("n", len(d.populations) - 1)] = _reduce.count(d.final)
        if not d.weights_per_seq:
            columns["w"] = _reduce.total(d.weights, d.final)
            columns["w2"] = _reduce.total(d.weights * d.weights, d.final)
            columns["lo"] = _reduce.minimum(d.weights, d.final)
            columns["hi"] = _reduce.maximum(d.weights, d.final)
    return t.layout.reduce(columns)


def _requested_means(t: Tokens, d: _Decided, count, sums: Mapping) -> None:
    """The metrics the stages asked the pipeline to reduce, into ``d.parts``."""
    for name, metric, at in d.requests:
        p = d.index(metric, at)
        if metric.per_seq:
            d.parts[name] = _reduce.seq_mean_of_values(metric.value, count(p), t.reduction)
        else:
            key = metric.key if metric.key is not None else name
            d.parts[name] = _reduce.seq_mean(sums[("sum", key, p)], count(p), t.reduction)


def _weight_statistics(
    t: Tokens, d: _Decided, n_final: jax.Array, sums: Mapping, batch_normalize: str | None
) -> jax.Array:
    """The ``mis_is_ratio_*`` metrics and the ESS sums, into ``d.parts``; returns the
    batch normaliser ``μ`` (1 without ``batch_normalize``)."""
    how, weights = t.reduction, d.weights

    def mean_weight(reduction):
        if d.weights_per_seq:
            return _reduce.seq_mean_of_values(weights, n_final, reduction)
        return _reduce.seq_mean(sums["w"], n_final, reduction)

    after = mean_weight(how)
    d.parts["mis_is_ratio_mean_after_tis_rs"] = after
    mu = jnp.ones((), jnp.float32)
    if batch_normalize is not None:
        terms = after if batch_normalize == how else mean_weight(batch_normalize)
        mu = normalize.normalizer(t.layout.batch_means({"mu": terms})["mu"].value())
    # Normalising is one division by μ > 0: it scales the mean, and min(w/μ) =
    # min(w)/μ exactly, so the final statistics come from the same sums.
    low, high = (weights, weights) if d.weights_per_seq else (sums["lo"], sums["hi"])
    d.parts["mis_is_ratio_mean_final"] = MeanParts(after.numerator / mu, after.denominator)
    d.parts["mis_is_ratio_min_final"] = _reduce.seq_mean_of_values(low / mu, n_final, how)
    d.parts["mis_is_ratio_max_final"] = _reduce.seq_mean_of_values(high / mu, n_final, how)
    # The batch's own extremes of the weights the loss uses (the two above average the
    # sequences' extremes): the low tail a mean of minima hides.
    d.parts["mis_is_ratio_batch_min_final"] = batch_extreme(t.layout, low / mu, n_final, "min")
    d.parts["mis_is_ratio_batch_max_final"] = batch_extreme(t.layout, high / mu, n_final, "max")
    # ESS sums (invariant to μ): Σ w m', Σ w² m', Σ m' of the final mask.
    if d.weights_per_seq:
        some = n_final > 0
        sum_w = jnp.where(some, weights, 0.0) * n_final
        sum_w2 = jnp.where(some, weights * weights, 0.0) * n_final
    else:
        sum_w, sum_w2 = sums["w"], sums["w2"]
    d.parts[_ESS_W] = MeanParts(sum_w, sum_w2)
    d.parts[_ESS_N] = MeanParts(n_final, n_final)
    return mu


def run(
    stages: Sequence[Stage],
    t: Tokens,
    *,
    weight_stats: bool,
    batch_normalize: str | None,
) -> tuple[jax.Array, jax.Array, dict[str, MeanParts]]:
    """Runs the stages (see the module docstring).

    Args:
      stages: the configured rules, in order.
      t: the batch (``t.population`` = the mask).
      weight_stats: emit ``mis_is_ratio_*`` and ``mis_nonfinite_seq_fraction`` (use_tis).
      batch_normalize: None, or the reduction ``μ`` is averaged with (``"token"`` /
        ``"sequence"``); ``mis_batch_norm_factor`` is emitted whenever ``weight_stats``.

    Returns:
      ``(w, m', parts)``: the weights on kept tokens (0 elsewhere, not multiplied by the
      mask value; broadcastable to ``[..., T]``), the final float mask and the metrics as
      batch-total :class:`~offpolicy_jax.MeanParts`.
    """
    t, pass1, finite = _pass1(stages, t)
    d = _decide(stages, t, pass1, finite)
    if weight_stats:
        d.parts["mis_nonfinite_seq_fraction"] = _reduce.seq_mean_of_values(
            jnp.where(finite, 0.0, 1.0), pass1["count"], t.reduction
        )
    pass2 = _pass2(t, d, weight_stats)
    count_valid = _restrict(finite, pass1["count"])

    def count(p):
        return count_valid if p == 0 else pass2[("n", p)]

    _requested_means(t, d, count, pass2)
    mu = jnp.ones((), jnp.float32)
    if weight_stats:
        mu = _weight_statistics(t, d, count(len(d.populations) - 1), pass2, batch_normalize)
    # Batch extremes are batch totals already; every other part is per sequence.
    extremes = {k: v for k, v in d.parts.items() if isinstance(v, Extreme)}
    parts = t.layout.batch_means({k: v for k, v in d.parts.items() if k not in extremes})
    parts.update(extremes)
    if weight_stats:
        w_parts, n_parts = parts.pop(_ESS_W), parts.pop(_ESS_N)
        parts["mis_ess"] = EffectiveSampleSize(
            w_parts.numerator, w_parts.denominator, n_parts.numerator
        )
        # As (μ, 1): pooled over micro-batches it reports their mean normaliser.
        parts["mis_batch_norm_factor"] = MeanParts(mu, jnp.ones((), jnp.float32))
    token_weights = t.layout.broadcast(d.weights) if d.weights_per_seq else d.weights
    # `where`, not a product: rejected positions may hold e^20-sized mask-mode ratios.
    return jnp.where(d.final > 0, token_weights / mu, 0.0), d.final, parts
