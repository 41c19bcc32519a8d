"""Regressions: hostile but plausible inputs and configs.

Each test failed on the code before its fix.
"""

from __future__ import annotations

import doc_pages
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import offpolicy_jax as opj

METRICS = opj.LossConfig(get_mismatch_metrics=True)


# ------------------------------------------------------------------ 6: lists, axis_names


@pytest.mark.heavy
def test_nested_lists_are_accepted_like_arrays():
    logp, old, rollout = [[-1.0, -1.5]], ((-1.25, -1.0),), [[-1.0, -2.0]]
    advantages, mask = [1.0], [[1, 1]]
    from_lists = opj.policy_loss(logp, old, rollout, advantages, mask, METRICS)
    from_arrays = opj.policy_loss(
        *(np.asarray(x, np.float32) for x in (logp, old, rollout, advantages)),
        np.asarray(mask),
        METRICS,
    )
    jax.tree.map(np.testing.assert_array_equal, from_lists, from_arrays)
    config = opj.CorrectionConfig(use_tis=True, tis_mode="mask")
    res = opj.compute_correction(old, rollout, [[True, False]], config)
    want = opj.compute_correction(np.float32(old), np.float32(rollout), np.array([[1, 0]]), config)
    jax.tree.map(np.testing.assert_array_equal, res, want)


@pytest.mark.parametrize("argument", ["logp", "old_logp", "rollout_logp", "advantages", "mask"])
def test_ragged_or_non_numeric_list_error_names_the_argument(argument):
    args = dict(
        logp=[[-1.0, -1.0]],
        old_logp=[[-1.0, -1.0]],
        rollout_logp=[[-1.0, -1.0]],
        advantages=[1.0],
        mask=[[1, 1]],
    )
    for bad in ([[-1.0], [-1.0, -1.0]], [["a", "b"]]):
        args[argument] = bad
        with pytest.raises((TypeError, ValueError), match=f"^{argument} "):
            opj.policy_loss(**args, config=METRICS)


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("axis_names", ["data", ("data", "fsdp"), opj.MeshAxes(token="seq")])
def test_axis_names_outside_shard_map_error_names_the_argument(use_jit, axis_names):
    x = np.full((2, 3), -1.0, np.float32)
    calls = [
        lambda x: opj.compute_correction(
            x, x, x < 0, opj.CorrectionConfig(), axis_names=axis_names
        ),
        lambda x: opj.policy_loss(x, x, x, x, x < 0, METRICS, axis_names=axis_names),
    ]
    for call in calls:
        with pytest.raises(
            ValueError, match="axis_names names mesh axis .* no axis of that name is bound"
        ):
            (jax.jit(call) if use_jit else call)(x)


@pytest.mark.heavy
def test_axis_names_of_a_vmap_axis_are_bound():
    batches = np.full((3, 2, 4), -1.0, np.float32)
    per_call = jax.vmap(
        lambda x: opj.policy_loss(x, x, x, x, x < 0, METRICS, axis_names="v")[0], axis_name="v"
    )(batches)
    np.testing.assert_array_equal(per_call, np.full(3, 1.0, np.float32))  # ratio 1, A = -1


# ------------------------------------------------------------------ 7: configs in float32


@pytest.mark.parametrize("value", [1e-46, 1e-39, 1e39])
@pytest.mark.parametrize(
    "key, extra",
    [
        ("tis_upper_bound", {}),
        ("tis_lower_bound", {"tis_mode": "clip", "tis_upper_bound": 1e38}),
        ("rs_veto_threshold", {}),
        ("rs_lower_bound", {"use_rs": True, "rs_upper_bound": 1e38}),
        ("rs_upper_bound", {"use_rs": True, "rs_lower_bound": 2e-38}),
    ],
)
def test_bound_that_is_zero_subnormal_or_inf_in_float32_is_rejected(key, extra, value):
    if key == "tis_lower_bound" and value > 1:
        extra = {**extra, "tis_upper_bound": 3e38}  # keep L < U, so the float32 check decides
    with pytest.raises(ValueError, match=f"{key}.*float32"):
        opj.CorrectionConfig(use_tis=True, **extra, **{key: value})


def test_tis_upper_bound_1e_minus_46_no_longer_zeroes_every_weight():
    # Once accepted, and every weight became min(w, float32(1e-46)) = 0.
    with pytest.raises(ValueError, match="tis_upper_bound"):
        opj.CorrectionConfig(use_tis=True, tis_upper_bound=1e-46)


@pytest.mark.parametrize("tis_mode, use_rs", [("clip", False), ("mask", False), ("truncate", True)])
def test_reciprocal_lower_bound_that_underflows_float32_is_rejected(tis_mode, use_rs):
    # 1 / 1e38 = 1e-38 is subnormal in float32 (flushed to 0 on most backends).
    with pytest.raises(ValueError, match="1 / tis_upper_bound"):
        opj.CorrectionConfig(use_tis=True, tis_mode=tis_mode, use_rs=use_rs, tis_upper_bound=1e38)
    opj.CorrectionConfig(use_tis=True, tis_upper_bound=1e38)  # truncate: L unused, fine


