"""``policy_loss``: PPO, bypass PPO, decoupled 3-policy PPO with IS, REINFORCE-IS.

Per-token terms come from ``surrogates``, IS weights and the rejection mask from
``compute_correction`` (or ``VanillaTIS`` / a user callable), and the
aggregation below turns them into a scalar as a (numerator, denominator) pair,
so that micro-batches and devices pool exactly (docs/semantics.md §5).

=================  ======================================  =====================
algorithm          per-token loss                          ratio denominator d
=================  ======================================  =====================
``ppo``            ``ℓ(θ; d)``                             π_old
``bypass_ppo``     ``ℓ(θ; d)``                             π_rollout
``decoupled_ppo``  ``w(o, b) · ℓ(θ; d)`` on ``m'``         π_old
``reinforce_is``   ``−sg(w(θ, b)) · A · θ`` on ``m'``      (no ratio, no clip)
=================  ======================================  =====================

Decoupled PPO: Hilton et al., "Batch size-invariance for policy optimization"
(2022); truncated IS under training–inference mismatch: Yao et al. (2025).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import NamedTuple, ParamSpec, TypeVar

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from offpolicy_jax._src import reduction as _reduce
from offpolicy_jax._src.config import CorrectionConfig, LossConfig, VanillaTIS
from offpolicy_jax._src.config.plan import LossPlan, resolve
from offpolicy_jax._src.correction import metrics, ratios, rules, stages, staleness
from offpolicy_jax._src.correction.chain import Correction
from offpolicy_jax._src.correction.compute import CorrectionResult, correction_parts
from offpolicy_jax._src.correction.ratios import metric_exp
from offpolicy_jax._src.correction.topk_divergence import (
    TOPK_COUNT,
    TopKTerms,
    topk_mismatch_columns,
    topk_mismatch_means,
    topk_terms,
)
from offpolicy_jax._src.correction.vanilla import VanillaIS
from offpolicy_jax._src.logprobs.topk import TopKLogprobs
from offpolicy_jax._src.losses import builtins as _objective
from offpolicy_jax._src.losses import proximal
from offpolicy_jax._src.losses.algorithms import ALGORITHMS, Algorithm, Policy
from offpolicy_jax._src.losses.policy_losses import safe_log_ratio
from offpolicy_jax._src.losses.registry import SurrogateInput
from offpolicy_jax._src.losses.surrogates import reinforce_term
from offpolicy_jax._src.reduction import AxisNames, MeanParts, Reduction
from offpolicy_jax._src.validation import (
    as_array,
    as_float_logp,
    as_float_mask,
    check_same_shape,
    check_split_over,
)

LossParts = MeanParts
"""The loss as ``numerator / denominator``: the library's one poolable type.

