"""The one place where masked values are summed, averaged and combined across devices.

Every reduction in the library goes through this module, so that sharding and
micro-batch pooling are solved once:

* ``seq_reduce`` takes per-sequence reductions over the token axis (the last
  axis): each :class:`Column` is a sum, min or max of a per-token value over a
  population, and all of them are computed together in one pass over the tokens.
  Inside ``shard_map`` with a sharded token axis (context parallelism) the
  per-sequence partial results are ``psum``-ed (``pmin``/``pmax``) over the token
  mesh axes. Only ``[...]``-sized (per-sequence) values ever cross devices.
* Means are returned as :class:`MeanParts` (numerator, denominator): summing the
  parts of several micro-batches (or devices) and dividing once gives exactly the
  full-batch mean. The mean of per-shard means is never computed. A mean is first
  built as per-sequence terms (:class:`SeqMean`, from per-sequence sums or one value
  per sequence), and ``batch_means`` sums many of them over the batch at once and
  ``psum``-s the scalars over the data-parallel mesh axes.

Populations are float weights of shape ``[..., T]`` that are 0 outside the
population (padding, rejected tokens). Values are selected with ``where`` before
they are weighted, so NaN/inf outside the population never reaches a sum.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec

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


AxisNames = None | str | Sequence[str] | MeshAxes | Mapping[str, str | Sequence[str]]


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


# --------------------------------------------------------------------------- fused reductions


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
    return Column("min", x, population)


def maximum(x: jax.Array, population: jax.Array) -> Column:
    return Column("max", x, population)


_INIT = {"sum": 0.0, "min": math.inf, "max": -math.inf}
_COMBINE = {"sum": jnp.add, "min": jnp.minimum, "max": jnp.maximum}
_FINISH = {"sum": jnp.sum, "min": jnp.min, "max": jnp.max}
_COLLECTIVE = {"sum": jax.lax.psum, "min": jax.lax.pmin, "max": jax.lax.pmax}

# Why seq_reduce does not simply call jnp.sum once per column: XLA:CPU hands each
# reduction to a library kernel (YNNPACK) that cannot fuse the elementwise code
# producing its input, so every jnp.sum(f(inputs), -1) first writes f(inputs) as a
# full [..., T] float32 array and reads it back, and K sums of functions of the same
# inputs read those inputs K times. A *variadic* reduce (several operands, one
# loop) stays in XLA's own fused loop, which reads the inputs once and evaluates
# every column's expression in registers. XLA:CPU vectorises that loop only when
# LLVM fully unrolls its inner reduction loop, which bounds the work per loop: so
# the loop reduces small chunks of _CHUNK tokens (writing [..., T / _CHUNK]
# partial results, then finished by the library kernel) and takes at most _GROUP
# columns; larger sets of columns run as several such loops. Both numbers were
# measured with benchmarks/ on jax 0.10.2 (CPU): with chunks of 8, two columns of the
# PPO loss already fall back to scalar code (3-5x slower); with chunks of 4, eight
# still vectorise. Other backends fuse either form.
_CHUNK = 4
_GROUP = 8
# Below this many values in total (columns x elements, e.g. the per-sequence terms of
# all the metrics), one scalar loop over every column is cheaper than a kernel each.
_SMALL = 1 << 16


def _plain_reduce(op: str, value: jax.Array) -> jax.Array:
    return _FINISH[op](value, axis=-1, initial=_INIT[op])  # `initial`: T = 0 is fine too


class _Split(NamedTuple):
    """How the devices may share the last (token) axis of an array."""

    explicit: int  # devices its explicit sharding splits it over
    free: int  # devices the XLA partitioner may still split it over, in any way
    spec: PartitionSpec | None  # the chunked array's sharding, when the axis is explicit


def _split(value: jax.Array) -> _Split:
    """How the devices may share the last axis of ``value``.

    Inside ``shard_map`` (Manual mesh axes) arrays are local: nothing splits them.
    An explicitly sharded axis is split over a known number of devices. Mesh axes
    left to the XLA partitioner (Auto axes, or every device when no mesh is set)
    may split it over any number of devices dividing their total.
    """
    sharding = jax.typeof(value).sharding
    spec = tuple(sharding.spec) + (None,) * (value.ndim - len(sharding.spec))
    token = spec[-1]
    names = () if token is None else (token,) if isinstance(token, str) else tuple(token)
    context = jax.sharding.get_abstract_mesh()
    if context.empty:
        free = jax.device_count()
    else:
        free = math.prod(
            size
            for size, kind in zip(context.axis_sizes, context.axis_types, strict=True)
            if kind == AxisType.Auto
        )
    return _Split(
        explicit=math.prod(sharding.mesh.shape[name] for name in names),
        free=free,
        spec=PartitionSpec(*spec[:-1], token, None) if names else None,
    )


def _grouped_reduce(
    ops: tuple[str, ...], values: tuple[jax.Array, ...], spec: PartitionSpec | None
) -> list[jax.Array]:
    """One variadic chunked reduce: ``[..., T]`` operands -> ``[...]`` results."""
    shape = values[0].shape
    chunked_shape = (*shape[:-1], shape[-1] // _CHUNK, _CHUNK)
    chunked = tuple(jax.lax.reshape(v, chunked_shape, out_sharding=spec) for v in values)
    return [_plain_reduce(op, p) for op, p in zip(ops, _variadic_reduce(ops, chunked), strict=True)]


def _variadic_reduce(ops: tuple[str, ...], values: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """One loop reducing every operand over its last axis (XLA's own, not a library kernel)."""
    inits = tuple(jnp.array(_INIT[op], v.dtype) for op, v in zip(ops, values, strict=True))
    return tuple(
        jax.lax.reduce(
            values,
            inits,
            lambda acc, x: tuple(_COMBINE[op](a, b) for op, a, b in zip(ops, acc, x, strict=True)),
            (values[0].ndim - 1,),
        )
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _fused_reduce(ops: tuple[str, ...], values: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Reduces each ``[..., T]`` operand over its last axis by its op, in few loops.

    The variadic loops must not reduce across devices: the XLA partitioner would
    all-gather every operand's partial results, one collective per column, where it
    combines plain reductions into one all-reduce. So one loop over the whole axis
    only when nothing can split it, and chunks only when no chunk straddles two
    devices' shares (the reshape would move token data between devices).
    """
    split = _split(values[0])
    length = values[0].shape[-1]
    if len(values) == 1:
        return (_plain_reduce(ops[0], values[0]),)
    if values[0].size * len(values) <= _SMALL and split.explicit * split.free == 1:
        return _variadic_reduce(ops, values)
    share = length // split.explicit
    if length == 0 or share % (_CHUNK * split.free):
        return tuple(_plain_reduce(op, v) for op, v in zip(ops, values, strict=True))
    # Balanced groups: 17 columns run as 6 + 6 + 5, never as 8 + 8 + 1 (a single
    # column would go back to the write-then-reduce path).
    n_groups = -(-len(values) // _GROUP)
    size = -(-len(values) // n_groups)
    out: list[jax.Array] = []
    for start in range(0, len(values), size):
        out += _grouped_reduce(ops[start : start + size], values[start : start + size], split.spec)
    return tuple(out)


def _fused_reduce_jvp(ops, primals, tangents):
    # A sum is linear, so its tangent is the plain sum of the tangents; reverse mode
    # transposes that into a broadcast, and the whole backward of a seq_reduce is
    # then one elementwise pass over the inputs, with nothing [..., T] stored from
    # the forward. Min/max use JAX's own rule (the library never differentiates them).
    (values,), (dvalues,) = primals, tangents
    out = _fused_reduce(ops, values)
    dout = []
    for op, value, dvalue, primal in zip(ops, values, dvalues, out, strict=True):
        if isinstance(dvalue, jax.custom_derivatives.SymbolicZero):
            dout.append(jnp.zeros_like(primal))
        elif op == "sum":
            dout.append(jnp.sum(dvalue, axis=-1))
        else:
            dout.append(jax.jvp(functools.partial(_plain_reduce, op), (value,), (dvalue,))[1])
    return out, tuple(dout)


_fused_reduce.defjvp(_fused_reduce_jvp, symbolic_zeros=True)


def _operand(column: Column, shape: tuple[int, ...]) -> jax.Array:
    """The column's value where its population is, and the op's identity elsewhere."""
    if column.op == "sum":
        value = masked(column.value, column.population)
    else:
        value = jnp.where(column.population > 0, column.value, _INIT[column.op])
    return jnp.broadcast_to(value, shape)


def seq_reduce(columns: Mapping[str, Column], axes: MeshAxes) -> dict[str, jax.Array]:
    """Every column's per-sequence reduction, ``[..., T] -> [...]``, computed together.

    On one device the columns take one fused loop per group of ``_GROUP`` (see
    ``_fused_reduce``) instead of a write-then-reduce kernel pair each.

    Each result is ``Σ_t x_t p_t``, ``min`` or ``max`` over the sequence's tokens
    in the column's population. Values are selected with ``where`` before they are
    weighted, so NaN/inf outside a population never reaches a result. The
    reductions are differentiable (sums w.r.t. their values).

    Inside ``shard_map`` with a sharded token axis the per-sequence partial results
    are combined over ``axes.token`` (``psum`` / ``pmin`` / ``pmax``): one
    ``[...]``-sized collective per op, never a ``[..., T]`` one.

    Args:
      columns: name -> :class:`Column` (see :func:`total`, :func:`count`,
        :func:`count_where`, :func:`minimum`, :func:`maximum`).
      axes: mesh axes to combine over inside ``shard_map``.

    Returns:
      name -> ``[...]`` per-sequence result.
    """
    if not columns:
        return {}
    names = list(columns)
    shape = jnp.broadcast_shapes(
        *(jnp.shape(c.population) for c in columns.values()),
        *(jnp.shape(c.value) for c in columns.values()),
    )
    ops = tuple(columns[n].op for n in names)
    results = dict(
        zip(
            names,
            _fused_reduce(ops, tuple(_operand(columns[n], shape) for n in names)),
            strict=True,
        )
    )
    if axes.token:
        for op, collective in _COLLECTIVE.items():
            same = {n: results[n] for n in names if columns[n].op == op}
            if same:
                results.update(collective(same, axes.token))
    return results


def seq_any(condition: jax.Array, population: jax.Array, axes: MeshAxes) -> jax.Array:
    """Per-sequence ``any(condition)`` over the population, ``[..., T] -> [...]`` bool."""
    return seq_reduce({"hits": count_where(condition, population)}, axes)["hits"] > 0


class SeqMean(NamedTuple):
    """A mean before its batch sum: per-sequence numerator and denominator terms, ``[...]``.

    :func:`batch_means` sums many of them over the batch at once; summing each on its
    own would cost XLA a couple of small kernels per metric.
    """

    numerator: jax.Array
    denominator: jax.Array


def seq_mean(sums: jax.Array, counts: jax.Array, reduction: Reduction) -> SeqMean:
    """The mean of a per-token value from its per-sequence sums ``Σ_t x m`` and sizes ``N``.

    ``"token"``: ``Σ x m / Σ m``; ``"sequence"``: the mean over sequences with
    ``N > 0`` of ``Σ_t x m / N``.
    """
    if reduction == "token":
        return SeqMean(sums, counts)
    return seq_mean_of_values(safe_divide(sums, counts), counts, "sequence")


def seq_mean_of_values(values: jax.Array, counts: jax.Array, reduction: Reduction) -> SeqMean:
    """The mean of one value per sequence, ``[...]``, over the non-empty sequences.

    Args:
      values: ``[...]`` per-sequence values (may be garbage where ``counts == 0``).
      counts: ``[...]`` per-sequence population sizes ``N``.
      reduction: ``"sequence"``: plain mean over sequences with ``N > 0``;
        ``"token"``: mean weighted by ``N`` (each token carries its sequence's value).
    """
    nonempty = counts > 0
    weight = jnp.where(nonempty, 1.0 if reduction == "sequence" else counts, 0.0)
    return SeqMean(jnp.where(nonempty, values, 0) * weight, weight)


def batch_means(means: Mapping[str, SeqMean], axes: MeshAxes) -> dict[str, MeanParts]:
    """Sums every mean's terms over the batch (and the data-parallel devices) at once.

    One fused loop over the batch (whose code XLA fuses with every term's) and one
    ``psum`` of scalars, whatever the number of means.
    """
    if not means:
        return {}
    totals = tuple(
        jnp.broadcast_arrays(*(t for m in means.values() for t in (m.numerator, m.denominator)))
    )
    while totals[0].ndim:  # one leading axis at a time
        totals = _fused_reduce(("sum",) * len(totals), totals)
    if axes.batch:
        totals = jax.lax.psum(totals, axes.batch)
    return {key: MeanParts(*totals[2 * i : 2 * i + 2]) for i, key in enumerate(means)}


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
    if reduction == "sequence" and x.shape[-1:] == (1,) and population.shape[-1] != 1:
        # A broadcast per-sequence value: its masked mean is the value itself, so
        # skip the sum and divide (which could also move it by an ulp).
        counts = seq_reduce({"count": count(population)}, axes)["count"]
        terms = seq_mean_of_values(x[..., 0], counts, "sequence")
    else:
        sums = seq_reduce({"sum": total(x, population), "count": count(population)}, axes)
        terms = seq_mean(sums["sum"], sums["count"], reduction)
    return batch_means({"mean": terms}, axes)["mean"]


def reduce_mean(
    x: jax.Array, population: jax.Array, reduction: Reduction, axes: MeshAxes
) -> jax.Array:
    """:func:`mean_parts` divided out: a float32 scalar, 0 for an empty population."""
    return mean_parts(x, population, reduction, axes).value()
