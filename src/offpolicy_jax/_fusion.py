"""XLA:CPU speed trick: several per-sequence reductions in one fused loop.

Only :func:`offpolicy_jax._reduce.Rows.reduce` and ``_reduce.batch_means`` call
:func:`reduce_columns`; on every backend but CPU it is one plain reduction per
column, which GPU/TPU compilers fuse by themselves.

Why CPU needs it: XLA:CPU hands each reduction to a library kernel (YNNPACK) that
cannot fuse the elementwise code producing its input, so every
``jnp.sum(f(inputs), -1)`` first writes ``f(inputs)`` as a full ``[..., T]``
float32 array and reads it back, and K sums of functions of the same inputs read
those inputs K times. A *variadic* reduce (several operands, one loop) stays in
XLA's own fused loop, which reads the inputs once and evaluates every column's
expression in registers. XLA:CPU vectorises that loop only when LLVM fully unrolls
its inner reduction loop, which bounds the work per loop: so the loop adds only
``_CHUNK`` tokens per result (writing ``[..., T / _CHUNK]`` partial results, then
finished by the library kernel; see :func:`_chunked_reduce` for the two views of
the token axis), and a loop takes at most ``_MAX_COLUMNS``
columns and only up to a budget of ``_BUDGET`` cost units (:class:`offpolicy_jax._reduce.Column` ``.cost``: 1 for a
select / compare / a few arithmetic operations, 2, the default, for anything heavier
such as an ``exp`` of its own); larger sets of columns run as several such loops. The numbers were measured
with ``benchmarks/`` on jax 0.10.2 (CPU): with chunks of 8, two columns of the PPO
loss already fall back to scalar code (3-5x slower). With chunks of 4 the limit is
the size of the loop body and the number of results: the correction's first pass
(eight columns, one ``exp`` and the k3 series, cost 9) vectorises as one loop, but
nine light columns, or the PPO loss's seven or eight columns with their non-finite
checks and ``exp`` (cost 10), fall back to scalar code (2-3x slower steps).
Every extra loop re-reads its inputs, so packing light columns together saves a
pass (about 10% of ``compute_correction``; a fixed four columns per loop cost
that). ``expm1``, ``log1p`` and divisions cost far more of the budget than ``exp``
and multiplications (``ratios.k3``). Callers that do not give costs (the packed
layout, whose loops carry ``K`` compares per column) get the old four columns per
loop (cost 2 each). A length that is not a multiple of ``_CHUNK`` is reduced as its
chunked prefix plus a short remainder loop (issue 17 #5: it used to fall back to
the slow path, 7x slower at ``T = 131071``).

Which path runs depends only on the backend the program is traced for and on how
the devices may share the token axis (the arrays' own sharding, or the mesh axes
left to the XLA partitioner): the chunk reshape must never straddle two devices'
shares, and a variadic loop must never reduce across devices (the partitioner
would all-gather each operand's partial results, one collective per column).
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec

INIT = {"sum": 0.0, "min": math.inf, "max": -math.inf}
_COMBINE = {"sum": jnp.add, "min": jnp.minimum, "max": jnp.maximum}
_FINISH = {"sum": jnp.sum, "min": jnp.min, "max": jnp.max}

_CHUNK = 4
_BUDGET = 9
_MAX_COLUMNS = 8
_DEFAULT_COST = 2  # four columns per loop when the caller gives no costs
# Below this many values in total (columns x elements, e.g. the per-sequence terms of
# all the metrics), one scalar loop over every column is cheaper than a kernel each.
_SMALL = 1 << 16


def plain_reduce(op: str, value: jax.Array) -> jax.Array:
    """One reduction over the last axis (``initial``: ``T = 0`` is fine too)."""
    return _FINISH[op](value, axis=-1, initial=INIT[op])


def _combine(op: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return _COMBINE[op](a, b)


class _Split(NamedTuple):
    """How the devices may share the last (token) axis of an array."""

    explicit: int  # devices its explicit sharding splits it over
    free: int  # devices the XLA partitioner may still split it over, in any way
    spec: PartitionSpec | None  # the chunked array's sharding, when the axis is explicit


def _split(value: jax.Array) -> _Split:
    """How the devices may share the last axis of ``value``, from its own sharding.

    Inside ``shard_map`` (Manual mesh axes) arrays are local: nothing splits them.
    An explicitly sharded axis is split over a known number of devices. Mesh axes
    left to the partitioner (Auto axes) may split it over any number of devices
    dividing their total; with no mesh in context, jit may place the program on any
    of the backend's devices, which is the same question for the backend at hand.
    """
    sharding = jax.typeof(value).sharding
    spec = tuple(sharding.spec) + (None,) * (value.ndim - len(sharding.spec))
    token = spec[-1]
    names = () if token is None else (token,) if isinstance(token, str) else tuple(token)
    context = jax.sharding.get_abstract_mesh()
    if context.empty:
        free = len(jax.devices(jax.default_backend()))
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


def _variadic_reduce(
    ops: tuple[str, ...], values: tuple[jax.Array, ...], axis: int = -1
) -> tuple[jax.Array, ...]:
    """One loop reducing every operand over ``axis`` (XLA's own, not a library kernel);
    float or integer operands."""
    inits = tuple(_identity(op, v.dtype) for op, v in zip(ops, values, strict=True))
    return tuple(
        jax.lax.reduce(
            values,
            inits,
            lambda acc, x: tuple(_combine(op, a, b) for op, a, b in zip(ops, acc, x, strict=True)),
            (axis % values[0].ndim,),
        )
    )


def _identity(op: str, dtype) -> jax.Array:
    """The op's identity in ``dtype`` (the extreme integers stand for ``±inf``)."""
    if op != "sum" and jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return jnp.array(info.max if op == "min" else info.min, dtype)
    return jnp.array(INIT[op], dtype)


def _chunked_reduce(
    ops: tuple[str, ...], values: tuple[jax.Array, ...], spec: PartitionSpec | None, unsplit: bool
) -> list[jax.Array]:
    """One variadic loop adding ``_CHUNK`` tokens at a time, then the partial results.

    ``T`` must be a multiple of ``_CHUNK`` here. When nothing may split the token
    axis (``unsplit``: one device, or local arrays inside ``shard_map``) it is viewed
    as ``[..., _CHUNK, T / _CHUNK]`` and the loop reduces the short *leading* axis:
    each result adds ``_CHUNK`` tokens ``T / _CHUNK`` apart, and LLVM vectorises
    along the contiguous axis of the results (the step 3-8% faster, and a loop 1.2-2.7x
    in isolation, than contiguous chunks). Otherwise it is viewed as ``[..., T /
    _CHUNK, _CHUNK]``: contiguous chunks never straddle two devices' shares, where the
    strided view would make the loop reduce across devices.
    """
    shape = values[0].shape
    if unsplit:
        strided_shape = (*shape[:-1], _CHUNK, shape[-1] // _CHUNK)
        strided = tuple(jax.lax.reshape(v, strided_shape) for v in values)
        partial = _variadic_reduce(ops, strided, axis=len(shape) - 1)
    else:
        chunked_shape = (*shape[:-1], shape[-1] // _CHUNK, _CHUNK)
        chunked = tuple(jax.lax.reshape(v, chunked_shape, out_sharding=spec) for v in values)
        partial = _variadic_reduce(ops, chunked)
    return [plain_reduce(op, p) for op, p in zip(ops, partial, strict=True)]


def _loops(costs: tuple[int, ...]) -> list[slice]:
    """Consecutive groups of columns, each within ``_BUDGET`` and ``_MAX_COLUMNS``.

    As few groups as the limits allow, as even as possible (the largest group's cost
    smallest): 17 light columns run as 5 + 6 + 6, never as 8 + 8 + 1 (a lone light
    column would go back to the write-then-reduce path). Order is kept so that
    columns that share a subexpression (k3 and χ²'s ``exp``) stay in one loop.
    """
    size = len(costs)

    @functools.cache
    def best(start: int, groups: int) -> tuple[tuple[int, int, int], tuple[int, ...]] | None:
        # ((largest cost, largest count, −smallest count), cut points) of columns[start:]
        # in `groups` loops, the smallest such key.
        if groups == 1:
            cost, count = sum(costs[start:]), size - start
            if cost > _BUDGET or count > _MAX_COLUMNS:
                return None
            return (cost, count, -count), ()
        options = []
        for stop in range(start + 1, size - groups + 2):
            cost, count = sum(costs[start:stop]), stop - start
            if cost > _BUDGET or count > _MAX_COLUMNS:
                break
            rest = best(stop, groups - 1)
            if rest is not None:
                worst = (max(cost, rest[0][0]), max(count, rest[0][1]), max(-count, rest[0][2]))
                options.append((worst, (stop, *rest[1])))
        return min(options) if options else None

    for groups in range(1, size + 1):
        found = best(0, groups)
        if found is not None:
            cuts = (0, *found[1], size)
            return [slice(a, b) for a, b in itertools.pairwise(cuts)]
    return [slice(i, i + 1) for i in range(size)]  # a single column over the budget


def _cpu_reduce(
    ops: tuple[str, ...], values: tuple[jax.Array, ...], costs: tuple[int, ...]
) -> tuple[jax.Array, ...]:
    split = _split(values[0])
    length = values[0].shape[-1]
    if values[0].size * len(values) <= _SMALL and split.explicit * split.free == 1:
        return _variadic_reduce(ops, values)
    share = length // split.explicit
    unsplit = split.explicit * split.free == 1
    if length < _CHUNK or (share % (_CHUNK * split.free) and not unsplit):
        return tuple(plain_reduce(op, v) for op, v in zip(ops, values, strict=True))
    # On one device a ragged length is a chunked prefix plus a few remaining tokens:
    # 2 to _CHUNK + 1 of them, since a remainder of one token (a size-1 reduce that
    # XLA rewrites into the consumers) made every pass 2-4x slower at T = 4k + 1.
    body = length - length % _CHUNK if unsplit else length
    if unsplit and length % _CHUNK == 1 and body > _CHUNK:
        body -= _CHUNK
    prefix = tuple(v[..., :body] for v in values) if body < length else values
    out: list[jax.Array] = []
    for group in _loops(costs):
        out += _chunked_reduce(ops[group], prefix[group], split.spec, unsplit)
    if body < length:
        rest = _variadic_reduce(ops, tuple(v[..., body:] for v in values))
        out = [_combine(op, a, b) for op, a, b in zip(ops, out, rest, strict=True)]
    return tuple(out)


def reduce_columns(
    ops: tuple[str, ...], values: tuple[jax.Array, ...], costs: tuple[int, ...] | None = None
) -> tuple[jax.Array, ...]:
    """Reduces each ``[..., T]`` operand over its last axis by its op (sum/min/max).

    On CPU in few fused loops (see the module docstring), ``costs`` (static ints, one
    per operand; default 2 each) deciding which share a loop; elsewhere one plain
    reduction per operand. Differentiable: a sum's tangent is the plain sum of the
    tangents.
    """
    if costs is None:
        costs = (_DEFAULT_COST,) * len(values)
    return _reduce_columns(ops, tuple(costs), values)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _reduce_columns(
    ops: tuple[str, ...], costs: tuple[int, ...], values: tuple[jax.Array, ...]
) -> tuple[jax.Array, ...]:
    if len(values) == 1 or jax.default_backend() != "cpu":
        return tuple(plain_reduce(op, v) for op, v in zip(ops, values, strict=True))
    return _cpu_reduce(ops, values, costs)


def _reduce_columns_jvp(ops, costs, primals, tangents):
    # A sum is linear, so its tangent is the plain sum of the tangents; reverse mode
    # transposes that into a broadcast, and the whole backward of a reduction is
    # then one elementwise pass over the inputs, with nothing [..., T] stored from
    # the forward. Min/max use JAX's own rule (the library never differentiates them).
    (values,), (dvalues,) = primals, tangents
    out = _reduce_columns(ops, costs, values)
    dout = []
    for op, value, dvalue, primal in zip(ops, values, dvalues, out, strict=True):
        if isinstance(dvalue, jax.custom_derivatives.SymbolicZero):
            dout.append(jnp.zeros_like(primal))
        elif op == "sum":
            dout.append(jnp.sum(dvalue, axis=-1))
        else:
            dout.append(jax.jvp(functools.partial(plain_reduce, op), (value,), (dvalue,))[1])
    return out, tuple(dout)


_reduce_columns.defjvp(_reduce_columns_jvp, symbolic_zeros=True)