The denominator never depends on ``logp``, so the gradient pools the same way:
``∇(Σ numerator) / Σ denominator``.
"""


def aggregate(
    per_token_loss: jax.Array,
    final_mask: jax.Array,
    denominator_mask: jax.Array,
    aggregation: str,
    axis_names: AxisNames = None,
    segment_ids: jax.typing.ArrayLike | None = None,
    num_segments: int | None = None,
    *,
    loss_scale_factor: float | None = None,
) -> MeanParts:
    """Aggregates per-token losses ``ℓ'`` over the final mask ``m'`` (docs/semantics.md §5).

    * ``"sequence_mean"``: mean over sequences with ``Σ m'' > 0`` of ``Σ ℓ' m' / Σ m''``
    * ``"token_mean"``: ``Σ ℓ' m' / Σ m''``
    * ``"sequence_sum"``: ``Σ_t ℓ' m'`` averaged over the same sequences as
      ``sequence_mean`` (no length normalisation)
    * ``"sequence_sum_norm"``: ``sequence_sum / loss_scale_factor`` (default: the padded
      length ``T`` of the token axis; verl's ``seq-mean-token-sum-norm``)
    * ``"token_sum"``: ``Σ ℓ' m'`` (no normalisation; its parts have denominator 0, and
      the value of parts with denominator 0 is their numerator)
    * ``"row_mean"``: ``Σ_t ℓ' m' / Σ m''`` averaged over every sequence slot, empty
      and fully rejected ones included (verl's GMPO: ``torch.mean`` over the rows)

    Use it with :func:`policy_loss_terms` to add a per-token term (KL, entropy) over
    the same post-rejection mask as the policy loss.

    Args:
      per_token_loss: ``[..., T]`` per-token losses ``ℓ'``.
      final_mask: ``[..., T]`` mask ``m'`` of the tokens in the loss (a float value
        is the token's loss weight).
      denominator_mask: ``[..., T]`` ``m''``: ``m'`` (D5) or the original mask.
      aggregation: one of the names above.
      axis_names: mesh axes to ``psum`` over inside ``shard_map``.
      segment_ids, num_segments: packed rows (see :func:`policy_loss`).
      loss_scale_factor: ``sequence_sum_norm``'s divisor (None: the padded length).

    Returns:
      :class:`MeanParts`; an empty batch gives 0 / 0, whose value is 0.

    Examples:
      >>> import jax.numpy as jnp, offpolicy_jax as opj
      >>> m = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
      >>> x = jnp.array([[1.0, 3.0, 9.0], [5.0, 9.0, 9.0]])
      >>> float(opj.aggregate(x, m, m, "sequence_mean").value())
      3.5
    """
    final_mask = as_float_mask("final_mask", final_mask)
    denominator_mask = as_float_mask("denominator_mask", denominator_mask)
    layout = _reduce.layout(
        _reduce.as_mesh_axes(axis_names), segment_ids, num_segments, final_mask.shape
    )
    final_mask = _reduce.only_segments(layout, final_mask)
    denominator_mask = _reduce.only_segments(layout, denominator_mask)
    sums = layout.reduce(
        {
            "loss": _reduce.total(per_token_loss, final_mask),
            "count": _reduce.count(denominator_mask),
        }
    )
    horizon = _horizon(aggregation, loss_scale_factor, final_mask.shape[-1], layout)
    terms = aggregation_terms(sums["loss"], sums["count"], aggregation, horizon=horizon)
    return layout.batch_means({"loss": terms})["loss"]


def _horizon(aggregation, loss_scale_factor, length, layout):
    """``sequence_sum_norm``'s divisor: the configured constant, or the padded length."""
    if aggregation != "sequence_sum_norm":
        return 1.0
    if loss_scale_factor is not None:
        return loss_scale_factor
    # The whole token axis: a context-parallel shard holds 1/n of it.
    return length * (jax.lax.psum(1, layout.axes.token) if layout.axes.token else 1)


def aggregation_terms(
    per_seq_total: jax.Array,
    count: jax.Array,
    aggregation: str,
    *,
    horizon: float | jax.Array = 1.0,
) -> MeanParts:
    """:func:`aggregate`'s per-sequence terms, from ``Σ_t ℓ' m'`` and ``Σ_t m''``.

    ``horizon`` is ``sequence_sum_norm``'s divisor.
    """
    if aggregation == "token_mean":
        return MeanParts(per_seq_total, count)
    if aggregation == "token_sum":
        return MeanParts(per_seq_total, jnp.zeros_like(count))
    if aggregation in ("sequence_mean", "row_mean"):
        per_seq = _reduce.safe_divide(per_seq_total, count)
    elif aggregation in ("sequence_sum", "sequence_sum_norm"):
        per_seq = per_seq_total
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}")
    nonempty = count > 0
    if aggregation == "row_mean":
        return MeanParts(jnp.where(nonempty, per_seq, 0.0), jnp.ones_like(count))
    weight = horizon if aggregation == "sequence_sum_norm" else 1.0
    return MeanParts(jnp.where(nonempty, per_seq, 0.0), jnp.where(nonempty, weight, 0.0))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PolicyLossTerms:
    """Per-token view of :func:`policy_loss` (a pytree).

    Attributes:
      loss: ``[..., T]`` per-token loss ``ℓ'`` (IS-weighted; 0 outside ``mask``).
      mask: ``[..., T]`` float final mask ``m'``: after rejection and without the
        sequences that hold a non-finite input at a valid token.
      denominator_mask: ``[..., T]`` ``m''`` of the aggregation (``m'``, or the
        original mask with ``rejected_in_denominator``).
      parts: the loss as :class:`MeanParts` (``aggregate(loss, mask,
        denominator_mask, config.aggregation)``, computed in the same pass).
      metrics: metric parts (``MeanParts`` or arrays), for ``finalize_metrics``.
    """

    loss: jax.Array
    mask: jax.Array
    denominator_mask: jax.Array
    parts: MeanParts
    metrics: dict[str, MeanParts | jax.Array]


@dataclasses.dataclass(frozen=True)
class LossInputs:
    """The arguments of one loss call but its settings: the pipeline's one input type.

    Built by :func:`_terms` from the keyword arguments the entry points share (and
    by :mod:`offpolicy_jax.objectives` from theirs); the pipeline reads the call's
    arrays and layout from here only. Fields as the arguments of :func:`policy_loss`;
    ``axis_names`` and ``num_segments`` are static.
    """

    logp: ArrayLike
    old_logp: ArrayLike | None
    rollout_logp: ArrayLike | None
    advantages: ArrayLike
    mask: ArrayLike
    axis_names: AxisNames = None
    correction_result: CorrectionResult | None = None
    segment_ids: ArrayLike | None = None
    num_segments: int | None = None
    ref_logp: ArrayLike | None = None
    entropy: ArrayLike | None = None
    versions: ArrayLike | None = None
    current_version: ArrayLike | None = None
    key: ArrayLike | None = None
    rewards: ArrayLike | None = None
    topk: TopKLogprobs | None = None


def _terms(
    logp: ArrayLike,
    old_logp: ArrayLike | None,
    rollout_logp: ArrayLike | None,
    advantages: ArrayLike,
    mask: ArrayLike,
    config: LossConfig,
    *,
    axis_names: AxisNames = None,
    correction_result: CorrectionResult | None = None,
    segment_ids: ArrayLike | None = None,
    num_segments: int | None = None,
    ref_logp: ArrayLike | None = None,
    entropy: ArrayLike | None = None,
    versions: ArrayLike | None = None,
    current_version: ArrayLike | None = None,
    key: ArrayLike | None = None,
    rewards: ArrayLike | None = None,
    topk: TopKLogprobs | None = None,
) -> PolicyLossTerms:
    """The one signature of :func:`policy_loss`, :func:`policy_loss_parts` and
    :func:`policy_loss_terms` (documented on :func:`policy_loss`): its arguments as
    :class:`LossInputs`, the config resolved once per trace into the plan the pipeline
    reads (never the config itself)."""
    inputs = LossInputs(
        logp,
        old_logp,
        rollout_logp,
        advantages,
        mask,
        axis_names=axis_names,
        correction_result=correction_result,
        segment_ids=segment_ids,
        num_segments=num_segments,
        ref_logp=ref_logp,
        entropy=entropy,
        versions=versions,
        current_version=current_version,
        key=key,
        rewards=rewards,
        topk=topk,
    )
    return loss_terms(inputs, resolve(config))


_Result = TypeVar("_Result")
_Params = ParamSpec("_Params")


def _takes_arguments_of(
    arguments: Callable[_Params, PolicyLossTerms],
) -> Callable[[Callable[[PolicyLossTerms], _Result]], Callable[_Params, _Result]]:
    """An entry point: ``arguments`` (the shared signature, which computes the terms)
    followed by a function that turns the :class:`PolicyLossTerms` into its result.

    The entry point has ``arguments``' parameters (the real signature, for type checkers
    through the ``ParamSpec`` and for ``inspect`` / autodoc through ``__signature__``)
    and the finishing function's name, docstring and return type.
    """

    def decorate(finish: Callable[[PolicyLossTerms], _Result]) -> Callable[_Params, _Result]:
        def entry(*args: _Params.args, **kwargs: _Params.kwargs) -> _Result:
            return finish(arguments(*args, **kwargs))

        # finish's name and docstring; no __wrapped__: the signature is arguments'.
        for name in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(entry, name, getattr(finish, name))
        returns = finish.__annotations__["return"]
        signature = inspect.signature(arguments).replace(return_annotation=returns)
        setattr(entry, "__signature__", signature)  # noqa: B010 (not a declared attribute)
        entry.__annotations__ = {**arguments.__annotations__, "return": returns}
        return entry

    return decorate


@dataclasses.dataclass(frozen=True)
class _Batch:
    """The checked inputs of one call: float32 ``[..., T]`` arrays and the layout.

    ``old`` / ``rollout`` / ``ref`` are stop-gradient; ``adv`` is 0 where not valid or
    not finite; ``bad_model`` marks the valid tokens whose ``θ``, advantage (or a
    reference log-prob or entropy the loss uses) is not finite. ``old`` is the
    proximal approximation under ``prox_logp_method`` ``"loglinear"`` / ``"linear"``;
    ``versions`` / ``current`` are integer arrays from
    :func:`~offpolicy_jax._src.correction.staleness.check_versions` (or None), ``proximal`` the ``prox_*`` metric
    parts (batch totals).
    """

    theta: jax.Array
    old: jax.Array | None
    rollout: jax.Array | None
    adv: jax.Array
    mask: jax.Array
    valid: jax.Array
    bad_model: jax.Array
    ref: jax.Array | None
    ent: jax.Array | None
    layout: _reduce.Rows
    reduction: Reduction
    versions: jax.Array | None = None
    current: jax.Array | None = None
    proximal: Mapping[str, MeanParts] = dataclasses.field(default_factory=dict)
    key: jax.Array | None = None
    rewards: jax.Array | None = None
    topk: TopKTerms | None = None

    @property
    def theta_sg(self) -> jax.Array:
        return jax.lax.stop_gradient(self.theta)

    def policy(self, name: Policy) -> jax.Array | None:
        """log π of an :class:`~offpolicy_jax._src.losses.algorithms.Algorithm` role's policy."""
        return {"old": self.old, "rollout": self.rollout, "theta": self.theta_sg}[name]


def _prepare(inputs: LossInputs, plan: LossPlan) -> _Batch:
    """Checks the arguments (errors name them) and builds the layout (``num_segments``:
    static, with ``inputs.segment_ids``)."""
    theta, old, rollout, adv, mask = _check_inputs(plan, inputs)
    axes = _reduce.as_mesh_axes(inputs.axis_names)
    layout = _reduce.layout(axes, inputs.segment_ids, inputs.num_segments, theta.shape)
    if inputs.segment_ids is not None and jnp.shape(inputs.advantages) != theta.shape:
        raise ValueError(
            f"advantages has shape {jnp.shape(inputs.advantages)}; with segment_ids they must "
            f"be per token, {theta.shape} (give each token its sequence's advantage)"
        )
    mask = _reduce.only_segments(layout, mask)
    ref, ent = _check_regularisers(plan, theta, inputs.ref_logp, inputs.entropy)
    if inputs.correction_result is not None and not plan.reweights:
        raise ValueError(
            f"correction_result is only used by algorithms that apply IS weights "
            f"(decoupled_ppo, reinforce_is), not {plan.algorithm.name!r}"
        )
    # Per-sequence advantages are legitimately replicated across token shards.
    check_split_over(
        axes.batch + axes.token,
        logp=inputs.logp,
        old_logp=inputs.old_logp,
        rollout_logp=inputs.rollout_logp,
        mask=mask,
        segment_ids=inputs.segment_ids,
    )
    valid = mask > 0
    # A non-finite θ or advantage at a valid token takes its sequence out of the loss
    # (§0); garbage advantages elsewhere would turn 0-cotangents into NaN. So does a
    # non-finite reference log-prob or entropy that enters the loss: read as 0 it
    # would silently drop the KL / entropy term of that token (§5.2).
    bad_model = ~jnp.isfinite(theta) | ~jnp.isfinite(adv)
    rewards = _check_rewards(plan, theta, inputs.rewards, inputs.segment_ids)
    if rewards is not None and plan.positive_example_nll_weight > 0:
        bad_model = bad_model | ~jnp.isfinite(rewards)
    if ref is not None and plan.kl_coef > 0:
        bad_model = bad_model | ~jnp.isfinite(ref)
    if ent is not None and plan.entropy_coef != 0:
        bad_model = bad_model | ~jnp.isfinite(ent)
    adv = jnp.where(valid & jnp.isfinite(adv), adv, 0.0)
    versions, current = staleness.check_versions(
        inputs.versions, inputs.current_version, theta.shape, needed_by=plan.versions_key, mask=mask
    )
    check_split_over(axes.batch + axes.token, versions=inputs.versions)
    b = _Batch(
        theta,
        old,
        rollout,
        adv,
        mask,
        valid,
        bad_model,
        ref,
        ent,
        layout,
        plan.metric_reduction,
        key=_check_key(inputs.key),
        rewards=rewards,
        # Both divergences once, for the metrics and a top-k trust region alike.
        topk=None if inputs.topk is None else topk_terms(inputs.topk, theta.shape, valid),
    )
    if versions is None:
        return b
    b = dataclasses.replace(b, versions=versions, current=current)
    return _proximal(b, plan) if plan.prox_logp_method != "recompute" else b


def _check_key(key) -> jax.Array | None:
    """``key=`` as a typed PRNG key (a raw ``uint32[2]`` key is wrapped), or None."""
    if key is None:
        return None
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(f"key must be one PRNG key (shape ()), got shape {key.shape}")
        return key
    if key.dtype != jnp.uint32 or key.shape != (2,):
        raise ValueError(
            f"key must be a PRNG key (jax.random.key(seed)), got dtype {key.dtype} shape "
            f"{key.shape}"
        )
    return jax.random.wrap_key_data(key)


def _proximal(b: _Batch, plan: LossPlan) -> _Batch:
    """AReaL's proximal approximation (:mod:`offpolicy_jax._src.losses.proximal`): π_old from π_rollout,
    ``sg(θ)`` and the versions (``loglinear`` / ``linear``), and the ``prox_*`` metrics
    (with ``"metrics"``, or whenever ``old_logp`` is given too: the approximations'
    errors against it) over the valid tokens whose log-probs are finite."""
    assert b.rollout is not None and b.versions is not None and b.current is not None
    alpha = proximal.interpolation_weight(b.versions, b.current)
    method = plan.prox_logp_method
    methods = proximal.METHODS if method == "metrics" else (method,)
    finite = jnp.isfinite(b.theta_sg) & jnp.isfinite(b.rollout)
    if b.old is not None:
        finite = finite & jnp.isfinite(b.old)
    population = jnp.where(finite, b.mask, 0.0)
    parts = proximal.metric_parts(
        methods, alpha, b.old, b.rollout, b.theta_sg, population, b.layout, b.reduction
    )
    old = b.old
    if plan.approximates_old:
        old = proximal.approximate(method, b.rollout, b.theta_sg, alpha)
    return dataclasses.replace(b, old=old, proximal=parts)


def _check_regularisers(plan: LossPlan, theta, ref_logp, entropy):
    """``ref_logp`` / ``entropy``: required by a non-zero coefficient, shaped like ``logp``."""
    if plan.kl_coef > 0 and ref_logp is None:
        raise ValueError(
            f"ref_logp is required: LossConfig.kl_coef = {plan.kl_coef} adds a KL-to-reference "
            "term (pass the reference policy's log-probs of the sampled tokens)"
        )
    if plan.entropy_coef != 0 and entropy is None:
        raise ValueError(
            f"entropy is required: LossConfig.entropy_coef = {plan.entropy_coef} adds an "
            "entropy bonus (pass the per-token entropies [..., T])"
        )
    ref = None if ref_logp is None else jax.lax.stop_gradient(as_float_logp("ref_logp", ref_logp))
    ent = None if entropy is None else as_float_logp("entropy", entropy)
    check_same_shape("logp", theta, ref_logp=ref, entropy=ent)
    return ref, ent


def _check_rewards(plan: LossPlan, theta, rewards, segment_ids):
    """``rewards``: required by ``positive_example_nll_weight > 0``; ``[...]`` per
    sequence (as ``[..., 1]``) or ``[..., T]`` per token (required with ``segment_ids``)."""
    weight = plan.positive_example_nll_weight
    if rewards is None:
        if weight > 0:
            raise ValueError(
                f"rewards is required: LossConfig.positive_example_nll_weight = {weight} adds "
                "VAPO's NLL on the tokens of sequences with reward > 0 (pass the rewards, "
                f"{theta.shape[:-1]} per sequence or {theta.shape} per token)"
            )
        return None
    r = jnp.asarray(as_array("rewards", rewards))
    if not (jnp.issubdtype(r.dtype, jnp.floating) or jnp.issubdtype(r.dtype, jnp.integer)):
        raise TypeError(f"rewards must be a numeric array, got dtype {r.dtype}")
    if r.shape == theta.shape[:-1] and segment_ids is None:
        r = r[..., None]
    elif r.shape != theta.shape:
        packed = " (with segment_ids, per token)" if segment_ids is not None else ""
        raise ValueError(
            f"rewards has shape {r.shape}; expected {theta.shape} (per token) or "
            f"{theta.shape[:-1]} (per sequence){packed} to match logp {theta.shape}"
        )
    return jax.lax.stop_gradient(r.astype(jnp.float32))


def _check_inputs(plan: LossPlan, inputs: LossInputs):
    algo = plan.algorithm
    theta = as_float_logp("logp", inputs.logp)
    if inputs.old_logp is None and algo.needs_old and not plan.approximates_old:
        takes_none = [a.name for a in ALGORITHMS.values() if not a.needs_old]
        raise ValueError(
            f"old_logp is required for algorithm {algo.name!r} (it is the ratio denominator); "
            f"only {' and '.join(repr(a) for a in takes_none)} accept old_logp=None"
        )
    if inputs.rollout_logp is None and plan.needs_rollout:
        raise ValueError(
            f"rollout_logp is required for algorithm {algo.name!r} with this correction/metrics "
            "setting: without the inference engine's log-probs there is nothing to correct"
        )
    # π_old and π_rollout are data, never differentiated: the IS weights and the
    # ratio denominator must carry no gradient into them.
    old, rollout = (
        None if x is None else jax.lax.stop_gradient(as_float_logp(name, x))
        for name, x in (("old_logp", inputs.old_logp), ("rollout_logp", inputs.rollout_logp))
    )
    weights_mask = as_float_mask("mask", inputs.mask)
    check_same_shape("logp", theta, old_logp=old, rollout_logp=rollout, mask=weights_mask)
    if inputs.advantages is None:
        raise ValueError("advantages is required but got None")
    adv = jnp.asarray(as_array("advantages", inputs.advantages))
    if not (jnp.issubdtype(adv.dtype, jnp.floating) or jnp.issubdtype(adv.dtype, jnp.integer)):
        raise TypeError(f"advantages must be a numeric array, got dtype {adv.dtype}")
    if adv.shape == theta.shape[:-1]:
        adv = adv[..., None]
    elif adv.shape != theta.shape:
        raise ValueError(
            f"advantages has shape {adv.shape}; expected {theta.shape} (per token) or "
            f"{theta.shape[:-1]} (per sequence) to match logp {theta.shape}"
        )
    return theta, old, rollout, adv.astype(jnp.float32), weights_mask


def _precomputed(name, result, shape):
    final = jnp.asarray(result.mask, jnp.float32)
    weights = jnp.asarray(result.weights, jnp.float32)
    for field, value in (("mask", final), ("weights", weights)):
        if value.shape != tuple(shape):
            raise ValueError(
                f"{name}.{field} has shape {value.shape} but logp has shape {tuple(shape)}; "
                f"{name} must be computed for exactly these tokens"
            )
    # CorrectionResult weights are w·m'; the loss applies m' once, itself.
    return jax.lax.stop_gradient(_reduce.safe_divide(weights, final)), final


class _Corrected(NamedTuple):
    """The correction's IS weights (None: no reweighting), final mask ``m'`` and metric
    parts; ``counts_nonfinite``: it rejected (and counted, as
    ``mis_nonfinite_seq_fraction``) the sequences with a non-finite log-prob itself."""

    weights: jax.Array | None
    mask: jax.Array
    parts: dict[str, MeanParts | jax.Array]
    counts_nonfinite: bool = False


def _correct(plan: LossPlan, old, b: _Batch, precomputed) -> _Corrected:
    """The configured correction, with ``old`` as the IS numerator."""
    correction, mask, layout, rollout = plan.correction, b.mask, b.layout, b.rollout
    assert rollout is not None  # _check_inputs: a correction requires rollout_logp
    if precomputed is not None:
        # Its metrics describe the whole batch and live in precomputed.metrics;
        # repeating them here would count them once per micro-batch when pooled.
        return _Corrected(*_precomputed("correction_result", precomputed, mask.shape), {})
    if isinstance(correction, CorrectionConfig):
        weights, final, parts = correction_parts(
            old,
            rollout,
            mask,
            correction,
            reduction=b.reduction,
            layout=layout,
            versions=b.versions,
            current_version=b.current,
        )
        return _Corrected(weights, final, dict(parts), counts_nonfinite=True)
    if isinstance(correction, Correction):  # a chain of rules: the same pipeline, as parts
        weights, final, parts = correction.parts(
            old,
            rollout,
            mask,
            reduction=b.reduction,
            layout=layout,
            versions=b.versions,
            current_version=b.current,
        )
        return _Corrected(weights, final, dict(parts), correction.counts_nonfinite)
    if isinstance(correction, VanillaTIS):
        vanilla = VanillaIS(correction.clip_low, correction.clip)
        weights, parts = vanilla.parts(old, rollout, mask, reduction=b.reduction, layout=layout)
        return _Corrected(weights, mask, dict(parts))
    assert correction is not None  # plan.reweights
    result = correction(
        old,
        rollout,
        mask,
        reduction=b.reduction,
        axis_names=layout.axes,
        **_reduce.segment_arguments(layout),
    )
    parts = dict(result.metrics)
    weights, final = _precomputed("config.correction's result", result, mask.shape)
    return _Corrected(weights, final, parts, "mis_nonfinite_seq_fraction" in parts)


def _mismatch_parts(metrics_only: object, old: jax.Array, b: _Batch, versions, current) -> dict:
    """The metric parts of the metrics-only correction beside the loss (a
    ``CorrectionConfig`` or a chain of rules), of ``old`` against π_rollout."""
    assert b.rollout is not None  # _check_inputs: mismatch metrics require rollout_logp
    where = {"reduction": b.reduction, "layout": b.layout}
    if isinstance(metrics_only, CorrectionConfig):
        _, _, parts = correction_parts(
            old,
            b.rollout,
            b.mask,
            metrics_only,
            versions=versions,
            current_version=current,
            **where,
        )
    else:
        assert isinstance(metrics_only, Correction)  # a chain that only reports metrics
        _, _, parts = metrics_only.parts(
            old, b.rollout, b.mask, versions=versions, current_version=current, **where
        )
    return dict(parts)


def _corrected(b: _Batch, plan: LossPlan, algo: Algorithm, precomputed) -> _Corrected:
    """The correction (if it reweights), the mismatch metrics and OPSM: ``w``, ``m'``."""
    done = _Corrected(None, b.mask, {})
    if plan.reweights:
        done = _correct(plan, b.policy(algo.is_numerator), b, precomputed)
    proxy_old = b.old if b.old is not None else b.theta_sg
    if plan.mismatch_metrics is not None:
        # §4 metrics of π_old (sg(θ) where absent) against π_rollout; the loss is
        # unchanged. In reinforce_is they replace those of the correction's sg(θ).
        # The staleness metrics come with them, unless the correction above reported them.
        versions = (None, None) if plan.reweights else (b.versions, b.current)
        mismatch = _mismatch_parts(plan.mismatch_metrics, proxy_old, b, *versions)
        # A reweighting correction counted the neutral reads against its own π_old.
        if _NEUTRAL_KEY in done.parts:
            mismatch.pop(_NEUTRAL_KEY, None)
        done.parts.update(mismatch)
    if plan.opsm_delta is None:
        return done
    # §8 OPSM drops sequences, like a rejection: a stage of its own over the valid tokens.
    behaviour = b.rollout if b.rollout is not None else proxy_old
    tokens = stages.Tokens(
        b.theta_sg,
        behaviour,
        ratios.log_ratio(b.theta_sg, behaviour, b.valid),
        b.mask,
        b.layout,
        b.reduction,
    )
    opsm = rules.OffPolicySequenceMask(plan.opsm_delta, b.adv)
    _, kept, opsm_parts = stages.run([opsm], tokens, weight_stats=False, batch_normalize=None)
    done.parts.update(opsm_parts)
    return done._replace(mask=jnp.where(kept > 0, done.mask, 0.0))


_NEUTRAL_KEY = "mis_nonfinite_rollout_token_fraction"


def _neutral_rollout(b: _Batch, plan: LossPlan, algo: Algorithm) -> _Batch:
    """``nonfinite_rollout="neutral"``: the loss reads a non-finite ``π_rollout`` at a
    valid token as the policy the correction compares it with (π_old, or ``sg(θ)``
    where the algorithm has none), as the correction does: that token neither rejects
    its sequence nor reaches a ratio as NaN."""
    if b.rollout is None or plan.nonfinite_rollout != "neutral":
        return b
    old = b.policy(algo.is_numerator)
    old = old if old is not None else b.theta_sg
    return dataclasses.replace(b, rollout=staleness.neutral_rollout(old, b.rollout, b.mask)[0])


def _rollout_abs_diff(b: _Batch, algo: Algorithm) -> jax.Array | None:
    """``|log π_old − log π_rollout|`` per token (0 where not finite) for the
    ``train_rollout_logprob_abs_diff`` metric, or None where the loss does not report it."""
    if algo.ratio is None or b.rollout is None:
        return None
    # D8b: where π_old is sg(θ) (bypass) the reference reports 0 here.
    source = b.policy(algo.is_numerator)
    assert source is not None
    diff = jnp.abs(source - b.rollout)
    return jax.lax.stop_gradient(jnp.where(jnp.isfinite(diff), diff, 0.0))


def _policy_term(
    b: _Batch, plan: LossPlan, algo: Algorithm, c: _Corrected, diff: jax.Array | None
) -> _objective.SurrogateOutput:
    """The per-token policy loss ``ℓ'`` and its metric columns (over ``m'``); ``diff``:
    :func:`_rollout_abs_diff`."""
    if algo.ratio is None:  # the REINFORCE term: the IS weights are its only correction
        assert c.weights is not None  # a weighted algorithm always reweights
        loss = reinforce_term(jnp.where(c.mask > 0, b.theta, 0.0), b.adv, c.weights)
        return _objective.SurrogateOutput(loss, {})
    denominator = b.policy(algo.ratio)
    assert denominator is not None  # _check_inputs: required by the algorithm
    log_ratio = safe_log_ratio(b.theta, denominator, b.valid)
    x = SurrogateInput(
        b.theta,
        log_ratio,
        denominator,
        b.adv,
        b.valid,
        c.mask,
        c.weights,
        b.layout,
        b.rollout,
        b.key,
        b.topk,
    )
    out = _objective.surrogate_columns(plan, x)
    columns = dict(out.columns)
    if diff is not None:
        columns["train_rollout_logprob_abs_diff"] = _reduce.total(diff, c.mask)
    if plan.reports_ois:
        # ois = mean exp(θ − d) (§5), not the ±S-clamped ratio: it must show the
        # divergence it exists to show; capped like every metric exponential.
        ois = metric_exp(jax.lax.stop_gradient(log_ratio))
        columns["ois"] = _reduce.total(ois, b.mask)
    return out._replace(columns=columns)


def loss_terms(inputs: LossInputs, plan: LossPlan) -> PolicyLossTerms:
    """The loss pipeline: checked inputs, correction, surrogate, regularisers and
    aggregation, as the plan says. Every entry point ends here: the config's through
    :func:`~offpolicy_jax._src.config.plan.resolve`, :mod:`offpolicy_jax.objectives` with
    the plan of their own arguments."""
    raw = _prepare(inputs, plan)
    # The correction reads the raw π_rollout (it counts the neutral reads itself);
    # everything after it reads the filled one.
    algo = plan.algorithm
    b = _neutral_rollout(raw, plan, algo)
    diff = _rollout_abs_diff(b, algo)
    c = _corrected(raw, plan, algo, inputs.correction_result)
    policy = _policy_term(b, plan, algo, c, diff)
    per_token, policy_columns = policy.loss, policy.columns
    columns = {
        "count": _reduce.count(c.mask),
        "mask_count": _reduce.count(b.mask),
        "bad_model": _reduce.count_where(b.bad_model, b.mask),
    }
    if not c.counts_nonfinite:
        # Not rejected by a correction pipeline: reject (and count) here, alike.
        logps = (b.old, b.rollout, b.theta_sg if algo.theta_weighs else None)
        bad_logp = jnp.zeros(b.mask.shape, bool)
        for x in logps:
            if x is not None:
                bad_logp = bad_logp | ~jnp.isfinite(x)
        columns["bad_logp"] = _reduce.count_where(bad_logp, b.mask)
    # The clip indicators are taken beside "loss" (below): both read the ratio.
    clip_keys = ("pg_clipfrac", "pg_clipfrac_lower")
    columns |= {k: v for k, v in policy_columns.items() if k not in clip_keys}
    # KL-to-reference and entropy join the policy term per token: one sum, one
    # aggregation, the same final mask.
    kl_denominator = b.policy(algo.ratio or "old")
    positive = None if b.rewards is None else b.rewards > 0
    regularisers = _objective.regulariser_terms(
        plan, b.theta, kl_denominator, b.valid, b.ref, b.ent, positive=positive
    )
    pg_per_token = per_token
    if "kl_loss" in regularisers:
        columns["kl_loss"] = _reduce.total(regularisers["kl_loss"], c.mask)
        if plan.kl_coef:
            per_token = per_token + plan.kl_coef * regularisers["kl_loss"]
    if "entropy" in regularisers:
        columns["entropy"] = _reduce.total(regularisers["entropy"], c.mask)
        if plan.entropy_coef:
            per_token = per_token - plan.entropy_coef * regularisers["entropy"]
    if "nll_loss" in regularisers:
        columns["nll_loss"] = _reduce.total(regularisers["nll_loss"], c.mask)
        if plan.positive_example_nll_weight:
            per_token = per_token + plan.positive_example_nll_weight * regularisers["nll_loss"]
    if per_token is not pg_per_token:
        columns["pg_loss"] = _reduce.total(pg_per_token, c.mask)
    columns |= {k: policy_columns[k] for k in clip_keys if k in policy_columns}
    if b.topk is not None:
        columns |= topk_mismatch_columns(b.topk, b.mask)
    columns["loss"] = _reduce.total(per_token, c.mask)
    sums = b.layout.reduce(columns)
    return _aggregated(b, plan, per_token, c, sums, policy.own_metrics)


def _aggregated(
    b: _Batch, plan: LossPlan, per_token, c: _Corrected, sums, own_metrics=()
) -> PolicyLossTerms:
    """The per-sequence sums as the loss's and the metrics' batch parts."""
    reduction, layout = b.reduction, b.layout
    ok = sums["bad_model"] == 0
    means = {
        "pg_nonfinite_seq_fraction": _reduce.seq_mean_of_values(
            jnp.where(ok, 0.0, 1.0), sums["mask_count"], reduction
        )
    }
    if not c.counts_nonfinite:
        logp_ok = sums["bad_logp"] == 0
        means["mis_nonfinite_seq_fraction"] = _reduce.seq_mean_of_values(
            jnp.where(logp_ok, 0.0, 1.0), sums["mask_count"], reduction
        )
        ok = ok & logp_ok
    # Such sequences are rejected like any other: they leave m' (the loss, its metrics)
    # and stay in m'' = m under rejected_in_denominator, as in the correction's path.
    count = jnp.where(ok, sums["count"], 0.0)
    mask_count = jnp.where(ok, sums["mask_count"], 0.0)
    denominator = sums["mask_count"] if plan.rejected_in_denominator else count
    horizon = _horizon(plan.aggregation, plan.loss_scale_factor, b.mask.shape[-1], layout)
    for key in ("loss", "pg_loss", "kl_loss", "entropy", "nll_loss"):
        if key in sums:
            means[key] = aggregation_terms(
                jnp.where(ok, sums[key], 0.0), denominator, plan.aggregation, horizon=horizon
            )
    means.setdefault("pg_loss", means["loss"])
    token_means = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "train_rollout_logprob_abs_diff")
    for key in token_means + own_metrics:
        if key in sums:
            means[key] = _reduce.seq_mean(jnp.where(ok, sums[key], 0.0), count, reduction)
    if "ois" in sums:
        means["ois"] = _reduce.seq_mean(jnp.where(ok, sums["ois"], 0.0), mask_count, reduction)
    if TOPK_COUNT in sums:
        means |= topk_mismatch_means(sums, ok, reduction)
    parts = {**c.parts, **b.proximal, **layout.batch_means(means)}
    final_mask = jnp.where(layout.broadcast(ok), c.mask, 0.0)
    loss_parts = parts.pop("loss")
    assert isinstance(loss_parts, MeanParts)  # aggregation_terms -> batch_means
    return PolicyLossTerms(
        loss=jnp.where(final_mask > 0, per_token, 0.0),
        mask=final_mask,
        denominator_mask=b.mask if plan.rejected_in_denominator else final_mask,
        parts=loss_parts,
        metrics=parts,
    )


