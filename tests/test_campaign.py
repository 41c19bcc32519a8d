"""The adversarial property campaign: what a hostile user would try.

Every property draws from ``strategies`` (``hypothesis.extra.numpy``, so failures
shrink): ragged ``[4, 16]`` batches with NaN / ±inf / ±1e30 at masked positions,
float32 / bf16 / fp16 log-probs, float / bool / int masks, and a fixed pool of
configs covering every algorithm and aggregation. One shape and a bounded pool
mean one compilation per (config, dtypes), shared by all properties through the
module-level jitted functions, so that thousands of examples stay affordable.

Profiles (tests/conftest.py): ``ci`` (the default) runs each property on a few
derandomised examples, the counts given to :func:`budget`; ``HYPOTHESIS_PROFILE=thorough``
runs every property on the profile's count (5,000), except ``jit == eager``, whose
eager side costs about a second a call (see ``THOROUGH_EAGER_EXAMPLES``).

Tiers: the fast tier (``-m "not slow"``) runs the headline properties (garbage at masked
positions, finiteness, empty batches, threads, hostile configs) and the regressions; the
properties marked slow (mask dtypes, low precision, jit == eager, vmap, pooling, the
correction) each compile their own pool of programs (5-8 s of CPU apiece) and have
fixed-example counterparts in the fast tier (test_pipeline_defects, test_policy_losses,
test_correction); the full suite runs them all.

The two defects the campaign found in the core have regression tests at the end.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from strategies import (
    CAMPAIGN_CORRECTION_CONFIGS,
    CAMPAIGN_LOSS_CONFIGS,
    DTYPES,
    F32,
    LOGP_KEYS,
    MASK_DTYPES,
    campaign_batches,
    hostile_numbers,
    optional_hostile_numbers,
)

import offpolicy_jax as opj
from offpolicy_jax._src.correction import bounds, criteria

pytestmark = pytest.mark.usefixtures("clear_jax_caches")

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
# The thorough profile caps the eager property (op by op: about 0.4 s an example);
# CAMPAIGN_EAGER_EXAMPLES=5000 runs it in full (about 30 min on one core).
THOROUGH_EAGER_EXAMPLES = int(os.environ.get("CAMPAIGN_EAGER_EXAMPLES", "300"))


def budget(ci: int, thorough: int | None = None):
    """``ci`` examples in the ci profile; the loaded profile's count (or ``thorough``) else."""
    if PROFILE in ("ci", "default"):
        return settings(max_examples=ci)
    profile_count = settings().max_examples
    return settings(max_examples=min(thorough, profile_count) if thorough else profile_count)


loss_vg = jax.jit(jax.value_and_grad(opj.policy_loss, has_aux=True), static_argnames="config")
correct = jax.jit(opj.compute_correction, static_argnames=("config", "reduction"))


def _parts(logp, old, rollout, adv, mask, config):
    parts, metrics = opj.policy_loss_parts(logp, old, rollout, adv, mask, config)
    return parts.numerator, (parts.denominator, metrics)


parts_vg = jax.jit(jax.value_and_grad(_parts, has_aux=True), static_argnames="config")


@functools.cache
def vmapped_loss_vg(config):
    return jax.jit(
        jax.vmap(lambda *args: jax.value_and_grad(opj.policy_loss, has_aux=True)(*args, config))
    )


THREADS = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="campaign")

loss_configs = st.sampled_from(CAMPAIGN_LOSS_CONFIGS)
correction_configs = st.sampled_from(CAMPAIGN_CORRECTION_CONFIGS)
dtypes = st.sampled_from(DTYPES)
mask_dtypes = st.sampled_from(MASK_DTYPES)
reductions = st.sampled_from(["sequence", "token"])


# --------------------------------------------------------------------------- helpers


def inputs(batch, dtype="float32", mask_dtype="float32", *, dirty=True):
    """``(logp, old, rollout, advantages, mask)`` as the library receives them.

    ``dirty``: junk at every masked position, else 0 there. fp16 ``logp`` is passed
    upcast to float32, the README's recipe: a gradient w.r.t. fp16 overflows at 65504.
    """
    mask = batch["mask"]
    out = []
    for key in (*LOGP_KEYS, "advantages"):
        x = np.where(mask, batch[key], batch["junk"][key] if dirty else 0).astype(np.float32)
        if key in LOGP_KEYS:
            x = jnp.asarray(x, dtype)
            if key == "logp" and dtype == "float16":
                x = x.astype(jnp.float32)
        out.append(x)
    return (*out, np.asarray(mask, mask_dtype))


