"""``offpolicy-jax diagnose``: exact pooling, recommendation, readers, bad input."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("matplotlib")

from run_once import shared_folder  # noqa: E402

import offpolicy_jax as opj  # noqa: E402
from offpolicy_jax import cli  # noqa: E402
from offpolicy_jax.diagnose import (  # noqa: E402
    WHAT_IFS,
    DiagnoseError,
    analysis,
    diagnose,
    write_dump,
)
from offpolicy_jax.diagnose.analysis import METRICS_ONLY  # noqa: E402
from offpolicy_jax.diagnose.readers import Chunk  # noqa: E402


def make_dump(seed=0, batch=29, length=24, sigma=0.3, spike=0.02, drift=0.0, nan=True):
    """Ragged lengths (some empty), log-normal-ish mismatch, spikes and one NaN token."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, length + 1, batch)
    lengths[0] = length  # at least one full row
    mask = np.arange(length)[None] < lengths[:, None]
    old = -rng.exponential(1.0, (batch, length))
    noise = rng.normal(0, sigma, (batch, length)) + drift * rng.normal(0, 1, (batch, 1))
    spikes = np.where(rng.random((batch, length)) < spike, rng.normal(0, 8, (batch, length)), 0)
    rollout = np.minimum(old + noise + spikes, -1e-6)
    old, rollout = old.astype(np.float32), rollout.astype(np.float32)
    if nan:
        old[1, 0] = np.nan  # a NaN at a valid token: the sequence leaves every metric
        mask[1, 0] = True
        rollout[2, length - 1] = np.nan  # NaN at padding: harmless (row 2 is shorter)
        mask[2, length - 1] = False
    return old, rollout, mask


# The whole dump in one call, the reference the pooled chunks must equal (jitted: one
# compile per config, not an eager dispatch per operation).
_whole_batch = jax.jit(opj.compute_correction, static_argnums=3, static_argnames="reduction")


def _check_equal(report, old, rollout, mask, reduction):
    configs = {"metrics": METRICS_ONLY} | {w.name: w.build() for w in WHAT_IFS}
    for name, config in configs.items():
        got = report["metrics"] if name == "metrics" else report["what_if"][name]["metrics"]
        want = _whole_batch(old, rollout, mask, config, reduction=reduction).metrics
        assert set(got) == set(want), name
        for key, value in want.items():
            np.testing.assert_allclose(
                got[key], float(value), rtol=2e-6, atol=1e-6, err_msg=f"{name}: {key}"
            )