@_takes_arguments_of(_terms)
def policy_loss_terms(terms: PolicyLossTerms) -> PolicyLossTerms:
    """:func:`policy_loss` with its per-token terms and its final mask.

    A per-token KL or entropy term over the same post-rejection mask is then a few
    lines (see the example). Arguments as :func:`policy_loss`.

    Returns:
      :class:`PolicyLossTerms`.

    Examples:
      >>> import jax, jax.numpy as jnp, offpolicy_jax as opj
      >>> logp = jnp.log(jnp.array([[0.5, 0.4, 0.9], [0.3, 0.2, 0.7]]))
      >>> ref_logp = jnp.log(jnp.array([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
      >>> mask = jnp.array([[1, 1, 0], [1, 1, 1]], bool)
      >>> cfg = opj.LossConfig(algorithm="ppo")
      >>> def loss_fn(lp):
      ...     t = opj.policy_loss_terms(lp, logp, None, jnp.array([1.0, -1.0]), mask, cfg)
      ...     d = ref_logp - lp  # per-token k3 estimate of KL(π_θ ‖ π_ref)
      ...     kl = jnp.exp(d) - d - 1
      ...     kl = opj.aggregate(kl, t.mask, t.denominator_mask, cfg.aggregation)
      ...     return t.parts.value() + 0.1 * kl.value()
      >>> round(float(loss_fn(logp)), 4)  # PPO part 0 (ratio 1, advantages ±1) + 0.1 · KL
      0.0138
      >>> jax.grad(loss_fn)(logp).shape
      (2, 3)
    """
    return terms


