"""Covariance-based token selection of Clip-Cov and KL-Cov (Cui et al. 2025).

Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models" (arXiv:2505.22617), control the policy's entropy through the few tokens whose
centred covariance

    ``cov_t = (A_t − Ā)·(θ_t − θ̄)``,   ``Ā``, ``θ̄`` the means over the call's tokens,

is largest: Clip-Cov takes a random few with ``lb < cov_t < ub`` out of the gradient,
KL-Cov adds a KL penalty to the top ``k``. This module selects those tokens as verl does
(``compute_policy_loss_clip_cov`` / ``compute_policy_loss_kl_cov`` in
``verl/trainer/ppo/core_algos.py``), as pure, jit-able functions:

* the *population* is the tokens of the mask after rejection ``m'`` in sequences whose
  ``log π_θ`` is finite at every valid token (a non-finite one takes its sequence out
  of the loss); verl's ``response_mask``;
* the number of tokens ``k = max(int(ratio · n), 1)`` (``n`` the population's size) is
  Python's: the float64 product truncated, for a traced ``n`` (:func:`selection_count`);
* the selection is over the tokens this call sees, a *micro-batch* in a training loop
  (as verl: it does not pool across micro-batches, though the loss's parts do). Under
  ``jit`` with sharded arrays the arrays are global, so the selection is that of the
  whole call; inside ``shard_map`` with ``axis_names`` the means are ``psum`` -ed and the
  few per-token values the ranking needs are all-gathered, so every device selects
  as the unsharded call would and keeps its own block. (The means are float32 sums:
  summed in another order, a covariance within rounding of a band edge or of the
  ``k``-th largest can decide the other way, as it can between verl and this library.)

Order and ties, deterministic: tokens are ranked in the row-major ("flat") order of the
batch. KL-Cov ranks the population by ``cov`` descending, equal values by flat position.
Clip-Cov gives the ``j``-th token of the population (flat order, counting from 0) the
priority ``bits(fold_in(key, j))`` (uint32) and keeps the ``k`` candidates of smallest
priority, equal ones by flat position: the same key picks the same tokens whether the
batch is padded, packed (``segment_ids``, sequences in order) or sharded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from offpolicy_jax import reduction as _reduce
from offpolicy_jax.losses.registry import SurrogateInput

__all__ = ["covariance", "population", "select_random", "select_top", "selection_count"]


def population(x: SurrogateInput) -> jax.Array:
    """The tokens the selection sees: ``m' > 0`` in sequences with a finite ``log π_θ``.

    Args:
      x: the surrogate's input.

    Returns:
      ``[..., T]`` bool.
    """
    valid = jnp.where(x.valid, 1.0, 0.0)
    bad = x.layout.reduce({"bad": _reduce.count_where(~jnp.isfinite(x.logp), valid)})["bad"]
    finite = x.layout.broadcast(bad == 0)
    return (x.mask > 0) & jnp.broadcast_to(finite, x.mask.shape)


def _psum(value, axes) -> jax.Array:
    names = tuple(axes.batch) + tuple(axes.token)
    return jax.lax.psum(value, names) if names else value


def covariance(x: SurrogateInput, members: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``cov_t = (A_t − Ā)·(θ_t − θ̄)`` over ``members`` (stop-gradient), and their count.

    ``Ā = Σ A / n`` and ``θ̄ = Σ θ / n`` over the members of the whole call (all devices
    of ``x.layout.axes``); ``cov`` is 0 outside ``members``, and everything is 0 when
    there are none.

    Args:
      x: the surrogate's input.
      members: ``[..., T]`` bool, :func:`population`.

    Returns:
      ``(cov [..., T] float32, n)``, ``n`` the global number of members (float32 scalar).
    """
    theta = jax.lax.stop_gradient(jnp.where(members, x.logp, 0.0))
    adv = jax.lax.stop_gradient(jnp.where(members, x.advantages, 0.0))
    sums = _psum(
        (jnp.sum(adv), jnp.sum(theta), jnp.sum(jnp.where(members, 1.0, 0.0))), x.layout.axes
    )
    n = sums[2]
    safe_n = jnp.where(n > 0, n, 1.0)
    cov = (adv - sums[0] / safe_n) * (theta - sums[1] / safe_n)
    return jnp.where(members, cov, 0.0), n