def _rule_dump(seed=0, batch=40, length=16):
    """Per-row mismatch scales from 0.01 to 0.5 (k3 per token ~ scale²/2 on both sides of
    0.01), spikes |δ| ~ 3 (k2 > 2.5), ragged lengths, empty rows and one NaN row."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, length + 1, batch)
    lengths[0] = length
    lengths[[5, 6, 7]] = 0  # rows 5-7: the empty chunk below
    mask = np.arange(length)[None] < lengths[:, None]
    old = -rng.exponential(1.0, (batch, length))
    scale = 10.0 ** rng.uniform(-2, np.log10(0.5), (batch, 1))
    spikes = np.where(
        rng.random((batch, length)) < 0.03, rng.choice([-3.0, 3.0], (batch, length)), 0
    )
    rollout = old + rng.normal(0, 1, (batch, length)) * scale + spikes
    old, rollout = old.astype(np.float32), rollout.astype(np.float32)
    old[8, 0] = np.nan  # row 8: non-finite at a valid token, alone in its chunk below
    return old, rollout, mask


# Every key the what-if rows emit, and the rule/band keys in other combinations:
# IcePop + Trust Region Masking with batch normalisation (both token and sequence μ),
# a two-sided per-token criterion (fraction_low, token-level max/min), seq_max_k3, and
# NeMo-RL's sequence log-prob error (its _max/_min are batch extremes too).
EXTRA_CONFIGS = {
    "trm_icepop_norm": opj.CorrectionConfig(
        use_tis=True,
        tis_mode="band",
        tis_lower_bound=0.5,
        tis_upper_bound=5.0,
        tis_batch_normalize=True,
        rs_criteria=("seq_max_k2:2.5", "seq_mean_k3:0.01"),
    ),
    "geo_band_token_k1": opj.CorrectionConfig(
        use_tis=True,
        tis_level="geometric",
        tis_mode="band",
        tis_lower_bound=0.8,
        tis_upper_bound=1.25,
        tis_batch_normalize=True,
        rs_criteria=("token_k1:0.5_2.0", "seq_max_k3:1.0", "seq_sum_k2:0.5"),
        seq_logprob_error_threshold=1.3,
    ),
}

# Chunk boundaries (row indices): several sizes, ragged widths, a chunk of empty
# sequences only (rows 5-7) and one holding only the NaN sequence (row 8).
SPLITS = {
    "ones": list(range(1, 40)),
    "mixed": [3, 5, 8, 9, 16, 17, 30],
    "halves": [5, 8, 9, 20],
}


def _chunks(old, rollout, mask, cuts):
    for lo, hi in zip([0, *cuts], [*cuts, old.shape[0]], strict=True):
        width = max(1, int(mask[lo:hi].sum(-1).max()))  # the reader trims to the longest
        yield Chunk(
            old=old[lo:hi, :width],
            rollout=rollout[lo:hi, :width],
            mask=mask[lo:hi, :width].astype(np.float32),
            file=np.zeros(hi - lo, np.int64),
            row=np.arange(lo, hi),
            start=np.zeros(hi - lo, np.int64),
        )


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["sequence", "token"])
@pytest.mark.parametrize("split", sorted(SPLITS))
def test_accumulator_pools_rule_and_band_metrics_exactly(split, reduction):
    """Every key of the what-if rows (IcePop, the k3 trust region included) and of
    other rule/band configs, pooled over ragged chunks, equals one compute_correction
    call on the whole dump: means weighted by their population, the rules' batch
    extremes as max/min over chunks that hold a valid sequence."""
    old, rollout, mask = _rule_dump()
    assert mask[5:8].sum() == 0
    configs = {"metrics": METRICS_ONLY} | {w.name: w.build() for w in WHAT_IFS} | EXTRA_CONFIGS
    acc = analysis.Accumulator(tuple(configs.items()), reduction, rows=64)
    for chunk in _chunks(old, rollout, mask, SPLITS[split]):
        acc.add(chunk)
    extremes = 0
    for name, config in configs.items():
        got = acc.metrics(name)
        want = _whole_batch(old, rollout, mask, config, reduction=reduction).metrics
        assert set(got) == set(want), name
        for key, value in want.items():
            np.testing.assert_allclose(
                got[key], float(value), rtol=2e-6, atol=1e-6, err_msg=f"{name}: {key}"
            )
            if analysis.population(key, config) in ("max", "min"):
                extremes += 1
                if key.endswith("_min") and ("_k2_" in key or "_k3_" in key):
                    assert float(value) > 0, key  # a chunk's empty-batch 0 would win here
    assert extremes >= 16
    trm = acc.metrics("k3_trust_region")
    assert 0 < trm["mis_rs_seq_mean_k3_seq_fraction"] < 1  # the rows test both sides
    assert 0 < trm["mis_rs_seq_max_k2_seq_fraction"] < 1
    icepop = acc.what_if("icepop")
    assert icepop["rejected_token_share"] == 0 and icepop["rejected_seq_share"] == 0
    assert icepop["truncated_share"] is None and icepop["zero_weight_share"] > 0
    assert acc.what_if("token_tis")["zero_weight_share"] is None
    if reduction == "token":  # then the band fractions are shares of the valid tokens
        band = acc.metrics("icepop")
        np.testing.assert_allclose(
            icepop["zero_weight_share"],
            band["mis_tis_band_fraction_low"] + band["mis_tis_band_fraction_high"],
            rtol=1e-5,
        )


@pytest.mark.slow
def test_accumulator_extremes_of_a_dump_without_valid_sequence_are_zero():
    old, rollout, mask = _rule_dump()
    rows = slice(5, 9)  # three empty sequences and the NaN one
    config = next(w for w in WHAT_IFS if w.name == "k3_trust_region").build()
    acc = analysis.Accumulator((("trm", config),), "sequence")
    for chunk in _chunks(old[rows], rollout[rows], mask[rows], [3]):
        acc.add(chunk)
    got = acc.metrics("trm")
    want = _whole_batch(old[rows], rollout[rows], mask[rows], config).metrics
    assert got == pytest.approx({k: float(v) for k, v in want.items()}, abs=1e-7)
    assert got["mis_rs_seq_mean_k3_max"] == got["mis_rs_seq_mean_k3_min"] == 0


def test_accumulator_refuses_configs_it_cannot_pool():
    with pytest.raises(ValueError, match="'m'.*tis_mode='mask'"):
        analysis.Accumulator((("m", opj.CorrectionConfig(use_tis=True, tis_mode="mask")),))
    with pytest.raises(ValueError, match="'p'.*m2po_tau"):
        m2po = opj.CorrectionConfig(use_tis=True, tis_mode="none", m2po_tau=0.04)
        analysis.Accumulator((("p", m2po),))


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["sequence", "token"])
@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".npz"])
def test_chunked_report_equals_one_compute_correction(tmp_path, suffix, reduction):
    old, rollout, mask = make_dump()
    path = write_dump(tmp_path / f"dump{suffix}", old_logp=old, rollout_logp=rollout, mask=mask)
    report = diagnose(path, reduction=reduction, chunk_rows=4)  # 8 chunks of ragged length
    _check_equal(report, old, rollout, mask, reduction)
    assert report["totals"]["nonfinite_tokens"] == 1
    assert report["totals"]["nonfinite_sequences"] == 1
    assert report["totals"]["tokens"] == int(mask.sum())


@pytest.mark.slow
def test_several_files_and_glob_pool_like_one_batch(tmp_path):
    old, rollout, mask = make_dump(seed=1, batch=20)
    write_dump(tmp_path / "a.parquet", old_logp=old[:7], rollout_logp=rollout[:7], mask=mask[:7])
    write_dump(tmp_path / "b.parquet", old_logp=old[7:], rollout_logp=rollout[7:], mask=mask[7:])
    report = diagnose(str(tmp_path / "*.parquet"), chunk_rows=4)
    _check_equal(report, old, rollout, mask, "sequence")
    worst = report["worst_tokens"][0]
    delta = np.where(mask & np.isfinite(old) & np.isfinite(rollout), old - rollout, 0)
    delta[1] = 0  # the NaN sequence is left out
    row = int(np.argmax(np.abs(delta).max(-1)))
    assert worst["file"].endswith("a.parquet" if row < 7 else "b.parquet")
    assert worst["row"] == (row if row < 7 else row - 7)
    assert worst["position"] == int(np.argmax(np.abs(delta[row])))


@pytest.mark.slow
def test_packed_rows_by_segment_ids_equal_unpacked(tmp_path):
    old, rollout, mask = make_dump(seed=2, batch=6, length=10, nan=False)
    # Row i of the packed dump holds sequences 2i (segment 1) and 2i + 1 (segment 2).
    old_p, rollout_p, mask_p = (a.reshape(3, 20) for a in (old, rollout, mask))
    segments = np.repeat([[1] * 10 + [2] * 10], 3, axis=0)
    path = write_dump(
        tmp_path / "packed.npz",
        old_logp=old_p,
        rollout_logp=rollout_p,
        mask=mask_p,
        segment_ids=segments,
    )
    report = diagnose(path, chunk_rows=2)
    _check_equal(report, old, rollout, mask, "sequence")
    assert report["totals"]["sequences"] == int((mask.sum(-1) > 0).sum())


@pytest.mark.slow
def test_recommendation_mild_vs_severe(tmp_path):
    """Mild -> token TIS; severe -> geometric RS + veto (or mis.yaml), as the README says."""
    common = dict(batch=64, length=64, nan=False)
    mild = make_dump(seed=3, sigma=0.02, spike=0.0, **common)
    severe = make_dump(seed=3, sigma=0.3, spike=0.01, **common)
    names = {}
    for label, (old, rollout, mask) in (("mild", mild), ("severe", severe)):
        path = write_dump(tmp_path / f"{label}.npz", old_logp=old, rollout_logp=rollout, mask=mask)
        out = tmp_path / f"out_{label}"
        report = diagnose(path, out, chunk_rows=32)
        rec = report["recommendation"]
        names[label] = (rec["name"], rec["severity"])
        loaded = opj.CorrectionConfig.from_yaml(str(out / "recommended.yaml"))
        assert loaded.to_dict() == rec["config"]
    assert names["mild"] == ("token_tis", "mild")
    assert names["severe"][1] == "severe" and names["severe"][0] in ("geo_rs_veto", "mis")
    assert opj.CorrectionConfig.from_yaml(str(tmp_path / "out_severe" / "recommended.yaml")).use_rs
    negligible = make_dump(seed=4, sigma=1e-3, spike=0.0, **common)
    old, rollout, mask = negligible
    path = write_dump(tmp_path / "tiny.npz", old_logp=old, rollout_logp=rollout, mask=mask)
    assert diagnose(path, chunk_rows=32)["recommendation"]["name"] == "metrics_only"


# --------------------------------------------------------------------------- the CLI


def _cli(argv, capsys):
    try:
        status = cli.main(argv)
    except SystemExit as e:
        status = e.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.slow
def test_cli_writes_report_files_and_plots(tmp_path, capsys):
    old, rollout, mask = make_dump(seed=5)
    path = write_dump(tmp_path / "d.parquet", old_logp=old, rollout_logp=rollout, mask=mask)
    out = tmp_path / "out"
    status, stdout, _ = _cli(["diagnose", str(path), "--out", str(out), "--no-progress"], capsys)
    assert status == 0
    assert "## What-if" in stdout and "Recommended:" in stdout
    names = {p.name for p in out.iterdir()}
    assert {"report.md", "report.json", "recommended.yaml", "overview.png"} <= names
    assert {"log_ratio_hist.png", "seq_ratio_hist.png"} <= names
    assert {"log_ratio_vs_position.png", "log_ratio_vs_prob.png"} <= names
    report = json.loads((out / "report.json").read_text())
    text = (out / "report.md").read_text()
    assert "TODO" not in text and "| zero weight |" in text
    for name in ("icepop", "k3_trust_region"):
        assert f"| {name} | " in text
        row = report["what_if"][name]
        assert opj.CorrectionConfig.from_dict(row["config"]) == next(
            w.build() for w in WHAT_IFS if w.name == name
        )
    assert report["what_if"]["icepop"]["config"]["tis_mode"] == "band"
    assert report["what_if"]["icepop"]["table"]["truncated_share"] is None  # – in the table
    assert report["what_if"]["token_tis"]["table"]["zero_weight_share"] is None
    assert report["what_if"]["token_tis"]["table"]["ess"] <= 1.0


@pytest.mark.slow
def test_cli_custom_column_names(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"o": [[-1.0, -2.0], [-0.5]], "r": [[-1.1, -2.0], [-0.4]], "m": [[1, 1], [1]]})
    pq.write_table(table, tmp_path / "c.parquet")
    argv = ["diagnose", str(tmp_path / "c.parquet"), "--out", str(tmp_path / "o")]
    argv += ["--old-col", "o", "--rollout-col", "r", "--mask-col", "m", "--no-progress"]
    status, _, err = _cli(argv, capsys)
    assert status == 0, err


def _one_line_error(status, err):
    assert status not in (0, None)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("offpolicy-jax: error: "), err
    return lines[0]


def test_bad_input_missing_column(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"old_log_probs": [[-1.0]], "foo": [[1]]}), tmp_path / "m.parquet")
    status, _, err = _cli(["diagnose", str(tmp_path / "m.parquet"), "--out", str(tmp_path)], capsys)
    line = _one_line_error(status, err)
    assert "'rollout_log_probs'" in line and "'old_log_probs', 'foo'" in line


def test_bad_input_ragged_row(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    rows = [
        {"old_log_probs": [-1.0, -2.0], "rollout_log_probs": [-1.0, -2.0], "response_mask": [1, 1]},
        {"old_log_probs": [-1.0, -2.0], "rollout_log_probs": [-1.0], "response_mask": [1, 1]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    status, _, err = _cli(["diagnose", str(path), "--out", str(tmp_path / "o")], capsys)
    line = _one_line_error(status, err)
    assert "row 1" in line and "'rollout_log_probs' has 1" in line


@pytest.mark.slow
def test_bad_input_nan_at_valid_tokens_is_counted_not_fatal(tmp_path, capsys):
    old, rollout, mask = make_dump(seed=6)
    old[3, 0], mask[3, 0] = np.nan, True
    path = write_dump(tmp_path / "n.npz", old_logp=old, rollout_logp=rollout, mask=mask)
    out = tmp_path / "o"
    status, stdout, _ = _cli(["diagnose", str(path), "--out", str(out), "--no-progress"], capsys)
    assert status == 0
    assert "2 valid tokens with NaN/inf log-probs in 2 sequences" in stdout
    report = json.loads((out / "report.json").read_text())
    assert all(np.isfinite(v) for v in report["metrics"].values())


@pytest.mark.parametrize("kind", ["parquet_no_rows", "zero_bytes_jsonl", "zero_bytes_parquet"])
def test_bad_input_empty_file(tmp_path, capsys, kind):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == "parquet_no_rows":
        path = tmp_path / "e.parquet"
        list_f32 = pa.list_(pa.float32())
        schema = pa.schema(
            [
                ("old_log_probs", list_f32),
                ("rollout_log_probs", list_f32),
                ("response_mask", list_f32),
            ]
        )
        pq.write_table(schema.empty_table(), path)
    else:
        path = tmp_path / ("e.jsonl" if kind == "zero_bytes_jsonl" else "e.parquet")
        path.write_bytes(b"")
    status, _, err = _cli(["diagnose", str(path), "--out", str(tmp_path / "o")], capsys)
    assert "empty file" in _one_line_error(status, err)


def test_bad_input_unreadable_path(tmp_path, capsys):
    missing = tmp_path / "nope.parquet"
    status, _, err = _cli(["diagnose", str(missing), "--out", str(tmp_path / "o")], capsys)
    assert "No such file" in _one_line_error(status, err)
    status, _, err = _cli(["diagnose", str(tmp_path / "*.npz"), "--out", str(tmp_path)], capsys)
    assert "no file matches" in _one_line_error(status, err)


def test_write_dump_rejects_mismatched_shapes(tmp_path):
    with pytest.raises(ValueError, match="one shape"):
        write_dump(
            tmp_path / "x.npz",
            old_logp=np.zeros((2, 3)),
            rollout_logp=np.zeros((2, 4)),
            mask=np.ones((2, 3)),
        )
    with pytest.raises(DiagnoseError, match="unknown format"):
        write_dump(
            tmp_path / "x.csv",
            old_logp=np.zeros((2, 3)),
            rollout_logp=np.zeros((2, 3)),
            mask=np.ones((2, 3)),
        )


def test_parquet_streaming_memory_stays_flat(tmp_path):
    """Arrow's pool holds about one row group at a time, not the whole file read so far."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from offpolicy_jax.diagnose import readers

    rng = np.random.default_rng(0)
    path = tmp_path / "big.parquet"
    schema = pa.schema([(c, pa.list_(pa.float32())) for c in readers.DEFAULT_COLUMNS.values()])
    rows, length, groups = 500, 200, 30
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * length)
    with pq.ParquetWriter(path, schema) as writer:
        for _ in range(groups):
            # Log-probs are <= 0 (the readers refuse positive ones at valid tokens).
            values = [-np.abs(rng.normal(size=rows * length)).astype(np.float32) for _ in range(2)]
            values.append(np.ones(rows * length, np.float32))
            lists = [pa.ListArray.from_arrays(offsets, pa.array(v)) for v in values]
            writer.write_table(pa.Table.from_arrays(lists, schema=schema))
    group_bytes = 3 * rows * length * 4  # 1.2 MB; the file holds 36 MB
    pool = pa.default_memory_pool()
    peak = 0
    for chunk in readers.iter_chunks([path], rows=rows):
        assert chunk.old.shape == (rows, length)
        peak = max(peak, pool.bytes_allocated())
    assert peak < 12 * group_bytes  # pre-buffered reading reached ~36 MB here


