"""AReaL's rejection grid as a config: :class:`RejectionSamplingConfig`."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any, Literal

from offpolicy_jax._src.checks import (
    check_choice,
    check_f32_coefficient,
    check_f32_ratio,
    check_number,
    keyword_hints,
    reject_unknown_keys,
)
from offpolicy_jax._src.messages import shown

__all__ = [
    "AREAL_ACTIONS",
    "AREAL_AGGS",
    "AREAL_LEVELS",
    "AREAL_METRICS",
    "RejectionSamplingConfig",
]

AREAL_LEVELS: tuple[str, ...] = ("token", "sequence")
AREAL_ACTIONS: tuple[str, ...] = ("mask", "clamp")
AREAL_METRICS: tuple[str, ...] = ("ratio", "kl_k1", "kl_k2", "kl_k3", "binary_kl")
AREAL_AGGS: tuple[str, ...] = ("sum", "mean", "max")


@keyword_hints
@dataclasses.dataclass(frozen=True)
class RejectionSamplingConfig:
    """AReaL's rejection grid: filter or bound the π_old / π_rollout weight by a divergence.

    The fields, defaults and checks of AReaL's ``RejectionSamplingConfig``
    (inclusionAI/AReaL ``areal/api/cli_args.py``, applied by
    ``apply_rejection_sampling`` in ``areal/utils/functional/functional.py``, commit
    ``4aef98d8``); the value of :attr:`CorrectionConfig.rejection_sampling`, which
    brings AReaL's IS weight (``behave_imp_weight``) and decision into the pipeline
    (docs/semantics.md §8). With ``δ_t = log π_old − log π_rollout``:

    * weight ``w_t = exp(δ_t)``; at ``level="sequence"`` with ``metric="ratio"`` the
      geometric mean ``exp(Σ δ m / N)`` of the sequence, whatever ``agg``;
    * statistic per token: ``ratio = e^δ``, ``kl_k1 = δ``, ``kl_k2 = ½δ²``,
      ``kl_k3 = e^{−δ} − 1 + δ`` (AReaL's ``KLEstimator`` with π_old as ``log_probs``),
      ``binary_kl = max(D_B(o‖b), D_B(b‖o))`` (KPop, Guo et al. 2026: the Bernoulli KL
      of the sampled token, AReaL's ``compute_binary_kl_divergence`` with its clamp of
      both probabilities to ``[1e-8, 1 − 1e-8]``; a probability that rounds to 1 in
      float32 makes AReaL's value NaN, which its bounds reject, and so does this one;
      added by AReaL commit ``13353cc6``, whose own ``__post_init__`` still lists only
      the four metrics above, so this reader accepts what AReaL's loss computes);
      at ``level="sequence"`` its per-sequence ``agg``: for ``ratio`` in log space
      (``sum``: ``exp(Σ δ m)``, ``mean``: ``exp(Σ δ m / N)``, ``max``: ``exp(max δ)``),
      for the KL metrics of the values (``Σ k m``, ``Σ k m / N``, ``max k``); an empty
      sequence has aggregate 0;
    * in bounds iff ``lower ≤ stat ≤ upper`` (``stat ≤ upper`` when ``lower`` is None);
    * ``action="mask"``: tokens (sequences) out of bounds are rejected; the weight is
      the unbounded ``w``. ``action="clamp"`` (``metric="ratio"`` only): nothing is
      rejected; ``w ← clip(w, lower or 0, upper)``, every token at the token level and
      the tokens of out-of-bounds sequences at the sequence level.

    Validated as AReaL does: ``ValueError`` for a choice outside the grid, ``lower >
    upper``, ``upper ≤ 1`` or ``lower ≤ 0`` with ``metric="ratio"``, ``upper ≤ 0`` with
    ``kl_k2`` / ``kl_k3`` / ``binary_kl``, or ``clamp`` with a KL metric (a bound on a
    divergence is not a bound on a weight); a ``UserWarning`` when ``agg`` is not
    ``"mean"`` at the token level (where it is ignored). Bounds must also be normal, finite float32 values (0
    allowed for ``kl_k1``), compared as float32.

    Attributes:
      level: ``"token"`` (each token judged alone) or ``"sequence"`` (a sequence shares
        one fate).
      action: ``"mask"`` (reject) or ``"clamp"`` (bound the weight).
      metric: ``"ratio"``, ``"kl_k1"``, ``"kl_k2"``, ``"kl_k3"`` or ``"binary_kl"``
        (KPop: ``upper`` is its φ; AReaL's example ``gsm8k_kpop.yaml`` sets 2.0).
      agg: the per-sequence aggregation at ``level="sequence"``: ``"sum"``, ``"mean"``
        or ``"max"``.
      upper: upper bound of the statistic (AReaL's default 5.0).
      lower: lower bound, or None (none; ``clamp`` then clips at 0).
    """

    level: Literal["token", "sequence"] = "token"
    action: Literal["mask", "clamp"] = "mask"
    metric: Literal["ratio", "kl_k1", "kl_k2", "kl_k3", "binary_kl"] = "ratio"
    agg: Literal["sum", "mean", "max"] = "mean"
    upper: float = 5.0
    lower: float | None = None

    def __post_init__(self):
        owner = "CorrectionConfig.rejection_sampling"
        set_ = lambda key, value: object.__setattr__(self, key, value)  # noqa: E731 (frozen)
        for key, allowed in (
            ("level", AREAL_LEVELS),
            ("action", AREAL_ACTIONS),
            ("metric", AREAL_METRICS),
            ("agg", AREAL_AGGS),
        ):
            set_(key, check_choice(owner, key, getattr(self, key), allowed))
        set_("upper", check_number(owner, "upper", self.upper, optional=False))
        set_("lower", check_number(owner, "lower", self.lower, optional=True))
        self._check_bounds(owner)
        if self.action == "clamp" and self.metric != "ratio":
            raise ValueError(
                f"{owner}.action='clamp' only supports metric='ratio' (it clips the importance "
                f"weight to [lower, upper]; a bound on {self.metric!r} is not a bound on a "
                "weight), got metric={self.metric!r}; use action='mask' for KL-based filtering"
            )
        if self.level == "token" and self.agg != "mean":
            warnings.warn(
                f"{owner}.agg={self.agg!r} is ignored when level='token'; aggregation is only "
                "used for sequence-level filtering",
                UserWarning,
                stacklevel=3,
            )

    def _check_bounds(self, owner: str) -> None:
        upper, lower = self.upper, self.lower
        assert upper is not None  # optional=False never returns None
        if lower is not None and lower > upper:
            raise ValueError(
                f"{owner}: lower ({shown(lower)}) cannot be greater than upper ({shown(upper)})"
            )
        if self.metric == "ratio":
            if upper <= 1.0:
                raise ValueError(
                    f"{owner}.upper must be > 1.0 for metric='ratio' (otherwise every token whose "
                    f"policies differ is filtered), got {shown(upper)}"
                )
            if lower is not None and lower <= 0:
                raise ValueError(
                    f"{owner}.lower must be > 0 for metric='ratio', got {shown(lower)}"
                )
            for key in ("upper", "lower"):
                check_f32_ratio(owner, key, getattr(self, key))
        else:
            if self.metric in ("kl_k2", "kl_k3", "binary_kl") and upper <= 0:
                raise ValueError(
                    f"{owner}.upper must be > 0 for metric={self.metric!r}, got {shown(upper)}"
                )
            for key in ("upper", "lower"):
                check_f32_coefficient(owner, key, getattr(self, key))

    @property
    def clamp_lower(self) -> float:
        """The lower clip of ``action="clamp"``: ``lower``, or 0 (AReaL's default)."""
        return 0.0 if self.lower is None else self.lower

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RejectionSamplingConfig:
        """From a mapping of AReaL's keys, unknown keys refused with a did-you-mean hint."""
        if not isinstance(data, Mapping):
            raise ValueError(
                "CorrectionConfig.rejection_sampling must be a mapping of AReaL's "
                f"RejectionSamplingConfig keys or None, got {type(data).__name__}"
            )
        reject_unknown_keys("CorrectionConfig.rejection_sampling", data, cls.keys())
        return cls(**dict(data))