def as_f32(tree):
    return jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.float32)), tree)


def assert_identical(a, b):
    """Bit for bit (NaN == NaN), including dict keys."""
    a, b = as_f32(a), as_f32(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True
    ):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def assert_close(a, b, *, rtol=1e-5, atol=1e-5):
    """Equal up to float32 summation order: atol scales with the largest magnitude."""
    a, b = as_f32(a), as_f32(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True
    ):
        scale = 1.0 + float(np.max(np.abs(x), initial=0.0))
        np.testing.assert_allclose(
            x, y, rtol=rtol, atol=atol * scale, err_msg=jax.tree_util.keystr(path)
        )


def assert_finite(tree):
    for leaf in jax.tree.leaves(as_f32(tree)):
        assert np.all(np.isfinite(leaf)), leaf


def has_valid_tokens(batch):
    return bool(batch["mask"].any())


# --------------------------------------------------------------------------- configs


def _float32_ratio_ok(value):
    """The rule a ratio bound must obey: its float32 value is normal and finite."""
    with np.errstate(over="ignore", under="ignore"):
        as_f32 = float(np.float32(value))
    return math.isfinite(value) and F32.tiny <= as_f32 <= F32.max


def _f32(value):
    with np.errstate(over="ignore", under="ignore"):
        return np.float32(value)


@budget(ci=300)
@given(
    kwargs=st.fixed_dictionaries(
        {
            "use_tis": st.booleans(),
            "tis_mode": st.sampled_from(["truncate", "clip", "mask"]),
            "tis_upper_bound": hostile_numbers,
            "tis_lower_bound": optional_hostile_numbers,
            "use_rs": st.booleans(),
            "rs_lower_bound": optional_hostile_numbers,
            "rs_upper_bound": optional_hostile_numbers,
            "rs_veto_threshold": optional_hostile_numbers,
        }
    )
)
def test_hostile_correction_config_builds_sound_or_names_the_key(kwargs):
    upper, lower = kwargs["tis_upper_bound"], kwargs["tis_lower_bound"]
    resolved_lower = lower if lower is not None else (1 / upper if upper else math.inf)
    lower_used = kwargs["tis_mode"] != "truncate" or (
        kwargs["use_rs"] and kwargs["rs_lower_bound"] is None
    )
    ok = all(  # every number set must be finite, used or not
        math.isfinite(value) for value in kwargs.values() if isinstance(value, float)
    ) and all(
        _float32_ratio_ok(kwargs[key])
        for key in ("tis_upper_bound", "tis_lower_bound", "rs_veto_threshold")
        if kwargs[key] is not None
    )
    if ok and lower_used:
        ok = _float32_ratio_ok(resolved_lower)
    if ok and kwargs["tis_mode"] != "truncate":
        ok = _f32(resolved_lower) < _f32(upper)
    if ok and lower is not None:  # an explicit lower bound, used or not, lies below upper
        ok = _f32(lower) < _f32(upper)
    if ok and kwargs["use_rs"]:
        rs_lower = (
            kwargs["rs_lower_bound"] if kwargs["rs_lower_bound"] is not None else resolved_lower
        )
        rs_upper = kwargs["rs_upper_bound"] if kwargs["rs_upper_bound"] is not None else upper
        ok = all(
            _float32_ratio_ok(kwargs[k])
            for k in ("rs_lower_bound", "rs_upper_bound")
            if kwargs[k] is not None
        ) and _f32(rs_lower) < _f32(rs_upper)
    if not ok:
        with pytest.raises(ValueError) as info:
            opj.CorrectionConfig(**kwargs)
        named = [k for k in kwargs if k in str(info.value)]
        assert named, str(info.value)
        return
    config = opj.CorrectionConfig(**kwargs)
    # Never a silent 0 / inf: the float32 bounds bound finite, positive weights.
    ratios = jnp.exp(jnp.linspace(-20.0, 20.0, 41, dtype=jnp.float32))
    weights, keep = bounds.apply_mode(
        ratios, config.tis_mode, config.lower_bound, config.upper_bound
    )
    weights = np.asarray(weights)
    assert np.all(np.isfinite(weights))
    assert np.all(weights[np.asarray(keep)] > 0) if keep is not None else np.all(weights > 0)
    if config.rs_veto_threshold is not None:
        assert np.isfinite(np.float32(math.log(config.rs_veto_threshold)))


