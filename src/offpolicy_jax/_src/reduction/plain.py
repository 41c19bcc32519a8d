"""How the reductions run, the same on every backend.

* One sequence per row (:func:`reduce_columns`): the columns stacked by kind and
  reduced over the token axis, one ``jnp.sum`` for the sums and one ``jnp.min`` for the
  minima and maxima of each shape.
* Packed rows: :mod:`~offpolicy_jax._src.reduction.packed` (one scatter-add and one
  scatter-min a pass, by the same grouping).

Gradients: a sum is linear, so its JVP is written as the plain sum of the tangents
(:func:`linear_jvp`); reverse mode transposes that into a broadcast, and the whole
backward of a reduction is one elementwise pass over the inputs, with nothing
``[..., T]`` stored from the forward. Min/max take JAX's own rule (the library never
differentiates them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from offpolicy_jax._src.reduction.columns import INIT

_FINISH = {"sum": jnp.sum, "min": jnp.min, "max": jnp.max}


def plain_reduce(op: str, value: jax.Array) -> jax.Array:
    """One reduction over the last axis (``initial``: ``T = 0`` is fine too)."""
    return _FINISH[op](value, axis=-1, initial=INIT[op])


def linear_jvp(
    ops: tuple[str, ...],
    values: tuple[jax.Array, ...],
    dvalues: tuple,
    out: tuple[jax.Array, ...],
    sum_tangent: Callable[[jax.Array], jax.Array],
    reduce_one: Callable[[str, jax.Array], jax.Array],
) -> tuple[jax.Array, ...]:
    """The tangents of reductions ``out`` of ``values``: ``sum_tangent(dvalue)`` for a
    sum (linear: its transpose is the backward's one elementwise pass), JAX's own rule
    of ``reduce_one(op, value)`` for min/max, zeros for symbolic-zero tangents."""
    dout = []
    for op, value, dvalue, primal in zip(ops, values, dvalues, out, strict=True):
        if isinstance(dvalue, jax.custom_derivatives.SymbolicZero):
            dout.append(jnp.zeros_like(primal))
        elif op == "sum":
            dout.append(sum_tangent(dvalue))
        else:
            dout.append(jax.jvp(functools.partial(reduce_one, op), (value,), (dvalue,))[1])
    return tuple(dout)


STACK_LIMIT = 8
"""The most operands stacked into one reduction. XLA:CPU fuses a ``concatenate`` of at
most 8 operands into the kernel that makes them; a 9th leaves every operand a kernel of
its own and the stack a copy of all of them, one more pass over every operand."""


def _reduce_together(ops: tuple[str, ...], values: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Operands of one shape and dtype stacked, then reduced over their last axis in one
    reduction per kind: every sum in one ``jnp.sum``, every min and max in one ``jnp.min``
    (``max x = −min(−x)``, exact; the identities ``±inf`` swap with the sign). More than
    :data:`STACK_LIMIT` operands go in near-equal stacks of at most that many."""
    if len(values) > STACK_LIMIT:
        stacks = -(-len(values) // STACK_LIMIT)
        size = -(-len(values) // stacks)
        return tuple(
            r
            for at in range(0, len(values), size)
            for r in _reduce_together(ops[at : at + size], values[at : at + size])
        )
    if len(values) == 1:
        return (plain_reduce(ops[0], values[0]),)
    if all(op == "sum" for op in ops):
        out = plain_reduce("sum", jnp.stack(values))
        return tuple(out[j] for j in range(len(values)))
    signed = [v if op == "min" else -v for op, v in zip(ops, values, strict=True)]
    out = plain_reduce("min", jnp.stack(signed))
    return tuple(out[j] if op == "min" else -out[j] for j, op in enumerate(ops))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def reduce_columns(ops: tuple[str, ...], values: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Each ``[..., T]`` operand reduced over its last axis by its op (sum/min/max).

    Columns are reduced in groups, not one by one: the sums of one shape and dtype
    together, and the minima and maxima together (:func:`_reduce_together`), so that
    a pass over the tokens is a few reductions whatever the number of columns (XLA:CPU
    runs each reduction, and each operand it does not fuse, as a kernel of its own).
    Each result is the reduction of its own operand's row; only the order a float sum
    is taken in may differ from a reduction of that row alone (a rounding).
    """
    groups: dict[tuple, list[int]] = {}
    for i, (op, v) in enumerate(zip(ops, values, strict=True)):
        kind = "sum" if op == "sum" else "extreme"
        groups.setdefault((kind, jnp.shape(v), jnp.result_type(v)), []).append(i)
    results: list = [None] * len(values)
    for at in groups.values():
        together = _reduce_together(tuple(ops[i] for i in at), tuple(values[i] for i in at))
        for i, r in zip(at, together, strict=True):
            results[i] = r
    return tuple(results)


def _reduce_columns_jvp(ops, primals, tangents):
    (values,), (dvalues,) = primals, tangents
    out = reduce_columns(ops, values)
    return out, linear_jvp(ops, values, dvalues, out, lambda d: jnp.sum(d, axis=-1), plain_reduce)


reduce_columns.defjvp(_reduce_columns_jvp, symbolic_zeros=True)
