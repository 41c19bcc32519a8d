"""The layout "one sequence per row": columns in, per-sequence values out.

A layout reduces a dict of :class:`~offpolicy_jax._src.reduction.columns.Column` s to
per-sequence values in one go (:meth:`Rows.reduce`, the columns stacked into one
``jnp.sum`` and one ``jnp.min``: :mod:`~offpolicy_jax._src.reduction.plain`), ``psum``-s them
over context-parallel mesh axes, broadcasts per-sequence values back to tokens, and sums
per-sequence terms over the batch (:meth:`Rows.batch_means`) with one ``psum`` of
scalars over the data-parallel axes. Only per-sequence values ever cross devices.
The packed layout (:class:`~offpolicy_jax._src.reduction.segments.Packed`) is the same
seam with several sequences a row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from typing import TypeVar

import jax
import jax.numpy as jnp

from offpolicy_jax._src.reduction import plain, scan
from offpolicy_jax._src.reduction.columns import Column, broadcast_shape, identity, operand
from offpolicy_jax._src.reduction.means import MeanParts
from offpolicy_jax._src.reduction.mesh import MeshAxes

# Column names: strings, or tuples where the pipeline keys columns by (stage, name).
ColumnKey = TypeVar("ColumnKey", bound=Hashable)

_COLLECTIVE = {"sum": jax.lax.psum, "min": jax.lax.pmin, "max": jax.lax.pmax}


def combine_over(results: dict, columns: Mapping, names: tuple[str, ...] | tuple) -> dict:
    """Combines per-sequence partial results over the token mesh axes ``names``: one
    ``psum`` / ``pmin`` / ``pmax`` per op, of ``[...]``-sized values only."""
    if not names:
        return results
    for op, collective in _COLLECTIVE.items():
        same = [n for n in columns if columns[n].op == op]  # a list: names need not sort
        if same:
            combined = collective([results[n] for n in same], names)
            results.update(zip(same, combined, strict=True))
    return results


@dataclasses.dataclass(frozen=True)
class Rows:
    """The layout "one sequence per row": the seam between tokens and sequences.

    Every per-sequence reduction (:meth:`reduce`) and every broadcast of a
    per-sequence value back to its tokens (:meth:`broadcast`) goes through a layout,
    so no other module assumes that a row is a sequence. Here per-sequence arrays
    are ``[...]`` (the token axis reduced away); the packed layout has per-sequence
    arrays ``[..., K]``.

    Attributes:
      axes: mesh axes to combine over inside ``shard_map``.
    """

    axes: MeshAxes = MeshAxes()
    # The reductions taken through this layout (one public call), by what they reduce.
    _taken: dict = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def reduce(self, columns: Mapping[ColumnKey, Column]) -> dict[ColumnKey, jax.Array]:
        """Every column's per-sequence reduction, ``[..., T] -> [...]``, computed together.

        Each result is ``Σ_t x_t p_t``, ``min`` or ``max`` over the sequence's tokens
        in the column's population; values are selected with ``where`` before they
        are weighted, so NaN/inf outside a population never reaches a result. Sums
        are differentiable w.r.t. their values. A column asked for again of the same
        layout (the same op on the same arrays) is not reduced again.

        Inside ``shard_map`` with a sharded token axis the per-sequence partial
        results are combined over ``axes.token``.
        """
        keys = {name: identity(column) for name, column in columns.items()}
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
        """:meth:`reduce` without looking for columns already taken."""
        names = tuple(columns)
        shape = broadcast_shape(columns.values())
        results = plain.reduce_columns(
            tuple(columns[n].op for n in names),
            tuple(operand(columns[n], shape) for n in names),
        )
        return combine_over(dict(zip(names, results, strict=True)), columns, self.axes.token)

    def broadcast(self, per_seq: jax.Array) -> jax.Array:
        """A per-sequence value ``[...]`` on every token of its sequence (``[..., 1]``)."""
        return jnp.asarray(per_seq)[..., None]

    def exclusive_min(self, x: jax.Array, population: jax.Array) -> jax.Array:
        """Each token's minimum of ``x`` over the *earlier* tokens of its sequence.

        ``out_t = min {x_s : s < t, p_s > 0}`` over the tokens of ``t``'s sequence
        (``+inf`` where there is none), ``[..., T]``; the prefix scan of
        :mod:`~offpolicy_jax._src.reduction.scan`. ``x`` outside the population never
        reaches a result. Inside ``shard_map`` with a sharded token axis each shard
        takes the minimum of the shards before it (exact: a minimum does not depend on
        the order it is taken in). Asked again of the same layout with the same arrays,
        it is not computed again. Not differentiable (the library scans weights only).
        """
        key = ("exclusive_min", id(x), id(population))
        if key not in self._taken:
            values = jnp.where(population > 0, x, jnp.inf).astype(jnp.float32)
            spec = scan.explicit_spec(values)
            if spec is None:
                out = self.exclusive_min_of(values, token_axes=self.axes.token)
            elif self.axes.token:
                raise ValueError(
                    f"the token axis is sharded both over the shard_map axes "
                    f"{list(self.axes.token)} (axis_names) and, in its type, over "
                    f"{list(scan.token_axes_of(spec))}; shard it one way"
                )
            else:
                token_axes = scan.token_axes_of(spec)
                out = scan.on_shards(
                    lambda *local: self.exclusive_min_of(*local, token_axes=token_axes),
                    (values, *self.scan_inputs(values)),
                    spec,
                )
            # The arrays stay referenced beside the result: their ids are never reused.
            self._taken[key] = (x, population, out)
        return self._taken[key][2]

    def scan_inputs(self, values: jax.Array) -> tuple[jax.Array, ...]:
        """What the scan needs beside the values, token-shaped (none here)."""
        return ()

    def exclusive_min_of(self, values: jax.Array, *, token_axes: tuple[str, ...]) -> jax.Array:
        """:meth:`exclusive_min` of ``values`` already ``+inf`` outside the population, on
        the tokens this device holds (``token_axes``: the shards of the token axis)."""
        return scan.exclusive_min_rows(values, token_axes)

    def batch_means(self, means: Mapping[str, MeanParts]) -> dict[str, MeanParts]:
        """Sums per-sequence :class:`MeanParts` terms over the batch and the devices.

        The batch sum of each term, and one ``psum`` of scalars over ``axes.batch``,
        whatever the number of means.
        """
        if not means:
            return {}
        totals = tuple(
            jnp.broadcast_arrays(*(t for m in means.values() for t in (m.numerator, m.denominator)))
        )
        # One trailing axis at a time, each term on its own: stacked, the terms would
        # come back as one slice each, a kernel of its own to compile on XLA:CPU, while
        # summing a few [B] values is no work worth sharing. A plain sum, whose own JVP
        # is linear: a custom-JVP reduction per term made tens of custom calls to trace
        # per config, most of a metrics-heavy program's trace time.
        while totals[0].ndim:
            totals = tuple(plain.plain_reduce("sum", t) for t in totals)
        if self.axes.batch:
            totals = jax.lax.psum(totals, self.axes.batch)
        return {key: MeanParts(*totals[2 * i : 2 * i + 2]) for i, key in enumerate(means)}