@budget(ci=300)
@given(
    clip_eps=hostile_numbers,
    clip_eps_high=optional_hostile_numbers,
    dual_clip_c=optional_hostile_numbers,
    clip_low=hostile_numbers,
    clip=hostile_numbers,
)
def test_hostile_loss_settings_build_sound_or_name_the_key(
    clip_eps, clip_eps_high, dual_clip_c, clip_low, clip
):
    one = np.float32(1)
    ok = 0 < clip_eps < 1 and 0 < one - _f32(clip_eps) < one < one + _f32(clip_eps)  # float32
    ok &= clip_eps_high is None or (clip_eps_high > 0 and one < _f32(1 + clip_eps_high) <= F32.max)
    ok &= dual_clip_c is None or (math.isfinite(dual_clip_c) and one < _f32(dual_clip_c) <= F32.max)
    kwargs = dict(clip_eps=clip_eps, clip_eps_high=clip_eps_high, dual_clip_c=dual_clip_c)
    if ok:
        config = opj.LossConfig(**kwargs)
        low, high = 1 - np.float32(config.clip_eps), 1 + np.float32(config.upper_clip_eps)
        assert 0 < low < 1 < high < np.inf
    else:
        with pytest.raises(ValueError, match=r"LossConfig\.(clip_eps|clip_eps_high|dual_clip_c) "):
            opj.LossConfig(**kwargs)
    vanilla_ok = (
        math.isfinite(clip_low)
        and clip_low >= 0
        and (clip_low == 0 or _float32_ratio_ok(clip_low))
        # clip = +inf is the documented "no cap" (the untruncated vanilla-IS weight).
        and (clip == math.inf or _float32_ratio_ok(clip))
        and _f32(clip_low) < _f32(clip)
    )
    if vanilla_ok:
        opj.VanillaTIS(clip_low=clip_low, clip=clip)
    else:
        with pytest.raises(ValueError, match="clip"):
            opj.VanillaTIS(clip_low=clip_low, clip=clip)


# --------------------------------------------------------------------------- losses


@pytest.mark.heavy
@budget(ci=5)
@given(batch=campaign_batches(), config=loss_configs, dtype=dtypes, mask_dtype=mask_dtypes)
def test_garbage_at_masked_positions_changes_nothing_bit_for_bit(batch, config, dtype, mask_dtype):
    dirty = loss_vg(*inputs(batch, dtype, mask_dtype), config=config)
    clean = loss_vg(*inputs(batch, dtype, mask_dtype, dirty=False), config=config)
    assert_identical(dirty, clean)
    (_, metrics), grad = dirty
    assert np.all(as_f32(grad)[~batch["mask"]] == 0)


@budget(ci=3)
@given(batch=campaign_batches(), config=loss_configs, dtype=dtypes, mask_dtype=mask_dtypes)
def test_finite_inputs_give_finite_loss_metrics_and_gradients(batch, config, dtype, mask_dtype):
    (loss, metrics), grad = loss_vg(*inputs(batch, dtype, mask_dtype), config=config)
    assert_finite((loss, metrics, grad))
    assert loss.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in metrics.values())


@budget(ci=3)
@given(
    batch=campaign_batches(),
    config=loss_configs,
    dtype=dtypes,
    mask_dtype=mask_dtypes,
    how=st.sampled_from(["empty", "rejected"]),
)
def test_empty_or_fully_rejected_batch_gives_zero_loss_and_zero_gradient(
    batch, config, dtype, mask_dtype, how
):
    batch = dict(batch)
    if how == "empty":
        batch["mask"] = np.zeros_like(batch["mask"])
    else:
        # A NaN rollout log-prob at one valid token of every sequence rejects them all,
        # whatever the algorithm (docs/semantics.md §0).
        first_valid = np.argmax(batch["mask"], axis=-1)
        rollout = batch["rollout_logp"].copy()
        rollout[np.arange(len(rollout)), first_valid] = np.nan
        batch["rollout_logp"] = rollout
    (loss, metrics), grad = loss_vg(*inputs(batch, dtype, mask_dtype), config=config)
    assert float(loss) == 0.0
    assert np.all(as_f32(grad) == 0)
    assert_finite(metrics)
    if how == "rejected" and has_valid_tokens(batch) and "mis_nonfinite_seq_fraction" in metrics:
        assert float(metrics["mis_nonfinite_seq_fraction"]) == 1.0


