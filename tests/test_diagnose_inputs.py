"""``diagnose`` reads the demo's dump folder (or its ``index.json``) and labels the worst
sequences and tokens by file, training step and row within the step."""

from __future__ import annotations

import json

import numpy as np
import pytest

from offpolicy_jax.diagnose import DiagnoseError, diagnose, write_dump
from offpolicy_jax.diagnose.report import markdown

STEPS = [10, 20, 30]  # the training steps along the files' first axis
B, T = 4, 5


def _dump_folder(root, *, index=True):
    """Two files of ``[3, B, T]`` arrays as the demo writes them; returns the folder and
    the arrays by file name. One sequence (file b, step 20, row 3) is far off."""
    rng = np.random.default_rng(0)
    folder = root / "dumps"
    folder.mkdir()
    arrays = {}
    for name in ("a_seed0.npz", "b_seed0.npz"):
        old = rng.normal(-1.0, 0.2, (len(STEPS), B, T)).astype(np.float32)
        rollout = old + rng.normal(0.0, 0.01, old.shape).astype(np.float32)
        if name.startswith("b"):
            rollout[1, 3] -= 2.0  # the worst sequence; its token 0 the worst token
            rollout[1, 3, 0] -= 1.0
        mask = np.ones(old.shape, bool)
        write_dump(folder / name, old_logp=old, rollout_logp=rollout, mask=mask)
        arrays[name] = (old, rollout)
    if index:
        meta = {"steps": STEPS, "files": {"b": ["b_seed0.npz"], "a": ["a_seed0.npz"]}}
        (folder / "index.json").write_text(json.dumps(meta, indent=2) + "\n")  # as the demo
    return folder, arrays


@pytest.mark.heavy
def test_folder_and_index_read_the_listed_files_labelled_by_step(tmp_path):
    folder, _ = _dump_folder(tmp_path)
    by_folder = diagnose(folder)
    by_index = diagnose(folder / "index.json")
    by_glob = diagnose(str(folder / "*.npz"))
    # The index's order (b before a); the same sequences as the glob's.
    assert (
        by_folder["inputs"]
        == by_index["inputs"]
        == [
            str(folder / "b_seed0.npz"),
            str(folder / "a_seed0.npz"),
        ]
    )
    assert by_folder["metrics"] == by_index["metrics"]
    np.testing.assert_allclose(
        [by_folder["metrics"][k] for k in sorted(by_glob["metrics"])],
        [by_glob["metrics"][k] for k in sorted(by_glob["metrics"])],
        rtol=1e-6,
    )
    for report in (by_folder, by_glob):  # the index beside the files labels a glob too
        seq, tok = report["worst_sequences"][0], report["worst_tokens"][0]
        assert seq["file"].endswith("b_seed0.npz")
        assert (seq["step"], seq["row"], seq["flat_row"]) == (20, 3, 1 * B + 3)
        assert (tok["step"], tok["row"], tok["position"]) == (20, 3, 0)
    table = markdown(by_folder)
    assert "| file | step | row | tokens |" in table
    assert "| b_seed0.npz | 20 | 3 | 5 |" in table


@pytest.mark.heavy
def test_folder_without_index_reads_every_dump_labelled_by_index(tmp_path):
    folder, _ = _dump_folder(tmp_path, index=False)
    (folder / "notes.txt").write_text("not a dump")
    report = diagnose(folder)
    assert report["inputs"] == [str(folder / "a_seed0.npz"), str(folder / "b_seed0.npz")]
    seq = report["worst_sequences"][0]
    assert "step" not in seq and seq["row"] == [1, 3]
    assert "| b_seed0.npz | – | 1, 3 |" in markdown(report)


def test_empty_folder_and_empty_index_are_one_line_errors(tmp_path):
    with pytest.raises(DiagnoseError, match="no dump files in this folder"):
        diagnose(tmp_path)
    (tmp_path / "index.json").write_text(json.dumps({"steps": [], "files": {}}))
    with pytest.raises(DiagnoseError, match="lists no dump files"):
        diagnose(tmp_path / "index.json")
