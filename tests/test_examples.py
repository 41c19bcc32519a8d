"""The copy-paste examples in examples/ run and produce finite losses and metrics."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest

pytest.importorskip("flax")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_flax_nnx_train_step(capsys):
    module = runpy.run_path(str(EXAMPLES / "flax_nnx_train_step.py"))
    loss, metrics = module["main"](steps=2)
    assert math.isfinite(float(loss))
    assert {"mis_k3_kl", "mis_tis_truncate_fraction", "pg_clipfrac"} <= set(metrics)
    assert all(math.isfinite(float(v)) for v in metrics.values())
    assert capsys.readouterr().out.count("step ") == 2