@pytest.mark.slow
@budget(ci=3)
@given(batch=campaign_batches(), config=loss_configs, dtype=dtypes)
def test_mask_dtype_changes_nothing(batch, config, dtype):
    results = [loss_vg(*inputs(batch, dtype, m), config=config) for m in MASK_DTYPES]
    for other in results[1:]:  # other programs: XLA may fuse (and round) differently
        assert_close(results[0], other, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@budget(ci=3)
@given(
    batch=campaign_batches(),
    config=loss_configs,
    dtype=st.sampled_from(["bfloat16", "float16"]),
    mask_dtype=mask_dtypes,
)
def test_low_precision_inputs_equal_their_exact_float32_upcast(batch, config, dtype, mask_dtype):
    low = inputs(batch, dtype, mask_dtype)
    upcast = tuple(
        x.astype(jnp.float32) if isinstance(x, jax.Array) else x for x in low
    )  # the same values, exactly, in float32
    (loss, metrics), grad = loss_vg(*low, config=config)
    (loss32, metrics32), grad32 = loss_vg(*upcast, config=config)
    # Two programs: equal up to XLA's fusion, which may round a sum differently.
    assert_close((loss, metrics), (loss32, metrics32), rtol=1e-6, atol=1e-6)
    assert grad.dtype == low[0].dtype
    assert_close(grad, grad32.astype(grad.dtype), rtol=1e-2, atol=1e-6)  # one bf16 ulp


@pytest.mark.slow
@budget(ci=2, thorough=THOROUGH_EAGER_EXAMPLES)
@given(batch=campaign_batches(), config=loss_configs, dtype=dtypes, mask_dtype=mask_dtypes)
def test_jit_equals_eager(batch, config, dtype, mask_dtype):
    args = inputs(batch, dtype, mask_dtype)
    eager = jax.value_and_grad(opj.policy_loss, has_aux=True)(*args, config=config)
    assert_close(loss_vg(*args, config=config), eager)


@pytest.mark.slow
@budget(ci=2)
@given(
    batches=st.lists(campaign_batches(), min_size=3, max_size=3),
    config=loss_configs,
    dtype=dtypes,
    mask_dtype=mask_dtypes,
)
def test_vmap_equals_loop(batches, config, dtype, mask_dtype):
    each = [inputs(b, dtype, mask_dtype) for b in batches]
    stacked = [jnp.stack(xs) for xs in zip(*each, strict=True)]
    mapped = vmapped_loss_vg(config)(*stacked)
    for i, args in enumerate(each):
        assert_close(jax.tree.map(lambda x, i=i: x[i], mapped), loss_vg(*args, config=config))


POOLABLE = [
    c
    for c in CAMPAIGN_LOSS_CONFIGS
    if not (isinstance(c.correction, opj.CorrectionConfig) and c.correction.tis_batch_normalize)
]


@pytest.mark.slow
@budget(ci=3)
@given(
    batch=campaign_batches(),
    config=st.sampled_from(POOLABLE),
    dtype=dtypes,
    mask_dtype=mask_dtypes,
)
def test_pooled_micro_batches_equal_the_full_batch(batch, config, dtype, mask_dtype):
    logp, *rest = inputs(batch, dtype, mask_dtype)
    # Differentiated in float32: a bf16 gradient of each part, rounded before the
    # division by the pooled denominator, would round twice.
    args = (logp.astype(jnp.float32), *rest)
    (loss, metrics), grad = loss_vg(*args, config=config)
    numerator, denominator, grads, parts = 0.0, 0.0, [], None
    for rows in (slice(0, 2), slice(2, 4)):
        (num, (den, part)), g = parts_vg(*(x[rows] for x in args), config=config)
        numerator, denominator = numerator + num, denominator + den
        grads.append(g)
        parts = part if parts is None else opj.pool_metric_parts(parts, part)
    pooled_loss = numerator / denominator if denominator > 0 else 0.0 * numerator
    pooled_grad = jnp.concatenate(grads) / (denominator if denominator > 0 else 1.0)
    assert_close(
        (pooled_loss, opj.finalize_metrics(parts), pooled_grad),
        (loss, metrics, grad),
        rtol=2e-5,
    )


@budget(ci=2)
@given(batch=campaign_batches(), config=loss_configs, dtype=dtypes, mask_dtype=mask_dtypes)
def test_four_threads_agree_with_one(batch, config, dtype, mask_dtype):
    base = inputs(batch, dtype, mask_dtype)
    variants = [
        base,
        (*base[:3], -base[3], base[4]),  # negated advantages
        *(tuple(jnp.roll(x, k, axis=0) for x in base) for k in (1, 2)),  # other row orders
    ]
    alone = [jax.block_until_ready(loss_vg(*v, config=config)) for v in variants]

    def run(v):
        return jax.block_until_ready(loss_vg(*v, config=config))

    for _ in range(2):
        together = list(THREADS.map(run, variants))
        for a, b in zip(alone, together, strict=True):
            assert_identical(a, b)


# --------------------------------------------------------------------------- correction


@pytest.mark.slow
@budget(ci=4)
@given(
    batch=campaign_batches(),
    config=correction_configs,
    dtype=dtypes,
    mask_dtype=mask_dtypes,
    reduction=reductions,
)
def test_correction_garbage_dtypes_and_finiteness(batch, config, dtype, mask_dtype, reduction):
    _, old, rollout, _, mask = inputs(batch, dtype, mask_dtype)
    _, old_c, rollout_c, _, _ = inputs(batch, dtype, mask_dtype, dirty=False)
    res = correct(old, rollout, mask, config=config, reduction=reduction)
    assert_identical(res, correct(old_c, rollout_c, mask, config=config, reduction=reduction))
    upcast = correct(
        old.astype(jnp.float32),
        rollout.astype(jnp.float32),
        mask,
        config=config,
        reduction=reduction,
    )
    assert_close(res, upcast, rtol=1e-6, atol=1e-6)  # another program: fusion may round
    assert_finite(res)
    weights, final = np.asarray(res.weights), np.asarray(res.mask)
    assert np.all(weights[~batch["mask"]] == 0) and np.all(final[~batch["mask"]] == 0)


# --------------------------------------------------------------------------- core defects
# Found by this campaign; fixed in the stage pipeline.


@pytest.mark.heavy
@pytest.mark.parametrize(
    "config", [c for c in CAMPAIGN_LOSS_CONFIGS if not c.reweights], ids=lambda c: c.algorithm
)
def test_core_nonfinite_valid_logprob_rejects_in_every_algorithm(config):
    nan = np.float32(np.nan)
    old = np.array([[nan, -1.0]], np.float32)
    rollout = np.array([[nan, -1.0]], np.float32)
    logp = np.array([[-1.0, -1.0]], np.float32)
    (loss, _), grad = loss_vg(
        logp, old, rollout, np.ones(1, np.float32), np.ones((1, 2)), config=config
    )
    assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0)