def test_bounds_that_are_equal_in_float32_are_rejected():
    with pytest.raises(ValueError, match="tis_lower_bound must be < tis_upper_bound"):
        opj.CorrectionConfig(tis_mode="clip", tis_lower_bound=1.0, tis_upper_bound=1.0 + 1e-9)
    with pytest.raises(ValueError, match="rs_lower_bound must be < rs_upper_bound"):
        opj.CorrectionConfig(use_rs=True, rs_lower_bound=0.5, rs_upper_bound=0.5 + 1e-12)
    with pytest.raises(ValueError, match="clip_low must be < clip"):
        opj.VanillaTIS(clip_low=2.0, clip=2.0 + 1e-12)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(clip=1e39), "clip"),
        (dict(clip=1e-46), "clip"),
        (dict(clip_low=1e-46), "clip_low"),
    ],
)
def test_vanilla_tis_bounds_checked_in_float32(kwargs, key):
    with pytest.raises(ValueError, match=f"VanillaTIS.{key}"):
        opj.VanillaTIS(**kwargs)
    opj.VanillaTIS(clip_low=0.0, clip=2.0)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(clip_eps=1.5), "clip_eps"),
        (dict(clip_eps=1.0), "clip_eps"),
        (dict(clip_eps=1e-9), "clip_eps"),  # 1 - 1e-9 == 1 in float32: no clip range
        (dict(clip_eps=1 - 1e-9), "clip_eps"),  # 1 - (1 - 1e-9) == 0 in float32
        (dict(clip_eps=3e-8), "clip_eps"),  # 1 + 3e-8 == 1 in float32: no upper clip range
        (dict(clip_eps_high=1e39), "clip_eps_high"),
        (dict(clip_eps_high=1e-9), "clip_eps_high"),
        (dict(dual_clip_c=1e39), "dual_clip_c"),
        (dict(dual_clip_c=1.0 + 1e-9), "dual_clip_c"),
    ],
)
def test_loss_clip_settings_checked_in_float32(kwargs, key):
    with pytest.raises(ValueError, match=f"LossConfig.{key} "):
        opj.LossConfig(**kwargs)


def test_clip_eps_high_may_exceed_one():
    assert opj.LossConfig(clip_eps=0.2, clip_eps_high=1.5).upper_clip_eps == 1.5


def test_veto_without_use_tis_is_documented_as_inactive_and_is():
    # The conformance pack keeps veto keys in metrics-only configs (metrics_only_*), so
    # they are accepted; README and docstring now say that only use_tis: true rejects.
    config = opj.CorrectionConfig(use_tis=False, rs_veto_threshold=1e-4)
    old = np.array([[-1.0, -1.0]], np.float32)
    rollout = np.array([[-1.0, 30.0]], np.float32)  # ratio e^-31 < 1e-4: catastrophic
    res = opj.compute_correction(old, rollout, np.ones_like(old), config)
    np.testing.assert_array_equal(res.mask, [[1.0, 1.0]])
    assert "mis_rs_catastrophic_seq_fraction" not in res.metrics
    vetoing = opj.CorrectionConfig(use_tis=True, rs_veto_threshold=1e-4)
    np.testing.assert_array_equal(
        opj.compute_correction(old, rollout, np.ones_like(old), vetoing).mask, [[0.0, 0.0]]
    )
    readme = doc_pages.text()  # README.md and docs/
    d1 = next(line for line in readme.splitlines() if line.startswith("| D1 |"))
    assert "use_tis" in d1, d1
    row = next(line for line in readme.splitlines() if line.startswith("| `rs_veto_threshold`"))
    assert "use_tis" in row, row
    assert "use_tis" in opj.CorrectionConfig.__doc__.split("rs_veto_threshold:")[1]


# ------------------------------------------------------------------ 8: fp16 gradients


def _fp16_readme_block() -> dict:
    blocks = doc_pages.marked_blocks("doc-test")
    block = next(b for b in blocks if "float16" in b)
    namespace: dict = {}
    exec(compile(block, "docs/guide/training_step.md", "exec"), namespace)  # noqa: S102 - our docs
    return namespace


@pytest.mark.heavy
def test_fp16_gradient_overflow_and_the_float32_recipe():
    # Default ppo, log-ratio 12, advantage -1: dℓ/dθ = e^12 = 162754.8, above fp16's 65504.
    readme = _fp16_readme_block()
    grad16, grad32 = readme["grad16"], readme["grad32"]
    assert grad16.dtype == jnp.float16 and np.isinf(np.asarray(grad16, np.float32)).all()
    assert grad32.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(grad32), [[np.exp(np.float32(12))]], rtol=1e-6)
    # The recipe reproduces the all-float32 computation exactly.
    loss = lambda lp: opj.policy_loss(  # noqa: E731
        lp, jnp.float32([[-12.0]]), None, jnp.float32([-1.0]), [[True]], opj.LossConfig()
    )[0]
    np.testing.assert_array_equal(grad32, jax.grad(loss)(jnp.float32([[0.0]])))
