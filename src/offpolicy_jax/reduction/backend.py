"""Which reduction path runs: the one switch between the two implementations.

``OFFPOLICY_JAX_REDUCTION`` (read when a function is traced, so set it before the
first call of a jitted function, or clear JAX's caches after changing it):

* ``auto`` (default): :mod:`~offpolicy_jax.reduction.fused_cpu` when the program is
  traced for the CPU backend, :mod:`~offpolicy_jax.reduction.plain` on TPU and GPU.
* ``plain``: the plain path everywhere (what TPU/GPU run; on CPU it tests that path).
* ``fused``: the fused CPU path; a ``ValueError`` on any other backend.

Both paths compute the same values (to float32 rounding) and the same gradients;
``benchmarks/fused_vs_plain.md`` measures what the fused path buys on CPU.
"""

from __future__ import annotations

import os
from typing import Literal

import jax

from offpolicy_jax.reduction import fused_cpu, plain

ENV = "OFFPOLICY_JAX_REDUCTION"
CHOICES = ("auto", "plain", "fused")


def implementation() -> Literal["plain", "fused"]:
    """The path this trace takes, from ``OFFPOLICY_JAX_REDUCTION`` and the backend.

    Raises:
      ValueError: an unknown value, or ``fused`` on a backend other than CPU.
    """
    choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV} must be one of {list(CHOICES)}, got {choice!r}")
    backend = jax.default_backend()
    if choice == "fused" and backend != "cpu":
        raise ValueError(
            f"{ENV}=fused: the fused reductions are XLA:CPU loops, but the backend is "
            f"{backend!r}; use 'auto' or 'plain'"
        )
    if choice == "auto":
        return "fused" if backend == "cpu" else "plain"
    return choice  # type: ignore[return-value]


def reduce_rows(ops: tuple[str, ...], values: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Each ``[..., T]`` operand reduced over its last axis by its op: ``[...]``."""
    if implementation() == "fused":
        return fused_cpu.reduce_columns(ops, values)
    return plain.reduce_columns(ops, values)


def batch_totals(values: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Each operand summed over all its axes: scalars."""
    if implementation() == "fused":
        return fused_cpu.batch_totals(values)
    while values[0].ndim:  # one trailing axis at a time
        values = plain.reduce_columns(("sum",) * len(values), values)
    return values


def windows_plan(
    segment_ids: jax.Array, num_segments: int, contiguous: bool
) -> fused_cpu.Plan | None:
    """The windows of packed rows for the fused windowed path, when it applies: the
    caller promises contiguous segments, the fused path runs, the rows are long enough
    and unshared (:func:`~offpolicy_jax.reduction.fused_cpu.use_windows`); else None."""
    if not contiguous or implementation() != "fused":
        return None
    if not fused_cpu.use_windows(segment_ids, num_segments):
        return None
    return fused_cpu.windows_plan(segment_ids, num_segments)


def reduce_segments(
    ops: tuple[str, ...],
    num_segments: int,
    values: tuple[jax.Array, ...],
    segment_ids: jax.Array,
    plan: fused_cpu.Plan | None,
) -> tuple[jax.Array, ...]:
    """Each ``[..., T]`` operand reduced by its op over each segment ``1..K``: ``[..., K]``
    (``plan``: :func:`windows_plan`)."""
    if implementation() == "fused":
        return fused_cpu.reduce_segments(ops, num_segments, values, segment_ids, plan)
    return plain.reduce_segments(ops, num_segments, values, segment_ids)