# --------------------------------------------------------------------------- demo dumps


def _demo_dump(out, *flags):
    """``offpolicy-jax demo --tiny ... --dump-logprobs OUT/dumps`` in a child process.
    Returns the dump folder."""
    import subprocess
    import sys

    pytest.importorskip("flax")
    dumps = out / "dumps"
    argv = [sys.executable, "-m", "offpolicy_jax", "demo", "--tiny", "--no-progress"]
    argv += ["--out", str(out / "demo"), "--dump-logprobs", str(dumps), *flags]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    return dumps


def _load_dumps(paths):
    """The arrays of several demo dumps as one ``[N, T]`` batch, in diagnose's file order."""
    arrays = [np.load(p) for p in paths]
    t = arrays[0]["old_logp"].shape[-1]
    return tuple(
        np.concatenate([a[k].reshape(-1, t) for a in arrays])
        for k in ("old_logp", "rollout_logp", "mask")
    )


_DEMO_DUMP_RUNS = {
    "stale": ("--mismatch", "stale"),
    "mild": ("--mismatch", "precision", "--severity", "3"),
    "severe": ("--mismatch", "precision", "--severity", "7"),
}


@pytest.fixture
def demo_dump(tmp_path_factory):
    """``demo_dump(run)``: the folder of dumps the demo itself wrote, each run built once
    per test run: a stale engine (default severity), and a precision mismatch at 5
    mantissa bits (mild) and at 1 bit (severe); every step of the tiny run."""

    def get(run):
        def build(folder):
            flags = ("--algorithms", "ppo,decoupled_ppo+mis", "--dump-steps", "4")
            _demo_dump(folder, *flags, *_DEMO_DUMP_RUNS[run])

        return shared_folder(tmp_path_factory, f"demo_dump_{run}", build) / "dumps"

    return get


