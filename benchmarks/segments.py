"""How to sum per segment: ``python -m benchmarks.segments [--size 64x2048] [--segments 8]``.

The evidence behind ``offpolicy_jax._src.reduction.segments``: per-segment sums ``[B, T] -> [B, K]``
of ``C`` columns (cheap ones, ``x·y + i``, and ones holding an ``exp``, as the
mismatch metrics do), forward and forward + backward, for every way of writing
them, against the one-sequence-per-row reduction of the same columns
(``reduction.Rows.reduce``, ``[B, T] -> [B]``). Times are the minimum over
``--repeats`` calls, the variants interleaved call by call so that a busy machine
slows them alike; temp memory is XLA's compiled temporary allocation.

Variants:

* ``row``: the unpacked layout's reduction (the baseline);
* ``library``: the library's choice (``reduction.segment_reduce``): the columns
  stacked, one scatter-add into (chunk of 256 tokens, segment) slots, the chunks
  summed as a tree; O(T) whatever K;
* ``materialized``: the same after writing the column values once
  (``optimization_barrier``);
* ``per_segment_loop``: K operands per column (``where(id == k, x, 0)``), each reduced
  as a row;
* ``jnp_sum``: ``jnp.sum`` of the ``[B, K, T]`` select (a library kernel);
* ``einsum``: one-hot ``[B, T, K]`` indicator, ``einsum`` with the stacked columns;
* ``segment_sum``: ``jax.ops.segment_sum`` over flattened (row, segment) ids.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax import reduction as _reduce
from offpolicy_jax._src.reduction.columns import operand
from offpolicy_jax.reduction import MeshAxes


def make_inputs(batch: int, length: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = np.zeros((batch, length), np.int32)
    used = int(length * 0.95)
    for b in range(batch):
        bounds = np.concatenate([[0], np.sort(rng.integers(0, used, k - 1)), [used]])
        for s in range(k):
            ids[b, bounds[s] : bounds[s + 1]] = s + 1
    x = rng.normal(size=(batch, length)).astype(np.float32)
    y = rng.normal(size=(batch, length)).astype(np.float32)
    pop = rng.random((batch, length)) > 0.1
    return x, y, ids, pop


def columns(x, y, pop, n, kind):
    pop = pop.astype(jnp.float32)
    out = {}
    for i in range(n):
        if kind == "exp" and i % 2:
            value = jnp.exp(jnp.clip(x * 0.1 * i, -20, 20)) - y
        else:
            value = x * y + i
        out[f"c{i}"] = _reduce.total(value, pop)
    return out


def variants(k: int, n: int, kind: str):
    def row(x, y, ids, pop):
        return _reduce.Rows(MeshAxes()).reduce(columns(x, y, pop, n, kind))

    def library(x, y, ids, pop):
        return _reduce.segment_reduce(columns(x, y, pop, n, kind), ids, k, MeshAxes())

    def materialized(x, y, ids, pop):
        cols = columns(x, y, pop, n, kind)
        values = jax.lax.optimization_barrier(tuple(operand(c, x.shape) for c in cols.values()))
        plain = {name: _reduce.total(v, 1.0) for name, v in zip(cols, values, strict=True)}
        return _reduce.segment_reduce(plain, ids, k, MeshAxes())

    def per_segment_loop(x, y, ids, pop):
        cols = columns(x, y, pop, n, kind)
        flat = {
            (name, s): _reduce.total(jnp.where(ids == s, operand(c, x.shape), 0.0), 1.0)
            for name, c in cols.items()
            for s in range(1, k + 1)
        }
        sums = _reduce.Rows(MeshAxes()).reduce(flat)
        return {name: jnp.stack([sums[(name, s)] for s in range(1, k + 1)], -1) for name in cols}

    def jnp_sum(x, y, ids, pop):
        hit = ids[..., None, :] == jnp.arange(1, k + 1)[:, None]
        return {
            name: jnp.sum(jnp.where(hit, operand(c, x.shape)[..., None, :], 0.0), -1)
            for name, c in columns(x, y, pop, n, kind).items()
        }

    def einsum(x, y, ids, pop):
        cols = columns(x, y, pop, n, kind)
        onehot = (ids[..., None] == jnp.arange(1, k + 1)).astype(jnp.float32)
        stacked = jnp.stack([operand(c, x.shape) for c in cols.values()], -1)
        out = jnp.einsum("btc,btk->bck", stacked, onehot)
        return {name: out[:, i] for i, name in enumerate(cols)}

    def segment_sum(x, y, ids, pop):
        b = x.shape[0]
        flat = (jnp.arange(b, dtype=jnp.int32)[:, None] * (k + 1) + ids).reshape(-1)
        out = {}
        for name, c in columns(x, y, pop, n, kind).items():
            s = jax.ops.segment_sum(operand(c, x.shape).reshape(-1), flat, num_segments=b * (k + 1))
            out[name] = s.reshape(b, k + 1)[:, 1:]
        return out

    return {
        "row": row,
        "library": library,
        "materialized": materialized,
        "per_segment_loop": per_segment_loop,
        "jnp_sum": jnp_sum,
        "einsum": einsum,
        "segment_sum": segment_sum,
    }


def with_backward(fn):
    def step(x, y, ids, pop):
        def total(x):
            return sum(jnp.sum(jnp.tanh(v)) for v in fn(x, y, ids, pop).values())

        return jax.value_and_grad(total)(x)

    return step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="64x2048")
    parser.add_argument("--segments", type=int, default=8)
    parser.add_argument("--columns", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    batch, length = (int(v) for v in args.size.lower().split("x"))
    k, n = args.segments, args.columns
    x, y, ids, pop = make_inputs(batch, length, k)
    print(f"[{batch}, {length}], K = {k}, {n} columns; jax {jax.__version__}, {jax.devices()[0]}")
    print(f"{'variant':18s} {'cols':5s} {'pass':8s} {'min ms':>8s} {'x row':>6s} {'temp MB':>8s}")
    for kind in ("cheap", "exp"):
        for backward in (False, True):
            compiled = {}
            for name, fn in variants(k, n, kind).items():
                step = with_backward(fn) if backward else fn
                compiled[name] = jax.jit(step).lower(x, y, ids, pop).compile()
            ref = compiled["library"](x, y, ids, pop)
            times = {name: [] for name in compiled}
            for _ in range(args.repeats):
                for name, c in compiled.items():
                    start = time.perf_counter()
                    jax.block_until_ready(c(x, y, ids, pop))
                    times[name].append(time.perf_counter() - start)
            for name, c in compiled.items():
                if name != "row":  # every variant computes the same sums
                    got = c(x, y, ids, pop)
                    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
                        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)
                best = min(times[name]) * 1e3
                ratio = best / (min(times["row"]) * 1e3)
                temp = c.memory_analysis().temp_size_in_bytes / 1e6
                step = "fwd+bwd" if backward else "fwd"
                print(f"{name:18s} {kind:5s} {step:8s} {best:8.3f} {ratio:6.2f} {temp:8.2f}")


if __name__ == "__main__":
    main()
