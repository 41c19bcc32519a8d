"""Rejection stages: which tokens or sequences leave the loss (mask only, never weights).

* :func:`rejection_sampling`: keep iff ``L_rs ≤ ρ_rs ≤ U_rs`` at ``rs_level``
  (docs/semantics.md §3.3), an instance of the generic criterion
  :class:`~offpolicy_jax._src.correction.stages.Bounded`;
* :class:`Veto`: reject a sequence holding a catastrophic token (§3.4, D1);
* the non-finite rejection (§0) is the pipeline's own (``stages.run``): it must
  shrink every population, not only the mask.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp

from offpolicy_jax._src import reduction as _reduce
from offpolicy_jax._src.correction.stages import (
    TOKEN_LEVELS,
    Bounded,
    Decision,
    Mean,
    Stage,
    level_ratio,
)


def rejection_sampling(level: str, lower: float, upper: float) -> Bounded:
    """RS at ``level``: the ratio ``ρ_rs`` of the level must lie in ``[lower, upper]``."""
    ratio = functools.partial(level_ratio, level)
    if level in TOKEN_LEVELS:
        return Bounded(
            "mis_rs_mask", lower, upper, statistic=lambda t: ratio(t, {}), name=("ratio", level)
        )
    return Bounded("mis_rs_mask", lower, upper, from_sums=ratio, name=("ratio", level))


@dataclasses.dataclass(frozen=True)
class Veto(Stage):
    """Rejects a sequence if a valid token has raw, unclamped ``δ_t < log(threshold)``."""

    threshold: float

    def columns(self, t):
        bad = (t.population > 0) & (t.delta < math.log(self.threshold))
        return {"hits": _reduce.count_where(bad, t.population)}

    def decide(self, t, sums):
        vetoed = sums["hits"] > 0
        how = t.reduction
        return Decision(
            keep=~vetoed,
            per_seq=True,
            metrics={
                "mis_rs_catastrophic_token_fraction": _reduce.seq_mean(
                    sums["hits"], sums["count"], how
                ),
                "mis_rs_catastrophic_seq_fraction": Mean(jnp.where(vetoed, 1.0, 0.0), per_seq=True),
            },
        )
