"""The documentation's Python examples run as written.

README.md's example (the block after its ``readme-test`` marker) is copied into a file
in an empty folder outside the clone and run there, as a user who pastes it would; the
blocks after ``doc-test`` markers in docs/ run in order, one namespace per page.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from doc_pages import DOCS, README, ROOT, marked_blocks

TRAINING_STEP = DOCS / "guide" / "training_step.md"


def test_readme_example_runs_pasted_into_an_empty_folder(tmp_path):
    blocks = marked_blocks("readme-test", README)
    assert len(blocks) == 2, "README.md has its example and the optax step that continues it"
    assert 'preset("mis")' in blocks[0] and "from_yaml" not in blocks[0]
    assert "scale_by_ess" in blocks[1]
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "example.py").write_text("\n".join(blocks))
    # This checkout's library, however it is installed; nothing of the clone's folder.
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(
        [sys.executable, "example.py"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "kept tokens",
        "mismatch k3 KL",
        "loss",
        "ESS",
    ]
    assert np.isfinite(float(lines[1].split()[-1]))
    # ESS in (0, 1] and the learning-rate factor is its square root.
    ess, scale = (float(x.split()[0]) for x in lines[3].split(":")[1:])
    assert 0 < ess <= 1
    np.testing.assert_allclose(scale, np.sqrt(ess), rtol=1e-6)


def test_readme_example_is_the_getting_started_one():
    readme = marked_blocks("readme-test", README)[0]
    assert readme in marked_blocks("doc-test", DOCS / "getting_started.md")


def test_training_step_page_runs_and_agrees(capsys):
    blocks = marked_blocks("doc-test", TRAINING_STEP)
    assert len(blocks) >= 4  # optax step, micro-batches, own per-token term, fp16
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(TRAINING_STEP), "exec"), namespace)  # noqa: S102 - our docs
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 3 and all(
        np.isfinite(float(x)) for line in printed for x in line.split()
    )
    # The accumulated micro-batch gradient equals the full-batch one.
    jax, opj = namespace["jax"], namespace["opj"]
    g = namespace

    def full_batch_loss(p):
        logp = g["token_logp"](p, g["tokens"])
        return opj.policy_loss(
            logp, g["old_logp"], g["rollout_logp"], g["advantages"], g["mask"], g["loss_config"]
        )[0]

    full = jax.jit(jax.grad(full_batch_loss))(g["params"])
    np.testing.assert_allclose(g["grads"]["logits"], full["logits"], rtol=1e-5, atol=1e-7)
    assert set(g["metrics"]) >= {"pg_loss", "mis_k3_kl", "mis_batch_norm_factor"}


@pytest.mark.parametrize(
    "page",
    [p for p in sorted(DOCS.rglob("*.md")) if p != TRAINING_STEP and marked_blocks("doc-test", p)],
    ids=lambda p: str(p.relative_to(DOCS)),
)
def test_other_pages_doc_tests_run(page):
    namespace: dict = {}
    for block in marked_blocks("doc-test", page):
        exec(compile(block, str(page), "exec"), namespace)  # noqa: S102 - our docs
