"""The TIS stage: the IS weight at its level, bounded by truncate / clip / mask.

``w = ρ`` at ``tis_level`` (``stages.level_ratio``), then with the resolved bounds
``L`` / ``U`` (docs/semantics.md §3.2):

* truncate (Ionides, 2008): ``min(w, U)``, one-sided;
* clip: ``clip(w, L, U)``;
* mask: tokens (or sequences) with ``w`` outside ``[L, U]`` are rejected and carry
  weight 0 (D8).

Metrics: ``mis_tis_weight_before_bound`` (valid tokens), ``mis_tis_weight_after_bound``
(tokens still kept after this stage), and the mode's fractions of valid tokens
beyond a bound. The weights are stop-gradient, so min/max JVP conventions do not matter.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from offpolicy_jax.correction.stages import TOKEN_LEVELS, Decision, Mean, Stage, level_ratio


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

    def decide(self, t, sums):
        raw = level_ratio(self.level, t, sums)
        per_seq = self.level not in TOKEN_LEVELS
        weights, keep = apply_mode(raw, self.mode, self.lower, self.upper)
        metrics = {
            "mis_tis_weight_before_bound": Mean(raw, per_seq=per_seq),
            "mis_tis_weight_after_bound": Mean(weights, "kept", per_seq),
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
