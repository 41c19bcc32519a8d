"""The demo's asynchronous mismatch (``--mismatch async``): mixed policy versions
per batch, the staleness rule and the proximal approximation as rows."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")

from flax import nnx

import offpolicy_jax as opj
from offpolicy_jax.demo import engine, experiment, task, train

TINY = train.TrainConfig(d_model=16, prompts_per_step=4, group_size=4, prompt_len=3, eval_prompts=8)
PROX_ROWS = ("decoupled_ppo+mis+loglinear", "decoupled_ppo+mis+linear")
STALENESS_ROW = f"decoupled_ppo+mis+staleness{train.ASYNC_MAX_STALENESS}"


@pytest.mark.heavy
def test_async_engine_reports_the_versions_of_the_weights_it_sampled_with():
    """Each group's tokens and log-probs are those of the ring slot holding the version it
    reports (every slot different weights), and the versions are mixed and in range."""
    slots, step, g, n = 5, 7, 2, 3
    graphdef = nnx.graphdef(train.make_model(TINY, 0))
    copies = [nnx.state(train.make_model(TINY, 10 + i), nnx.Param) for i in range(slots)]
    ring = jax.tree.map(lambda *p: jnp.stack(p), *copies)
    prompts = jnp.repeat(task.sample_prompts(jax.random.key(1), 8, n), g, axis=0)
    keys = (jax.random.key(2), jax.random.key(3))
    async_generate = jax.jit(train.async_generate, static_argnums=(0, 5))
    responses, logq, versions = async_generate(graphdef, ring, jnp.int32(step), prompts, keys, g)
    assert versions.shape == responses.shape == logq.shape == (16, n)
    v = np.asarray(versions)
    assert (v == v[:, :1]).all() and (v.reshape(8, g, n) == v[::g, None, :1]).all()
    assert ((step - v >= 0) & (step - v < slots)).all()
    assert len(np.unique(v)) > 1  # mixed versions in one batch
    sample_keys = jax.random.split(keys[1], 8)
    generate = jax.jit(engine.generate, static_argnums=(0, 4))  # one compile, 8 groups
    for j in range(8):
        version = int(v[j * g, 0])
        params = copies[(version - 1) % slots]
        rows = slice(j * g, (j + 1) * g)
        want_r, want_q = generate(
            graphdef, params, prompts[rows], sample_keys[j], engine.Numerics()
        )
        np.testing.assert_array_equal(responses[rows], want_r)
        np.testing.assert_allclose(logq[rows], want_q, rtol=1e-6, atol=1e-6)
    # Without mismatch every group is sampled by the current weights (slot (step − 1) % K).
    _, _, current = async_generate(graphdef, ring, jnp.int32(step), prompts, keys, g, False)
    assert (np.asarray(current) == step).all()
    # Early steps: the ring still holds the initial weights, version 0.
    _, _, early = async_generate(graphdef, ring, jnp.int32(1), prompts, keys, g)
    assert set(np.unique(early)) <= {0, 1}


@pytest.mark.heavy
def test_prox_rows_skip_the_old_pass(monkeypatch):
    """The trainer computes token log-probs once per trace (the loss's θ) for the prox
    rows, twice when a row recomputes π_old or the pass is kept on purpose."""
    calls = []
    original = train.token_logp

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(train, "token_logp", counting)
    mismatch = train.Mismatch("async", 3)
    graphdef, state = train.init_state(TINY, mismatch, [0])
    one = jax.tree.map(lambda x: x[0], state)

    def traced(rows, old_pass=None):
        calls.clear()
        algos = [train.row(r) for r in rows]
        step = train.make_train_step(graphdef, TINY, algos, mismatch, old_pass=old_pass)
        jax.eval_shape(step, one, jax.random.key(0), jnp.int32(0), jnp.bool_(True))
        return len(calls)

    assert traced(PROX_ROWS) == 1
    assert traced(PROX_ROWS, old_pass=True) == 2
    assert traced(("decoupled_ppo+mis", *PROX_ROWS)) == 2
    assert not any(train.needs_old_pass(train.row(r).loss) for r in PROX_ROWS)
    with pytest.raises(ValueError, match="old_pass=False"):
        traced(("decoupled_ppo+mis",), old_pass=False)


@pytest.mark.heavy
def test_prox_rows_train_without_old_logp():
    """The prox rows train on the mixed-version batches: finite losses, α > 0 once old
    versions appear, the policy moves, and the π_old monitors are NaN (never computed)."""
    cfg = experiment.DemoConfig(
        steps=6,
        seeds=1,
        chunk=3,
        algorithms=PROX_ROWS,
        mismatch=train.Mismatch("async", 4),
        train=TINY,
    )
    history = experiment.run(cfg)
    for row in PROX_ROWS:
        m = history.metrics[row]
        assert np.isfinite(m["loss/pg_loss"]).all() and np.isfinite(m["grad_norm"]).all()
        assert (m["grad_norm"] > 0).all()
        assert np.nanmax(m["loss/prox_alpha_mean"]) > 0
        assert len(np.unique(m["reward"])) > 1
        assert np.isnan(m["is_weight_mean"]).all() and np.isnan(m["rejected_fraction"]).all()
        assert (m["staleness_mean"][1:] > 0).any()


@pytest.mark.heavy
def test_staleness_row_rejects_exactly_the_sequences_too_old_plus_mis():
    """The staleness row's rejected tokens = those MIS rejects ∪ those of sequences more than
    ``ASYNC_MAX_STALENESS`` versions old (ages from the dumped versions, step t = version t),
    and ``loss/mis_staleness_seq_fraction`` is the share of such sequences."""
    steps = 8
    cfg = experiment.DemoConfig(
        steps=steps,
        seeds=1,
        chunk=4,
        algorithms=(STALENESS_ROW,),
        mismatch=train.Mismatch("async", 6),
        train=TINY,
        dump_steps=tuple(range(1, steps + 1)),
    )
    history = experiment.run(cfg)
    dump, m = history.dumps[STALENESS_ROW], history.metrics[STALENESS_ROW]
    seen_stale = 0
    for t in range(steps):
        versions, mask = dump["versions"][t, 0], dump["mask"][t, 0]
        old, rollout = dump["old_logp"][t, 0], dump["rollout_logp"][t, 0]
        too_old = (t - versions).max(axis=-1) > train.ASYNC_MAX_STALENESS  # [B]
        seen_stale += too_old.sum()
        kept_by_mis = opj.compute_correction(old, rollout, mask, train.MIS, reduction="token").mask
        kept = (np.asarray(kept_by_mis) > 0) & ~too_old[:, None] & (mask > 0)
        want = 1.0 - kept.sum() / mask.sum()
        np.testing.assert_allclose(m["rejected_fraction"][t, 0], want, atol=1e-6)
        np.testing.assert_allclose(
            m["loss/mis_staleness_seq_fraction"][t, 0], too_old.mean(), atol=1e-6
        )
    assert seen_stale > 0  # the rule had something to reject


def test_version_rows_need_the_async_mismatch():
    with pytest.raises(ValueError, match="--mismatch async"):
        experiment.DemoConfig(algorithms=(STALENESS_ROW,), mismatch=train.Mismatch("stale", 4))
    with pytest.raises(ValueError, match="--mismatch async"):
        experiment.DemoConfig(algorithms=PROX_ROWS, mismatch=train.Mismatch("async", 0))
    with pytest.raises(ValueError, match="dense policy"):
        experiment.DemoConfig(
            algorithms=("ppo",),
            mismatch=train.Mismatch("async", 2),
            train=dataclasses.replace(TINY, n_experts=2),
        )
    assert train.Mismatch("async", 8).staleness() == 9  # ring copies: ages 0..8
    assert experiment.PRESETS["async"].mismatch == train.Mismatch("async", 8)


@pytest.mark.slow
def test_async_preset_and_prox_only_run_from_the_command_line(tmp_path):
    """``--preset async`` writes every row; a prox-only run (the π_old pass skipped) too."""
    import json
    import subprocess
    import sys

    def run_cli(out, *flags):
        command = [
            sys.executable,
            "-m",
            "offpolicy_jax",
            "demo",
            "--tiny",
            "--no-progress",
        ]
        return subprocess.run(
            [*command, *flags, "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )

    proc = run_cli(tmp_path / "preset", "--preset", "async", "--steps", "3")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "preset" / "summary.json").read_text())
    rows = [r["algorithm"] for r in summary["results"]]
    assert rows == list(experiment.PRESETS["async"].algorithms)
    proc = run_cli(tmp_path / "prox", "--mismatch", "async", "--algorithms", ",".join(PROX_ROWS))
    assert proc.returncode == 0, proc.stderr
    assert "decoupled_ppo+mis+linear" in proc.stdout
