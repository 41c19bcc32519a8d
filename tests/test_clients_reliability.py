"""Regression tests of the clients: diagnose, the demo's summary, the tunix example, install.

Each test failed on the code before its fix: a traceback or a plausible answer where a
one-line error or an honest report belongs.
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _diagnose_cli(argv, capsys):
    pytest.importorskip("pyarrow")
    pytest.importorskip("matplotlib")
    from offpolicy_jax import cli

    try:
        status = cli.main([*argv, "--no-progress"])
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err


def _assert_one_line_error(status, err, *needles):
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, err
    assert lines[0].startswith("offpolicy-jax: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]


def _logprobs(rows=4, length=8, seed=0):
    rng = np.random.default_rng(seed)
    old = -rng.exponential(1.0, (rows, length)) - 0.01
    rollout = np.minimum(old + rng.normal(0, 0.01, (rows, length)), -1e-6)
    return old.astype(np.float32), rollout.astype(np.float32)


# --------------------------------------------------------------------------- diagnose input


@pytest.mark.parametrize("value", [np.inf, 1e300])  # 1e300 is inf once read as float32
def test_diagnose_mask_of_inf_is_a_one_line_error(tmp_path, capsys, value):
    old, rollout = _logprobs()
    mask = np.ones(old.shape)
    mask[2, 5] = value
    path = tmp_path / "d.npz"
    np.savez(path, old_logp=old, rollout_logp=rollout, mask=mask)
    status, err = _diagnose_cli(["diagnose", str(path), "--out", str(tmp_path / "o")], capsys)
    # Was an OverflowError traceback (int(inf) while counting the sequence's tokens).
    _assert_one_line_error(status, err, str(path), "'mask'", "row 2 position 5", "+inf")


@pytest.mark.parametrize("suffix", [".npz", ".jsonl"])
def test_diagnose_refuses_positive_logprobs_naming_the_field(tmp_path, capsys, suffix):
    from offpolicy_jax.diagnose import write_dump

    old, rollout = _logprobs()
    # Negative log-likelihoods passed as log-probs: every value is positive. This was
    # diagnosed as a perplexity of 0.37 and a "mild" mismatch.
    path = write_dump(
        tmp_path / f"d{suffix}", old_logp=-old, rollout_logp=-rollout, mask=np.ones(old.shape)
    )
    status, err = _diagnose_cli(["diagnose", str(path), "--out", str(tmp_path / "o")], capsys)
    field = "'old_logp'" if suffix == ".npz" else "'old_log_probs'"
    _assert_one_line_error(status, err, str(path), field, "row 0 position 0", "not a log-prob")


def test_diagnose_accepts_logprobs_rounded_just_above_zero_and_positive_padding(tmp_path):
    from offpolicy_jax.diagnose import readers, write_dump

    old, rollout = _logprobs()
    old[0, 0] = 1e-6  # float32 log-softmax rounding of a near-certain token
    mask = np.ones(old.shape)
    mask[1, 3] = 0.0
    rollout[1, 3] = 7.0  # at padding: never read
    path = write_dump(tmp_path / "d.npz", old_logp=old, rollout_logp=rollout, mask=mask)
    chunks = list(readers.iter_chunks([path]))
    assert sum(c.old.shape[0] for c in chunks) == 4
    rollout[1, 4] = 2 * readers.LOGPROB_TOLERANCE  # just past the tolerance, at a valid token
    path = write_dump(tmp_path / "e.npz", old_logp=old, rollout_logp=rollout, mask=mask)
    with pytest.raises(readers.DiagnoseError, match="row 1 position 4: 'rollout_logp'"):
        list(readers.iter_chunks([path]))


@pytest.mark.slow  # compiles diagnose's chunk kernel
def test_diagnose_names_the_few_tokens_that_carry_a_severe_k3(tmp_path):
    pytest.importorskip("pyarrow")
    pytest.importorskip("matplotlib")
    from offpolicy_jax.diagnose import diagnose, write_dump

    rows, length = 512, 64
    old, rollout = _logprobs(rows, length, seed=1)
    spikes = [(3, 5), (100, 20), (200, 63), (400, 0)]  # 4 of 32,768 tokens (0.012%)
    for (r, c), size in zip(spikes, (15.0, 14.0, 13.0, 12.0), strict=True):
        rollout[r, c] = old[r, c] - size  # k3 = e^15 - 16 = 3.27e6 for the first
    path = write_dump(
        tmp_path / "d.npz", old_logp=old, rollout_logp=rollout, mask=np.ones(old.shape)
    )
    got = diagnose(path, tmp_path / "out")
    # Independent float64 reference of the pieces.
    delta = old.astype(np.float64) - rollout.astype(np.float64)
    k3 = np.expm1(delta) - delta
    seq_k3 = k3.mean(-1)
    assert got["metrics"]["mis_k3_kl"] == pytest.approx(seq_k3.mean(), rel=1e-4)
    assert got["metrics"]["mis_k3_kl"] > 100  # the severe headline
    assert not got["heavy_tail"]["heavy"]  # by sum |log rho| the mismatch is spread

    drivers = got["k3_drivers"]
    assert drivers["k3_sum"] == pytest.approx(k3.sum(), rel=1e-4)
    top4 = np.sort(k3.ravel())[::-1][:4].sum()
    assert drivers["top_k3_share"] >= top4 / k3.sum() - 1e-6
    assert drivers["half_tokens"] == 1 and drivers["half_sequences"] == 1
    assert drivers["concentrated"]
    located = {(t["row"], t["position"]) for t in drivers["tokens"][:4]}
    assert located == set(spikes)
    # The robust statistic: the median sequence's mean k3, within its bins' 12%.
    assert drivers["median_seq_k3"] == pytest.approx(np.median(seq_k3), rel=0.13)
    assert drivers["median_seq_k3"] < 1e-3

    rec = got["recommendation"]
    assert (rec["name"], rec["severity"]) == ("token_tis", "severe")  # was geo_rs_veto
    assert "carried by a few tokens" in rec["reason"]
    text = (tmp_path / "out" / "report.md").read_text()
    assert "## What drives `mis_k3_kl`" in text and "**Concentrated:**" in text
    assert "a few tokens carry it" in text  # the heavy-tail paragraph points there


# --------------------------------------------------------------------------- the demo


def _reject_constant(name):
    raise ValueError(f"not JSON: {name}")


def test_demo_summary_json_is_strict_json(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from offpolicy_jax.demo import experiment, report, train

    steps, seeds = 4, 2
    config = experiment.DemoConfig(steps=steps, seeds=seeds, algorithms=("ppo",))
    metrics = {k: np.full((steps, seeds), 0.5) for k in train.STEP_METRICS}
    metrics["route_flip_fraction"] = np.full((steps, seeds), np.nan)  # a dense policy
    metrics["grad_norm"][1, 0] = np.inf
    history = experiment.History(config=config, metrics={"ppo": metrics}, seconds=1.0)
    monkeypatch.setattr(report, "plot", lambda history, path: None)
    paths = report.write_outputs(history, tmp_path, "offpolicy-jax demo --tiny")
    text = paths["summary"].read_text()
    # Was a bare NaN, which JSON.parse (and Python with parse_constant) rejects.
    summary = json.loads(text, parse_constant=_reject_constant)
    (row,) = summary["results"]
    assert row["route_flip_fraction"] is None
    assert row["peak_grad_norm"] is None
    assert row["final_reward_mean"] == pytest.approx(0.5)
    assert all(not isinstance(v, float) or math.isfinite(v) for v in row.values())
