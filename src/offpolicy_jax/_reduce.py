"""The one place where masked values are summed, averaged and combined across devices.

Every reduction in the library goes through this module, so that sharding and
micro-batch pooling are solved once:

* ``seq_sum`` sums over the token axis (the last axis) of each sequence and, inside
  ``shard_map`` with a sharded token axis (context parallelism), ``psum``-s the
  per-sequence partial sums over the token mesh axes. Only ``[...]``-sized
  (per-sequence) values ever cross devices.
* ``batch_sum`` sums per-sequence values over the batch and ``psum``-s the scalar
  over the data-parallel mesh axes.
* Means are returned as :class:`MeanParts` (numerator, denominator): summing the
  parts of several micro-batches (or devices) and dividing once gives exactly the
  full-batch mean. The mean of per-shard means is never computed.

Populations are float weights of shape ``[..., T]`` that are 0 outside the
population (padding, rejected tokens). Values are selected with ``where`` before
they are weighted, so NaN/inf outside the population never reaches a sum.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple, Union

import jax
import jax.numpy as jnp

Reduction = Literal["sequence", "token"]
REDUCTIONS: tuple[str, ...] = ("sequence", "token")


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """Mesh axis names over which a call inside ``shard_map`` is split.

    Attributes:
      batch: data-parallel axes: different devices hold different sequences.
      token: context-parallel axes: different devices hold different tokens of the
        same sequences (the last array axis is sharded).
    """

    batch: tuple[str, ...] = ()
    token: tuple[str, ...] = ()

    def __post_init__(self):
        for field in ("batch", "token"):
            value = getattr(self, field)
            if isinstance(value, str):
                value = (value,)
            value = tuple(value)
            if not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"MeshAxes.{field} must be axis-name strings, got {value!r}")
            object.__setattr__(self, field, value)
        overlap = set(self.batch) & set(self.token)
        if overlap:
            raise ValueError(f"mesh axes {sorted(overlap)} are named both as batch and token axes")


AxisNames = Union[None, str, Sequence[str], MeshAxes, Mapping[str, Union[str, Sequence[str]]]]


def as_mesh_axes(axis_names: AxisNames) -> MeshAxes:
    """Normalises the ``axis_names`` argument of the public functions.

    ``None`` means unsharded; a string or a sequence of strings names data-parallel
    (batch) axes; a :class:`MeshAxes` or a mapping ``{"batch": ..., "token": ...}``
    also names context-parallel (token) axes.
    """
    if axis_names is None:
        return MeshAxes()
    if isinstance(axis_names, MeshAxes):
        return axis_names
    if isinstance(axis_names, str):
        return MeshAxes(batch=(axis_names,))
    if isinstance(axis_names, Mapping):
        unknown = set(axis_names) - {"batch", "token"}
        if unknown:
            raise ValueError(
                f"axis_names mapping has unknown keys {sorted(unknown)}; allowed: 'batch', 'token'"
            )
        return MeshAxes(batch=axis_names.get("batch", ()), token=axis_names.get("token", ()))
    if isinstance(axis_names, Sequence):
        return MeshAxes(batch=tuple(axis_names))
    raise TypeError(
        "axis_names must be None, a mesh axis name, a sequence of names, a MeshAxes or a "
        f"mapping {{'batch': ..., 'token': ...}}; got {type(axis_names).__name__}"
    )


class MeanParts(NamedTuple):
    """A mean kept as (numerator, denominator) so that it pools exactly.

    Sum the parts of micro-batches or devices, then call :meth:`value` once.
    """

    numerator: jax.Array
    denominator: jax.Array

    def value(self) -> jax.Array:
        """``numerator / denominator``, and 0 (never NaN) for an empty population."""
        return safe_divide(self.numerator, self.denominator)

    def __add__(self, other):  # type: ignore[override]  # pooling, not tuple concatenation
        return MeanParts(self.numerator + other.numerator, self.denominator + other.denominator)


def safe_divide(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """``numerator / denominator`` where the denominator is non-zero, else 0.

    Both branches of a ``where`` are differentiated, so the denominator is replaced
    by 1 first: dividing by 0 in the discarded branch would give NaN gradients.
    """
    nonzero = denominator != 0
    return jnp.where(nonzero, numerator / jnp.where(nonzero, denominator, 1), 0)


def masked(x: jax.Array, population: jax.Array) -> jax.Array:
    """``x`` weighted by the population, with 0 (not NaN) outside it."""
    return jnp.where(population > 0, x, 0) * population


def seq_sum(x: jax.Array, population: jax.Array, axes: MeshAxes) -> jax.Array:
    """Per-sequence sum ``Σ_t x_t m_t`` over the last axis, ``[..., T] -> [...]``.

    Inside ``shard_map`` with a sharded token axis the partial sums are ``psum``-ed
    over ``axes.token``: one ``[...]``-sized collective, never a ``[..., T]`` one.
    """
    total = jnp.sum(masked(x, population), axis=-1)
    return jax.lax.psum(total, axes.token) if axes.token else total


def seq_count(population: jax.Array, axes: MeshAxes) -> jax.Array:
    """Per-sequence population size ``N = Σ_t m_t``, ``[..., T] -> [...]``."""
    total = jnp.sum(population, axis=-1)
    return jax.lax.psum(total, axes.token) if axes.token else total


def seq_any(condition: jax.Array, population: jax.Array, axes: MeshAxes) -> jax.Array:
    """Per-sequence ``any(condition)`` over the population, ``[..., T] -> [...]`` bool."""
    hits = jnp.sum(jnp.where((population > 0) & condition, 1.0, 0.0), axis=-1)
    if axes.token:
        hits = jax.lax.psum(hits, axes.token)
    return hits > 0


def batch_sum(per_seq: jax.Array, axes: MeshAxes) -> jax.Array:
    """Sum of per-sequence values over every leading axis and the data-parallel devices.

    Per-sequence values are replicated across token shards, so only the batch
    axes are ``psum``-ed (a scalar collective).
    """
    total = jnp.sum(per_seq)
    return jax.lax.psum(total, axes.batch) if axes.batch else total


def token_mean_parts(x: jax.Array, population: jax.Array, axes: MeshAxes) -> MeanParts:
    """Token-weighted mean of per-token values: ``Σ x m / Σ m``."""
    return MeanParts(
        batch_sum(seq_sum(x, population, axes), axes),
        batch_sum(seq_count(population, axes), axes),
    )


def sequence_mean_parts(x: jax.Array, population: jax.Array, axes: MeshAxes) -> MeanParts:
    """Mean over non-empty sequences of each sequence's masked mean of ``x``."""
    count = seq_count(population, axes)
    per_seq_mean = safe_divide(seq_sum(x, population, axes), count)
    return per_seq_values_parts(per_seq_mean, count, "sequence", axes)


