"""The reduction engine: the one place where masked values are summed, averaged and pooled.

The seam between the domain (levels, bounds, rules, metrics, surrogates,
aggregation) and how reductions run. The domain declares per-token columns
(:func:`total`, :func:`count`, :func:`count_where`, :func:`minimum`,
:func:`maximum`), hands them to the call's layout (:class:`Rows`: one sequence per
row; :class:`Packed`: several, named by ``segment_ids``), and reads per-sequence
results, which it broadcasts back to tokens through the same layout; it pools means
as :class:`MeanParts`. It knows nothing of backends, loops or fusion.

Behind the seam (see docs/guide/reduction_engine.md):

* :mod:`~offpolicy_jax._src.reduction.columns`: the column type and its constructors;
* :mod:`~offpolicy_jax._src.reduction.rows` / :mod:`~offpolicy_jax._src.reduction.segments`: the
  two layouts (and the ``psum`` of per-sequence values over sharded token axes);
* :mod:`~offpolicy_jax._src.reduction.means`, :mod:`~offpolicy_jax._src.reduction.mesh`: poolable
  means and the ``axis_names`` argument;
* :mod:`~offpolicy_jax._src.reduction.plain` / :mod:`~offpolicy_jax._src.reduction.packed`:
  how the reductions run, the same on every backend (the columns of a row stacked into
  one ``jnp.sum`` and one ``jnp.min``; those of packed rows into one scatter-add and one
  scatter-min, O(T) whatever the number of segments, and one gather back);
* :mod:`~offpolicy_jax._src.reduction.scan`: the per-sequence prefix minimum.
"""

from offpolicy_jax._src.reduction.columns import (
    Column,
    count,
    count_where,
    maximum,
    minimum,
    total,
)
from offpolicy_jax._src.reduction.means import (
    REDUCTIONS,
    MeanParts,
    Reduction,
    masked,
    pool_metric_parts,
    pooled_value,
    safe_divide,
    seq_mean,
    seq_mean_of_values,
)
from offpolicy_jax._src.reduction.mesh import AxisNames, MeshAxes, as_mesh_axes
from offpolicy_jax._src.reduction.rows import ColumnKey, Rows
from offpolicy_jax._src.reduction.segments import (
    Packed,
    check_segments,
    in_segment,
    layout,
    only_segments,
    segment_any,
    segment_arguments,
    segment_broadcast,
    segment_reduce,
)

__all__ = [
    "REDUCTIONS",
    "AxisNames",
    "Column",
    "ColumnKey",
    "MeanParts",
    "MeshAxes",
    "Packed",
    "Reduction",
    "Rows",
    "as_mesh_axes",
    "check_segments",
    "count",
    "count_where",
    "in_segment",
    "layout",
    "masked",
    "maximum",
    "minimum",
    "only_segments",
    "pool_metric_parts",
    "pooled_value",
    "safe_divide",
    "segment_any",
    "segment_arguments",
    "segment_broadcast",
    "segment_reduce",
    "seq_mean",
    "seq_mean_of_values",
    "total",
]