def test_core_metrics_of_finite_extreme_inputs_are_finite():
    config = opj.LossConfig(get_mismatch_metrics=True)
    old = np.full((1, 4), -104.0, np.float32)
    rollout = old + 100.0  # δ = -100: k3 = e^-100 + 99, fine; perplexity e^104 = inf
    (loss, metrics), grad = loss_vg(
        old, old, rollout, np.ones(1, np.float32), np.ones((1, 4)), config=config
    )
    assert_finite((loss, metrics, grad))


# --------------------------------------------------------------------- silent wrong answers
# Properties that would have caught each class of silent wrong answers found once: packed
# ids above num_segments, masks other than 0/1, every verl rollout_rs option string,
# and hostile config values behind every config entry point. Their fixed-example
# regressions are in
# tests/test_reliability.py.

PACKED_MIS = opj.LossConfig(
    algorithm="decoupled_ppo", correction=opj.CorrectionConfig.preset("mis")
)


@functools.cache
def packed_loss(num_segments):
    return jax.jit(
        lambda logp, old, rollout, adv, mask, ids: opj.policy_loss(
            logp, old, rollout, adv, mask, PACKED_MIS, segment_ids=ids, num_segments=num_segments
        )
    )


@pytest.mark.slow  # its own programs; fixed examples in test_reliability.py
@budget(ci=20)
@given(
    batch=campaign_batches(),
    num_segments=st.integers(1, 4),
    ids=hnp.arrays(np.int32, (4, 16), elements=st.integers(-2, 7)),
)
def test_ids_above_num_segments_raise_eagerly_and_are_padding_under_jit(batch, num_segments, ids):
    logp, old, rollout, adv, mask = inputs(batch, dirty=False)
    adv = np.broadcast_to(np.asarray(adv), mask.shape)
    above = ids > num_segments
    if above.any():
        with pytest.raises(ValueError, match="segment_ids holds id .* num_segments"):
            opj.compute_correction(
                old,
                rollout,
                mask,
                PACKED_MIS.correction,
                segment_ids=ids,
                num_segments=num_segments,
            )
    # Under jit the ids are not read: an id above K is exactly padding (an id of 0).
    traced = packed_loss(num_segments)(logp, old, rollout, adv, mask, jnp.asarray(ids))
    padded = packed_loss(num_segments)(
        logp, old, rollout, adv, mask, jnp.asarray(np.where(above, 0, ids))
    )
    assert_identical(traced, padded)


