"""``correct``: a rollout correction from rules, without a config.

:func:`correct` runs :class:`~offpolicy_jax.rules.Correction` (the chain of its rules)
through the pipeline of :func:`~offpolicy_jax.compute_correction`.
"""

from __future__ import annotations

import jax

from offpolicy_jax._src.correction.chain import Correction, Rule
from offpolicy_jax._src.correction.compute import CorrectionResult
from offpolicy_jax._src.reduction import AxisNames, Reduction


def correct(
    old_logp: jax.typing.ArrayLike,
    rollout_logp: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike,
    *rules: Rule,
    nonfinite_rollout: str = "reject",
    reduction: Reduction = "sequence",
    axis_names: AxisNames = None,
    segment_ids: jax.typing.ArrayLike | None = None,
    num_segments: int | None = None,
    versions: jax.typing.ArrayLike | None = None,
    current_version: jax.typing.ArrayLike | None = None,
) -> CorrectionResult:
    """Rollout correction from rules: IS weights, rejection mask and metrics, without a config.

    The composable form of :func:`~offpolicy_jax.compute_correction`: the same pipeline
    runs ``rules`` in order (docs/semantics.md §3), so
    ``opj.rules.from_config(cfg)(o, b, m)`` (that is ``correct(o, b, m,
    *chain.rules, nonfinite_rollout=chain.nonfinite_rollout)``) equals
    ``compute_correction(o, b, m, cfg)``. With ``δ = o − b`` the weighting rule gives
    ``w``, the rejection rules shrink the mask to ``m'``, a sequence with a non-finite
    log-prob at a valid token is rejected (with ``nonfinite_rollout="neutral"`` a
    non-finite ``b`` is read as ``o`` instead), and ``batch_normalize()`` rescales ``w`` to
    mean 1 over ``m'``. Rules that only report metrics leave ``w = 1`` and the mask.

    Args:
      old_logp: ``[..., T]`` log π_old of the sampled tokens (float32, bf16 or fp16).
      rollout_logp: ``[..., T]`` log π_rollout from the inference engine.
      mask: ``[..., T]`` bool, 0/1 integers or floats; > 0 = trained on.
      *rules: the rules (see :func:`~offpolicy_jax.rules.chain`).
      nonfinite_rollout: ``"reject"`` or ``"neutral"`` (see
        :func:`~offpolicy_jax.rules.chain`).
      reduction: how metrics reduce: ``"sequence"`` or ``"token"``.
      axis_names: inside ``shard_map``, the mesh axes the batch is split over (a name,
        names, or a :class:`~offpolicy_jax.MeshAxes`).
      segment_ids: packed rows: int ``[..., T]``, 1..K the sequences of a row, 0 padding.
      num_segments: ``K``, static, given exactly when ``segment_ids`` is.
      versions: asynchronous RL: int ``[..., T]``, the policy version that sampled each
        token; required by :func:`~offpolicy_jax.rules.staleness` and
        :func:`~offpolicy_jax.rules.offpolicy_prefix`, and given to any chain it adds
        ``mis_staleness_mean`` / ``mis_staleness_max`` (as in ``compute_correction``).
      current_version: the trainer's version, required with ``versions``: an int, or
        int ``[...]``, ``[..., 1]`` or ``[..., T]``.

    Returns:
      A :class:`~offpolicy_jax.CorrectionResult`: float32 ``weights`` (``w·m'``,
      stop-gradient) and ``mask`` (``m'``) of the input's shape, and float32 scalar
      ``metrics``.

    Raises:
      TypeError / ValueError: a rule that is not a rule, or an argument of the wrong
      shape, type or value (naming it).

    Examples:
      >>> import jax.numpy as jnp, numpy as np, offpolicy_jax as opj
      >>> old = jnp.log(jnp.array([[0.5, 0.9, 0.2], [0.4, 0.4, 0.1]]))
      >>> rollout = jnp.log(jnp.array([[0.5, 0.3, 0.2], [0.4, 0.5, 0.9]]))
      >>> mask = jnp.array([[1, 1, 1], [1, 1, 0]], bool)
      >>> res = opj.correct(old, rollout, mask, opj.rules.importance_weights(upper=2.0))
      >>> np.round(np.asarray(res.weights, float), 2).tolist()  # min(π_old/π_rollout, 2)
      [[1.0, 2.0, 1.0], [1.0, 0.8, 0.0]]
    """
    return Correction(rules, nonfinite_rollout)(
        old_logp,
        rollout_logp,
        mask,
        reduction=reduction,
        axis_names=axis_names,
        segment_ids=segment_ids,
        num_segments=num_segments,
        versions=versions,
        current_version=current_version,
    )
