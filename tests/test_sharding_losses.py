"""Every ``policy_loss`` surrogate sharded == unsharded (docs/semantics.md §5).

On 8 virtual CPU devices (tests/conftest.py): GSPO / GSPO-token (a per-sequence ratio
summed across token shards), GMPO (per-sequence geometric means), CISPO, SAPO, GPG,
DPPO-TV / -KL, DRO, Clip-Cov and KL-Cov (batch means and ranks across every shard; one
key= for all), each with a correction, across every aggregation (verl's five
and ``row_mean``), bypass and plain PPO, and the KL-to-reference (k1 / k2 / k3, with
and without the π_θ/π_d weighting) and entropy terms: ``mesh_cases.SURROGATE_LOSSES``.
Layouts: ``jit`` with NamedSharding ``P('data', 'seq')`` (batch and token axis split)
under Explicit and Auto meshes, and ``shard_map`` with ``axis_names`` over data + context
parallelism and over 8 token shards. Value, metrics and gradient are compared with the
unpadded unsharded call (mesh_cases' ragged batch: NaN at a valid token, a catastrophic
token, garbage padding); the padding must receive exactly 0. ``row_mean`` and
``sequence_sum_norm`` without ``loss_scale_factor`` depend on the padded shape by
definition (row slots, padded length): those are compared with the unsharded call on
the padded batch, which checks that ``T`` is the global token length under context
parallelism.
"""

from __future__ import annotations

import functools

import jax
import mesh_cases as mc
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from run_once import shared_value

import offpolicy_jax as opj
from offpolicy_jax._src.losses import registry
from offpolicy_jax.config import AGGREGATIONS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clear_jax_caches")]

EVALUATE = functools.partial(mc.evaluate_all, losses=mc.SURROGATE_LOSSES, corrections={})


def _depends_on_padding(config: opj.LossConfig) -> bool:
    """``row_mean`` averages over every row slot and ``sequence_sum_norm`` divides by the
    padded length ``T`` (both as verl): padding to a shard multiple changes them by
    definition, so they are compared with the unsharded call on the *padded* batch."""
    return config.aggregation == "row_mean" or (
        config.aggregation == "sequence_sum_norm" and config.loss_scale_factor is None
    )


PADDED_LOSSES = {k: v for k, v in mc.SURROGATE_LOSSES.items() if _depends_on_padding(v[0])}
_PADDED_REFERENCES: dict[tuple[int, int], dict] = {}


def _on_cpu(arrays):
    cpu = jax.devices("cpu")[0]
    return {k: jax.device_put(np.asarray(v), cpu) for k, v in arrays.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    evaluate = functools.partial(
        mc.evaluate_all,
        losses={k: v for k, v in mc.SURROGATE_LOSSES.items() if k not in PADDED_LOSSES},
        corrections={},
    )
    return shared_value(
        tmp_path_factory,
        "sharding_losses_reference",
        lambda: mc.cpu_reference(evaluate),
    )


def _padded_reference(padded: dict) -> dict:
    shape = padded["mask"].shape
    if shape not in _PADDED_REFERENCES:
        evaluate = functools.partial(mc.evaluate_all, losses=PADDED_LOSSES, corrections={})
        _PADDED_REFERENCES[shape] = mc.to_numpy(jax.jit(evaluate)(_on_cpu(padded)))
    return _PADDED_REFERENCES[shape]


def _mesh(shape, names, axis_type=AxisType.Explicit):
    devices = jax.devices("cpu")[:8]
    if len(devices) < 8:
        pytest.fail("needs 8 CPU devices (tests/conftest.py sets JAX_NUM_CPU_DEVICES=8)")
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names), devices=devices)


def _put(mesh, spec):
    padded = mc.padded_for(mesh, spec)
    specs = mc.input_specs(spec, padded)
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in padded.items()}, specs


def _check(out, reference, mesh, spec):
    out = mc.to_numpy(out)
    padded = mc.padded_for(mesh, spec)
    by_padding = {f"loss/{k}" for k in PADDED_LOSSES}
    failures = mc.compare({k: v for k, v in out.items() if k not in by_padding}, reference)
    failures += mc.compare(
        {k: v for k, v in out.items() if k in by_padding},
        _padded_reference(padded),
        real_shape=padded["mask"].shape,
    )
    assert set(out) == set(reference) | by_padding
    assert not failures, "\n".join(failures)


