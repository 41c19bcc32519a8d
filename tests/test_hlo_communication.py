"""Communication budget under context parallelism, read from the compiled HLO.

With the batch sharded over ``data`` (2) and the tokens over ``seq`` (4), a local
shard is ``[4, 128]`` of a global ``[8, 512]`` batch (``[4, 130]`` of ``[8, 520]`` in
one case). The sequence and geometric levels need whole-sequence sums, the veto a
whole-sequence ``any``, batch normalisation and every metric a batch mean: all of
them must cross devices as per-sequence ``[4]`` partial sums or scalars (possibly
bundled into one vector), never as token data: every collective operand must hold
fewer values than one shard's *single row* of tokens (128), so not even a slice of
a ``[B, T]`` array can pass. The test compiles ``policy_loss`` (value and
gradient) and ``compute_correction`` both inside ``jax.shard_map`` with
``axis_names`` and as a plain ``jax.jit`` over ``NamedSharding`` inputs (the XLA
partitioner's choice), parses every collective of the optimised HLO and checks
its operand shapes.

See the collective counts with ``python -m pytest tests/test_hlo_communication.py -s``.
"""

from __future__ import annotations

import functools

import jax
import mesh_cases as mc
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import offpolicy_jax as opj

pytestmark = pytest.mark.usefixtures("clear_jax_caches")

B, T = 8, 512
DATA, SEQ = 2, 4
B_LOCAL = B // DATA
# The chain of dependent reductions (non-finite check -> level sums and veto ->
# kept counts -> batch-norm mean -> per-sequence statistics -> min / max -> batch
# sums) needs a handful of rounds; XLA combines the independent reductions of a
# round into one tuple all-reduce. Measured on jax 0.10.2 (CPU) with the library
# of commit e1dd2d1: 8 ops moving 113 values under shard_map, 13 ops moving 374-382
# values under jit, Explicit or Auto (the partitioner does not deduplicate the
# correction computed by both calls). The budgets leave a little headroom and
# catch reductions that escape the combining.
MAX_COLLECTIVE_OPS = {"shard_map": 10, "jit": 16}


def _config(level):
    correction = opj.CorrectionConfig(
        use_tis=True,
        tis_level=level,
        tis_mode="mask",
        tis_lower_bound=0.05,
        tis_upper_bound=20.0,
        tis_batch_normalize=True,
        use_rs=True,
        rs_level=level,
        rs_lower_bound=0.1,
        rs_upper_bound=10.0,
        rs_veto_threshold=1e-4,
    )
    return opj.LossConfig(
        algorithm="decoupled_ppo", correction=correction, get_mismatch_metrics=True
    )


def _step(a, config, axis_names=None):
    def loss_fn(logp):
        return opj.policy_loss(
            logp, a["old"], a["rollout"], a["adv"], a["mask"], config, axis_names=axis_names
        )

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(a["logp"])
    res = opj.compute_correction(
        a["old"], a["rollout"], a["mask"], config.correction, axis_names=axis_names
    )
    return loss, metrics, grad, res.weights, res.mask, res.metrics


def _inputs(mesh, spec, length):
    lengths = (length, 0, 17, 1, length // 2 + 3, length, length // 3, length - 5)
    data = mc.make_batch(seed=3, batch=B, length=length, lengths=lengths)
    del data["adv_seq"]
    return {k: jax.device_put(v, NamedSharding(mesh, spec)) for k, v in data.items()}


def _compiled(path, level, length, axis_type):
    mesh = jax.make_mesh(
        (DATA, SEQ),
        ("data", "seq"),
        axis_types=(axis_type,) * 2,
        devices=jax.devices("cpu")[: DATA * SEQ],
    )
    spec = P("data", "seq")
    config = _config(level)
    with jax.set_mesh(mesh):
        arrays = _inputs(mesh, spec, length)
        if path == "shard_map":
            shapes = jax.eval_shape(functools.partial(_step, config=config), arrays)
            out_specs = mc.output_specs(shapes, spec)
            fn = functools.partial(
                _step, config=config, axis_names=opj.MeshAxes(batch="data", token="seq")
            )
            fn = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,), out_specs=out_specs))
        else:
            fn = jax.jit(functools.partial(_step, config=config))
        return mc.compiled_text(fn, arrays)


# (path, global T, mesh axis type): shard_map with axis_names; the XLA partitioner
# on an Explicit mesh; and on an Auto mesh with 130 tokens per shard (a local length
# that chunks of 4 or 8 tokens do not divide).
CASES = {
    "shard_map": ("shard_map", T, AxisType.Explicit),
    "jit_explicit": ("jit", T, AxisType.Explicit),
    "jit_auto_130_per_shard": ("jit", 520, AxisType.Auto),
}


# minpro: MinPRO's prefix minimum crosses token shards as one [B_local, shards] carry
# per scan (an all_gather), a per-sequence value like the others, under shard_map and
# on an Explicit mesh (where the scan runs in a shard_map of the arrays' sharding). On
# an Auto mesh the sharding is not in the types, so the XLA partitioner splits the
# associative scan itself: per-sequence-sized collective-permutes, but one per scan
# round (log2 T of them, 120 ops measured at T = 520); lax.cummin would all-gather the
# tokens instead.
MINPRO_AUTO_MAX_OPS = 140


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("level", ["sequence", "geometric", "minpro"])
def test_only_per_sequence_values_cross_devices(level, case):
    path, length, axis_type = CASES[case]
    collectives = mc.hlo_collectives(_compiled(path, level, length, axis_type))
    summary = mc.summarize_collectives(collectives)
    print(
        f"\n[{level} / {case}] {len(collectives)} collective ops, "
        f"{sum(c['elements'] for c in collectives)} elements per step:\n{summary}"
    )
    assert collectives, "expected the cross-shard reductions to appear as collectives"
    local_length = length // SEQ
    for c in collectives:
        for shape in c["shapes"]:
            # Scalars, [B_local] per-sequence values, or bundles of them: always
            # fewer values than one row of one shard's tokens.
            assert int(np.prod(shape)) < local_length, c["line"][:300]
            assert local_length not in shape and length not in shape, c["line"][:300]
    budget = MAX_COLLECTIVE_OPS[path]
    if level == "minpro" and axis_type == AxisType.Auto:
        budget = MINPRO_AUTO_MAX_OPS
    assert len(collectives) <= budget, summary


def test_parser_sees_a_token_sized_collective():
    """Control: the parser does report a ``[B, T]``-sized collective when there is one."""
    mesh = jax.make_mesh(
        (DATA, SEQ),
        ("data", "seq"),
        axis_types=(AxisType.Explicit,) * 2,
        devices=jax.devices("cpu")[: DATA * SEQ],
    )
    spec = P("data", "seq")
    with jax.set_mesh(mesh):
        x = jax.device_put(np.ones((B, T), np.float32), NamedSharding(mesh, spec))
        fn = jax.jit(
            jax.shard_map(
                lambda v: jax.lax.all_gather(v, "seq", axis=1, tiled=True),
                mesh=mesh,
                in_specs=spec,
                out_specs=P("data"),
                check_vma=False,
            )
        )
        collectives = mc.hlo_collectives(mc.compiled_text(fn, x))
    assert [c["op"] for c in collectives] == ["all-gather"]
    assert collectives[0]["shapes"] == [(B_LOCAL, T)]
