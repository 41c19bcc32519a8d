"""VCPO: variance-controlled off-policy policy gradients (Huang et al., 2026).

"Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs", arXiv:2602.17616. Two
controls of the policy-gradient variance that stale rollouts inflate:

* **ESS-guided step scaling.** The learning rate is multiplied by
  ``min(1, ρ_ess / ρ_base)^{1/2}`` (``"sqrt"``, the rule for Adam-style optimizers and
  the paper's default) or ``min(1, ρ_ess / ρ_base)`` (``"linear"``), where
  ``ρ_ess = (Σ_i w_i)² / (B Σ_i w_i²)`` is the batch's normalised effective sample size
  of the sequence importance weights. :func:`sequence_ess` is that ``ρ_ess``;
  :func:`ess_learning_rate_scale` is the factor; the optax transform
  ``offpolicy_jax.integrations.optax.scale_by_ess`` applies it to an update.
* **The off-policy optimal baseline (OPOB)**, closed form, no critic:
  ``b* = Σ_i w_i² ‖∇_θ log π_θ(τ_i)‖² R_i / Σ_i w_i² ‖∇_θ log π_θ(τ_i)‖²`` over a group
  (the responses to one prompt) or the whole batch: :func:`opob_baseline`,
  :func:`opob_advantages`.

Names and defaults follow the authors' implementation (github.com/mit-han-lab/vcpo at
c7f030f: ``ess_scaling.{scaling_rule, base_ess_ratio}`` and
``grad_baselining.norm_by_std`` in ``verl/trainer/config/actor/actor.yaml``, the step in
``verl/workers/actor/megatron_actor.py``, ``compute_opob_baseline`` in
``recipe/fully_async_policy/staleness_utils.py``). Everything here is a stop-gradient
statistic: pure, jit / vmap / shard_map safe, never NaN.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax._src.reduction import AxisNames, MeanParts, as_mesh_axes

SCALING_RULES: tuple[str, ...] = ("sqrt", "linear")
# The authors floor ρ_base at 1e-8 (megatron_actor.py) and divide by σ only above 1e-8
# (megatron_actor.py's `_update_grad_buffers`).
_BASE_FLOOR = 1e-8
_STD_FLOOR = 1e-8
_F32 = np.finfo(np.float32)


def check_scaling_rule(scaling_rule: str) -> None:
    """``scaling_rule`` must be ``"sqrt"`` or ``"linear"`` (a ``ValueError`` otherwise)."""
    if scaling_rule not in SCALING_RULES:
        raise ValueError(f"scaling_rule must be one of {SCALING_RULES}, got {scaling_rule!r}")


def check_base_ess_ratio(base_ess_ratio: object) -> None:
    """A Python / NumPy ``base_ess_ratio`` must be a finite, normal float32 ``> 0``.

    A JAX array (``optax.inject_hyperparams`` passes one, traced) is not checked: it is
    floored at ``1e-8`` like the authors' code, and a NaN makes the factor 0.
    """
    if isinstance(base_ess_ratio, jax.Array):
        return
    if isinstance(base_ess_ratio, bool) or not isinstance(
        base_ess_ratio, (int, float, np.integer, np.floating)
    ):
        raise ValueError(f"base_ess_ratio must be a number, got {base_ess_ratio!r}")
    value = float(base_ess_ratio)
    if not (math.isfinite(value) and float(_F32.tiny) <= value <= float(_F32.max)):
        raise ValueError(
            f"base_ess_ratio must be a finite float32 > 0 (normal), got {base_ess_ratio!r}"
        )


def ess_learning_rate_scale(
    ess: jax.typing.ArrayLike | MeanParts,
    *,
    base_ess_ratio: jax.typing.ArrayLike = 1.0,
    scaling_rule: str = "sqrt",
) -> jax.Array:
    """VCPO's learning-rate factor from the batch's effective sample size.

    ``s = min(1, ρ_ess / ρ_base)``; the factor is ``√s`` (``"sqrt"``) or ``s``
    (``"linear"``). Huang et al. (2026), arXiv:2602.17616: ``η_eff ∝ √ρ_ess``, the
    square-root rule for AdamW-style optimizers (linear for SGD). An ESS that is not a
    finite number ``> 0`` (0 for an empty or fully rejected batch, NaN, ±inf) gives
    factor 0: the step is skipped, as the authors' code does when it has no ESS.

    Args:
      ess: the normalised ESS ``ρ_ess`` in ``[0, 1]``, a scalar (or any shape): e.g.
        ``metrics["mis_ess"]`` of :func:`~offpolicy_jax.policy_loss` or
        :func:`sequence_ess`; a :class:`~offpolicy_jax.MeanParts` (the pooled
        ``mis_ess`` parts of ``policy_loss_parts``) is divided out first.
      base_ess_ratio: ``ρ_base > 0`` (``ess_scaling.base_ess_ratio``, default 1): the
        ESS from which on the full learning rate is used.
      scaling_rule: ``"sqrt"`` (``ess_scaling.scaling_rule``, default) or ``"linear"``.

    Returns:
      float32 factor in ``[0, 1]``, the shape of ``ess``; no gradient.

    Raises:
      ValueError: an unknown ``scaling_rule`` or a non-positive / non-finite
        ``base_ess_ratio``.

    Examples:
      >>> import offpolicy_jax as opj
      >>> round(float(opj.ess_learning_rate_scale(0.25)), 4)  # √0.25
      0.5
      >>> float(opj.ess_learning_rate_scale(float("nan")))  # no ESS: the step is skipped
      0.0
    """
    check_scaling_rule(scaling_rule)
    check_base_ess_ratio(base_ess_ratio)
    if isinstance(ess, MeanParts):
        ess = ess.value()
    rho = jax.lax.stop_gradient(jnp.asarray(ess, jnp.float32))
    base = jnp.maximum(jnp.asarray(base_ess_ratio, jnp.float32), _BASE_FLOOR)
    ratio = rho / base
    usable = jnp.isfinite(ratio) & (ratio > 0)
    linear = jnp.where(usable, jnp.minimum(ratio, 1.0), 0.0)
    return jnp.sqrt(linear) if scaling_rule == "sqrt" else linear


def _broadcast(name_values: dict[str, jax.typing.ArrayLike | None]) -> dict[str, jax.Array]:
    """The given arrays as float32 / bool arrays of one shape ``[..., N]`` (N >= 1)."""
    arrays = {k: jnp.asarray(v) for k, v in name_values.items() if v is not None}
    try:
        shape = jnp.broadcast_shapes(*(a.shape for a in arrays.values()))
    except ValueError:
        shapes = ", ".join(f"{k} {a.shape}" for k, a in arrays.items())
        raise ValueError(f"the arguments' shapes do not broadcast: {shapes}") from None
    if len(shape) == 0:
        raise ValueError(
            f"{', '.join(arrays)} must have at least one axis (the last is the group); got scalars"
        )
    return {k: jnp.broadcast_to(a, shape) for k, a in arrays.items()}


def sequence_ess(
    log_weights: jax.typing.ArrayLike,
    *,
    where: jax.typing.ArrayLike | None = None,
    axis_names: AxisNames = None,
) -> jax.Array:
    """The normalised effective sample size ``ρ_ess`` of per-sequence IS weights.

    ``ρ_ess = ESS / B = (Σ_i w_i)² / (B Σ_i w_i²)`` with ``w_i = exp(log_weights_i)``
    over the ``B`` counted sequences (Huang et al., 2026, arXiv:2602.17616, the
    quantity VCPO's step scaling reads; ``compute_ess_info`` of the authors' code).
    Computed as ``(Σ e^{l−m})² / (B Σ e^{2(l−m)})`` with ``m = max l``: exact and free
    of overflow for any finite log-weight (the authors' code exponentiates first).
    A log-weight of ``−inf`` is a weight of 0 and counts; NaN or ``+inf`` does not (as
    a non-finite input rejects its sequence in the loss). No counted sequence, or only
    zero weights, gives 0.

    The authors' default reads the unclipped sequence ratio
    ``Σ_t (log π_old − log π_rollout)`` (``ess_scaling.use_clipped: false``); for their
    ``use_clipped: true`` pass ``jnp.minimum(l, log C)``. The library's ``mis_ess``
    metric is the same formula over kept *tokens* with the final (truncated) weights.

    Args:
      log_weights: ``[...]`` per-sequence ``log w_i`` (any leading shape; every entry
        is one sequence of the batch).
      where: optional ``[...]`` bool: the sequences that count.
      axis_names: inside ``shard_map``, the mesh axes the sequences are split over
        (data parallel); the sums and the max are reduced over them. Token (context
        parallel) axes of a :class:`~offpolicy_jax.MeshAxes` are ignored: per-sequence
        values are the same on them.

    Returns:
      float32 scalar in ``[0, 1]``; no gradient.

    Examples:
      >>> import jax.numpy as jnp, offpolicy_jax as opj
      >>> round(float(opj.sequence_ess(jnp.log(jnp.array([1.0, 1.0, 2.0, 4.0])))), 4)
      0.7273
    """
    arrays = _broadcast({"log_weights": log_weights, "where": where})
    logw = jax.lax.stop_gradient(arrays["log_weights"].astype(jnp.float32))
    counted = _usable_log_weights(logw)
    if where is not None:
        counted &= arrays["where"].astype(bool)
    batch_axes = as_mesh_axes(axis_names).batch
    top = jnp.max(jnp.where(counted, logw, -jnp.inf), initial=-jnp.inf)
    n = jnp.sum(counted, dtype=jnp.float32)
    if batch_axes:
        top, n = jax.lax.pmax(top, batch_axes), jax.lax.psum(n, batch_axes)
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    scaled = jnp.where(counted, logw - shift, -jnp.inf)
    sums = jnp.stack([jnp.sum(jnp.exp(scaled)), jnp.sum(jnp.exp(2.0 * scaled))])
    if batch_axes:
        sums = jax.lax.psum(sums, batch_axes)
    sum_w, sum_w2 = sums[0], sums[1]
    # The largest counted term is e^0 = 1, so sum_w2 >= 1 unless every weight is 0.
    denominator = n * sum_w2
    nonzero = denominator > 0
    return jnp.where(nonzero, sum_w * sum_w / jnp.where(nonzero, denominator, 1.0), 0.0)


def _usable_log_weights(log_w: jax.Array) -> jax.Array:
    """A log-weight counts unless it is NaN or ``+inf`` (``−inf`` is a weight of 0)."""
    return ~jnp.isnan(log_w) & (log_w < jnp.inf)


def _opob_inputs(returns, grad_sq_norms, log_weights, where):
    """float32 ``R``, ``‖g‖²``, ``log w`` and the counted mask, all ``[..., N]``."""
    arrays = _broadcast(
        {
            "returns": returns,
            "grad_sq_norms": grad_sq_norms,
            "log_weights": log_weights,
            "where": where,
        }
    )
    stop = jax.lax.stop_gradient
    r = stop(arrays["returns"].astype(jnp.float32))
    g2 = stop(arrays["grad_sq_norms"].astype(jnp.float32))
    log_w = None
    counted = jnp.isfinite(r) & jnp.isfinite(g2) & (g2 >= 0)
    if log_weights is not None:
        log_w = stop(arrays["log_weights"].astype(jnp.float32))
        counted &= _usable_log_weights(log_w)
    if where is not None:
        counted &= arrays["where"].astype(bool)
    return r, g2, log_w, counted


def _weighted_sums(big, r, counted, batch_axes) -> jax.Array:
    """``[Σ W R, Σ W]`` over the last axis (stacked on a new first axis)."""
    weight = jnp.where(counted, big, 0.0)
    sums = jnp.stack([jnp.sum(jnp.where(counted, weight * r, 0.0), -1), jnp.sum(weight, -1)])
    return jax.lax.psum(sums, batch_axes) if batch_axes else sums


def _group_baseline(r, g2, log_w, counted, batch_axes) -> jax.Array:
    """``Σ W R / Σ W`` over the last axis, ``W = w² ‖g‖²``, overflow-free."""
    raw = g2 if log_w is None else jnp.exp(2.0 * jnp.where(counted, log_w, 0.0)) * g2
    direct = _weighted_sums(raw, r, counted, batch_axes)
    fine = jnp.all(jnp.isfinite(direct), axis=0) & (direct[1] >= _F32.tiny)
    # Where W or its sums overflow (a long sequence's ratio e^50, or e^20 times a
    # large ‖g‖²) or underflow, the same ratio from log W minus its group maximum:
    # every term in [0, 1], the largest exactly 1.
    log_big = jnp.log(jnp.where(counted, g2, 0.0))
    if log_w is not None:
        log_big = log_big + 2.0 * jnp.where(counted, log_w, 0.0)
    log_big = jnp.where(counted, log_big, -jnp.inf)
    top = jnp.max(log_big, axis=-1, keepdims=True, initial=-jnp.inf)
    if batch_axes:
        top = jax.lax.pmax(top, batch_axes)
    scaled = _weighted_sums(
        jnp.exp(log_big - jnp.where(jnp.isfinite(top), top, 0.0)), r, counted, batch_axes
    )
    sums = jnp.where(fine, direct, scaled)
    return MeanParts(sums[0], sums[1]).value()


def opob_baseline(
    returns: jax.typing.ArrayLike,
    grad_sq_norms: jax.typing.ArrayLike,
    *,
    log_weights: jax.typing.ArrayLike | None = None,
    where: jax.typing.ArrayLike | None = None,
    axis_names: AxisNames = None,
) -> jax.Array:
    """VCPO's closed-form off-policy optimal baseline (OPOB), one per group.

    ``b* = Σ_i w_i² ‖∇_θ log π_θ(τ_i)‖² R_i / Σ_i w_i² ‖∇_θ log π_θ(τ_i)‖²`` over the
    last axis (Huang et al., 2026, arXiv:2602.17616): the baseline that minimises the
    variance of the importance-weighted estimator ``Σ_i w_i (R_i − b) ∇ log π_θ(τ_i)``.
    Without ``log_weights`` it is the on-policy optimal baseline (the authors'
    ``grad_baselining.use_is_weights: false``). The authors add ``1e-8`` to the
    denominator; here the division is exact and overflow-free (``W`` is rescaled by
    its group maximum when it leaves float32's range), and a group without weight (no
    counted sequence, or every ``W_i = 0``) gets 0. A sequence with a non-finite
    return, a non-finite or negative ``‖g‖²``, or a NaN / ``+inf`` log-weight is not
    counted.

    Args:
      returns: ``[..., N]`` ``R_i``: the rewards of the ``N`` responses to one prompt
        (the authors' ``scope: group``), or the advantages of the whole batch as one
        group (``scope: minibatch``).
      grad_sq_norms: ``[..., N]`` ``‖∇_θ log π_θ(τ_i)‖²``, the squared norm of the
        gradient of each sequence's summed log-probability (e.g. ``jax.vmap`` of
        ``jax.grad``; see docs/guide/training_step.md).
      log_weights: optional ``[..., N]`` ``log w_i`` of the sequence IS weights (e.g.
        ``Σ_t (log π_old − log π_rollout)`` over the sequence's tokens; ``−inf`` is a
        weight of 0); None = all weights 1.
      where: optional ``[..., N]`` bool: the sequences that count (padding groups to
        a common ``N``: garbage outside ``where`` never reaches the result).
      axis_names: inside ``shard_map``, mesh axes the *last* axis is split over (a
        ``scope: minibatch`` group split over data-parallel devices).

    Returns:
      ``[...]`` float32, one baseline per group; no gradient.

    Examples:
      >>> import jax.numpy as jnp, offpolicy_jax as opj
      >>> b = opj.opob_baseline(jnp.array([1.0, 0.0]), jnp.array([3.0, 1.0]))
      >>> float(b)  # (3·1 + 1·0) / (3 + 1)
      0.75
    """
    r, g2, log_w, counted = _opob_inputs(returns, grad_sq_norms, log_weights, where)
    return _group_baseline(r, g2, log_w, counted, as_mesh_axes(axis_names).batch)


def opob_advantages(
    returns: jax.typing.ArrayLike,
    grad_sq_norms: jax.typing.ArrayLike,
    *,
    log_weights: jax.typing.ArrayLike | None = None,
    where: jax.typing.ArrayLike | None = None,
    norm_by_std: bool = False,
    axis_names: AxisNames = None,
) -> jax.Array:
    """Advantages with VCPO's off-policy optimal baseline: ``A_i = (R_i − b*) / σ``.

    ``b*`` is :func:`opob_baseline` of the group (the last axis). With
    ``norm_by_std`` (the authors' ``grad_baselining.norm_by_std``), ``σ`` is the
    population standard deviation of the group's counted ``R`` and the division is
    made only where ``σ > 1e-8``, as in their code; otherwise ``σ = 1``. Passing these
    advantages to a policy-gradient loss gives the paper's update
    ``Σ_i w_i (R_i − b*) ∇ log π_θ(τ_i)`` (Huang et al., 2026, arXiv:2602.17616).

    Args:
      returns: ``[..., N]`` ``R_i`` (see :func:`opob_baseline`).
      grad_sq_norms: ``[..., N]`` ``‖∇_θ log π_θ(τ_i)‖²``.
      log_weights: optional ``[..., N]`` ``log w_i`` of the sequence IS weights.
      where: optional ``[..., N]`` bool: the sequences that count.
      norm_by_std: divide by the group's reward standard deviation.
      axis_names: inside ``shard_map``, mesh axes the last axis is split over.

    Returns:
      ``[..., N]`` float32 advantages, 0 where a sequence does not count; no gradient.

    Examples:
      >>> import jax.numpy as jnp, offpolicy_jax as opj
      >>> a = opj.opob_advantages(jnp.array([1.0, 0.0]), jnp.array([3.0, 1.0]))
      >>> [float(x) for x in a]  # b* = 0.75
      [0.25, -0.75]
    """
    r, g2, log_w, counted = _opob_inputs(returns, grad_sq_norms, log_weights, where)
    batch_axes = as_mesh_axes(axis_names).batch
    centred = r - _group_baseline(r, g2, log_w, counted, batch_axes)[..., None]
    if norm_by_std:
        std = _group_std(r, counted, batch_axes)[..., None]
        centred = jnp.where(std > _STD_FLOOR, centred / jnp.where(std > 0, std, 1.0), centred)
    return jnp.where(counted, centred, 0.0)


def _group_std(r: jax.Array, counted: jax.Array, batch_axes: tuple[str, ...]) -> jax.Array:
    """Population standard deviation of ``r`` over the counted entries of the last axis."""

    def total(x):
        s = jnp.sum(jnp.where(counted, x, 0.0), -1)
        return jax.lax.psum(s, batch_axes) if batch_axes else s

    n = total(jnp.ones_like(r))
    mean = MeanParts(total(r), n).value()[..., None]
    # Two passes (mean, then squared deviations): no cancellation of E[R²] − E[R]².
    var = MeanParts(total(jnp.square(r - mean)), n).value()
    return jnp.sqrt(var)