@pytest.mark.slow
@pytest.mark.parametrize("run", ["stale", "severe"])
def test_demo_dump_report_equals_compute_correction(demo_dump, run, tmp_path, capsys):
    """`offpolicy-jax diagnose` on the demo's own dump reports
    the metrics of one `compute_correction` call on the same arrays (every config)."""
    from offpolicy_jax.diagnose import readers

    dumps = demo_dump(run)
    index = json.loads((dumps / "index.json").read_text())
    assert index["steps"] == [1, 2, 3, 4] and set(index["files"]) == {"ppo", "decoupled_ppo+mis"}
    assert sorted(p.name for p in dumps.glob("*.npz")) == sorted(
        f for files in index["files"].values() for f in files
    )
    with np.load(dumps / index["files"]["ppo"][0]) as one:
        # [steps, B, n] log-probs and mask, [steps, B] advantages (tiny: 4 x 16 x 3).
        assert one["old_logp"].shape == one["mask"].shape == (4, 16, 3)
        assert one["advantages"].shape == (4, 16)
    out = tmp_path / "diag"
    argv = ["diagnose", str(dumps / "*.npz"), "--out", str(out), "--no-progress"]
    status, _, err = _cli(argv + ["--chunk-rows", "24"], capsys)  # chunks cut the files
    assert status == 0, err
    report = json.loads((out / "report.json").read_text())
    paths = readers.expand_inputs([str(dumps / "*.npz")])
    old, rollout, mask = _load_dumps(paths)
    assert report["totals"]["tokens"] == int(mask.sum())
    assert report["metrics"]["mis_k3_kl"] > 1e-4  # the engine did mismatch
    _check_equal(report, old, rollout, mask, "sequence")