def test_reference_exercises_every_surrogate_and_aggregation(reference):
    """The cases are not vacuous: every surrogate and aggregation runs, losses and
    gradients are non-zero, and the clip / trust-region fractions bind somewhere."""
    configs = [config for config, _ in mc.SURROGATE_LOSSES.values()]
    assert {c.policy_loss for c in configs} == set(registry.names()) - {"ppo_clip"}
    assert {c.aggregation for c in configs} == set(AGGREGATIONS)
    assert {(c.kl_estimator, c.kl_off_policy) for c in configs if c.kl_coef} >= {
        ("k1", False),
        ("k2", True),
        ("k3", True),
    }
    clipped = set()
    padded = _padded_reference(mc.pad_batch(mc.make_batch()))
    for name, out in {**reference, **padded}.items():
        assert float(out["loss"]) != 0.0, name
        assert np.any(out["grad"] != 0.0), name
        if float(out["metrics"].get("pg_clipfrac", 0.0)) > 0:
            clipped.add(name.split("/")[1])
    assert len(clipped) >= 8, clipped


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_surrogates_jit_named_sharding_match_unsharded(axis_type, reference):
    mesh = _mesh((2, 4), ("data", "seq"), axis_type)
    spec = P("data", "seq")
    with jax.set_mesh(mesh):
        arrays, _ = _put(mesh, spec)
        out = jax.jit(EVALUATE)(arrays)
    _check(out, reference, mesh, spec)
    for name, outputs in out.items():
        assert outputs["loss"].sharding.is_fully_replicated, name
        assert outputs["grad"].sharding.is_equivalent_to(NamedSharding(mesh, spec), 2), name


LAYOUTS = {
    "data2_seq4": (
        (2, 4),
        ("data", "seq"),
        P("data", "seq"),
        opj.MeshAxes(batch="data", token="seq"),
    ),
    # 8 token shards of 2: sequences span several shards, some shards hold only padding.
    "seq8": ((8,), ("seq",), P(None, "seq"), opj.MeshAxes(token="seq")),
    # Data parallelism only, a plain axis-name string.
    "data8": ((8,), ("data",), P("data"), "data"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_surrogates_shard_map_match_unsharded(layout, reference):
    shape, names, spec, axes = LAYOUTS[layout]
    mesh = _mesh(shape, names)
    with jax.set_mesh(mesh):
        arrays, specs = _put(mesh, spec)
        out_specs = mc.output_specs(jax.eval_shape(EVALUATE, arrays), spec)
        # check_vma (the default) proves every scalar output is combined across shards.
        fn = jax.jit(
            jax.shard_map(
                functools.partial(EVALUATE, axis_names=axes),
                mesh=mesh,
                in_specs=(specs,),
                out_specs=out_specs,
            )
        )
        out = fn(arrays)
    _check(out, reference, mesh, spec)


@pytest.mark.parametrize(
    "name",
    [
        "decoupled_gspo_sequence_mean",
        "decoupled_gmpo_token_truncate_token_mean",
        "decoupled_cispo_kl_k3_off_policy_entropy",
    ],
)
def test_surrogate_gradient_taken_outside_shard_map(name):
    """``jax.grad`` of a shard_map-ed loss (the usual training-step shape)."""
    config, adv_kind = mc.SURROGATE_LOSSES[name]
    mesh = _mesh((2, 4), ("data", "seq"))
    spec = P("data", "seq")
    axes = opj.MeshAxes(batch="data", token="seq")
    adv_key = "adv" if adv_kind == "token" else "adv_seq"
    keys = ("logp", "old", "rollout", adv_key, "adv", "mask")

    def loss_fn(logp, old, rollout, adv, token_adv, mask, axis_names=None):
        extra = mc.regulariser_inputs(config, jax.lax.stop_gradient(logp), rollout, token_adv)
        return opj.policy_loss(
            logp, old, rollout, adv, mask, config, axis_names=axis_names, **extra
        )[0]

    real = mc.make_batch()
    want_loss, want_grad = jax.jit(jax.value_and_grad(loss_fn))(*(real[k] for k in keys))
    with jax.set_mesh(mesh):
        arrays, specs = _put(mesh, spec)
        sharded = jax.shard_map(
            functools.partial(loss_fn, axis_names=axes),
            mesh=mesh,
            in_specs=tuple(specs[k] for k in keys),
            out_specs=P(),
        )
        loss, grad = jax.jit(jax.value_and_grad(sharded))(*(arrays[k] for k in keys))
    grad = np.array(grad)
    np.testing.assert_allclose(loss, want_loss, rtol=mc.RTOL, atol=mc.ATOL)
    np.testing.assert_allclose(
        grad[: mc.REAL_B, : mc.REAL_T], want_grad, rtol=mc.RTOL, atol=mc.ATOL
    )
    grad[: mc.REAL_B, : mc.REAL_T] = 0
    assert not np.any(grad), "gradient leaks into the padding"
