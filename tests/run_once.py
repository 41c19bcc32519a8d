"""A folder built once per test run, shared by the xdist workers.

A module-scoped fixture is built once per process, so under ``pytest -n 2`` each worker
that runs one of its tests builds it again: for an end-to-end demo run that is tens of
seconds of CPU spent twice. (``--dist loadgroup`` would keep such tests on one worker, but
it does not group under pytest 9: pytest-dev/pytest-xdist#1386.) Here the first worker
to ask builds the folder; the others wait for it and read the same files.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import shutil
import time
from collections.abc import Callable

import pytest

_WAIT_S = 900.0


def shared_folder(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    build: Callable[[pathlib.Path], None],
) -> pathlib.Path:
    """``build(folder)`` run once per test run (whichever worker asks first); ``folder``.

    The workers' temporary folders share a parent (one per run), which holds the folder
    and its lock; ``os.mkdir`` of the lock is atomic, so exactly one worker builds. A
    build that fails leaves its error for the others, which fail with it.
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder, lock = root / name, root / f"{name}.lock"
    done, failed = lock / "done", lock / "failed"
    try:
        lock.mkdir()
    except FileExistsError:
        deadline = time.monotonic() + _WAIT_S
        while not (done.exists() or failed.exists()):
            if time.monotonic() > deadline:
                pytest.fail(f"{name}: another worker's build did not finish in {_WAIT_S:.0f} s")
            time.sleep(0.2)
        if failed.exists():
            pytest.fail(f"{name}: its build failed in another worker: {failed.read_text()}")
        return folder
    try:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        build(folder)
    except BaseException as error:
        failed.write_text(f"{type(error).__name__}: {error}")
        raise
    done.touch()
    return folder


def shared_value(
    tmp_path_factory: pytest.TempPathFactory, name: str, compute: Callable[[], object]
) -> object:
    """``compute()`` once per test run (a picklable value: NumPy arrays, not jax.Arrays),
    read back by every worker that asks."""

    def build(folder: pathlib.Path) -> None:
        with open(folder / "value.pkl", "wb") as f:
            pickle.dump(compute(), f)

    with open(shared_folder(tmp_path_factory, name, build) / "value.pkl", "rb") as f:
        return pickle.load(f)