@functools.lru_cache(maxsize=64)
def _count_thresholds(ratio: float, size: int) -> np.ndarray:
    """``n_m``, the least ``n`` with ``int(ratio * n) >= m``, for ``m = 1 .. int(ratio * size)``.

    ``int(ratio * n)`` (a float64 product, truncated) is non-decreasing in ``n``, so
    ``int(ratio * n) = #{m : n_m <= n}``. Computed on the host, exactly as Python does.
    """
    top = int(ratio * size)
    m = np.arange(1, top + 1, dtype=np.int64)
    guess = np.ceil(m / ratio).astype(np.int64)

    def count(n):
        return (ratio * n.astype(np.float64)).astype(np.int64)

    for _ in range(64):  # the guess is off by at most a few: fix it where it is
        lower = (guess > 0) & (count(guess - 1) >= m)
        higher = count(guess) < m
        if not (lower.any() or higher.any()):
            return guess.astype(np.int32)
        guess = guess - lower + higher
    raise AssertionError(f"selection thresholds did not settle for ratio {ratio!r}")


def selection_count(ratio: float, n: jax.Array, size: int) -> jax.Array:
    """``k = max(int(ratio · n), 1)`` as Python computes it (float64), for a traced ``n``.

    Args:
      ratio: the selection ratio (static), ``0 < ratio <= 1``.
      n: the number of members, a float32 or int scalar (traced), ``0 <= n <= size``.
      size: static upper bound of ``n`` (the number of tokens).

    Returns:
      int32 scalar ``k``.

    The thresholds are a constant of ``int(ratio · size)`` int32 values (host-computed,
    cached): small at verl's ratios (2e-4 of the tokens), as large as the batch at 1.
    """
    thresholds = jnp.asarray(_count_thresholds(float(ratio), int(size)))
    k = jnp.sum(jnp.where(thresholds <= n, 1, 0), dtype=jnp.int32)
    return jnp.maximum(k, 1)


def _gather(values: jax.Array, axes) -> tuple[jax.Array, int]:
    """The global array of a shard_map block (the token axis, then the batch axis) and
    the length of axis 0 before the batch axis was gathered."""
    if axes.token:
        values = jax.lax.all_gather(values, axes.token, axis=values.ndim - 1, tiled=True)
    rows = values.shape[0]
    if axes.batch:
        values = jax.lax.all_gather(values, axes.batch, axis=0, tiled=True)
    return values, rows


def _block(values: jax.Array, rows: int, length: int, axes) -> jax.Array:
    """This device's block of a global array (the inverse of :func:`_gather`): ``rows``
    along axis 0, then ``length`` along the last axis."""
    if axes.batch:
        start = jax.lax.axis_index(axes.batch) * rows
        values = jax.lax.dynamic_slice_in_dim(values, start, rows, axis=0)
    if axes.token:
        start = jax.lax.axis_index(axes.token) * length
        values = jax.lax.dynamic_slice_in_dim(values, start, length, axis=values.ndim - 1)
    return values


def _first_k(keys: tuple[jax.Array, ...], k: jax.Array) -> jax.Array:
    """Flat bool: the ``k`` first positions in the order of ``keys`` (lexicographic,
    then flat position)."""
    size = keys[0].shape[0]
    position = jnp.arange(size, dtype=jnp.int32)
    order = jax.lax.sort((*keys, position), num_keys=len(keys) + 1)[-1]
    return jnp.zeros(size, bool).at[order].set(position < k)


