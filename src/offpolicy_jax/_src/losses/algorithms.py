"""The four algorithms of ``policy_loss`` as data: which log-probs play which role.

Every algorithm runs the same pipeline (correction, surrogate, aggregation); they differ
only in which policy anchors the surrogate's ratio, which policy the correction's IS
weights compare with π_rollout, and whether those weights multiply the loss.

=================  ============  ===============  ========  =============================
algorithm          ratio ``d``   IS numerator     weighted  per-token loss
=================  ============  ===============  ========  =============================
``ppo``            π_old         π_old            no        ``ℓ(θ; d)``
``bypass_ppo``     π_rollout     sg(π_θ)          no        ``ℓ(θ; d)`` (rejection only)
``decoupled_ppo``  π_old         π_old            yes       ``w(π_old/π_rollout)·ℓ(θ; d)``
``reinforce_is``   (none)        sg(π_θ)          yes       ``−sg(w(π_θ/π_rollout))·A·θ``
=================  ============  ===============  ========  =============================
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Policy = Literal["old", "rollout", "theta"]


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """How one algorithm reads π_θ, π_old and π_rollout.

    Attributes:
      name: the ``LossConfig.algorithm`` value.
      ratio: the surrogate's ratio denominator ``d`` (``"old"`` or ``"rollout"``), or
        None: no surrogate, the REINFORCE term ``−sg(w)·A·log π_θ`` (Williams, 1992)
        with the IS weights as its only correction.
      is_numerator: the policy the correction's IS weights compare with π_rollout:
        ``"old"`` (π_old) or ``"theta"`` (``sg(π_θ)``: π_old is not part of the
        algorithm, so the current policy stands in for it, D8b / D9).
      weighted: the correction's IS weights multiply the loss, so a correction that
        reweights is required; otherwise one is refused (only its mask, or its
        metrics, may apply).
      rejection_only: a correction that rejects but never reweights
        (``tis_mode="none"``) is accepted although ``weighted`` is False (verl's bypass
        PPO-clip with ``rollout_rs``).
      weighted_variant: the algorithm to name when a reweighting correction is given to
        this unweighted one.
    """

    name: str
    ratio: Literal["old", "rollout"] | None
    is_numerator: Literal["old", "theta"]
    weighted: bool
    rejection_only: bool = False
    weighted_variant: str | None = None

    @property
    def needs_old(self) -> bool:
        """``old_logp`` is required: it is the ratio denominator."""
        return self.ratio == "old"

    @property
    def needs_rollout(self) -> bool:
        """``rollout_logp`` is required whatever the correction."""
        return self.ratio == "rollout" or self.weighted

    @property
    def theta_weighs(self) -> bool:
        """The IS weights are computed from π_θ: a non-finite π_θ is a non-finite log-prob
        of the correction, counted in ``mis_nonfinite_seq_fraction``."""
        return self.weighted and self.is_numerator == "theta"


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("ppo", "old", "old", weighted=False, weighted_variant="decoupled_ppo"),
        Algorithm(
            "bypass_ppo",
            "rollout",
            "theta",
            weighted=False,
            rejection_only=True,
            weighted_variant="reinforce_is",
        ),
        Algorithm("decoupled_ppo", "old", "old", weighted=True),
        Algorithm("reinforce_is", None, "theta", weighted=True),
    )
}
"""The algorithms by name, in the spec's order."""