@pytest.mark.slow  # its own programs; fixed examples in test_reliability.py
@budget(ci=20)
@given(
    batch=campaign_batches(),
    config=loss_configs,
    values=hnp.arrays(np.int32, (4, 16), elements=st.integers(-3, 3)),
    scale=st.sampled_from([0.25, 0.5, 2.0, 3.0]),
)
def test_masks_other_than_0_1(batch, config, values, scale):
    logp, old, rollout, adv, _ = inputs(batch, dirty=False)
    if np.any((values != 0) & (values != 1)):
        with pytest.raises(ValueError, match="mask is an integer mask holding"):
            opj.policy_loss(logp, old, rollout, adv, values, config)
    # Under jit an integer entry > 0 is membership (weight 1), as the bool mask.
    members = values > 0
    assert_identical(
        loss_vg(logp, old, rollout, adv, values, config=config),
        loss_vg(logp, old, rollout, adv, members.astype(np.int32), config=config),
    )
    # A float mask weights its tokens in every sum: a uniform scale leaves every mean
    # unchanged, but not a sum (the sequence-level log-ratio Σ δ m, seq_sum_* criteria).
    if config.aggregation in ("token_mean", "sequence_mean", "row_mean") and not _sums_mask(
        config.correction
    ):
        ones = members.astype(np.float32)
        (loss, _), _ = loss_vg(logp, old, rollout, adv, ones, config=config)
        (scaled, _), _ = loss_vg(logp, old, rollout, adv, ones * scale, config=config)
        assert_close(scaled, loss, rtol=1e-5, atol=1e-6)


def _sums_mask(correction) -> bool:
    """Whether a correction decides on a mask-weighted sum (docs/semantics.md §0)."""
    if not isinstance(correction, opj.CorrectionConfig) or not correction.use_tis:
        return False
    return (
        correction.tis_level == "sequence"
        or (correction.use_rs and correction.rs_level == "sequence")
        or any(spec.startswith("seq_sum_") for spec in correction.rs_criteria)
    )


VERL_OPTIONS = (*criteria.KL_CRITERIA, "binary_kl", "seq_max_k1", "token_k4", "")
_THRESHOLD_PIECES = (
    "2.0", "0.5", "3", "1e-3", " 2.5 ", "0.5_2.0", "2_0", "0.5_2_0", "abc", "inf", "nan",
    "-1", "0", "1e400", "2.0_0.5", "_", "",
)  # fmt: skip


