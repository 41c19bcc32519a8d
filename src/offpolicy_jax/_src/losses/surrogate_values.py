"""Surrogates as values: a registered surrogate's name with its validated hyperparameters.

:func:`surrogate` builds any registered surrogate (:func:`offpolicy_jax.register_surrogate`),
:func:`ppo_clip` the default one, with keyword-only hyperparameters validated by the
surrogate's own params class; the loss entries of :mod:`offpolicy_jax.objectives` take the
value as ``surrogate=``. ``LossConfig(policy_loss=NAME, **hyperparameters)`` names the same
value by its flat keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic

from offpolicy_jax._src.losses import registry
from offpolicy_jax._src.losses.builtins import PPOClip
from offpolicy_jax._src.losses.registry import Params
from offpolicy_jax._src.messages import shown


@dataclasses.dataclass(frozen=True)
class SurrogateSpec(Generic[Params]):
    """A registered surrogate and its hyperparameters (frozen, hashable).

    Generic in the params class, so that a type checker sees the hyperparameters of a
    :func:`ppo_clip` value (``SurrogateSpec[PPOClip]``); :func:`surrogate`, which picks
    the class by name at run time, gives ``SurrogateSpec[Any]``.

    Attributes:
      name: the registered name (``LossConfig.policy_loss``).
      params: an instance of the surrogate's registered params class (validated).
    """

    name: str
    params: Params


def surrogate(name: str, **hyperparameters: Any) -> SurrogateSpec[Any]:
    """The registered surrogate ``name`` with its hyperparameters (others at their defaults).

    The built-ins and their hyperparameters are listed in docs/guide/adding_a_loss.md
    (``ppo_clip``, ``gspo``, ``cispo``, ``gmpo``, ``sapo``, ``gpg``, ...); formulas and
    papers in :mod:`offpolicy_jax._src.losses.policy_losses`.

    Args:
      name: a registered surrogate name.
      **hyperparameters: the surrogate's own hyperparameters, by keyword.

    Returns:
      A :class:`SurrogateSpec`.

    Raises:
      ValueError: an unknown ``name`` (with a did-you-mean hint), or a bad value (the
        message names the hyperparameter).
      TypeError: a keyword the surrogate does not take (naming it).

    Examples:
      >>> import offpolicy_jax as opj
      >>> opj.objectives.surrogate("gspo", clip_eps=3e-4).params.clip_eps
      0.0003
    """
    entry = registry.lookup(name, owner="surrogate: name")
    for key in hyperparameters:
        if key not in entry.param_names:
            raise TypeError(
                f"surrogate({entry.name!r}) got an unexpected keyword argument {shown(key)}; "
                f"it takes {list(entry.param_names)}"
            )
    return SurrogateSpec(entry.name, registry.build_params(entry.name, hyperparameters))


def ppo_clip(
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
) -> SurrogateSpec[PPOClip]:
    """PPO's clipped surrogate: ``ℓ = max(−r·A, −clip(r, 1 − ε, 1 + ε_high)·A)``, ``r = π_θ / π_d``.

    Schulman et al. (2017), "Proximal Policy Optimization Algorithms"; with
    ``dual_clip_c`` the dual clip ``min(ℓ, −c·A)`` for ``A < 0`` (Ye et al., 2020).

    Args:
      clip_eps: ``ε`` in ``(0, 1)``.
      clip_eps_high: ``ε_high`` (clip-higher, DAPO); None means ``ε``.
      dual_clip_c: ``c > 1``, or None (no dual clip).

    Returns:
      A :class:`SurrogateSpec` for ``"ppo_clip"``.

    Raises:
      ValueError: a bad value (the message names the argument).
    """
    return surrogate(
        "ppo_clip", clip_eps=clip_eps, clip_eps_high=clip_eps_high, dual_clip_c=dual_clip_c
    )