@pytest.mark.slow
def test_demo_dump_recommendation_mild_vs_severe(demo_dump):
    """The demo's engine at 5 and at 1 mantissa bits: token TIS for the mild mismatch,
    sequence-level rejection (geometric RS + veto, or mis.yaml) for the severe one, in
    the direction README.md's "Diagnose a run" explains (k3 below / above 1e-2)."""
    got = {}
    for run in ("mild", "severe"):
        report = diagnose(str(demo_dump(run) / "*.npz"))
        got[run] = report
    mild, severe = got["mild"], got["severe"]
    assert 1e-4 <= mild["metrics"]["mis_k3_kl"] < 1e-2 <= severe["metrics"]["mis_k3_kl"]
    assert (mild["recommendation"]["name"], mild["recommendation"]["severity"]) == (
        "token_tis",
        "mild",
    )
    assert severe["recommendation"]["severity"] == "severe"
    assert severe["recommendation"]["name"] in ("geo_rs_veto", "mis")
    mild_cfg = opj.CorrectionConfig.from_dict(mild["recommendation"]["config"])
    severe_cfg = opj.CorrectionConfig.from_dict(severe["recommendation"]["config"])
    assert mild_cfg.use_tis and not mild_cfg.use_rs  # token weights only
    assert severe_cfg.use_rs and severe_cfg.rs_veto_threshold is not None  # rejects too


@pytest.mark.heavy
def test_position_profile_ends_at_the_longest_sequence(tmp_path):
    """A chunk pads to at least 64 tokens (one compiled kernel for small chunks); the
    padding adds no bucket to the position profile, whose token counts are exact."""
    lengths = np.array([13, 5, 0, 9])
    mask = np.arange(13)[None] < lengths[:, None]
    old = np.full(mask.shape, -1.0, np.float32)
    path = write_dump(tmp_path / "d.npz", old_logp=old, rollout_logp=old - 0.1, mask=mask)
    report = diagnose([path])
    assert list(report["by_position"]["start"]) == list(range(13))  # buckets of width 1
    tokens = np.asarray(report["by_position"]["tokens"])
    np.testing.assert_array_equal(tokens, [3] * 5 + [2] * 4 + [1] * 4)