def _verl_rs(options: str, threshold):
    """verl's rollout_rs parsing (rollout_corr_helper: _parse_rollout_rs_thresholds),
    rewritten from its rules, with KPop's binary_kl (one upper bound, like k2 / k3):
    {option: (lower, upper)}, or ValueError."""
    names = list(dict.fromkeys(o.strip() for o in options.split(",") if o.strip()))
    if not names or any(n not in (*criteria.KL_CRITERIA, "binary_kl") for n in names):
        raise ValueError("option")
    if threshold is None and set(names) == {"binary_kl"}:
        threshold = 2.0  # KPop (verl PR 6800): binary_kl alone defaults to φ = 2
    if threshold is None:
        raise ValueError("threshold")
    if isinstance(threshold, (int, float)):
        specs = [str(threshold)]
    elif isinstance(threshold, str):
        specs = [p.strip() for p in threshold.split(",") if p.strip()]
    else:
        raise ValueError("type")
    if len(specs) not in (1, len(names)):
        raise ValueError("count")
    specs = specs * len(names) if len(specs) == 1 else specs
    out = {}
    for name, spec in zip(names, specs, strict=True):
        if name.endswith("k1"):
            lo_text, hi_text = spec.split("_", 1) if "_" in spec else (None, spec)
            hi = float(hi_text)
            lo = float(lo_text) if lo_text is not None else 1.0 / hi
            if lo <= 0 or hi <= 0:
                raise ValueError("positive")
        else:
            if "_" in spec:
                raise ValueError("underscore")
            lo, hi = None, float(spec)
            if hi <= 0:
                raise ValueError("positive")
        out[name] = (lo, hi)
    return out


def _stricter_than_verl(bounds) -> bool:
    """Where this library refuses what verl would accept: non-finite bounds, lo > hi."""
    return any(
        not all(math.isfinite(x) for x in (lo, hi) if x is not None) or (lo is not None and lo > hi)
        for lo, hi in bounds.values()
    )


@budget(ci=300)
@given(
    options=st.lists(st.sampled_from(VERL_OPTIONS), min_size=1, max_size=4).map(",".join),
    threshold=st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from([2.0, 0.01, 3, -1.0, math.inf, math.nan, 0]),
        st.lists(st.sampled_from(_THRESHOLD_PIECES), min_size=1, max_size=4).map(",".join),
    ),
)
def test_every_verl_option_string_parses_like_verl(options, threshold):
    block = {"rollout_is": None, "rollout_rs": options, "rollout_rs_threshold": threshold}
    try:
        bounds = _verl_rs(options, threshold)
    except (ValueError, TypeError, ZeroDivisionError, OverflowError):
        bounds = None
    has_digit_separator = isinstance(threshold, str) and any(
        p.strip().count("_") > (1 if "k1" in options else 0) for p in threshold.split(",")
    )
    if bounds is None or _stricter_than_verl(bounds) or has_digit_separator:
        with pytest.raises(ValueError, match=r"rollout_correction\.rollout_rs"):
            opj.CorrectionConfig.from_verl(block)
        return
    config = opj.CorrectionConfig.from_verl(block)
    got = {c.name: (c.lo, c.hi) for c in config.criteria}
    assert got == bounds  # the same float arithmetic as verl's
    assert list(got) == list(bounds)  # verl's order, duplicates dropped


_JUNK = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(10**400), 10**400),
        st.floats(),
        st.text(max_size=30),
        st.sampled_from(["tokn", "x" * 200_000, "2_0", "0.5_2_0", "1" * 401]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
_CORRECTION_KEYS = st.sampled_from([*opj.CorrectionConfig.keys(), "tis_uper_bound"])
_LOSS_KEYS = st.sampled_from(
    [f.name for f in __import__("dataclasses").fields(opj.LossConfig)] + ["kl_coeff"]
)


@pytest.mark.heavy
@budget(ci=300)
@given(
    entry=st.sampled_from(
        ["CorrectionConfig", "from_dict", "from_yaml", "LossConfig", "from_verl"]
    ),
    key=st.one_of(_CORRECTION_KEYS, _LOSS_KEYS),
    value=_JUNK,
)
def test_every_config_entry_point_builds_or_raises_a_bounded_named_error(entry, key, value):
    import yaml

    try:
        if entry == "CorrectionConfig":
            opj.CorrectionConfig(**{key: value})
        elif entry == "from_dict":
            opj.CorrectionConfig.from_dict({key: value})
        elif entry == "from_yaml":
            opj.CorrectionConfig.from_yaml(yaml.safe_dump({key: value}))
        elif entry == "LossConfig":
            opj.LossConfig(**{key: value})
        else:
            opj.LossConfig.from_verl({"rollout_rs": value, "rollout_rs_threshold": value}, None)
    except (ValueError, TypeError) as err:  # never OverflowError, RecursionError, KeyError
        message = str(err)
        assert len(message) < 2000, message[:300]
        if entry != "from_verl" and key not in ("correction",):
            assert key in message or "YAML" in message, message
    except yaml.YAMLError:
        pass  # safe_dump of a value YAML cannot represent: not the library's input
