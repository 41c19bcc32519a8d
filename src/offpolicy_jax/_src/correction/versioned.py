"""Rules that read the per-token policy versions: :func:`staleness`, :func:`offpolicy_prefix`.

In asynchronous RL (docs/guide/async.md) a token's *age* is
``current_version − version``. These two rules are the chain's form of the
:class:`~offpolicy_jax.CorrectionConfig` keys ``max_weight_staleness`` /
``staleness_level`` and ``mask_offpolicy_in_partial_rollout``. A rule value holds only
its hyperparameters (it is hashable, so a chain can be a static argument); the
:class:`~offpolicy_jax.rules.Correction` it is chained into builds its stage from the
``versions`` and ``current_version`` of each call
(:mod:`offpolicy_jax._src.correction.staleness`).
"""

from __future__ import annotations

import dataclasses

import jax

from offpolicy_jax._src.checks import check_choice
from offpolicy_jax._src.config.correction import STALENESS_LEVELS
from offpolicy_jax._src.correction import staleness as _staleness
from offpolicy_jax._src.correction.stages import Stage
from offpolicy_jax._src.validation import check_staleness_limit


class VersionedRule:
    """A rule that reads ``versions``: a chain builds its stage per call (:meth:`stage`)."""

    key: str = ""  # the config key it stands for, named when versions are missing

    def stage(self, versions: jax.Array, current: jax.Array, age: jax.Array) -> Stage:
        """The stage of this call: integer ``versions`` ``[..., T]``, ``current`` (shaped
        to broadcast against them) and ``age = current − versions``."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Staleness(VersionedRule):
    """The staleness rule (built by :func:`staleness`).

    Attributes:
      max_weight_staleness: the largest age kept, or None (the age metrics only).
      staleness_level: ``"sequence"`` or ``"token"``.
    """

    max_weight_staleness: int | None = None
    staleness_level: str = "sequence"
    key = "rules.staleness"

    def stage(self, versions, current, age):
        limit, level = self.max_weight_staleness, self.staleness_level
        return _staleness.Staleness(age, versions >= 0, limit, level)


@dataclasses.dataclass(frozen=True)
class OffPolicyPrefix(VersionedRule):
    """The off-policy-prefix rule (built by :func:`offpolicy_prefix`)."""

    key = "rules.offpolicy_prefix"

    def stage(self, versions, current, age):
        return _staleness.OffPolicyPrefix(versions, _staleness.prefix_order(versions, age))


def staleness(
    *, max_weight_staleness: int | None = None, staleness_level: str = "sequence"
) -> Staleness:
    """Age metrics and the staleness rule: reject what is older than ``L`` policy versions.

    With per-token ``versions`` ``v`` and the trainer's ``current_version`` ``c`` (given to
    the call: :func:`~offpolicy_jax.correct`, a :class:`~offpolicy_jax.rules.Correction`
    or a loss entry), a token's age is ``a = c − v`` (integers; a negative version has no
    age). With ``L = max_weight_staleness`` a token is stale iff ``a > L``; at
    ``staleness_level="token"`` each stale token is rejected, at ``"sequence"`` (miles'
    rule) each sequence holding one. ``CorrectionConfig(max_weight_staleness=L,
    staleness_level=...)`` builds this rule.

    Args:
      max_weight_staleness: ``L``, an int ``>= 0``, or None: only the age metrics.
      staleness_level: ``"sequence"`` (default) or ``"token"``.

    Returns:
      The rule (a frozen, hashable value). Metrics: ``mis_staleness_mean``,
      ``mis_staleness_max`` and, with ``L``, ``mis_staleness_fraction_high`` (share of
      valid tokens that are stale) and ``mis_staleness_seq_fraction``. A chain given
      ``versions`` without this rule reports the two age metrics by itself.

    Raises:
      ValueError: naming ``rules.staleness.max_weight_staleness`` or
        ``rules.staleness.staleness_level``.
    """
    owner = "rules.staleness"
    level = check_choice(owner, "staleness_level", staleness_level, STALENESS_LEVELS)
    limit = max_weight_staleness
    if limit is not None:
        check_staleness_limit(owner, limit)
        limit = int(limit)
    return Staleness(limit, level)


def offpolicy_prefix() -> OffPolicyPrefix:
    """Reject the off-policy prefix of a partial rollout (miles
    ``--mask-offpolicy-in-partial-rollout``).

    A valid token is rejected iff its version is older than the newest version among the
    valid tokens of its sequence: ``v_t < max_s v_s`` (a negative version is neither
    compared nor rejected). ``CorrectionConfig(mask_offpolicy_in_partial_rollout=True)``
    builds this rule.

    Returns:
      The rule (a frozen, hashable value); it needs ``versions`` and ``current_version``
      at the call. Metrics: ``mis_offpolicy_prefix_fraction`` (share of valid tokens
      rejected), ``mis_offpolicy_prefix_seq_fraction`` (share of sequences that mix
      versions).
    """
    return OffPolicyPrefix()
