"""Columns: what the domain asks of the engine, one per-sequence reduction each.

A :class:`Column` is a per-sequence sum, min or max of a per-token value over a
*population* (float weights ``[..., T]``, 0 outside it: padding, rejected tokens).
The domain declares columns with :func:`total`, :func:`count`, :func:`count_where`,
:func:`minimum` and :func:`maximum` and hands a dict of them to its layout
(:class:`~offpolicy_jax._src.reduction.rows.Rows`), which returns per-sequence values.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from offpolicy_jax._src.reduction.means import masked

INIT = {"sum": 0.0, "min": math.inf, "max": -math.inf}
"""Each op's identity: what a token outside the population contributes."""


class Column(NamedTuple):
    """One per-sequence reduction of a per-token value over a population.

    ``op`` is ``"sum"`` (``Σ_t x_t p_t``, with ``x`` taken as 0 where ``p_t = 0``),
    ``"min"`` or ``"max"`` (over the tokens with ``p_t > 0``; ``±inf`` for an empty
    sequence). ``value`` broadcasts against ``population``, ``[..., T]`` float
    weights that are 0 outside the population.
    """

    op: Literal["sum", "min", "max"]
    value: jax.Array | float
    population: jax.Array


def total(x: jax.Array | float, population: jax.Array) -> Column:
    """``Σ_t x_t p_t``."""
    return Column("sum", x, population)


def count(population: jax.Array) -> Column:
    """``N = Σ_t p_t``."""
    return Column("sum", 1.0, population)


def count_where(condition: jax.Array, population: jax.Array) -> Column:
    """``Σ_t [condition_t] p_t``: the population weight where ``condition`` holds."""
    return Column("sum", jnp.where(condition, 1.0, 0.0), population)


def minimum(x: jax.Array, population: jax.Array) -> Column:
    """``min_t x_t`` over the population (``+inf`` when it is empty)."""
    return Column("min", x, population)


def maximum(x: jax.Array, population: jax.Array) -> Column:
    """``max_t x_t`` over the population (``−inf`` when it is empty)."""
    return Column("max", x, population)


def operand(column: Column, shape: tuple[int, ...]) -> jax.Array:
    """The column's value where its population is, and the op's identity elsewhere
    (selected before weighting: NaN/inf outside the population never reaches a sum)."""
    if column.op == "sum":
        value = masked(column.value, column.population)
    else:
        value = jnp.where(column.population > 0, column.value, INIT[column.op])
    return jnp.broadcast_to(value, shape)


def broadcast_shape(columns, *extra: tuple[int, ...]) -> tuple[int, ...]:
    """The ``[..., T]`` shape all the columns' values and populations broadcast to."""
    return jnp.broadcast_shapes(
        *extra,
        *(jnp.shape(c.population) for c in columns),
        *(jnp.shape(c.value) for c in columns),
    )


def identity(column: Column) -> tuple:
    """What a column reduces: its op and its arrays (by identity; constants by value)."""

    def ref(x):
        return ("constant", x) if isinstance(x, int | float) else id(x)

    return (column.op, ref(column.value), ref(column.population))
