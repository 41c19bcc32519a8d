"""Two JAX processes on localhost equal one: ``jax.distributed`` with CPU collectives.

Each process (``tests/multiprocess_worker.py``) joins the distributed runtime on a
free loopback port, owns half of the global batch
(``jax.make_array_from_process_local_data``) and two CPU devices, and runs
``policy_loss`` (value, metrics and gradient; decoupled PPO with sequence-level
IS, geometric RS, veto and batch normalisation) under ``jax.jit`` and under
``jax.shard_map`` with ``axis_names``. This test stitches together the shards both
processes hold and compares them with the single-process call on the whole batch.

Bounded and clean: the coordinator binds 127.0.0.1 only, the children get
``TIMEOUT_S`` (a healthy run takes a few seconds), a crash of one stops the
other at once, and any child still running at the end is killed by its pid.
"""

from __future__ import annotations

import functools
import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import mesh_cases as mc
import numpy as np
import pytest

NUM_PROCESSES = 2
TIMEOUT_S = 120  # generous for a loaded CI machine; a healthy run takes a few seconds
WORKER = pathlib.Path(__file__).with_name("multiprocess_worker.py")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(out_dir: pathlib.Path) -> list[str]:
    try:
        return _run_workers_once(out_dir)
    except AssertionError as err:
        # The free port can be taken between choosing it and binding it: retry once.
        if "already in use" not in str(err).lower():
            raise
        return _run_workers_once(out_dir)


def _run_workers_once(out_dir: pathlib.Path) -> list[str]:
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="2", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    src = str(pathlib.Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(WORKER.parent), src] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    port = _free_port()
    logs = [out_dir / f"process_{i}.log" for i in range(NUM_PROCESSES)]
    procs = []
    try:
        for i, log in enumerate(logs):
            with open(log, "w") as stream:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            str(WORKER),
                            str(i),
                            str(NUM_PROCESSES),
                            str(port),
                            str(out_dir),
                        ],
                        env=env,
                        stdout=stream,
                        stderr=subprocess.STDOUT,
                    )
                )
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            codes = [p.poll() for p in procs]
            # A crashed process leaves its peer waiting on a collective: stop early.
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            if time.monotonic() > deadline:
                pytest.fail(
                    f"the worker processes did not finish within {TIMEOUT_S}s:\n"
                    + "\n".join(log.read_text()[-2000:] for log in logs)
                )
            time.sleep(0.05)
    finally:
        for proc in procs:  # only the processes started here, by pid
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    texts = [log.read_text() for log in logs]
    failed = [
        f"process {i} exited with {p.returncode}:\n{text[-3000:]}"
        for i, (p, text) in enumerate(zip(procs, texts, strict=True))
        if p.returncode != 0
    ]
    assert not failed, "\n".join(failed)
    return texts


def test_two_processes_equal_one_process(tmp_path):
    logs = _run_workers(tmp_path)
    print("\n".join(f"process {i}:\n{log}" for i, log in enumerate(logs)))
    data = mc.make_batch(**mc.MULTIPROCESS_BATCH)
    cpu = jax.devices("cpu")[0]
    reference = mc.to_numpy(
        jax.jit(functools.partial(mc.evaluate_all, **mc.MULTIPROCESS_CONFIGS))(
            {k: jax.device_put(v, cpu) for k, v in data.items()}
        )
    )
    want = {
        name: value
        for keys, value in jax.tree_util.tree_leaves_with_path(reference)
        for name in ["".join(str(k) for k in keys)]
    }
    got: dict[str, np.ndarray] = {}
    held: dict[str, np.ndarray] = {}
    for i in range(NUM_PROCESSES):
        part = dict(np.load(tmp_path / f"process_{i}.npz"))
        print(f"process {i}: {float(part.pop('seconds')):.1f}s from start to results")
        for key, value in part.items():
            if key.startswith("held:"):
                continue
            mine = part["held:" + key]
            if key in got:
                # Replicated values (the loss, metrics) are held by both processes: equal.
                both = held[key] & mine
                np.testing.assert_array_equal(got[key][both], value[both], err_msg=key)
                got[key] = np.where(mine, value, got[key])
                held[key] |= mine
            else:
                got[key], held[key] = value, mine
    assert all(h.all() for h in held.values()), "some output shard came back from no process"
    for path in ("jit", "shard_map"):
        prefix = f"['{path}']"
        assert {k[len(prefix) :] for k in got if k.startswith(prefix)} == set(want)
        for name, value in want.items():
            np.testing.assert_allclose(
                got[prefix + name], value, rtol=mc.RTOL, atol=mc.ATOL, err_msg=f"{path}{name}"
            )
