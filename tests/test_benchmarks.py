"""The benchmark command runs end to end on a tiny size (no timing is asserted)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _compilation_cache_as_before():
    """Importing ``benchmarks`` turns JAX's persistent compilation cache off (its compile
    times are cold compiles); the worker's later tests keep the setting they had."""
    enabled = jax.config.jax_enable_compilation_cache
    yield
    jax.config.update("jax_enable_compilation_cache", enabled)


# End to end: the whole benchmark grid at a tiny size (~35 s of CPU); the fast tier keeps
# the command's argument check and the thread probe.
@pytest.mark.slow
def test_benchmark_command_writes_its_report(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--tiny", "--cpus", "1", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "backend:" in proc.stdout
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["environment"]["backend"]
    assert report["environment"]["cpus_used"] == 1
    assert {(r["computation"], r["batch"], r["length"]) for r in report["results"]} == {
        (name, b, t)
        for name in ("loss", "correction", "loss_trm_icepop")
        for b, t in ((4, 64), (8, 128))
    }
    for row in report["results"]:
        assert set(row["seconds"]) == {"floor", "jit", "op_by_op", "numpy"}
        assert row["compile_seconds"] > 0 and row["input_bytes"] > 0
        assert set(row["pipelined_seconds"]) == {"floor", "jit"}
        assert min(row["pipelined_seconds"].values()) > 0
        assert row["dispatch_seconds"] > 0 and row["looped_seconds"] > 0
        # the loss step's outputs: the gradient (B x T float32) and scalars
        assert row["output_bytes"] >= (4 * row["tokens"] if "loss" in row["computation"] else 4)
        # the CPU backend's trace has no device streams
        assert row["device_seconds"] == {"floor": None, "jit": None}
    assert report["copy_bandwidth"]["bytes_per_second"] > 0
    text = (tmp_path / "results.md").read_text()
    assert "jit / floor" in text and "## Targets" in text
    assert "## Memory bandwidth" in text and "over the pipelined time" in text
    assert "jit looped µs" in text and "steps in one program" in text


def test_benchmark_command_rejects_a_bad_cpu_count():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--tiny", "--cpus", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "--cpus must be between 1 and" in proc.stderr


@pytest.mark.heavy
def test_thread_probe_runs_and_reports_every_size():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.threads", "--tiny"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| 4 x 64", "| 8 x 128"))]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")[1:]]
        assert cells and all(float(c) == float(c) for c in cells)  # numbers, not NaN


def test_against_flags_a_slower_jit_to_floor_ratio():
    sys.path.insert(0, str(REPO))
    from benchmarks.run import against

    def row(name, jit):
        return {"computation": name, "batch": 2, "length": 8, "seconds": {"floor": 1.0, "jit": jit}}

    baseline = {"environment": {"date": "then"}, "results": [row("loss", 2.0), row("corr", 2.0)]}
    report = {"results": [row("loss", 2.1), row("corr", 2.4), row("new", 1.0)]}
    text = against(report, baseline, pathlib.Path("old.json"))
    lines = [
        line for line in text.splitlines() if line.startswith("| loss") or line.startswith("| corr")
    ]
    assert lines[0].endswith("**1.05** |")  # within 10%: not flagged
    assert lines[1].endswith("**1.20** (slower) |")
    assert "| new" not in text  # absent from the baseline


def _bandwidth_row(device_seconds):
    return {
        "pipelined_seconds": {"floor": 1e-3, "jit": 4e-3},
        "device_seconds": device_seconds,
        "bytes_accessed": {"floor": 100, "jit": 1000},
        "input_bytes": 300,
        "output_bytes": 100,
    }


def test_bandwidth_is_taken_over_the_device_time_where_a_trace_gave_it():
    sys.path.insert(0, str(REPO))
    from benchmarks.run import bandwidth, step_seconds

    traced = _bandwidth_row({"floor": None, "jit": {"busy": 1e-3, "span": 2e-3, "kernels": 9}})
    assert step_seconds(traced) == (1e-3, "device busy")
    assert bandwidth(traced, peak=2e6) == {
        "once": 4e5,
        "once_fraction": 0.2,
        "accessed": 1e6,
        "accessed_fraction": 0.5,
    }
    untraced = _bandwidth_row({"floor": None, "jit": None})
    assert step_seconds(untraced) == (4e-3, "pipelined")
    assert bandwidth(untraced, peak=2e6)["accessed"] == 2.5e5


