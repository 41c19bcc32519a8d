"""Row chunking and ``shard_map`` varying-axis helpers of the fused log-prob kernels.

Shared by :mod:`offpolicy_jax._src.logprobs.token` (the full-vocabulary kernel) and
:mod:`offpolicy_jax._src.logprobs.sampling_support` (the kernel over the sampler's kept ids): both
walk ``N`` rows ``chunk_size`` at a time inside a custom VJP, and inside ``shard_map``
their loop carries must vary over the same mesh axes as the chunk results.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def vma(x) -> frozenset:
    """The mesh axes ``x`` varies over inside ``shard_map`` (empty outside or unchecked)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def vary(tree, axes: frozenset):
    """Marks every leaf as varying over ``axes`` (a no-op outside ``shard_map``).

    Loop carries must keep one type: a zero initial value is invariant while the
    chunk results it accumulates vary over the axes of ``hidden`` / ``unembedding``.
    """

    def cast(x):
        missing = tuple(sorted(axes - vma(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def chunks(total: int, size: int) -> tuple[int, int]:
    """(number of chunks, chunk size) covering ``total``. The last chunk is shifted
    back to end at ``total`` (overlapping its predecessor), so nothing is padded."""
    size = max(1, min(size, total))
    return -(-total // size), size


def loop(num: int, size: int, total: int, body, init):
    """``body(carry, start, lo)`` over the chunks: ``[start, start + size)``, of which
    the positions below ``lo`` belong to the previous chunk (the overlap)."""
    if num == 1:
        return body(init, 0, 0)

    def step(j, carry):
        lo = j * size
        return body(carry, jnp.minimum(lo, total - size), lo)

    return jax.lax.fori_loop(0, num, step, init)


def match_cotangent_axes(dh, dw, h, w, axis_name):
    """Cotangents of the hidden states and the unembedding varying over exactly their
    primal's mesh axes (inside ``shard_map``): ``dh`` is a partial sum over the
    vocabulary shards (one ``[N, D]`` all-reduce, as in any tensor-parallel
    unembedding), ``dW`` one over the batch / token shards."""
    if axis_name is not None and axis_name not in vma(h):
        dh = jax.lax.psum(dh, axis_name)
    dh_extra = tuple(sorted(vma(dh) - vma(h)))
    dw_extra = tuple(sorted(vma(dw) - vma(w)))
    if dh_extra:
        dh = jax.lax.psum(dh, dh_extra)
    if dw_extra:
        dw = jax.lax.psum(dw, dw_extra)
    return dh.astype(h.dtype), dw.astype(w.dtype)
