"""VCPO's ESS-guided step scaling as an optax gradient transformation.

Needs optax (the ``optax`` extra, ``pip install -e ".[optax]"`` in a clone; the ``demo`` and ``test`` extras
include it); ``import offpolicy_jax`` does not import this module.

    >>> import jax.numpy as jnp, optax
    >>> from offpolicy_jax.integrations.optax import scale_by_ess
    >>> optimizer = optax.chain(optax.sgd(0.5), scale_by_ess(scaling_rule="linear"))
    >>> params = {"w": jnp.ones(2)}
    >>> state = optimizer.init(params)
    >>> updates, state = optimizer.update({"w": jnp.ones(2)}, state, params, ess=0.5)
    >>> [float(u) for u in updates["w"]]  # -0.5 · 0.5
    [-0.25, -0.25]
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from offpolicy_jax import ess_learning_rate_scale
from offpolicy_jax.reduction import MeanParts

__all__ = ["ScaleByESSState", "scale_by_ess"]


class ScaleByESSState(NamedTuple):
    """State of :func:`scale_by_ess`.

    Attributes:
      lr_scale: float32 scalar, the factor the last update was multiplied by (1 before
        the first update): log it as the authors log ``ess_scaled_lr / lr``.
    """

    lr_scale: jax.Array


def scale_by_ess(
    *, base_ess_ratio: jax.typing.ArrayLike = 1.0, scaling_rule: str = "sqrt"
) -> optax.GradientTransformationExtraArgs:
    """Scales the update by VCPO's ESS factor: the learning rate times ``√min(1, ρ/ρ_base)``.

    Huang et al. (2026), "Stable Asynchrony: Variance-Controlled Off-Policy RL for
    LLMs", arXiv:2602.17616: ``η_eff = η · min(1, ρ_ess / ρ_base)^{1/2}`` (``"sqrt"``,
    for AdamW-style optimizers, the default) or ``^1`` (``"linear"``), with ``ρ_ess``
    the batch's normalised effective sample size (factor:
    :func:`offpolicy_jax.ess_learning_rate_scale`). Chain it *after* the optimizer,
    where it scales the learning rate, weight decay included, as the authors scale the
    optimizer's ``lr``: ``optax.chain(optax.adamw(lr), scale_by_ess())``. (Before an
    Adam-style optimizer it would scale the gradient, which Adam normalises away.)

    The ESS is an extra argument of ``update``:
    ``optimizer.update(grads, state, params, ess=metrics["mis_ess"])`` (``optax.chain``
    and ``optax.inject_hyperparams`` pass it on). An ESS that is not a finite number
    ``> 0`` (an empty or fully rejected batch, NaN, inf) makes the update exactly zero,
    never NaN; a missing ``ess`` raises at trace time. Pure and jit-able: no host
    synchronisation; the state is a pytree.

    Args:
      base_ess_ratio: ``ρ_base > 0`` (the authors' ``ess_scaling.base_ess_ratio``,
        default 1.0); may be injected (``optax.inject_hyperparams``).
      scaling_rule: ``"sqrt"`` (``ess_scaling.scaling_rule``, default) or ``"linear"``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update(updates, state,
      params=None, *, ess)`` takes ``ess``: a float scalar in ``[0, 1]`` (e.g.
      ``mis_ess`` of ``policy_loss``'s metrics or :func:`offpolicy_jax.sequence_ess`)
      or the pooled ``mis_ess`` :class:`~offpolicy_jax.MeanParts`.

    Raises:
      ValueError: an unknown ``scaling_rule`` or a non-positive ``base_ess_ratio``
        (at construction); ``update`` called without ``ess`` (at trace time).
    """
    # The factor's own checks, run now (a ValueError naming the argument) without computing.
    jax.eval_shape(
        lambda ess: ess_learning_rate_scale(
            ess, base_ess_ratio=base_ess_ratio, scaling_rule=scaling_rule
        ),
        jax.ShapeDtypeStruct((), jnp.float32),
    )

    def init_fn(params):
        del params
        return ScaleByESSState(lr_scale=jnp.ones((), jnp.float32))

    def update_fn(updates, state, params=None, *, ess=None, **extra_args):
        del state, params, extra_args
        if ess is None:
            raise ValueError(
                "scale_by_ess: update() needs the batch's effective sample size, e.g. "
                'optimizer.update(grads, state, params, ess=metrics["mis_ess"])'
            )
        if not isinstance(ess, MeanParts) and jnp.ndim(ess) != 0:
            raise ValueError(f"scale_by_ess: ess must be a scalar, got shape {jnp.shape(ess)}")
        scale = ess_learning_rate_scale(
            ess, base_ess_ratio=base_ess_ratio, scaling_rule=scaling_rule
        )

        def apply(u):
            # `where`, not u · 0: a skipped step is exactly zero even if u holds inf.
            return jnp.where(scale > 0, u * scale.astype(u.dtype), jnp.zeros_like(u))

        return jax.tree.map(apply, updates), ScaleByESSState(lr_scale=scale)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
