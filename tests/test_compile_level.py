"""What the suite's compile setting changes: float32 rounding, nothing more.

``tests/conftest.py`` compiles every program of the suite, and of the processes the suite
starts, at XLA's lowest backend optimisation level (``SUITE_XLA_FLAGS``, unless
``XLA_FLAGS`` names a level): that level governs LLVM's optimisation and machine-code
generation for each fused kernel, about a third of a program's compile time, and
compiling is most of the suite's time. The library traces the same programs and XLA runs
the same HLO passes at every level. The machine code differs: at XLA's default level
LLVM fuses more multiply-adds into fused multiply-add instructions, so some outputs differ
in their last bits. This module bounds that difference: values, metrics and gradients of every
algorithm and surrogate with its correction, a pairwise cover of the correction grid at
both reductions, the packed layout and the log-probs from hidden states, computed by this
process and by a fresh one with XLA's defaults (no ``XLA_FLAGS``, as users run them),
agree to float32 rounding: far inside every tolerance of the suite's numeric tests, and
most of them bit for bit.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import jax
import mesh_cases as mc
import numpy as np
import packing_cases as pc
import pytest
from strategies import ALL_CORRECTION_CONFIGS

import offpolicy_jax as opj

TESTS = Path(__file__).parent
GRID_FIELDS = (
    "use_tis",
    "tis_level",
    "tis_mode",
    "tis_batch_normalize",
    "use_rs",
    "rs_level",
    "rs_veto_threshold",
)


def _pairwise_cover(configs, fields=GRID_FIELDS):
    """Configs of the correction grid, chosen greedily until every pair of values of two
    fields that the grid holds has appeared (15 of its 217 configs)."""

    def pairs(config):
        values = [(field, repr(getattr(config, field))) for field in fields]
        return set(itertools.combinations(values, 2))

    wanted = set().union(*map(pairs, configs))
    chosen, covered = [], set()
    while covered != wanted:
        best = max(configs, key=lambda config: len(pairs(config) - covered))
        chosen.append(best)
        covered |= pairs(best)
    return chosen


CORRECTIONS = {f"grid{i}": c for i, c in enumerate(_pairwise_cover(ALL_CORRECTION_CONFIGS))}


def _packed(batch):
    """A few corrections and losses on the packed layout (segment reductions)."""
    corrections = {
        name: mc.CORRECTIONS[name]
        for name in ("token_truncate_norm_veto", "sequence_mask_rs_geometric")
    }
    losses = {name: mc.LOSSES[name][0] for name in mc.CORE_LOSSES}
    return pc.evaluate(batch, corrections, losses, batch["segment_ids"])


def _from_hidden(hidden, unembedding, tokens):
    def total(hidden, unembedding):
        logp, entropy = opj.token_logprobs_from_hidden(
            hidden, unembedding, tokens, chunk_size=5, vocab_chunk_size=7, return_entropy=True
        )
        return (logp.sum() + 0.1 * entropy.sum()), (logp, entropy)

    (value, outputs), grads = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(
        hidden, unembedding
    )
    return dict(value=value, outputs=outputs, grads=grads)


def outputs() -> dict[str, np.ndarray]:
    """Every output of the programs above, flat, by its path."""
    rng = np.random.default_rng(3)
    hidden = rng.normal(size=(3, 11, 16)).astype(np.float32)
    unembedding = rng.normal(size=(16, 23)).astype(np.float32) / 4
    tokens = rng.integers(0, 23, size=(3, 11)).astype(np.int32)
    losses = {**mc.LOSSES, **mc.SURROGATE_LOSSES}
    programs = {
        "losses": (lambda b: mc.evaluate_all(b, losses=losses, corrections={}), mc.make_batch(0)),
        "corrections": (
            lambda b: mc.evaluate_all(b, losses={}, corrections=CORRECTIONS),
            mc.make_batch(1),
        ),
        "packed": (_packed, pc.packed_batch(2, rows=5, length=24, num_segments=pc.NUM_SEGMENTS)),
        "hidden": (lambda a: _from_hidden(*a), (hidden, unembedding, tokens)),
    }
    flat = {}
    for name, (program, args) in programs.items():
        tree = jax.jit(program)(args)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            flat[name + jax.tree_util.keystr(path)] = np.asarray(leaf)
    return flat


def _default_compile_outputs(tmp_path: Path) -> dict[str, np.ndarray]:
    """:func:`outputs` computed in a fresh process with XLA's default flags."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env["PYTHONPATH"] = str(TESTS)
    path = tmp_path / "default.npz"
    script = f"import numpy as np, {__name__} as m; np.savez({str(path)!r}, **m.outputs())"
    subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=tmp_path)
    with np.load(path) as saved:
        return dict(saved)


@pytest.mark.heavy
def test_suite_compile_level_changes_only_float32_rounding(tmp_path):
    assert "--xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "")
    got = outputs()
    want = _default_compile_outputs(tmp_path)
    assert got.keys() == want.keys()
    assert len(got) > 500  # every metric of every config, not a handful of outputs
    differ = [key for key in want if not np.array_equal(got[key], want[key], equal_nan=True)]
    assert len(differ) < len(want) / 10, f"{len(differ)} of {len(want)} outputs differ"
    for key in differ:
        # A few float32 roundings of the output's scale, with an absolute floor for
        # outputs that are differences of nearly equal terms.
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7, err_msg=key)