def test_bandwidth_over_the_looped_wall_time():
    sys.path.insert(0, str(REPO))
    from benchmarks.run import bandwidth

    row = _bandwidth_row({"floor": None, "jit": None}) | {"looped_seconds": 2e-3}
    assert bandwidth(row, peak=2e6)["looped_fraction"] == 0.25


@pytest.mark.heavy
def test_looped_step_runs_the_step_and_returns_its_outputs():
    """The timing loop computes what one call does (the shift is zero), every output (to
    float32 rounding: inside the loop XLA may group a row's stacked reductions otherwise)."""
    sys.path.insert(0, str(REPO))
    from benchmarks import workloads
    from benchmarks.run import looped_step

    for comp in workloads.computations(4, 32, None)[:2]:
        want = jax.jit(comp.step)(*comp.args)
        got = jax.jit(looped_step(comp.step, 3))(*comp.args)
        assert jax.tree.structure(got) == jax.tree.structure(want), comp.name
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-9, err_msg=comp.name)


def test_device_time_sums_the_kernels_of_a_trace(monkeypatch):
    sys.path.insert(0, str(REPO))
    from benchmarks import run

    events = [("fusion_a", 1000, 3000), ("copy", 9000, 1000), ("fusion_a", 20000, 2000)]
    monkeypatch.setattr(run, "device_events", lambda fn, calls: events)
    assert run.device_time(None, calls=2) == {"busy": 3e-6, "span": 10.5e-6, "kernels": 1.5}
    monkeypatch.setattr(run, "device_events", lambda fn, calls: [])
    assert run.device_time(None, calls=2) is None


def test_kernel_table_lists_the_slowest_kernels_per_call():
    sys.path.insert(0, str(REPO))
    from benchmarks.kernels import kernel_table

    events = [("fusion_a", 0, 3000), ("fusion_b", 10, 1000), ("fusion_a", 20, 5000)]
    lines = kernel_table(events, calls=2, top=1)
    assert lines[0] == "2 kernels per call, 4.5 µs busy per call"
    assert lines[1:] == ["    4.00 µs  x1   fusion_a"]


def test_kernel_command_says_when_the_trace_has_no_device(capsys):
    sys.path.insert(0, str(REPO))
    from benchmarks.kernels import main

    assert main(["--size", "2x16", "--calls", "1"]) == 0
    assert "no device streams" in capsys.readouterr().out


