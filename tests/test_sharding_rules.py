"""The field's rejection rules (docs/semantics.md §8) sharded == unsharded.

On 8 virtual CPU devices (tests/conftest.py): every KL criterion, KPop's binary KL, IcePop, the sequence
log-prob error, M2PO (a global decision: bisection with psum'd counts) and OPSM in the
loss, under ``shard_map`` with the batch and the token axis sharded, with the token axis
alone sharded over 8 devices, and under ``jit`` with NamedSharding. The batch is
mesh_cases' ragged batch (NaN at a valid token, a catastrophic token, garbage
padding), padded with masked garbage to the shard multiples.
"""

from __future__ import annotations

import functools

import jax
import mesh_cases as mc
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from run_once import shared_value

import offpolicy_jax as opj

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clear_jax_caches")]

RULE_CORRECTIONS = {
    "k1_family_icepop": opj.CorrectionConfig(
        use_tis=True,
        tis_mode="band",
        tis_lower_bound=0.6,
        tis_upper_bound=1.6,
        rs_criteria=("token_k1:0.4_2.5", "seq_sum_k1:0.2_5.0", "seq_mean_k1:0.8_1.25"),
    ),
    "k2_k3_family_m2po": opj.CorrectionConfig(
        use_tis=True,
        tis_level="sequence",
        tis_mode="band",
        tis_lower_bound=0.05,
        tis_upper_bound=20.0,
        tis_batch_normalize=True,
        rs_criteria=(
            "token_k2:2.0",
            "token_k3:3.0",
            "seq_sum_k2:3.0",
            "seq_sum_k3:4.0",
            "seq_mean_k2:0.2",
            "seq_mean_k3:0.3",
            "seq_max_k2:5.0",
            "seq_max_k3:6.0",
            "binary_kl:0.01",
        ),
        m2po_tau=0.08,
    ),
    "none_logprob_error_m2po": opj.CorrectionConfig(
        use_tis=True, tis_mode="none", seq_logprob_error_threshold=1.4, m2po_tau=0.1
    ),
}
RULE_LOSSES = {
    "decoupled_trm_icepop": (
        opj.LossConfig(
            algorithm="decoupled_ppo",
            correction=opj.CorrectionConfig(
                use_tis=True,
                tis_mode="band",
                tis_lower_bound=0.5,
                tis_upper_bound=2.0,
                rs_criteria=("seq_max_k2:2.5", "seq_mean_k3:0.1"),
                m2po_tau=0.1,
            ),
            aggregation="token_mean",
        ),
        "token",
    ),
    "bypass_opsm": (opj.LossConfig(algorithm="bypass_ppo", opsm_delta=0.05), "sequence"),
}
EVALUATE = functools.partial(mc.evaluate_all, losses=RULE_LOSSES, corrections=RULE_CORRECTIONS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return shared_value(
        tmp_path_factory, "sharding_rules_reference", lambda: mc.cpu_reference(EVALUATE)
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
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rules_shard_map_match_unsharded(layout, reference):
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


def test_rules_jit_named_sharding_match_unsharded(reference):
    mesh = _mesh((2, 4), ("data", "seq"))
    with jax.set_mesh(mesh):
        arrays, _ = _put(mesh, P("data", "seq"))
        out = jax.jit(EVALUATE)(arrays)
    failures = mc.compare(mc.to_numpy(out), reference)
    assert not failures, "\n".join(failures)
