"""Sharded calls equal the unsharded call: jit + NamedSharding, and shard_map.

Runs on 8 virtual CPU devices: ``tests/conftest.py`` sets ``JAX_NUM_CPU_DEVICES=8``
before JAX is first imported (see the comment there). Each layout evaluates a
set of configurations from ``mesh_cases`` in one compiled program (one compile per
layout): the "full" set (every loss configuration: each algorithm, TIS/RS level
and mode, aggregation, metric reduction, VanillaTIS, plus compute_correction) on
three token-sharded layouts, and a compact "core" set that still covers every
algorithm and level on the others. The batch is padded with masked garbage to the
next shard multiple (7 x 13 real -> 8 x 14 on 2 token shards, i.e. 7 tokens per
shard; 8 x 16 on 4 or 8; 8 x 13 when the tokens are not split), and losses,
metrics, gradients, weights and masks are compared with the unpadded, unsharded
call at rtol 1e-5 (atol 1e-6); the padding must receive exactly 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import mesh_cases as mc
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from run_once import shared_value

import offpolicy_jax as opj

pytestmark = pytest.mark.usefixtures("clear_jax_caches")

N_DEVICES = 8


def _cpu_devices():
    devices = jax.devices("cpu")
    if len(devices) < N_DEVICES:
        pytest.fail(
            f"the sharding tests need {N_DEVICES} CPU devices, JAX has {len(devices)}: "
            "tests/conftest.py sets JAX_NUM_CPU_DEVICES=8 before importing jax; something "
            "imported jax earlier or overrode JAX_NUM_CPU_DEVICES / XLA_FLAGS"
        )
    return devices[:N_DEVICES]


def _mesh(shape, names, axis_type):
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names), devices=_cpu_devices())


def _put(mesh, token_spec, keys=None):
    """The real batch, padded to the shard multiples with masked garbage, on the mesh."""
    padded = mc.padded_for(mesh, token_spec)
    padded = padded if keys is None else {k: padded[k] for k in keys}
    specs = mc.input_specs(token_spec, padded)
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in padded.items()}, specs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The unsharded call on the unpadded batch (computed outside any mesh context)."""
    return shared_value(tmp_path_factory, "sharding_reference", mc.unsharded_reference)


def _assert_matches(got, reference):
    failures = mc.compare(mc.to_numpy(got), reference)
    assert not failures, "\n".join(failures)


# --- 1. jit + NamedSharding (pjit) under Auto and Explicit meshes -----------------

# spec, and which configurations ("full": every loss configuration; "core": a
# compact set that still covers every algorithm and level, cheaper to compile).
# The full set runs under an Explicit mesh with the tokens sharded (see below).
JIT_SPECS = {
    "data": (P("data"), "core"),
    "data_seq": (P("data", "seq"), "full"),
    "data_fsdp": (P(("data", "fsdp"), None), "core"),
}


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("spec_name", list(JIT_SPECS))
def test_jit_named_sharding_matches_unsharded(spec_name, axis_type, reference):
    spec, configs = JIT_SPECS[spec_name]
    if axis_type == AxisType.Auto:
        configs = "core"
    mesh = _mesh((2, 2, 2), ("data", "fsdp", "seq"), axis_type)
    traced_types = {}

    def fn(arrays):
        out = mc.evaluate_all(arrays, **mc.config_set(configs))
        # Under an Explicit mesh the sharding is part of the type (jax.typeof).
        traced_types.update(jax.tree.map(jax.typeof, out))
        return out

    with jax.set_mesh(mesh):
        arrays, _ = _put(mesh, spec)
        out = jax.jit(fn)(arrays)
    _assert_matches(out, reference)

    want = NamedSharding(mesh, spec)
    for name, outputs in out.items():
        for key, value in outputs.items():
            if key == "metrics" or value.ndim == 0:
                scalars = value if key == "metrics" else {key: value}
                for metric, scalar in scalars.items():
                    assert scalar.sharding.is_fully_replicated, (name, metric, scalar.sharding)
                continue
            # [B, T] outputs (weights, mask, grad) keep the inputs' batch and token sharding.
            assert value.sharding.is_equivalent_to(want, 2), (name, key, value.sharding)
            if axis_type == AxisType.Explicit:
                typed = traced_types[name][key].sharding.spec
                assert typed[0] == spec[0], (name, key, typed)
                assert jax.typeof(value).sharding.spec[0] == spec[0], (name, key)


