"""The TIS stage: the IS weight at its level, bounded by truncate / clip / mask.

``w = ρ`` at ``tis_level`` (``stages.level_ratio``), then with the resolved bounds
``L`` / ``U`` (docs/semantics.md §3.2):

* truncate (Ionides, 2008): ``min(w, U)``, one-sided;
* clip: ``clip(w, L, U)``;
* mask: tokens (or sequences) with ``w`` outside ``[L, U]`` are rejected and carry
  weight 0 (D8).

Metrics: ``mis_tis_weight_before_bound`` (valid tokens), ``mis_tis_weight_after_bound``
(tokens still kept after this stage), and the mode's fractions of valid tokens
beyond a bound. Both tails of the ratio before any bound or clamp, whatever the mode:
``mis_is_ratio_min_before_bound`` / ``_max_before_bound`` (batch extremes of
``exp(agg(δ))``, exponent capped at 50 like every metric, pooled as extremes) and
``mis_is_ratio_fraction_low_before_bound`` / ``_high_before_bound`` (shares of valid
tokens below ``L`` / above ``U``; ``L`` is ``1/U`` unless set, also in truncate mode,
which does not bound it); and after the bound, ``mis_is_ratio_fraction_low_final`` /
``_high_final``, the shares of the final mask whose bounded weight (before batch
normalisation) is below ``L`` / above ``U``: tokens the loss keeps with a starved
(or, truncating, an untouched small) weight. The weights are stop-gradient, so
min/max JVP conventions do not matter.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from offpolicy_jax._src import reduction as _reduce
from offpolicy_jax._src.correction import ratios
from offpolicy_jax._src.correction.stages import (
    TOKEN_LEVELS,
    Decision,
    Mean,
    Stage,
    batch_extreme,
    level_log_ratio,
)


def _indicator(x):
    return jnp.where(x, 1.0, 0.0)


def apply_mode(weights, mode: str, lower: float, upper: float):
    """``(bounded, keep)``: the bounded weights, and the bool keep mask in mask mode (else None)."""
    if mode == "truncate":
        return jnp.minimum(weights, upper), None
    if mode == "clip":
        return jnp.clip(weights, lower, upper), None
    if mode == "mask":
        keep = (weights >= lower) & (weights <= upper)
        return jnp.where(keep, weights, 0), keep
    if mode == "band":  # §8: weight 0 outside [L, U]; the token stays in the mask
        return jnp.where((weights >= lower) & (weights <= upper), weights, 0), None
    if mode == "none":  # §8: no IS weight, only the rejection rules
        return jnp.ones_like(weights), None
    raise ValueError(
        f"mode must be one of 'truncate', 'clip', 'mask', 'band', 'none', got {mode!r}"
    )


@dataclasses.dataclass(frozen=True)
class TISWeights(Stage):
    """Truncated / clipped / masked / IcePop importance weights at one level (or none)."""

    level: str
    mode: str
    lower: float
    upper: float

    def columns(self, t):
        if self.level != "token":  # per sequence, or MinPRO's prefix scan: in decide
            return {}
        # The token ratio's extremes per sequence, taken in pass 1 with every sum.
        return {
            "lo": _reduce.minimum(t.delta, t.population),
            "hi": _reduce.maximum(t.delta, t.population),
        }

    def _log_extremes(self, t, sums, log_ratio):
        """Per-sequence min / max of the unclamped log-ratio over the valid tokens."""
        if self.level == "token":
            return sums["lo"], sums["hi"]
        if self.level == "minpro":
            own = t.layout.reduce(
                {
                    "lo": _reduce.minimum(log_ratio, t.population),
                    "hi": _reduce.maximum(log_ratio, t.population),
                }
            )
            return own["lo"], own["hi"]
        return log_ratio, log_ratio

    def _tails(self, t, sums, log_ratio, raw, weights, per_seq) -> dict:
        """Both tails before any bound or clamp, and after the bound (module docstring)."""
        count = sums["count"]
        lo, hi = self._log_extremes(t, sums, log_ratio)
        metrics: dict = {
            "mis_is_ratio_min_before_bound": batch_extreme(
                t.layout, ratios.metric_exp(lo), count, "min"
            ),
            "mis_is_ratio_max_before_bound": batch_extreme(
                t.layout, ratios.metric_exp(hi), count, "max"
            ),
        }
        if self.mode == "none":  # no bound: no tails to count
            return metrics
        unbounded = ratios.metric_exp(log_ratio)
        # Within the clamp's range the clamped ratio crosses a bound exactly where the
        # unclamped one does: the test is then the mode's own (one shared column).
        clamp = math.exp(ratios.LOG_RATIO_CLAMP)
        shared = 1 / clamp <= self.lower and self.upper <= clamp
        # What the bound leaves outside [L, U] by construction (clip and mask keep
        # nothing outside; truncation and the band nothing above U) is 0, not a column.
        never = {"low", "high"} if self.mode in ("clip", "mask") else {"high"}
        zero = jnp.zeros(jnp.shape(count))
        for side, bound in (("low", self.lower), ("high", self.upper)):
            ratio = raw if shared else unbounded
            before = ratio < bound if side == "low" else ratio > bound
            key = (("ratio", self.level), side, bound) if shared else None
            metrics[f"mis_is_ratio_fraction_{side}_before_bound"] = Mean(
                _indicator(before), per_seq=per_seq, key=key
            )
            after = weights < bound if side == "low" else weights > bound
            metrics[f"mis_is_ratio_fraction_{side}_final"] = (
                Mean(zero, "final", per_seq=True)
                if side in never
                else Mean(_indicator(after), "final", per_seq)
            )
        return metrics

    def decide(self, t, sums):
        log_ratio = level_log_ratio(self.level, t, sums)
        raw = ratios.clamped_exp(log_ratio)
        per_seq = self.level not in TOKEN_LEVELS
        weights, keep = apply_mode(raw, self.mode, self.lower, self.upper)
        metrics = {
            "mis_tis_weight_before_bound": Mean(raw, per_seq=per_seq),
            "mis_tis_weight_after_bound": Mean(weights, "kept", per_seq),
            **self._tails(t, sums, log_ratio, raw, weights, per_seq),
        }
        # Keyed like rejection sampling's fractions: RS at this level and bound
        # (the reference mis.yaml) shares the column.
        sides = (("high", self.upper),) if self.mode != "none" else ()
        if self.mode not in ("truncate", "none"):
            sides = (("low", self.lower), *sides)
        for side, bound in sides:
            outside = raw < bound if side == "low" else raw > bound
            name = (
                "mis_tis_truncate_fraction"
                if self.mode == "truncate"
                else (f"mis_tis_{self.mode}_fraction_{side}")
            )
            key = (("ratio", self.level), side, bound)
            metrics[name] = Mean(jnp.where(outside, 1.0, 0.0), per_seq=per_seq, key=key)
        return Decision(keep=keep, weights=weights, per_seq=per_seq, metrics=metrics)
