"""AReaL's rejection grid and MinPRO's level sharded == unsharded, on 8 virtual CPU devices.

MinPRO's minimum prefix ratio is the one order-dependent quantity of the library: with
the token axis sharded, each shard scans its own tokens and takes the minimum of the
shards before it (one ``all_gather`` of a per-sequence value), which is exact. Layouts:
batch and token axes sharded, the token axis alone over 8 devices, the token axis over
*two* mesh axes (``("data", "seq")``, the carry then follows their order), ``jit`` with
``NamedSharding`` (XLA partitions the scan itself), and packed rows whose sequences
cross token shards. The batch is mesh_cases' ragged batch, padded with masked garbage.
"""

from __future__ import annotations

import functools

import jax
import mesh_cases as mc
import numpy as np
import packing_cases as pc
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from run_once import shared_value

import offpolicy_jax as opj

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clear_jax_caches")]

CORRECTIONS = {
    "areal_token_mask_ratio": opj.CorrectionConfig.from_areal(
        {"level": "token", "metric": "ratio", "lower": 0.7, "upper": 1.6}
    ),
    "areal_seq_clamp_ratio_max": opj.CorrectionConfig.from_areal(
        {"level": "sequence", "action": "clamp", "agg": "max", "lower": 0.8, "upper": 1.3}
    ),
    "areal_seq_mask_k3_sum": opj.CorrectionConfig(
        use_tis=True,
        tis_mode="none",
        tis_batch_normalize=True,
        rejection_sampling={"level": "sequence", "metric": "kl_k3", "agg": "sum", "upper": 0.6},
    ),
    "areal_seq_mask_binary_kl_max": opj.CorrectionConfig.from_areal(
        {"level": "sequence", "metric": "binary_kl", "agg": "max", "upper": 0.2}
    ),
    "minpro_clip_rs_minpro": opj.CorrectionConfig(
        use_tis=True,
        tis_level="minpro",
        tis_mode="clip",
        tis_lower_bound=0.7,
        tis_upper_bound=1.4,
        tis_batch_normalize=True,
        use_rs=True,
        rs_level="minpro",
        rs_lower_bound=0.2,
        rs_upper_bound=4.0,
        rs_veto_threshold=1e-3,
    ),
}
LOSSES = {
    "areal_decoupled": (
        opj.LossConfig(
            algorithm="decoupled_ppo",
            correction=opj.CorrectionConfig.from_areal(
                {"level": "sequence", "metric": "kl_k1", "agg": "mean", "lower": -0.2, "upper": 0.2}
            ),
            aggregation="token_mean",
            rejected_in_denominator=True,
        ),
        "token",
    ),
    "minpro_reinforce_is": (
        opj.LossConfig(
            algorithm="reinforce_is",
            correction=opj.CorrectionConfig(
                use_tis=True,
                tis_level="minpro",
                tis_mode="clip",
                tis_lower_bound=0.8,
                tis_upper_bound=1.28,
            ),
            aggregation="token_mean",
        ),
        "token",
    ),
}
EVALUATE = functools.partial(mc.evaluate_all, losses=LOSSES, corrections=CORRECTIONS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return shared_value(
        tmp_path_factory, "sharding_areal_minpro_reference", lambda: mc.cpu_reference(EVALUATE)
    )


def _mesh(shape, names):
    devices = jax.devices("cpu")[:8]
    if len(devices) < 8:
        pytest.fail("needs 8 CPU devices (tests/conftest.py sets JAX_NUM_CPU_DEVICES=8)")
    return jax.make_mesh(
        shape, names, axis_types=(AxisType.Explicit,) * len(names), devices=devices
    )


def _put(mesh, spec):
    padded = mc.padded_for(mesh, spec)
    specs = mc.input_specs(spec, padded)
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in padded.items()}, specs


LAYOUTS = {
    "data2_seq4": (
        (2, 4),
        ("data", "seq"),
        P("data", "seq"),
        opj.MeshAxes(batch="data", token="seq"),
    ),
    "seq8": ((8,), ("seq",), P(None, "seq"), opj.MeshAxes(token="seq")),
    "token_over_two_axes": (
        (2, 4),
        ("data", "seq"),
        P(None, ("data", "seq")),
        opj.MeshAxes(token=("data", "seq")),
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shard_map_matches_unsharded(layout, reference):
    shape, names, spec, axes = LAYOUTS[layout]
    mesh = _mesh(shape, names)
    with jax.set_mesh(mesh):
        arrays, specs = _put(mesh, spec)
        out_specs = mc.output_specs(jax.eval_shape(EVALUATE, arrays), spec)
        fn = jax.jit(
            jax.shard_map(
                functools.partial(EVALUATE, axis_names=axes),
                mesh=mesh,
                in_specs=(specs,),
                out_specs=out_specs,
            )
        )
        out = fn(arrays)
    failures = mc.compare(mc.to_numpy(out), reference)
    assert not failures, "\n".join(failures)


def test_jit_named_sharding_matches_unsharded(reference):
    mesh = _mesh((2, 4), ("data", "seq"))
    with jax.set_mesh(mesh):
        arrays, _ = _put(mesh, P("data", "seq"))
        out = jax.jit(EVALUATE)(arrays)
    failures = mc.compare(mc.to_numpy(out), reference)
    assert not failures, "\n".join(failures)


K = 4


def _packed(batch, ids, axis_names=None):
    out = {}
    for name, config in CORRECTIONS.items():
        res = opj.compute_correction(
            batch["old_logp"],
            batch["rollout_logp"],
            batch["mask"],
            config,
            axis_names=axis_names,
            segment_ids=ids,
            num_segments=K,
        )
        out[name] = dict(weights=res.weights, mask=res.mask, metrics=res.metrics)
    return out


@pytest.mark.parametrize("path", ["shard_map", "jit"])
def test_packed_token_sharded_prefix_scan_matches_unsharded(path):
    """Packed rows over 8 token shards: a sequence spans every shard of row 0 and the ids
    of row 1 interleave, so a prefix crosses shards and segments."""
    batch = pc.packed_batch(4, rows=4, length=32, num_segments=K)
    batch["segment_ids"][0] = np.where(np.arange(32) < 31, 1, 0)
    batch["segment_ids"][1] = np.tile([1, 2, 3, 2], 8)
    batch = {
        k: v for k, v in batch.items() if k in ("old_logp", "rollout_logp", "mask", "segment_ids")
    }
    ids = batch.pop("segment_ids")
    want = mc.to_numpy(jax.jit(_packed)(batch, ids))
    mesh = _mesh((8,), ("seq",))
    spec = P(None, "seq")
    with jax.set_mesh(mesh):
        arrays = {k: jax.device_put(v, NamedSharding(mesh, spec)) for k, v in batch.items()}
        sharded_ids = jax.device_put(ids, NamedSharding(mesh, spec))
        if path == "shard_map":
            shapes = jax.eval_shape(_packed, arrays, sharded_ids)
            fn = jax.jit(
                jax.shard_map(
                    functools.partial(_packed, axis_names=opj.MeshAxes(token="seq")),
                    mesh=mesh,
                    in_specs=({k: spec for k in arrays}, spec),
                    out_specs=mc.output_specs(shapes, spec),
                )
            )
        else:  # the token axis sharded in the arrays' types: the scan runs per shard
            fn = jax.jit(_packed)
        got = mc.to_numpy(fn(arrays, sharded_ids))
    failures = mc.compare(got, want, real_shape=ids.shape)
    assert not failures, "\n".join(failures)