# --- 2. shard_map with axis_names ---------------------------------------------------

SHARD_MAP_LAYOUTS = {
    # data + context parallelism, MeshAxes.
    "data2_seq4": (
        (2, 4),
        ("data", "seq"),
        AxisType.Explicit,
        P("data", "seq"),
        opj.MeshAxes(batch="data", token="seq"),
        "full",
    ),
    # Two data-parallel axes and a token axis, mapping form.
    "data_fsdp_seq": (
        (2, 2, 2),
        ("data", "fsdp", "seq"),
        AxisType.Auto,
        P(("data", "fsdp"), "seq"),
        {"batch": ("data", "fsdp"), "token": "seq"},
        "core",
    ),
    # Pure context parallelism over 8 shards of 2 tokens: several shards hold only
    # padding, one holds a lone catastrophic token of a sequence that starts elsewhere.
    "seq8": (
        (8,),
        ("seq",),
        AxisType.Explicit,
        P(None, "seq"),
        opj.MeshAxes(token="seq"),
        "full",
    ),
    # Data parallelism only, a plain axis-name string; the "model" axis is not used
    # by the inputs (they are replicated over it).
    "data4_model2": (
        (4, 2),
        ("data", "model"),
        AxisType.Auto,
        P("data"),
        "data",
        "core",
    ),
}


