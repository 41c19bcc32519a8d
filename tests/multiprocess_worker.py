"""One process of the 2-process test (tests/test_multiprocess.py); not a test module.

``python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR``

Joins a JAX distributed runtime on 127.0.0.1:PORT (CPU devices, gloo collectives:
the same runtime a TPU pod or GPU cluster uses, only on loopback), builds the
global batch from the rows this process holds with
``jax.make_array_from_process_local_data``, runs ``policy_loss`` and its gradient
under ``jax.jit`` and under ``jax.shard_map`` with ``axis_names`` (one program),
and writes the shards of the results it holds to OUT_DIR/process_<id>.npz.

Mesh: ``data`` across the processes x ``seq`` over the 2 local CPU devices of
each process, inputs sharded ``P('data', 'seq')``: both batch and token
reductions cross devices, the batch ones across processes.
"""

from __future__ import annotations

import os
import sys
import time

T0 = time.monotonic()


def _log(message: str) -> None:
    print(f"[{time.monotonic() - T0:5.1f}s] {message}", flush=True)


def main(process_id: int, num_processes: int, port: int, out_dir: str) -> None:
    import jax

    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        coordinator_bind_address=f"127.0.0.1:{port}",  # loopback only
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=60,
        heartbeat_timeout_seconds=10,
        shutdown_timeout_seconds=10,
    )
    _log("distributed runtime up")
    import functools

    import mesh_cases as mc
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import offpolicy_jax as opj

    assert jax.process_count() == num_processes
    local = jax.local_device_count()
    mesh = jax.make_mesh((num_processes, local), ("data", "seq"))
    # The data axis runs across processes: each process holds whole rows.
    for row, devices in enumerate(mesh.devices):
        assert {d.process_index for d in devices} == {row}, mesh.devices

    data = mc.make_batch(**mc.MULTIPROCESS_BATCH)
    rows = data["mask"].shape[0] // num_processes
    mine = slice(process_id * rows, (process_id + 1) * rows)
    token_spec = P("data", "seq")
    specs = mc.input_specs(token_spec, data)
    arrays = {
        k: jax.make_array_from_process_local_data(NamedSharding(mesh, specs[k]), v[mine])
        for k, v in data.items()
    }
    assert arrays["logp"].shape == data["logp"].shape

    evaluate = functools.partial(mc.evaluate_all, **mc.MULTIPROCESS_CONFIGS)
    out_specs = mc.output_specs(jax.eval_shape(evaluate, arrays), token_spec)
    sharded = jax.shard_map(
        functools.partial(evaluate, axis_names=opj.MeshAxes(batch="data", token="seq")),
        mesh=mesh,
        in_specs=(specs,),
        out_specs=out_specs,
    )
    with jax.set_mesh(mesh):
        # One program (one compilation) holding both paths: the XLA partitioner's
        # (plain jit over sharded inputs) and the explicit shard_map one.
        results = jax.jit(lambda a: {"jit": evaluate(a), "shard_map": sharded(a)})(arrays)
        jax.block_until_ready(results)
    _log("computed")
    # Outputs are sharded across the processes: save the shards this process holds
    # (and where they go); the test stitches the processes together.
    flat = {}
    for keys, value in jax.tree_util.tree_leaves_with_path(results):
        name = "".join(str(k) for k in keys)
        full = np.zeros(value.shape, np.float32)
        held = np.zeros(value.shape, bool)
        for shard in value.addressable_shards:
            full[shard.index] = np.asarray(shard.data)
            held[shard.index] = True
        flat[name], flat["held:" + name] = full, held
    flat["seconds"] = np.asarray(time.monotonic() - T0)
    np.savez(os.path.join(out_dir, f"process_{process_id}.npz"), **flat)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
