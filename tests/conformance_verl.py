"""Loading the verl-parity pack (../shared/conformance-verl) for the test suite.

Shared by the correction / config-error tests and the loss tests of
``test_conformance_verl.py``. The pack lives beside the project on developer and CI
machines only; elsewhere the tests skip. Set OFFPOLICY_JAX_CONFORMANCE_VERL to point
at another copy.
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest


def verl_dir() -> pathlib.Path | None:
    env = os.environ.get("OFFPOLICY_JAX_CONFORMANCE_VERL")
    here = (
        pathlib.Path(env)
        if env
        else pathlib.Path(__file__).resolve().parents[2] / "shared" / "conformance-verl"
    )
    return here if (here / "manifest.json").is_file() else None


SKIP_REASON = (
    "verl conformance pack not found: expected ../shared/conformance-verl/manifest.json "
    "beside the project (or set OFFPOLICY_JAX_CONFORMANCE_VERL); skipped without it"
)


def load_cases(kind: str | None = None) -> list[dict]:
    root = verl_dir()
    if root is None:
        return []
    cases = json.loads((root / "manifest.json").read_text())["cases"]
    return [c for c in cases if kind is None or c["kind"] == kind]


def params(kind: str):
    """``pytest.mark.parametrize("case", ...)`` over the manifest's cases of ``kind``."""
    cases = load_cases(kind)
    return pytest.mark.parametrize("case", cases, ids=[c["name"] for c in cases])


def load_arrays(case: dict) -> dict[str, np.ndarray]:
    with np.load(verl_dir() / case["file"]) as data:
        return {key: data[key] for key in data.files}


def assert_close(got, want, case: dict, key: str) -> None:
    tol = case["tolerance"]
    np.testing.assert_allclose(
        np.asarray(got, np.float64),
        np.asarray(want, np.float64),
        rtol=tol["rtol"],
        atol=tol["atol"],
        err_msg=f"{case['name']}: {key}",
    )
