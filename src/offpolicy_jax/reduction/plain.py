"""The plain reduction path: one ``jnp.sum`` / ``min`` / ``max`` per column.

What TPU and GPU run (their compilers fuse each column's elementwise code into its
reduction by themselves), and CPU with ``OFFPOLICY_JAX_REDUCTION=plain``
(:mod:`offpolicy_jax.reduction.backend`).

Gradients: a sum is linear, so its JVP is written as the plain sum of the tangents
(:func:`linear_jvp`); reverse mode transposes that into a broadcast, and the whole
backward of a reduction is one elementwise pass over the inputs, with nothing
``[..., T]`` stored from the forward. Min/max take JAX's own rule (the library never
differentiates them). The fused CPU path (:mod:`~offpolicy_jax.reduction.fused_cpu`)
shares the rule, so both paths have the same backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from offpolicy_jax.reduction.columns import INIT

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


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def reduce_columns(ops: tuple[str, ...], values: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Each ``[..., T]`` operand reduced over its last axis by its op (sum/min/max)."""
    return tuple(plain_reduce(op, v) for op, v in zip(ops, values, strict=True))


def _reduce_columns_jvp(ops, primals, tangents):
    (values,), (dvalues,) = primals, tangents
    out = reduce_columns(ops, values)
    return out, linear_jvp(ops, values, dvalues, out, lambda d: jnp.sum(d, axis=-1), plain_reduce)


reduce_columns.defjvp(_reduce_columns_jvp, symbolic_zeros=True)


def segment_axis(segment_ids: jax.Array, num_segments: int) -> jax.Array:
    """``[..., K, T]`` bool: ``hit[..., k − 1, t] = (id_t == k)``, fused into its consumer."""
    segments = jnp.arange(1, num_segments + 1, dtype=segment_ids.dtype)
    return segment_ids[..., None, :] == segments[:, None]


def compare_operands(
    ops: tuple[str, ...], num_segments: int, values: tuple[jax.Array, ...], segment_ids
) -> tuple[jax.Array, ...]:
    """``K`` masked copies of every ``[..., T]`` operand, ``[..., K, T]``: the op's
    identity where the token is not in segment ``k``."""
    hit = segment_axis(segment_ids, num_segments)
    return tuple(
        jnp.where(hit, v[..., None, :], INIT[op]) for op, v in zip(ops, values, strict=True)
    )


def plain_segment_sum(value: jax.Array, segment_ids: jax.Array, num_segments: int) -> jax.Array:
    """``K`` plain sums: linear in ``value``, and its transpose is a chain of selects
    (:func:`select_broadcast`)."""
    return jnp.stack(
        [
            jnp.sum(jnp.where(segment_ids == k, value, 0.0), axis=-1)
            for k in range(1, num_segments + 1)
        ],
        axis=-1,
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def reduce_segments(
    ops: tuple[str, ...], num_segments: int, values: tuple[jax.Array, ...], segment_ids
) -> tuple[jax.Array, ...]:
    """Each ``[..., T]`` operand reduced by its op over each segment ``1..K``: ``[..., K]``
    (the compare-and-reduce: ``Σ_t [id_t = k] x_t``, nothing ``[..., K, T]`` written
    where the compiler fuses the compare into the reduction)."""
    operands = compare_operands(ops, num_segments, values, segment_ids)
    return tuple(plain_reduce(op, o) for op, o in zip(ops, operands, strict=True))


def _reduce_segments_jvp(ops, num_segments, primals, tangents):
    # Sums: K plain sums of the tangent (their transpose is the gather); min/max: JAX's
    # rule of the compare-and-reduce.
    values, segment_ids = primals
    out = reduce_segments(ops, num_segments, values, segment_ids)

    def sum_tangent(d):
        return plain_segment_sum(d, segment_ids, num_segments)

    def extreme(op, v):
        return plain_reduce(op, compare_operands((op,), num_segments, (v,), segment_ids)[0])

    return out, linear_jvp(ops, values, tangents[0], out, sum_tangent, extreme)


reduce_segments.defjvp(_reduce_segments_jvp, symbolic_zeros=True)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def select_broadcast(values: jax.Array, segment_ids: jax.Array, fill) -> jax.Array:
    """``[..., K] -> [..., T]``: each token its segment's value, ``fill`` elsewhere.

    A chain of ``K`` selects, fused into whatever elementwise pass consumes it
    (``take_along_axis`` per token was 3x slower on CPU). Linear in ``values``: its
    transpose is a per-segment sum.
    """
    out = jnp.full(segment_ids.shape, fill, values.dtype)
    for k in range(values.shape[-1]):
        out = jnp.where(segment_ids == k + 1, values[..., k : k + 1], out)
    return out


@select_broadcast.defjvp
def _select_broadcast_jvp(fill, primals, tangents):
    values, segment_ids = primals
    return (
        select_broadcast(values, segment_ids, fill),
        select_broadcast(tangents[0], segment_ids, 0),
    )
