"""Means kept as (numerator, denominator) parts, so that they pool exactly.

Per-sequence terms first (:func:`seq_mean`, :func:`seq_mean_of_values`), then batch
totals (``Rows.batch_means``): adding the parts of micro-batches or devices and
dividing once gives exactly the full-batch mean.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

Reduction = Literal["sequence", "token"]
REDUCTIONS: tuple[str, ...] = ("sequence", "token")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MeanParts:
    """A mean kept as ``numerator / denominator`` so that it pools exactly.

    The one poolable type of the library: losses (``LossParts`` is this type),
    metrics and their per-sequence terms before the batch sum. ``a + b`` pools two
    of them (micro-batches, devices) into the same type; call :meth:`value` once,
    at the end. A pytree, so ``jax.tree.map(jnp.add, a, b)`` pools too.

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

    def __iter__(self):  # `num, den = parts`
        return iter((self.numerator, self.denominator))


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
