"""The README's Python examples run as written (blocks after a ``readme-test`` marker)."""

from __future__ import annotations

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _marked_blocks() -> list[str]:
    text = README.read_text()
    return re.findall(r"<!-- readme-test[^>]*-->\s*```python\n(.*?)```", text, flags=re.S)


def test_readme_examples_run_and_agree(capsys):
    blocks = _marked_blocks()
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - our own README
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 3 and all(
        np.isfinite(float(x)) for line in printed for x in line.split()
    )
    # The accumulated micro-batch gradient equals the full-batch one.
    jax, opj = namespace["jax"], namespace["opj"]
    g = namespace
    full = jax.grad(
        lambda p: opj.policy_loss(
            g["token_logp"](p, g["tokens"]),
            g["old_logp"],
            g["rollout_logp"],
            g["advantages"],
            g["mask"],
            g["loss_config"],
        )[0]
    )(g["params"])
    np.testing.assert_allclose(g["grads"]["logits"], full["logits"], rtol=1e-5, atol=1e-7)
    assert set(g["metrics"]) >= {"pg_loss", "mis_k3_kl", "mis_batch_norm_factor"}
