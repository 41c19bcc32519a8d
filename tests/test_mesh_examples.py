"""The mesh examples run on 8 CPU devices, and the docs' "Running on a mesh" shows them verbatim."""

from __future__ import annotations

import pathlib
import re
import runpy

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ("examples/sharded_train_step.py", "examples/shard_map_loss.py")

pytestmark = pytest.mark.usefixtures("clear_jax_caches")


def _doc_blocks() -> dict[str, str]:
    text = (ROOT / "docs" / "guide" / "mesh.md").read_text()
    return dict(re.findall(r"<!-- mesh-example: (\S+) -->\s*```python\n(.*?)```", text, flags=re.S))


@pytest.mark.parametrize("path", EXAMPLES)
def test_docs_show_the_example_verbatim(path):
    blocks = _doc_blocks()
    assert path in blocks, f'docs/guide/mesh.md has no "<!-- mesh-example: {path} -->" block'
    assert blocks[path] == (ROOT / path).read_text(), f"docs block differs from {path}"


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_sharded_train_step_runs(axis_type, capsys):
    example = runpy.run_path(str(ROOT / EXAMPLES[0]))
    loss, metrics = example["main"](steps=2, axis_type=axis_type)
    assert np.isfinite(float(loss)) and "mis_batch_norm_factor" in metrics
    out = capsys.readouterr().out
    assert out.count("step ") == 2
    if axis_type == AxisType.Explicit and jax.device_count() > 1:
        assert "@data" in out  # the batch is sharded, and the type says so


def test_shard_map_example_matches_unsharded(capsys):
    # Its __main__ block asserts the sharded loss and metrics equal the unsharded call's.
    namespace = runpy.run_path(str(ROOT / EXAMPLES[1]), run_name="__main__")
    out = capsys.readouterr().out
    assert out.count("step ") == 3
    if namespace["seq"] == 2 and jax.default_backend() == "cpu":  # 8 CPU devices: 4 x 2
        assert "float32[8@data,30@seq]" in out  # 29 tokens padded to 30, split in two
