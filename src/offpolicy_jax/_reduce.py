"""Reductions: the one place where masked values are summed, averaged and pooled.

Every reduction of the library goes through this module, so that sharding,
micro-batch pooling and (later) packed sequences are solved once:

* A :class:`Column` is a per-sequence sum, min or max of a per-token value over a
  *population* (float weights ``[..., T]``, 0 outside it: padding, rejected tokens).
* A layout (:class:`Rows`: one sequence per row) reduces a dict of columns to
  per-sequence values in one go (fused on CPU by :mod:`offpolicy_jax._fusion`),
  ``psum``-s them over context-parallel mesh axes, broadcasts per-sequence values
  back to tokens, and sums per-sequence terms over the batch (``batch_means``) with
  one ``psum`` of scalars over the data-parallel axes. Only per-sequence values
  ever cross devices.
* Means are :class:`MeanParts` (numerator, denominator), first as per-sequence
  terms (:func:`seq_mean`, :func:`seq_mean_of_values`), then batch totals: adding
  the parts of micro-batches or devices and dividing once gives exactly the
  full-batch mean.

Values are selected with ``where`` before they are weighted, so NaN/inf outside a
population never reaches a sum.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from typing import Literal, NamedTuple, TypeVar

import jax
import jax.numpy as jnp

from offpolicy_jax import _fusion

Reduction = Literal["sequence", "token"]
REDUCTIONS: tuple[str, ...] = ("sequence", "token")

# Column names: strings, or tuples where the pipeline keys columns by (stage, name).
ColumnKey = TypeVar("ColumnKey", bound=Hashable)


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


AxisNames = None | str | Sequence[str] | MeshAxes | Mapping[str, str | Sequence[str]]


def _names(value: str | Sequence[str]) -> tuple[str, ...]:
    # The same normalisation as MeshAxes.__post_init__, done before the call so that
    # the fields are typed as tuples.
    return (value,) if isinstance(value, str) else tuple(value)


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
        return MeshAxes(
            batch=_names(axis_names.get("batch", ())), token=_names(axis_names.get("token", ()))
        )
    if isinstance(axis_names, Sequence):
        return MeshAxes(batch=tuple(axis_names))
    raise TypeError(
        "axis_names must be None, a mesh axis name, a sequence of names, a MeshAxes or a "
        f"mapping {{'batch': ..., 'token': ...}}; got {type(axis_names).__name__}"
    )


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MaxParts(MeanParts):
    """A batch maximum kept so that it pools exactly, with ``max`` (not a mean).

    ``numerator`` is the maximum, ``denominator`` how many values it is the maximum
    of (0: none, and the value is 0). ``a + b`` keeps the larger maximum of the
    non-empty ones and adds the counts, so micro-batches pooled with ``+`` report the
    maximum of the whole batch. Pool a dict of metric parts with
    ``{k: a[k] + b[k] for k in a}``: ``jax.tree.map(jnp.add, ...)`` adds leaves, which
    would add the maxima.

    Examples:
      >>> import jax.numpy as jnp, offpolicy_jax as opj
      >>> a = opj.MaxParts(jnp.float32(3.0), jnp.float32(4.0))
      >>> b = opj.MaxParts(jnp.float32(5.0), jnp.float32(1.0))
      >>> float((a + b).value())
      5.0
    """

    def value(self) -> jax.Array:
        return jnp.where(self.denominator > 0, self.numerator, 0.0)

    def __add__(self, other: MeanParts) -> MeanParts:
        if not isinstance(other, MaxParts):
            return NotImplemented
        mine, theirs = self.denominator > 0, other.denominator > 0
        top = jnp.where(
            mine & theirs,
            jnp.maximum(self.numerator, other.numerator),
            jnp.where(mine, self.numerator, other.numerator),
        )
        return MaxParts(top, self.denominator + other.denominator)


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


# --------------------------------------------------------------------------- fused reductions


class Column(NamedTuple):
    """One per-sequence reduction of a per-token value over a population.

    ``op`` is ``"sum"`` (``Σ_t x_t p_t``, with ``x`` taken as 0 where ``p_t = 0``),
    ``"min"`` or ``"max"`` (over the tokens with ``p_t > 0``; ``±inf`` for an empty
    sequence). ``value`` broadcasts against ``population``, ``[..., T]`` float
    weights that are 0 outside the population. ``cost`` is how much of a fused CPU
    loop's budget the value's expression takes (:mod:`offpolicy_jax._fusion`): 1 for
    selects, compares and a few arithmetic operations on inputs, 2 (the default, the
    safe side) for anything heavier, such as an ``exp`` or ``log`` of its own.
    """

    op: Literal["sum", "min", "max"]
    value: jax.Array | float
    population: jax.Array
    cost: int = 2


def total(x: jax.Array | float, population: jax.Array, *, cost: int = 2) -> Column:
    """``Σ_t x_t p_t``; ``cost``: see :class:`Column`."""
    return Column("sum", x, population, cost)


def count(population: jax.Array) -> Column:
    """``N = Σ_t p_t``."""
    return Column("sum", 1.0, population, 1)


def count_where(condition: jax.Array, population: jax.Array) -> Column:
    """``Σ_t [condition_t] p_t``: the population weight where ``condition`` holds."""
    return Column("sum", jnp.where(condition, 1.0, 0.0), population, 1)


def minimum(x: jax.Array, population: jax.Array) -> Column:
    return Column("min", x, population, 1)


def maximum(x: jax.Array, population: jax.Array) -> Column:
    return Column("max", x, population, 1)


def _operand(column: Column, shape: tuple[int, ...]) -> jax.Array:
    """The column's value where its population is, and the op's identity elsewhere."""
    if column.op == "sum":
        value = masked(column.value, column.population)
    else:
        value = jnp.where(column.population > 0, column.value, _fusion.INIT[column.op])
    return jnp.broadcast_to(value, shape)


@dataclasses.dataclass(frozen=True)
class Rows:
    """The layout "one sequence per row": the seam between tokens and sequences.

    Every per-sequence reduction (:meth:`reduce`) and every broadcast of a
    per-sequence value back to its tokens (:meth:`broadcast`) goes through a layout,
    so no other module assumes that a row is a sequence. Here per-sequence arrays
    are ``[...]`` (the token axis reduced away); a packed layout (several sequences
    per row, ``segment_ids``) plugs in here with per-sequence arrays ``[..., S]``.

    Attributes:
      axes: mesh axes to combine over inside ``shard_map``.
    """

    axes: MeshAxes = MeshAxes()
    # The reductions taken through this layout (one public call), by what they reduce.
    _taken: dict = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def reduce(self, columns: Mapping[ColumnKey, Column]) -> dict[ColumnKey, jax.Array]:
        """:meth:`reduce_columns`, each distinct column reduced once per layout.

        A column asked for again, with the same op on the same arrays (the loss's
        count of the mask, which the correction's first pass took), is not reduced
        again: every column costs part of a fused loop, and one too many can cost a
        whole pass over the batch (:mod:`offpolicy_jax._fusion`).
        """
        keys = {name: _identity(column) for name, column in columns.items()}
        fresh: dict[ColumnKey, Column] = {}
        asked = set(self._taken)
        for name, column in columns.items():
            if keys[name] not in asked:
                fresh[name] = column
                asked.add(keys[name])
        if fresh:
            for name, result in self.reduce_columns(fresh).items():
                # The column stays referenced beside its result: the ids in the keys
                # belong to live arrays, so they are never reused.
                self._taken[keys[name]] = (fresh[name], result)
        return {name: self._taken[keys[name]][1] for name in columns}

    def reduce_columns(self, columns: Mapping[ColumnKey, Column]) -> dict[ColumnKey, jax.Array]:
        """Every column's per-sequence reduction, ``[..., T] -> [...]``, computed together.

        Each result is ``Σ_t x_t p_t``, ``min`` or ``max`` over the sequence's tokens
        in the column's population; values are selected with ``where`` before they
        are weighted, so NaN/inf outside a population never reaches a result. On CPU
        the columns run in few fused loops (:mod:`offpolicy_jax._fusion`). Sums are
        differentiable w.r.t. their values.

        Inside ``shard_map`` with a sharded token axis the per-sequence partial
        results are combined over ``axes.token`` (``psum`` / ``pmin`` / ``pmax``): one
        ``[...]``-sized collective per op, never a ``[..., T]`` one.
        """
        if not columns:
            return {}
        names = list(columns)
        shape = jnp.broadcast_shapes(
            *(jnp.shape(c.population) for c in columns.values()),
            *(jnp.shape(c.value) for c in columns.values()),
        )
        ops = tuple(columns[n].op for n in names)
        costs = tuple(columns[n].cost for n in names)
        operands = tuple(_operand(columns[n], shape) for n in names)
        results = dict(zip(names, _fusion.reduce_columns(ops, operands, costs), strict=True))
        if self.axes.token:
            for op, collective in _COLLECTIVE.items():
                same = [n for n in names if columns[n].op == op]  # names need not sort
                if same:
                    combined = collective([results[n] for n in same], self.axes.token)
                    results.update(zip(same, combined, strict=True))
        return results

    def broadcast(self, per_seq: jax.Array) -> jax.Array:
        """A per-sequence value ``[...]`` on every token of its sequence (``[..., 1]``)."""
        return jnp.asarray(per_seq)[..., None]

    def batch_means(self, means: Mapping[str, MeanParts]) -> dict[str, MeanParts]:
        """Sums per-sequence :class:`MeanParts` terms over the batch and the devices.

        One fused loop over the batch (whose code XLA fuses with every term's) and one
        ``psum`` of scalars over ``axes.batch``, whatever the number of means.
        """
        if not means:
            return {}
        totals = tuple(
            jnp.broadcast_arrays(*(t for m in means.values() for t in (m.numerator, m.denominator)))
        )
        while totals[0].ndim:  # one leading axis at a time
            totals = _fusion.reduce_columns(("sum",) * len(totals), totals)
        if self.axes.batch:
            totals = jax.lax.psum(totals, self.axes.batch)
        return {key: MeanParts(*totals[2 * i : 2 * i + 2]) for i, key in enumerate(means)}


_COLLECTIVE = {"sum": jax.lax.psum, "min": jax.lax.pmin, "max": jax.lax.pmax}


def _identity(column: Column) -> tuple:
    """What a column reduces: its op and its arrays (by identity; constants by value)."""

    def ref(x):
        return ("constant", x) if isinstance(x, int | float) else id(x)

    return (column.op, ref(column.value), ref(column.population))


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