def _explicit_spec(x: jax.Array) -> P | None:
    """``x``'s ``PartitionSpec`` where it is sharded in its type (``jit`` with
    ``NamedSharding`` on an ``AxisType.Explicit`` mesh), else None."""
    try:
        spec = jax.typeof(x).sharding.spec
    except AttributeError:
        return None
    return spec if any(entry is not None for entry in spec) else None


def _on_global(select, arrays: tuple[jax.Array, ...], axes) -> jax.Array:
    """``select`` (flat global arrays -> flat bool) on the call's global arrays; the
    result as this device's ``[..., T]`` block. Arrays sharded in their type (explicit
    sharding) are replicated for the ranking (flattening a sharded array is refused) and
    the result is sharded back like them."""
    spec = _explicit_spec(arrays[0])
    if spec is not None:
        arrays = tuple(jax.sharding.reshard(a, P()) for a in arrays)
    length = arrays[0].shape[-1]
    gathered = [_gather(a, axes) for a in arrays]
    full, rows = gathered[0]
    chosen = select(*(a.reshape(-1) for a, _ in gathered)).reshape(full.shape)
    chosen = _block(chosen, rows, length, axes)
    return chosen if spec is None else jax.sharding.reshard(chosen, spec)


def select_top(cov: jax.Array, members: jax.Array, n: jax.Array, ratio: float, axes) -> jax.Array:
    """KL-Cov's tokens: the ``k = max(int(ratio · n), 1)`` members of largest ``cov``.

    Equal covariances are ranked by flat position (torch.topk leaves ties unspecified).

    Args:
      cov: ``[..., T]`` covariances (:func:`covariance`).
      members: ``[..., T]`` bool, the population (none: nothing is selected).
      n: the global number of members.
      ratio: ``kl_cov_ratio`` (static).
      axes: the call's :class:`~offpolicy_jax.MeshAxes`.

    Returns:
      ``[..., T]`` bool, the selected tokens.
    """

    def select(cov, members):
        k = selection_count(ratio, n, cov.shape[0])
        outside = jnp.where(members, 0, 1).astype(jnp.int32)
        descending = -jnp.where(members, cov, 0.0) + 0.0  # + 0.0: −0.0 ranks as 0.0
        return members & _first_k((outside, descending), k)

    return _on_global(select, (cov, members), axes)


def select_random(
    candidates: jax.Array,
    members: jax.Array,
    n: jax.Array,
    ratio: float,
    key: jax.Array,
    axes,
) -> jax.Array:
    """Clip-Cov's tokens: ``min(k, #candidates)`` candidates chosen at random by ``key``.

    ``k = max(int(ratio · n), 1)``; the candidates of smallest priority
    ``bits(fold_in(key, j))`` win, ``j`` a token's index among the members in flat order
    (equal priorities: by flat position). verl draws ``torch.randperm`` instead: the
    same distribution (a uniformly random subset of that size), other draws.

    Args:
      candidates: ``[..., T]`` bool, a subset of ``members``.
      members: ``[..., T]`` bool, the population (indexes the priorities).
      n: the global number of members.
      ratio: ``clip_cov_ratio`` (static).
      key: a typed PRNG key.
      axes: the call's :class:`~offpolicy_jax.MeshAxes`.

    Returns:
      ``[..., T]`` bool, the selected tokens.
    """

    def select(candidates, members):
        k = selection_count(ratio, n, candidates.shape[0])
        index = jnp.cumsum(jnp.where(members, 1, 0), dtype=jnp.int32) - 1
        draw = jax.vmap(lambda j: jax.random.bits(jax.random.fold_in(key, j), (), jnp.uint32))
        priority = jnp.where(candidates, draw(index), jnp.uint32(0))
        outside = jnp.where(candidates, 0, 1).astype(jnp.int32)
        return candidates & _first_k((outside, priority), k)

    return _on_global(select, (candidates, members), axes)
