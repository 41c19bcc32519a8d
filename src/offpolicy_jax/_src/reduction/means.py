"""Means kept as (numerator, denominator) parts, so that they pool exactly.

Per-sequence terms first (:func:`seq_mean`, :func:`seq_mean_of_values`), then batch
totals (``Rows.batch_means``): adding the parts of micro-batches or devices and
dividing once gives exactly the full-batch mean. :func:`pool_metric_parts` pools
whole dicts of parts, each part by its own rule (a mean adds, a batch extreme keeps
the extreme).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp

from offpolicy_jax._src.reduction.mesh import as_mesh_axes

Reduction = Literal["sequence", "token"]
REDUCTIONS: tuple[str, ...] = ("sequence", "token")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MeanParts:
    """A mean kept as ``numerator / denominator`` so that it pools exactly.

    The base of the library's poolable types: losses (``LossParts`` is this type),
    metrics and their per-sequence terms before the batch sum. ``a + b`` pools two
    of them (micro-batches) into the same type, :meth:`all_reduce` pools them over
    mesh axes inside ``shard_map``; call :meth:`value` once, at the end. Subclasses
    pool by their own rule (a batch maximum keeps the larger one, the ESS adds its
    three sums), so pool dicts of metric parts with :func:`pool_metric_parts`, never
    with ``jax.tree.map(jnp.add, ...)``: that adds the leaves, which is right for a
    mean and wrong for a maximum.

    Examples:
      >>> import jax.numpy as jnp, offpolicy_jax as opj
      >>> a = opj.MeanParts(jnp.float32(3.0), jnp.float32(2.0))
      >>> b = opj.MeanParts(jnp.float32(1.0), jnp.float32(2.0))
      >>> float((a + b).value())
      1.0
    """

    numerator: jax.Array
    denominator: jax.Array

    def value(self) -> jax.Array:
        """``numerator / denominator``; 0 (never NaN) for an empty mean, and the numerator
        itself for a sum (denominator 0, see :func:`pooled_value`)."""
        return pooled_value(self.numerator, self.denominator)

    def __add__(self, other: MeanParts) -> MeanParts:
        if not isinstance(other, MeanParts):
            return NotImplemented
        return MeanParts(self.numerator + other.numerator, self.denominator + other.denominator)

    def all_reduce(self, axes: tuple[str, ...]) -> MeanParts:
        """These parts pooled over the named mesh axes (inside ``shard_map``): the
        numerator and the denominator ``psum``-ed, as ``+`` adds them."""
        return MeanParts(*jax.lax.psum((self.numerator, self.denominator), axes))

    def __iter__(self):  # `num, den = parts`
        return iter((self.numerator, self.denominator))


def _is_parts(x: Any) -> bool:
    return isinstance(x, MeanParts)


def _check_parts(x: Any) -> None:
    if not isinstance(x, MeanParts):
        raise TypeError(
            f"pool_metric_parts pools MeanParts (the parts policy_loss_parts and "
            f"correction_parts return), got {type(x).__name__}: a finished value (a mean, "
            "a maximum) cannot be pooled exactly"
        )


def pool_metric_parts(*parts: Any, axis_names: Any = None) -> Any:
    """Pools metric parts of micro-batches (and devices) into the full batch's parts.

    Each part pools by its own rule: a :class:`MeanParts` mean adds its numerator and
    denominator, a batch maximum or minimum (``mis_staleness_max``, a rule's ``P_max``
    / ``P_min``, ``mis_minpro_prefix_ratio_min``, the ``mis_is_ratio_*`` extremes)
    keeps the extreme over the parts that saw a sequence, ``mis_ess`` adds its sums.
    Taking :func:`~offpolicy_jax.finalize_metrics` of the result gives exactly the
    metrics of one call on the whole batch. ``jax.tree.map(jnp.add, ...)`` is wrong
    here: it adds the maxima.

    Args:
      *parts: pytrees of metric parts with the same structure (usually the metric
        dicts of ``policy_loss_parts`` for each micro-batch, or ``LossParts``).
      axis_names: inside ``shard_map``, mesh axes to pool over as well (a name or
        names): the sums are ``psum``-ed and the extremes ``pmax`` / ``pmin``-ed, so
        devices that each hold whole sequences pool exactly as micro-batches do. Not
        needed for parts computed with ``axis_names`` (they are pooled already).

    Returns:
      One pytree of the same structure.

    Raises:
      TypeError: no parts, or a leaf that is not a :class:`MeanParts` (a finished
        value), naming its type. ValueError: token (context-parallel) axes.

    Examples:
      >>> import jax.numpy as jnp, offpolicy_jax as opj
      >>> a = {"m": opj.MeanParts(jnp.float32(3.0), jnp.float32(2.0))}
      >>> b = {"m": opj.MeanParts(jnp.float32(1.0), jnp.float32(2.0))}
      >>> float(opj.finalize_metrics(opj.pool_metric_parts(a, b))["m"])
      1.0
    """
    if not parts:
        raise TypeError("pool_metric_parts needs at least one pytree of metric parts")
    jax.tree.map(_check_parts, parts[0], is_leaf=_is_parts)
    pooled = parts[0]
    for more in parts[1:]:
        pooled = jax.tree.map(lambda x, y: x + y, pooled, more, is_leaf=_is_parts)
    axes = as_mesh_axes(axis_names)
    if axes.token:
        # A sequence split over devices has per-device partial means, which no pooling
        # of finished parts makes exact: the library psums them inside the call.
        raise ValueError(
            "pool_metric_parts: axis_names may name data-parallel axes only, got token axes "
            f"{axes.token}; pass axis_names to the loss or correction instead"
        )
    names: Sequence[str] = tuple(axes.batch)
    if names:
        pooled = jax.tree.map(lambda x: x.all_reduce(tuple(names)), pooled, is_leaf=_is_parts)
    return pooled


def safe_divide(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """``numerator / denominator`` where the denominator is non-zero, else 0.

    Both branches of a ``where`` are differentiated, so the denominator is replaced
    by 1 first: dividing by 0 in the discarded branch would give NaN gradients.
    """
    nonzero = denominator != 0
    return jnp.where(nonzero, numerator / jnp.where(nonzero, denominator, 1), 0)


def pooled_value(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """The value of pooled ``(numerator, denominator)`` parts.

    ``numerator / denominator`` where the denominator is non-zero; elsewhere the
    numerator itself. A mean over an empty population has numerator 0 too, so it is 0
    (never NaN); a *sum* (the ``token_sum`` aggregation) is written with denominator 0,
    so that it pools like every mean: add the parts, then take the value.
    """
    nonzero = denominator != 0
    return jnp.where(nonzero, numerator / jnp.where(nonzero, denominator, 1), numerator)


def masked(x: jax.Array | float, population: jax.Array) -> jax.Array:
    """``x`` weighted by the population, with 0 (not NaN) outside it."""
    return jnp.where(population > 0, x, 0) * population


def seq_mean(sums: jax.Array, counts: jax.Array, reduction: Reduction) -> MeanParts:
    """Per-sequence terms of the mean of a per-token value, from ``Σ_t x m`` and ``N``.

    ``"token"``: ``Σ x m / Σ m``; ``"sequence"``: the mean over sequences with
    ``N > 0`` of ``Σ_t x m / N``.
    """
    if reduction == "token":
        return MeanParts(sums, counts)
    return seq_mean_of_values(safe_divide(sums, counts), counts, "sequence")


def seq_mean_of_values(values: jax.Array, counts: jax.Array, reduction: Reduction) -> MeanParts:
    """Per-sequence terms of the mean of one value per sequence, over the non-empty ones.

    Args:
      values: per-sequence values (may be garbage where ``counts == 0``).
      counts: per-sequence population sizes ``N``.
      reduction: ``"sequence"``: plain mean over sequences with ``N > 0``;
        ``"token"``: mean weighted by ``N`` (each token carries its sequence's value).
    """
    nonempty = counts > 0
    weight = jnp.where(nonempty, 1.0 if reduction == "sequence" else counts, 0.0)
    return MeanParts(jnp.where(nonempty, values, 0) * weight, weight)