@_takes_arguments_of(_terms)
def policy_loss_parts(terms: PolicyLossTerms) -> tuple[MeanParts, dict[str, MeanParts | jax.Array]]:
    """:func:`policy_loss` as poolable parts: ``(LossParts, metric parts)``.

    Pool both over micro-batches with :func:`offpolicy_jax.pool_metric_parts` (the
    loss alone also with ``a + b``), then call ``.value()`` on the loss and
    :func:`offpolicy_jax.finalize_metrics` on the metrics: the result equals the
    full-batch call. With batch normalisation
    or sequence-level statistics that need the whole batch, compute the
    correction once on the full batch and pass it as ``correction_result``
    (normalising per micro-batch would bias the pooled loss).

    Args: as :func:`policy_loss`, plus
      correction_result: a :class:`CorrectionResult` computed beforehand for
        exactly these tokens (decoupled_ppo); replaces the configured correction,
        whose metrics are then only in ``correction_result.metrics``.

    Examples:
      >>> import jax.numpy as jnp, offpolicy_jax as opj
      >>> lp = jnp.log(jnp.array([[0.5, 0.4], [0.3, 0.2]]))
      >>> m = jnp.ones((2, 2), bool)
      >>> cfg = opj.LossConfig(algorithm="ppo")
      >>> a, _ = opj.policy_loss_parts(lp[:1], lp[:1], None, jnp.ones(1), m[:1], cfg)
      >>> b, _ = opj.policy_loss_parts(lp[1:], lp[1:], None, jnp.ones(1), m[1:], cfg)
      >>> float((a + b).value())
      -1.0
    """
    return terms.parts, terms.metrics