def _run_module(module: str, *args: str, out: pathlib.Path) -> subprocess.CompletedProcess:
    """``python -m module *args --out out`` from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", module, *args, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def _git_checkout() -> bool:
    probe = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
    )
    return probe.returncode == 0


# The commit comparison needs git history (a clone, not an unpacked sdist); a few seconds
# of CPU for two compilations of each computation at a tiny size.
@pytest.mark.slow
@pytest.mark.skipif(not _git_checkout(), reason="needs a git checkout of the project")
def test_compare_against_a_commit_reports_both_versions(tmp_path):
    proc = _run_module(
        "benchmarks.compare",
        "--commit",
        "HEAD",
        "--sizes",
        "4x64",
        "--repeats",
        "2",
        "--compile-repeats",
        "2",
        out=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "compare_results.json").read_text())
    assert [(r["computation"], r["size"]) for r in report["rows"]] == [
        ("loss", "4 x 64"),
        ("correction", "4 x 64"),
    ]
    for row in report["rows"]:
        assert row["this_ms"] > 0 and [o["other_ms"] > 0 for o in row["others"]] == [True]
        assert row["this_compile_s"] > 0 and row["others"][0]["other_compile_s"] > 0
        assert row["others"][0]["compile_ratio"]["paired_ratio"] > 0
    assert "| loss | 4 x 64 |" in (tmp_path / "compare_results.md").read_text()


@pytest.mark.slow
def test_odd_lengths_pairs_each_ragged_size_with_its_aligned_neighbour(tmp_path):
    proc = _run_module(
        "benchmarks.odd_lengths", "--sizes", "2x127,2x128", "--repeats", "4", out=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "paired.json").read_text())
    assert [(r["computation"], r["ragged"], r["aligned"]) for r in report["rows"]] == [
        (name, [2, 127], [2, 128]) for name in ("loss", "correction", "loss_trm_icepop")
    ]
    assert all(r["paired_ratio"] > 0 for r in report["rows"])
    assert "Largest paired ratio" in (tmp_path / "paired.md").read_text()


def test_odd_lengths_needs_the_aligned_neighbour():
    from benchmarks.odd_lengths import pairs

    assert pairs("8x4093,8x4096,8x128") == [((8, 4093), (8, 4096))]
    with pytest.raises(ValueError, match="no aligned neighbour"):
        pairs("8x4093")


@pytest.mark.slow
def test_packing_benchmark_reports_the_paired_ratio(tmp_path):
    proc = _run_module(
        "benchmarks.packing", "--sizes", "8x256", "--repeats", "4", "--warmup", "1", out=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads((tmp_path / "packing_results.json").read_text())
    # the same sequences in both layouts: the same loss
    assert row["loss_packed"] == pytest.approx(row["loss_padded"], rel=1e-5, abs=1e-7)
    assert row["paired_ratio"] > 0 and len(row["paired_quartiles"]) == 2
    assert row["packed"]["compile_s"] > 0 and row["packed"]["temp_mb"] is not None
    assert "packed / padded, paired" in (tmp_path / "packing_results.md").read_text()


@pytest.mark.heavy
def test_loss_benchmark_runs_only_the_chosen_cases_beside_ppo_clip(tmp_path):
    from benchmarks import losses

    assert (
        losses.main(
            ["--sizes", "2x8", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)]
            + ["--cases", "dppo_topk_tv,dppo_topk_kl"]
        )
        == 0
    )
    report = json.loads((tmp_path / "losses_results.json").read_text())
    assert report["cases"] == ["ppo_clip", "dppo_topk_tv", "dppo_topk_kl"]
    (result,) = report["results"]
    assert set(result["ratio_to_ppo_clip"]) == set(report["cases"])
    assert result["ratio_to_ppo_clip"]["ppo_clip"] == 1.0
    assert "`dppo_topk_kl`" in (tmp_path / "losses_results.md").read_text()


@pytest.mark.heavy
def test_loss_benchmark_reports_the_topk_floors_beside_the_losses(tmp_path):
    from benchmarks import losses

    cases = "dppo_topk_tv,topk_read_floor,topk_exp_floor"
    argv = ["--sizes", "2x8", "--repeats", "3", "--warmup", "0", "--out", str(tmp_path)]
    assert losses.main(argv + ["--cases", cases]) == 0
    report = json.loads((tmp_path / "losses_results.json").read_text())
    assert report["cases"] == ["ppo_clip", *cases.split(",")]
    (result,) = report["results"]
    assert set(result["paired_ratio_to_ppo_clip"]) == set(report["cases"])
    assert result["paired_ratio_to_ppo_clip"]["ppo_clip"] == 1.0
    text = (tmp_path / "losses_results.md").read_text()
    assert "| `topk_read_floor` (floor) |" in text and "| `topk_exp_floor` (floor) |" in text
    # the verdict names a loss, never a floor
    (verdict,) = [line for line in text.splitlines() if line.startswith("Slowest:")]
    assert "floor" not in verdict


def test_loss_benchmark_names_an_unknown_case(capsys):
    from benchmarks import losses

    with pytest.raises(SystemExit) as exit_info:
        losses.main(["--cases", "ppo_clip,no_such_loss"])
    assert exit_info.value.code == 2
    assert "unknown --cases ['no_such_loss']" in capsys.readouterr().err
