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
call's global batch, with ``jax.lax.top_k`` on a float32 key (equal values: the lower
flat position first) of static size ``max(int(ratio · size), 1)`` (``size`` the number
of tokens, ``k`` never more), so no sort over the tokens (the work grows with the ratio:
a sort of every token at ratio 1; times in ``benchmarks/``). KL-Cov ranks the population by ``cov`` descending; a
non-finite covariance ranks lowest (NaN and −inf as the lowest finite float32; +inf
highest). Clip-Cov gives the token at flat position ``j`` the priority
``fmix32(fmix32(j) ^ seed) >> 8`` (:func:`priorities`, ``seed = bits(key)``) and keeps
the ``k`` candidates of smallest priority: the same key picks the same tokens sharded
or not (the gathered positions are the global ones), but different, equally random,
tokens in a padded and a packed (``segment_ids``) layout of the same sequences.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from offpolicy_jax._src import reduction as _reduce
from offpolicy_jax._src.losses.registry import SurrogateInput

__all__ = [
    "covariance",
    "priorities",
    "select_random",
    "select_top",
    "selection_count",
]


def covariance(x: SurrogateInput) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The population, ``cov_t = (A_t − Ā)·(θ_t − θ̄)`` over it (stop-gradient), its size.

    The population (the *members*) is the tokens with ``m' > 0`` in sequences whose
    ``log π_θ`` is finite at every valid token. ``Ā = Σ A / n`` and ``θ̄ = Σ θ / n``
    over the members of the whole call (all devices of ``x.layout.axes``); ``cov`` is
    0 outside the members, and everything is 0 when there are none.

    A sequence is in or out as a whole, so the members' sums are the per-sequence sums
    over ``m' > 0`` of the sequences in: one pass of the layout takes them with the
    non-finite count that decides it (a sequence out is dropped with ``where``, NaN
    and all).

    Args:
      x: the surrogate's input.

    Returns:
      ``(members [..., T] bool, cov [..., T] float32, n)``, ``n`` the global number of
      members (float32 scalar).
    """
    kept = jnp.where(x.mask > 0, 1.0, 0.0)
    theta = jax.lax.stop_gradient(x.logp)
    adv = jax.lax.stop_gradient(x.advantages)
    per_seq = x.layout.reduce(
        {
            "bad": _reduce.count_where(~jnp.isfinite(x.logp), jnp.where(x.valid, 1.0, 0.0)),
            "adv": _reduce.total(adv, kept),
            "theta": _reduce.total(theta, kept),
            "count": _reduce.count(kept),
        }
    )
    finite = per_seq["bad"] == 0
    count = jnp.where(finite, per_seq["count"], 0.0)
    means = x.layout.batch_means(
        {k: _reduce.MeanParts(jnp.where(finite, per_seq[k], 0.0), count) for k in ("adv", "theta")}
    )
    members = (x.mask > 0) & jnp.broadcast_to(x.layout.broadcast(finite), x.mask.shape)
    cov = (adv - means["adv"].value()) * (theta - means["theta"].value())
    return members, jnp.where(members, cov, 0.0), means["adv"].denominator


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


def _top(key: jax.Array, eligible: jax.Array, k: jax.Array, kmax: int) -> jax.Array:
    """Flat bool: the ``k`` (``<= kmax``, static) largest of the float32 ``key``, equal
    values by flat position (``jax.lax.top_k``'s order), kept where ``eligible``."""
    size = key.shape[0]
    kmax = min(kmax, size)
    if kmax == 0:
        return jnp.zeros(size, bool)
    idx = jax.lax.top_k(key, kmax)[1]
    keep = (jnp.arange(kmax) < k) & eligible[idx]
    return jnp.zeros(size, bool).at[idx].set(keep)


def _fmix32(h: jax.Array) -> jax.Array:
    """A bijective 32-bit integer finaliser (xor-shift-multiply, "lowbias32", C. Wellons)."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x7FEB352D)
    h = (h ^ (h >> 15)) * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def priorities(key: jax.Array, size: int) -> jax.Array:
    """Clip-Cov's priorities of the flat positions ``0 .. size − 1``: float32 integers
    in ``[0, 2^24)``, ``fmix32(fmix32(j) ^ seed) >> 8``, ``seed = bits(key)`` (uint32).

    A counter-based hash of (seed, position), a few integer operations a token (a
    ``fold_in`` per token is a whole threefry); 24 bits so that a float32 holds them
    exactly and the ranking runs on the same float32 ``jax.lax.top_k`` as KL-Cov's.

    Args:
      key: a typed PRNG key (or raw ``uint32[2]`` key data).
      size: the number of positions (static).

    Returns:
      ``[size]`` float32.
    """
    seed = jax.random.bits(key, (), jnp.uint32)
    position = jnp.arange(size, dtype=jnp.uint32)
    return (_fmix32(_fmix32(position) ^ seed) >> 8).astype(jnp.float32)


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


def _kmax(ratio: float, size: int) -> int:
    """The static bound of ``k``: ``max(int(ratio · size), 1)`` (``n <= size``)."""
    return max(int(float(ratio) * int(size)), 1)


def select_top(cov: jax.Array, members: jax.Array, n: jax.Array, ratio: float, axes) -> jax.Array:
    """KL-Cov's tokens: the ``k = max(int(ratio · n), 1)`` members of largest ``cov``.

    Equal covariances are ranked by flat position (torch.topk leaves ties unspecified);
    a non-finite covariance ranks lowest (NaN and −inf as the lowest finite float32,
    +inf above all), still above the non-members.

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
        size = cov.shape[0]
        k = selection_count(ratio, n, size)
        lowest = jnp.finfo(jnp.float32).min
        value = jnp.where(jnp.isnan(cov) | (cov == -jnp.inf), lowest, cov + 0.0)  # −0.0 → 0.0
        return _top(jnp.where(members, value, -jnp.inf), members, k, _kmax(ratio, size))

    return _on_global(select, (cov, members), axes)


def select_random(
    candidates: jax.Array,
    n: jax.Array,
    ratio: float,
    key: jax.Array,
    axes,
) -> jax.Array:
    """Clip-Cov's tokens: ``min(k, #candidates)`` candidates chosen at random by ``key``.

    ``k = max(int(ratio · n), 1)``; the candidates of smallest :func:`priorities`
    (those of their flat positions in the call's global ``[..., T]`` arrays) win, equal
    priorities by flat position. verl draws ``torch.randperm`` instead: the same
    distribution (a uniformly random subset of that size), other draws. The priorities
    are by position, so one key picks different (equally random) tokens in a padded
    and a packed layout of the same sequences, and the same tokens sharded or not.

    Args:
      candidates: ``[..., T]`` bool, a subset of the population.
      n: the global number of members of the population.
      ratio: ``clip_cov_ratio`` (static).
      key: a typed PRNG key.
      axes: the call's :class:`~offpolicy_jax.MeshAxes`.

    Returns:
      ``[..., T]`` bool, the selected tokens.
    """

    def select(candidates):
        size = candidates.shape[0]
        k = selection_count(ratio, n, size)
        rank = jnp.where(candidates, 0.0 - priorities(key, size), -jnp.inf)
        return _top(rank, candidates, k, _kmax(ratio, size))

    return _on_global(select, (candidates,), axes)