def per_seq_values_parts(
    values: jax.Array, count: jax.Array, reduction: Reduction, axes: MeshAxes
) -> MeanParts:
    """Reduces one value per sequence, ``[...]``, over the non-empty sequences.

    Args:
      values: ``[...]`` per-sequence values (may be garbage where ``count == 0``).
      count: ``[...]`` per-sequence population sizes ``N``.
      reduction: ``"sequence"``: plain mean over sequences with ``N > 0``;
        ``"token"``: mean weighted by ``N`` (each token carries its sequence's value).
      axes: mesh axes to combine over.
    """
    nonempty = count > 0
    if reduction == "sequence":
        weight = jnp.where(nonempty, 1.0, 0.0)
    else:
        weight = jnp.where(nonempty, count, 0.0)
    return MeanParts(
        batch_sum(jnp.where(nonempty, values, 0) * weight, axes), batch_sum(weight, axes)
    )


def mean_parts(
    x: jax.Array, population: jax.Array, reduction: Reduction, axes: MeshAxes
) -> MeanParts:
    """Reduces per-token values with the chosen reduction (semantics.md §4/§7).

    Args:
      x: ``[..., T]`` per-token values, or ``[..., 1]`` per-sequence values
        broadcast to every token of their sequence.
      population: ``[..., T]`` float weights, 0 outside the population.
      reduction: ``"sequence"`` (mean over non-empty sequences of their masked
        means) or ``"token"`` (mean over all tokens of the population).
      axes: mesh axes to combine over.

    Returns:
      The mean as :class:`MeanParts`; an empty population gives 0.
    """
    if reduction == "token":
        return token_mean_parts(x, population, axes)
    if x.shape[-1:] == (1,) and population.shape[-1] != 1:
        # A broadcast per-sequence value: its masked mean is the value itself, so
        # skip the sum and divide (which could also move it by an ulp).
        count = seq_count(population, axes)
        return per_seq_values_parts(x[..., 0], count, "sequence", axes)
    return sequence_mean_parts(x, population, axes)


def reduce_mean(
    x: jax.Array, population: jax.Array, reduction: Reduction, axes: MeshAxes
) -> jax.Array:
    """:func:`mean_parts` divided out: a float32 scalar, 0 for an empty population."""
    return mean_parts(x, population, reduction, axes).value()


def seq_min(x: jax.Array, population: jax.Array, axes: MeshAxes) -> jax.Array:
    """Per-sequence minimum of ``x`` over the population, ``[..., T] -> [...]`` (+inf if empty)."""
    x = jnp.broadcast_to(x, population.shape)
    low = jnp.min(jnp.where(population > 0, x, jnp.inf), axis=-1)
    return jax.lax.pmin(low, axes.token) if axes.token else low


def seq_max(x: jax.Array, population: jax.Array, axes: MeshAxes) -> jax.Array:
    """Per-sequence maximum of ``x`` over the population, ``[..., T] -> [...]`` (-inf if empty)."""
    x = jnp.broadcast_to(x, population.shape)
    high = jnp.max(jnp.where(population > 0, x, -jnp.inf), axis=-1)
    return jax.lax.pmax(high, axes.token) if axes.token else high
