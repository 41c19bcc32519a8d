"""Loading the shared conformance pack (../shared/conformance) for the test suite.

The pack lives beside the project on developer and CI machines only; on a
user's machine it is absent and the conformance tests skip with a message.
Set OFFPOLICY_JAX_CONFORMANCE to point at another copy.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax.numpy as jnp
import numpy as np


def conformance_dir() -> pathlib.Path | None:
    env = os.environ.get("OFFPOLICY_JAX_CONFORMANCE")
    here = (
        pathlib.Path(env)
        if env
        else pathlib.Path(__file__).resolve().parents[2] / "shared" / "conformance"
    )
    return here if (here / "manifest.json").is_file() else None


SKIP_REASON = (
    "conformance pack not found: expected ../shared/conformance/manifest.json beside the "
    "project (or set OFFPOLICY_JAX_CONFORMANCE); skipped on machines without it"
)


def load_cases(kind: str | None = None) -> list[dict]:
    root = conformance_dir()
    if root is None:
        return []
    cases = json.loads((root / "manifest.json").read_text())["cases"]
    return [c for c in cases if kind is None or c["kind"] == kind]


def load_inputs(case: dict) -> tuple[dict, np.lib.npyio.NpzFile]:
    import ml_dtypes

    data = np.load(conformance_dir() / case["file"])
    inputs = {}
    for key, dtype in case["inputs"].items():
        if dtype is None:
            inputs[key] = None
        elif dtype == "bfloat16":
            inputs[key] = jnp.asarray(data[key].view(ml_dtypes.bfloat16))
        else:
            inputs[key] = jnp.asarray(data[key])
    return inputs, data


def assert_close(got, want, case: dict, key: str) -> None:
    tol = case.get("tolerance_overrides", {}).get(key, case["tolerance"])
    np.testing.assert_allclose(
        np.asarray(got, np.float64), want, rtol=tol["rtol"], atol=tol["atol"], err_msg=key
    )