def _shard_mapped(fn, mesh, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


@pytest.mark.parametrize("layout", list(SHARD_MAP_LAYOUTS))
def test_shard_map_matches_unsharded(layout, reference):
    shape, names, axis_type, spec, axis_names, configs = SHARD_MAP_LAYOUTS[layout]
    mesh = _mesh(shape, names, axis_type)
    evaluate = functools.partial(mc.evaluate_all, **mc.config_set(configs))
    with jax.set_mesh(mesh):
        arrays, specs = _put(mesh, spec)
        out_specs = mc.output_specs(jax.eval_shape(evaluate, arrays), spec)
        # check_vma (the default) proves every scalar output is invariant over the
        # mesh, i.e. really combined across shards, before any number is compared.
        fn = _shard_mapped(
            functools.partial(evaluate, axis_names=axis_names), mesh, (specs,), out_specs
        )
        out = fn(arrays)
    _assert_matches(out, reference)


SMALL_LOSSES = {
    k: mc.LOSSES[k] for k in ("decoupled_sequence_rejected_in_den", "reinforce_is_geometric")
}


def test_gradient_taken_outside_shard_map():
    """``jax.grad`` of a shard_map-ed loss (the usual training-step shape) is the
    unsharded gradient; so is the loss."""
    mesh = _mesh((2, 4), ("data", "seq"), AxisType.Explicit)
    spec = P("data", "seq")
    axes = opj.MeshAxes(batch="data", token="seq")
    real = mc.make_batch()
    for name, (config, adv_kind) in SMALL_LOSSES.items():
        adv_key = "adv" if adv_kind == "token" else "adv_seq"
        old = None if config.algorithm == "reinforce_is" else "old"
        keys = ("logp", "rollout", adv_key, "mask") + ((old,) if old else ())

        def loss_fn(logp, rollout, adv, mask, *maybe_old, axis_names=None, config=config):
            old_logp = maybe_old[0] if maybe_old else None
            return opj.policy_loss(
                logp, old_logp, rollout, adv, mask, config, axis_names=axis_names
            )[0]

        want_loss, want_grad = jax.jit(jax.value_and_grad(loss_fn))(*(real[k] for k in keys))
        with jax.set_mesh(mesh):
            arrays, specs = _put(mesh, spec, keys)
            sharded_loss = jax.shard_map(
                functools.partial(loss_fn, axis_names=axes),
                mesh=mesh,
                in_specs=tuple(specs[k] for k in keys),
                out_specs=P(),
            )
            loss, grad = jax.jit(jax.value_and_grad(sharded_loss))(*(arrays[k] for k in keys))
        grad = np.array(grad)
        np.testing.assert_allclose(loss, want_loss, rtol=mc.RTOL, atol=mc.ATOL, err_msg=name)
        np.testing.assert_allclose(
            grad[: mc.REAL_B, : mc.REAL_T], want_grad, rtol=mc.RTOL, atol=mc.ATOL, err_msg=name
        )
        grad[: mc.REAL_B, : mc.REAL_T] = 0
        assert not np.any(grad), f"{name}: gradient leaks into the padding"


def test_mean_of_shard_means_is_not_the_answer(reference):
    """Negative control: per-shard calls *without* ``axis_names`` (then averaged)
    give a different loss and metrics on this batch, so the tests above would
    catch a missing collective."""
    mesh = _mesh((2, 4), ("data", "seq"), AxisType.Explicit)
    spec = P("data", "seq")
    name = "decoupled_sequence_rejected_in_den"
    losses = {name: SMALL_LOSSES[name]}

    def per_shard(arrays):
        out = mc.evaluate_all(arrays, losses=losses, corrections={})
        loss = out[f"loss/{name}"]
        scalars = {"loss": loss["loss"], **loss["metrics"]}
        return jax.tree.map(lambda x: x[None, None], scalars)

    with jax.set_mesh(mesh):
        arrays, specs = _put(mesh, spec)
        out = _shard_mapped(per_shard, mesh, (specs,), P("data", "seq"))(arrays)
    want = reference[f"loss/{name}"]
    naive_loss = float(jnp.mean(out.pop("loss")))
    assert not np.isclose(naive_loss, want["loss"], rtol=1e-3)
    differing = [
        k
        for k, v in out.items()
        if not np.isclose(float(jnp.mean(v)), want["metrics"][k], rtol=1e-3, atol=1e-5)
    ]
    assert len(differing) >= len(out) // 2, differing


def test_correction_result_reused_under_shard_map(reference):
    """A correction computed once on the sharded batch and passed to the loss as
    ``correction_result`` gives the same loss as the configured correction."""
    mesh = _mesh((2, 4), ("data", "seq"), AxisType.Explicit)
    spec = P("data", "seq")
    axes = opj.MeshAxes(batch="data", token="seq")
    name = "decoupled_sequence_rejected_in_den"
    config, _ = mc.LOSSES[name]

    def fn(a):
        res = opj.compute_correction(
            a["old"], a["rollout"], a["mask"], config.correction, axis_names=axes
        )
        return opj.policy_loss(
            a["logp"],
            a["old"],
            a["rollout"],
            a["adv_seq"],
            a["mask"],
            config,
            axis_names=axes,
            correction_result=res,
        )[0]

    with jax.set_mesh(mesh):
        arrays, specs = _put(mesh, spec)
        loss = _shard_mapped(fn, mesh, (specs,), P())(arrays)
    np.testing.assert_allclose(loss, reference[f"loss/{name}"]["loss"], rtol=mc.RTOL, atol=mc.ATOL)


def test_axis_names_naming_a_replicated_axis_raises():
    # Inputs split over "data" only; naming "model" too would psum replicated
    # copies and count every sequence twice, silently. The library refuses.
    mesh = _mesh((4, 2), ("data", "model"), AxisType.Explicit)
    x = np.zeros((8, 6), np.float32)
    mask = np.ones((8, 6), np.float32)
    config = opj.CorrectionConfig(use_tis=True)
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, x, mask)]

        def call(axis_names):
            fn = jax.shard_map(
                lambda o, b, m: (
                    opj.compute_correction(o, b, m, config, axis_names=axis_names).weights
                ),
                in_specs=(P("data"),) * 3,
                out_specs=P("data"),
            )
            return jax.jit(fn)(*args)

        np.testing.assert_array_equal(np.asarray(call("data")), 1.0)
        with pytest.raises(ValueError, match=r"\['model'\].*not split over"):
            call(("data", "model"))