@_takes_arguments_of(_terms)
def policy_loss(terms: PolicyLossTerms) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Policy-gradient loss with rollout correction (docs/semantics.md §5).

    ``ppo``: ``ℓ(θ; π_old)``; ``bypass_ppo``: ``ℓ(θ; π_rollout)``;
    ``decoupled_ppo``: ``w(π_old/π_rollout) · ℓ(θ; π_old)`` on the corrected mask;
    ``reinforce_is``: ``−sg(w(π_θ/π_rollout)) · A · log π_θ``. ``ℓ`` is the
    surrogate ``config.policy_loss``: the clipped PPO surrogate
    (:func:`~offpolicy_jax._src.losses.surrogates.ppo_surrogate`) by default, or GSPO, CISPO, GMPO,
    SAPO, GPG, DPPO, DRO, VESPO, LUSPO (:mod:`offpolicy_jax._src.losses.policy_losses`,
    docs/semantics.md §5.1);
    the weights come from ``config.correction``; aggregation per
    ``config.aggregation``. IS weights never carry gradient.

    Args:
      logp: ``[..., T]`` log π_θ of the sampled tokens: the differentiated input.
      old_logp: ``[..., T]`` log π_old from the training engine, or None for
        ``bypass_ppo`` / ``reinforce_is``.
      rollout_logp: ``[..., T]`` log π_rollout from the inference engine (may be
        None only for plain ``ppo`` without correction or mismatch metrics).
      advantages: ``[..., T]`` per token or ``[...]`` per sequence.
      mask: ``[..., T]`` bool, 0/1 integers, or floats; > 0 = token is trained on. A
        float value is the token's weight in every sum (a uniform 0.5 mask leaves the
        means unchanged but halves sums such as the sequence-level log-ratio); an
        integer mask must be 0/1 (a concrete one holding another value raises
        ``ValueError``); docs/semantics.md §0.
      config: a :class:`LossConfig` (static: hashable).
      axis_names: mesh axes to ``psum`` over inside ``shard_map`` (see
        :func:`~offpolicy_jax.compute_correction`).
      correction_result: optional precomputed correction for these tokens.
      segment_ids: packed rows (docs/semantics.md §10): int ``[..., T]``, 1..K name
        the sequences of a row, 0 is padding (never trained on, whatever ``mask``
        says); every per-sequence quantity (ratios, rejection, veto, batch
        normalisation, ``sequence_mean`` / ``sequence_sum``, sequence metrics) is
        then per (row, segment). ``advantages`` must be per token. None: one
        sequence per row.
      num_segments: ``K``, a static int, the most sequences a row may hold; given
        exactly when ``segment_ids`` is.
      ref_logp: ``[..., T]`` log π_ref of the sampled tokens (stop-gradient), for the
        KL-to-reference term (``config.kl_coef``, ``kl_estimator``, ``kl_off_policy``;
        docs/semantics.md §5.2); required when ``kl_coef > 0``, else it only adds the
        ``kl_loss`` metric. Non-finite at a valid token (with ``kl_coef > 0``): the
        sequence is rejected, like a non-finite ``logp``.
      entropy: ``[..., T]`` per-token entropies ``H`` (differentiable), for the bonus
        ``−entropy_coef · H``; required when ``entropy_coef != 0``, else it only adds
        the ``entropy`` metric.
      versions: asynchronous RL (docs/guide/async.md): int ``[..., T]``, the policy
        version that sampled each token, for a ``CorrectionConfig`` correction's
        staleness metrics and rules (as in :func:`compute_correction`) and for
        ``config.prox_logp_method``'s proximal approximation, which requires it.
      current_version: the trainer's policy version, required with ``versions``: an
        int, or an int array ``[...]`` (one per sequence), ``[..., 1]`` or ``[..., T]``;
        checked as in :func:`compute_correction` (a negative version has no age).
      key: a PRNG key (``jax.random.key(seed)``) for surrogates that choose tokens at
        random (``clip_cov``), handed to them as ``SurrogateInput.key``; the library
        draws no randomness of its own (the same key gives the same loss).
      rewards: ``[...]`` per sequence or ``[..., T]`` per token (per token with
        ``segment_ids``): the rewards that select VAPO's positive examples
        (``reward > 0``, NeMo-RL) for ``config.positive_example_nll_weight``'s NLL
        term; required when that weight is > 0, else it only adds the ``nll_loss``
        metric. Non-finite at a valid token (with the weight > 0): the sequence is
        rejected, like a non-finite ``logp``.
      topk: a :class:`~offpolicy_jax.TopKLogprobs`: the engine's top-k ids and
        log-probs per position ``[..., T, K]`` and the trainer's log-probs on them
        (:func:`~offpolicy_jax.topk_logprobs`), stop-gradient. Required by
        ``dppo_tv`` / ``dppo_kl`` with ``divergence_type="topk_tv"`` / ``"topk_kl"``;
        whenever given, the metrics gain ``mis_topk_tv`` and ``mis_topk_kl`` (the
        top-k divergences of ``topk.logp`` from ``topk.rollout_logp``, averaged over
        the valid tokens like ``ois``).

    Returns:
      ``(loss, metrics)``: a float32 scalar (0, with zero gradients, when nothing
      is left to train on) and a dict of float32 scalar metrics.

    Examples:
      >>> import jax, jax.numpy as jnp, offpolicy_jax as opj
      >>> logp = jnp.log(jnp.array([[0.5, 0.4, 0.9], [0.3, 0.2, 0.7]]))
      >>> old = logp - 0.1
      >>> rollout = logp - jnp.array([[0.1, 0.2, 0.1], [0.1, 3.0, 0.1]])
      >>> mask = jnp.array([[1, 1, 0], [1, 1, 1]], bool)
      >>> cfg = opj.LossConfig(algorithm="decoupled_ppo",
      ...                      correction=opj.CorrectionConfig.preset("mis"))
      >>> loss, metrics = opj.policy_loss(logp, old, rollout, jnp.array([1.0, -1.0]), mask, cfg)
      >>> round(float(loss), 4), round(float(metrics["mis_rs_mask_fraction_high"]), 4)
      (-0.0283, 0.1667)
      >>> jax.grad(lambda lp: opj.policy_loss(lp, old, rollout, 1.0 + 0 * lp, mask, cfg)[0])(
      ...     logp).shape
      (2, 3)
    """
    return terms.parts.value().astype(jnp.float32), metrics.finalize(terms.metrics)
