"""Regression tests: inputs that once gave a plausible number instead of an error.

One test per finding; each failed on 05d9d1f. The campaign properties that would have
caught each class are in tests/test_campaign.py.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import offpolicy_jax as opj

MIS = opj.CorrectionConfig.preset("mis")


def _packed_batch(seed=0, rows=2, length=12, segments=3):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-1.0, 0.3, (rows, length)).astype(np.float32)
    old = (logp - 0.05).astype(np.float32)
    rollout = (logp + rng.normal(0.0, 0.3, (rows, length))).astype(np.float32)
    adv = rng.normal(size=(rows, length)).astype(np.float32)
    ids = np.repeat(np.arange(1, segments + 1), length // segments)[None].repeat(rows, 0)
    return logp, old, rollout, adv, np.ones((rows, length), bool), ids.astype(np.int32)


# --------------------------------------------------------------------------- packing


@pytest.mark.heavy
def test_segment_ids_above_num_segments_raise_eagerly_and_are_padding_under_jit():
    logp, old, rollout, adv, mask, ids = _packed_batch()
    config = opj.LossConfig(algorithm="decoupled_ppo", correction=MIS)
    with pytest.raises(ValueError, match="segment_ids holds id 3 but num_segments is 2"):
        opj.policy_loss(logp, old, rollout, adv, mask, config, segment_ids=ids, num_segments=2)
    with pytest.raises(ValueError, match="num_segments"):
        opj.compute_correction(old, rollout, mask, MIS, segment_ids=ids, num_segments=2)
    # Under jit the ids are not read (no host sync): an id above K is padding (§10).
    padded = np.where(ids > 2, 0, ids)
    traced = jax.jit(
        lambda ids: opj.policy_loss(
            logp, old, rollout, adv, mask, config, segment_ids=ids, num_segments=2
        )[0]
    )
    want = opj.policy_loss(
        logp, old, rollout, adv, mask, config, segment_ids=padded, num_segments=2
    )
    np.testing.assert_allclose(float(traced(ids)), float(want[0]), rtol=1e-6)


def test_int64_segment_ids_beyond_int32_raise_instead_of_wrapping():
    logp, old, rollout, adv, mask, ids = _packed_batch()
    wide = ids.astype(np.int64)
    wide[:, -2:] = 2**32 + 1  # would wrap to segment 1 in int32
    with pytest.raises(ValueError, match="segment_ids holds ids outside int32"):
        opj.compute_correction(old, rollout, mask, MIS, segment_ids=wide, num_segments=3)
    with pytest.raises(ValueError, match="segment_ids holds ids outside int32"):  # a list
        opj.compute_correction(old, rollout, mask, MIS, segment_ids=wide.tolist(), num_segments=3)


# --------------------------------------------------------------------------- masks


@pytest.mark.parametrize("bad", [2, 255, -1])
def test_integer_mask_other_than_0_1_raises_naming_mask(bad):
    logp, old, rollout, adv, mask, _ = _packed_batch()
    ints = mask.astype(np.int32)
    ints[0, 1] = bad
    config = opj.LossConfig(algorithm="decoupled_ppo", correction=MIS)
    with pytest.raises(ValueError, match="mask is an integer mask holding"):
        opj.policy_loss(logp, old, rollout, adv, ints, config)
    with pytest.raises(ValueError, match="mask"):
        opj.compute_correction(old, rollout, jnp.asarray(ints), MIS)
    # Float values are documented weights: a weighted mean (numerator and denominator).
    weights = np.where(mask, 1.0, 0.0).astype(np.float32)
    weights[0, :6] = 0.5
    got = opj.aggregate(adv, weights, weights, "token_mean").value()
    np.testing.assert_allclose(float(got), np.sum(adv * weights) / np.sum(weights), rtol=1e-6)


# --------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    ("make", "typo", "hint"),
    [
        (opj.CorrectionConfig, "tis_uper_bound", "tis_upper_bound"),
        (opj.LossConfig, "kl_coeff", "kl_coef"),
        (opj.VanillaTIS, "clip_lo", "clip_low"),
    ],
)
def test_constructor_typos_get_a_did_you_mean_hint(make, typo, hint):
    with pytest.raises(TypeError, match=f"'{typo}'; did you mean '{hint}'"):
        make(**{typo: 1.0})


def _alias_bomb(levels: int) -> str:
    """YAML text whose ``tis_level`` is a list holding 9**levels strings through aliases."""
    items = ["&a0 [" + ", ".join(["x"] * 9) + "]"]
    for i in range(1, levels + 1):
        items.append(f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "tis_level: [" + ", ".join(items) + "]\n"


def test_error_messages_print_bounded_values():
    # 6 levels: 9**7 strings behind a 300-byte document (9 levels took 107 s and ended
    # in MemoryError while the message was formatted with repr).
    with pytest.raises(ValueError, match="tis_level") as err:
        opj.CorrectionConfig.from_yaml(_alias_bomb(6))
    assert len(str(err.value)) < 1000
    huge = "tokn" * 2_500_000  # 10 MB: printed whole, after seconds of did-you-mean matching
    with pytest.raises(ValueError, match="tis_level") as err:
        opj.CorrectionConfig(tis_level=huge)
    assert len(str(err.value)) < 1000
    with pytest.raises(ValueError, match="params") as err:  # found by the campaign
        opj.LossConfig(params=huge)
    assert len(str(err.value)) < 1000


def test_duplicate_yaml_keys_raise_naming_the_key():
    text = "use_tis: true\ntis_upper_bound: 2.0\ntis_upper_bound: 5.0\n"
    with pytest.raises(ValueError, match="duplicate YAML key 'tis_upper_bound'.*line 2.*line 3"):
        opj.CorrectionConfig.from_yaml(text)


@pytest.mark.parametrize(
    ("threshold", "key"),
    [
        ("seq_mean_k1:0.5_2_0", "rs_criteria"),  # was the band [0.5, 20.0]
        ("seq_mean_k3:2_0", "rs_criteria"),  # was 20.0 (float() reads digit separators)
    ],
)
def test_thresholds_with_digit_underscores_are_refused(threshold, key):
    with pytest.raises(ValueError, match=key):
        opj.CorrectionConfig(use_tis=True, rs_criteria=(threshold,))
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        opj.CorrectionConfig.from_verl({"rollout_is": "token", "rollout_is_threshold": "0.5_2_0"})
    with pytest.raises(ValueError, match="tis_upper_bound"):
        opj.CorrectionConfig(use_tis=True, tis_upper_bound="2_0")


def test_huge_integer_bound_raises_naming_the_key():
    with pytest.raises(ValueError, match="tis_upper_bound must be finite"):
        opj.CorrectionConfig.from_yaml("use_tis: true\ntis_upper_bound: " + "9" * 401 + "\n")


def test_deeply_nested_yaml_raises_a_value_error():
    with pytest.raises(ValueError, match="nested too deeply"):
        opj.CorrectionConfig.from_yaml("tis_level: " + "[" * 10_000 + "]" * 10_000 + "\n")


def test_a_directory_is_not_reported_as_a_missing_file(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a directory"):
        opj.CorrectionConfig.from_yaml(str(tmp_path))
    with pytest.raises(IsADirectoryError, match="is a directory"):
        opj.CorrectionConfig.from_yaml(tmp_path)


@pytest.mark.parametrize(
    "fields",
    [
        {"policy_loss": "sapo", "tau_pos": 1e39},  # grad NaN (inf · 0)
        {"policy_loss": "sapo", "tau_neg": 1e-45},  # loss inf (4 / 0)
        {"policy_loss": "dro", "dro_beta": 1e39},
        {"kl_coef": 1e39},
        {"entropy_coef": 1e39},
        {"aggregation": "sequence_sum_norm", "loss_scale_factor": 1e-39},  # flushed to 0
    ],
)
def test_coefficients_that_are_not_normal_float32_raise(fields):
    key = next(k for k in fields if k not in ("policy_loss", "aggregation"))
    with pytest.raises(ValueError, match=f"{key} = .* in float32"):
        opj.LossConfig(**fields)


def test_one_verl_threshold_for_several_criteria_is_shared_like_verl_and_documented():
    # verl's _parse_rollout_rs_thresholds repeats a single threshold for every option.
    shared = opj.CorrectionConfig.from_verl(
        {"rollout_is": None, "rollout_rs": "seq_max_k2,seq_mean_k3", "rollout_rs_threshold": "2.5"}
    )
    assert shared.rs_criteria == ("seq_max_k2:2.5", "seq_mean_k3:2.5")
    k1 = opj.CorrectionConfig.from_verl(
        {"rollout_rs": "token_k1,seq_sum_k1", "rollout_rs_threshold": 2.0}
    )
    assert k1.rs_criteria == ("token_k1:0.5_2.0", "seq_sum_k1:0.5_2.0")  # hi alone: [1/hi, hi]
    with pytest.raises(ValueError, match="rollout_rs_threshold"):  # two for three options
        opj.CorrectionConfig.from_verl(
            {"rollout_rs": "token_k1,token_k2,token_k3", "rollout_rs_threshold": "2,3"}
        )
    with pytest.raises(ValueError, match="rollout_rs_threshold"):  # lo_hi shared with a k3
        opj.CorrectionConfig.from_verl(
            {"rollout_rs": "token_k1,seq_mean_k3", "rollout_rs_threshold": "0.5_2.0"}
        )
    # ... and it is documented where a verl user looks.
    assert "shared by every criterion" in (opj.CorrectionConfig.from_verl.__doc__ or "")
    semantics = (pathlib.Path(__file__).parents[1] / "docs" / "semantics.md").read_text()
    assert "a single entry shared\nby every criterion" in semantics


# --------------------------------------------------------------------------- token_logprobs

_LOGITS = jnp.log(jnp.array([[[0.5, 0.3, 0.2]]]))
_TOKEN = jnp.array([[1]])


def test_array_top_k_top_p_temperature_follow_vllm_or_refuse():
    off = float(opj.token_logprobs(_LOGITS, _TOKEN)[0, 0])  # -1.204
    for k in (0, -1):  # vLLM's "off" per request: was read as top-1 (-inf)
        got = opj.token_logprobs(_LOGITS, _TOKEN, top_k=jnp.array([[k]]))
        np.testing.assert_allclose(float(got[0, 0]), off, rtol=1e-6)
    for p in (0.0, np.nan, 1.5):  # was silently the top-1 support
        with pytest.raises(ValueError, match="top_p"):
            opj.token_logprobs(_LOGITS, _TOKEN, top_p=jnp.array([[p]], jnp.float32))
        traced = jax.jit(lambda p: opj.token_logprobs(_LOGITS, _TOKEN, top_p=p))
        assert np.isnan(float(traced(jnp.array([[p]], jnp.float32))[0, 0]))
    for t in (0.0, -1.0, np.nan, np.inf):
        with pytest.raises(ValueError, match="temperature"):
            opj.token_logprobs(_LOGITS, _TOKEN, temperature=jnp.array([[t]], jnp.float32))
        traced = jax.jit(lambda t: opj.token_logprobs(_LOGITS, _TOKEN, temperature=t))
        assert np.isnan(float(traced(jnp.array([[t]], jnp.float32))[0, 0]))


def test_finite_logits_at_small_temperature_do_not_overflow():
    logits = jnp.array([[[3e38, 1.0, 0.0]]])
    logp, entropy = opj.token_logprobs(
        logits, jnp.array([[0]]), temperature=0.5, return_entropy=True
    )
    assert float(logp[0, 0]) == 0.0 and float(entropy[0, 0]) == 0.0  # was NaN
    rng = np.random.default_rng(0)
    normal = jnp.asarray(rng.normal(0.0, 2.0, (2, 3, 50)), jnp.float32)
    tokens = jnp.argmax(normal, -1)
    got = opj.token_logprobs(normal, tokens, temperature=2e-38)
    np.testing.assert_array_equal(np.asarray(got), 0.0)  # the argmax token, T -> 0
    with pytest.raises(ValueError, match="temperature"):  # subnormal: flushed to 0
        opj.token_logprobs(normal, tokens, temperature=1e-38)
    grad = jax.grad(lambda x: jnp.sum(opj.token_logprobs(x, tokens, temperature=0.5)))(normal)
    assert np.all(np.isfinite(np.asarray(grad)))


def test_int64_token_ids_beyond_int32_raise_instead_of_wrapping():
    wide = np.array([[2**32 + 1]], np.int64)  # wrapped to 1: -1.204 instead of NaN
    with pytest.raises(ValueError, match="tokens holds ids outside int32"):
        opj.token_logprobs(_LOGITS, wide)
    with pytest.raises(ValueError, match="tokens holds ids outside int32"):  # a list
        opj.token_logprobs(_LOGITS, wide.tolist())


# --------------------------------------------------------------------------- diagnose


def _diagnose_cli(argv, capsys):
    pytest.importorskip("pyarrow")
    pytest.importorskip("matplotlib")
    from offpolicy_jax import cli

    try:
        status = cli.main([*argv, "--no-progress"])
    except SystemExit as e:
        status = e.code
    captured = capsys.readouterr()
    return status, captured.err


def _assert_one_line_error(status, err, *needles):
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, err
    assert lines[0].startswith("offpolicy-jax: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]


def _mismatched_jsonl(path, null_mask: bool):
    import json

    rng = np.random.default_rng(0)
    rows = []
    for i in range(8):
        old = rng.normal(-4.0, 0.1, 6)  # log-probs stay <= 0 (diagnose refuses others)
        rollout = old + (3.0 if i in (3, 6) else 0.01)  # two badly mismatched sequences
        mask = [1, 1, 1, 1, 1, None if (null_mask and i in (3, 6)) else 1]
        rows.append({"old_log_probs": old.tolist(), "rollout_log_probs": rollout.tolist()})
        rows[-1]["response_mask"] = mask
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    arrays = [np.array([r[k] for r in rows], np.float32) for k in rows[0]]
    arrays[2] = np.array([[np.nan if v is None else v for v in r["response_mask"]] for r in rows])
    return arrays


@pytest.mark.slow  # compiles diagnose's chunk kernel
def test_diagnose_keeps_sequences_whose_mask_holds_null(tmp_path):
    pytest.importorskip("pyarrow")
    from offpolicy_jax.diagnose import diagnose

    old, rollout, mask = _mismatched_jsonl(tmp_path / "d.jsonl", null_mask=True)
    want = opj.compute_correction(old, rollout, mask.astype(np.float32), opj.CorrectionConfig())
    got = diagnose([tmp_path / "d.jsonl"], chunk_rows=2)
    assert got["totals"]["sequences"] == 8  # was 6
    np.testing.assert_allclose(
        got["metrics"]["mis_k3_kl"], float(want.metrics["mis_k3_kl"]), rtol=1e-5
    )
    assert got["recommendation"]["severity"] == "severe"  # was mild (token_tis)


@pytest.mark.slow  # compiles diagnose's chunk kernel
def test_diagnose_reads_segment_id_0_as_padding(tmp_path):
    pytest.importorskip("pyarrow")
    from offpolicy_jax.diagnose import diagnose, write_dump

    old = np.full((1, 6), -1.0, np.float32)
    rollout = old.copy()
    rollout[0, 4:] = -30.0  # a huge mismatch on the id-0 tokens
    ids = np.array([[1, 1, 2, 2, 0, 0]], np.int32)
    mask = np.ones((1, 6), np.float32)
    write_dump(tmp_path / "p.npz", old_logp=old, rollout_logp=rollout, mask=mask, segment_ids=ids)
    got = diagnose([tmp_path / "p.npz"])
    want = opj.compute_correction(
        old, rollout, mask, opj.CorrectionConfig(), segment_ids=ids, num_segments=2
    )
    assert float(want.metrics["mis_k3_kl"]) == 0.0
    assert got["metrics"]["mis_k3_kl"] == pytest.approx(0.0, abs=1e-7)  # was 1.09e6
    assert got["totals"]["sequences"] == 2


@pytest.mark.parametrize("kind", ["non_utf8", "string", "nested", "npz_object", "npz_string"])
def test_diagnose_bad_values_are_a_one_line_error(tmp_path, capsys, kind):
    good = '{"old_log_probs": [-1.0], "rollout_log_probs": [-1.1], "response_mask": [1]}\n'
    if kind == "non_utf8":
        path = tmp_path / "d.jsonl"
        path.write_bytes(good.encode() + b'{"old_log_probs": [-1.0], "x": "\xff"}\n')
    elif kind in ("string", "nested"):
        path = tmp_path / "d.jsonl"
        value = '"-1.0"' if kind == "string" else "[-1.0]"
        path.write_text(good + good.replace("[-1.1]", f"[{value}]"))
    else:
        path = tmp_path / "d.npz"
        bad = np.array([[object()]], object) if kind == "npz_object" else np.array([["a"]])
        np.savez(
            path, old_logp=np.zeros((1, 1), np.float32), rollout_logp=bad, mask=np.ones((1, 1))
        )
    status, err = _diagnose_cli(["diagnose", str(path), "--out", str(tmp_path / "o")], capsys)
    _assert_one_line_error(status, err, str(path))


def test_diagnose_pads_a_skewed_batch_by_length_groups(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from offpolicy_jax.diagnose import readers

    # One 20,000-token sequence beside 1,023 of 64: padding all to the longest made
    # 1024 x 20,000 cells per column (a 2M-token case: 7.63 GiB).
    lengths = np.array([64] * 500 + [20_000] + [64] * 523)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    tokens = int(lengths.sum())
    values = pa.array(np.full(tokens, -1.0, np.float32))
    ones = pa.array(np.ones(tokens, np.float32))
    table = {name: pa.ListArray.from_arrays(offsets, values) for name in readers.NPZ_KEYS}
    columns = dict(zip(readers.NPZ_KEYS, readers.DEFAULT_COLUMNS.values(), strict=True))
    table = {columns[k]: v for k, v in table.items()}
    table[columns["mask"]] = pa.ListArray.from_arrays(offsets, ones)
    pq.write_table(pa.table(table), tmp_path / "s.parquet")
    cells, rows = 0, []
    for chunk in readers.iter_chunks([tmp_path / "s.parquet"], rows=1024):
        cells += chunk.old.size
        rows += chunk.row.tolist()
        np.testing.assert_array_equal(chunk.mask.sum(1), lengths[chunk.row])
    assert sorted(rows) == list(range(1024))
    assert cells <= 2 * tokens + 1024 * 512  # was 1024 x 20,000 = 20.5M cells


@pytest.mark.slow  # compiles diagnose's chunk kernel
@pytest.mark.parametrize("kind", ["empty", "nonfinite"])
def test_diagnose_refuses_to_recommend_without_a_valid_sequence(tmp_path, capsys, kind):
    pytest.importorskip("pyarrow")
    from offpolicy_jax.diagnose import write_dump

    old = np.full((3, 4), -1.0, np.float32)
    mask = np.zeros((3, 4)) if kind == "empty" else np.ones((3, 4))
    if kind == "nonfinite":
        old[:, 1] = np.nan
    path = write_dump(tmp_path / "e.npz", old_logp=old, rollout_logp=old, mask=mask)
    status, err = _diagnose_cli(["diagnose", str(path), "--out", str(tmp_path / "o")], capsys)
    _assert_one_line_error(status, err, "nothing to diagnose")  # was "no correction needed"


@pytest.mark.slow  # compiles diagnose's chunk kernel
def test_diagnose_reads_a_1d_npz_as_one_sequence(tmp_path):
    pytest.importorskip("pyarrow")
    from offpolicy_jax.diagnose import diagnose

    old = np.array([-1.0, -2.0, -0.5], np.float32)
    np.savez(tmp_path / "one.npz", old_logp=old, rollout_logp=old - 0.2, mask=np.ones(3))
    got = diagnose([tmp_path / "one.npz"])  # was "empty file (no sequences)"
    want = opj.compute_correction(
        old[None], old[None] - 0.2, np.ones((1, 3)), opj.CorrectionConfig()
    )
    assert got["totals"]["sequences"] == 1
    np.testing.assert_allclose(
        got["metrics"]["mis_k3_kl"], float(want.metrics["mis_k3_kl"]), rtol=1e-5
    )


@pytest.mark.slow  # compiles diagnose's chunk kernel for every path
def test_diagnose_split_paths_pool_exactly(tmp_path, monkeypatch):
    pytest.importorskip("pyarrow")
    from offpolicy_jax.diagnose import analysis, diagnose, readers, write_dump

    rng = np.random.default_rng(3)
    lengths = np.array([300, 5, 7, 5000, 2, 9, 0, 11])
    mask = np.arange(5000)[None] < lengths[:, None]
    old = (-rng.exponential(1.0, mask.shape)).astype(np.float32)
    # Log-probs are <= 0: diagnose refuses positive ones at valid tokens.
    rollout = np.minimum(old + rng.normal(0, 0.4, mask.shape), -1e-6).astype(np.float32)
    path = write_dump(tmp_path / "d.parquet", old_logp=old, rollout_logp=rollout, mask=mask)
    plain = diagnose([path], chunk_rows=8)
    monkeypatch.setattr(readers, "LONG_SEQUENCE", 32)  # split the batch by length
    monkeypatch.setattr(readers, "length_groups", _always_split(readers.length_groups))
    monkeypatch.setattr(analysis, "SPLIT_CELLS", 0)  # one config per call
    monkeypatch.setattr(analysis, "MAX_POSITION_BUCKETS", 4)  # coarsen the profile
    # the 5000-token sequence is a lone one: its programs are dropped between calls
    monkeypatch.setattr(analysis, "LONE_SEQUENCE_COLS", 4096)
    drops, drop = [], analysis._drop_programs

    def counted_drop():
        drops.append(True)
        drop()

    monkeypatch.setattr(analysis, "_drop_programs", counted_drop)
    split = diagnose([path], chunk_rows=8)
    assert drops  # the lone path ran
    for name, entry in plain["what_if"].items():
        for key, value in entry["metrics"].items():
            got = split["what_if"][name]["metrics"][key]
            np.testing.assert_allclose(got, value, rtol=2e-5, atol=1e-6, err_msg=f"{name}.{key}")
    np.testing.assert_allclose(
        np.sum(split["by_position"]["tokens"]), np.sum(plain["by_position"]["tokens"])
    )


def _always_split(length_groups):
    def groups(length):
        return [np.array([i]) for i in np.argsort(-length)] if length.size > 1 else [np.arange(1)]

    return groups


def _peak_rss_script() -> str:
    """The diagnose CLI, then its own peak RSS (VmHWM: the high-water mark of this
    process's address space only). Not ``getrusage(RUSAGE_SELF).ru_maxrss``: Linux
    carries the pre-exec address space's high-water mark across ``execve``, and
    ``subprocess`` forks (or vforks) the test process, so ru_maxrss reported the pytest
    worker's own peak (4.6 GiB late in a full suite run) instead of diagnose's."""
    return (
        "import sys\n"
        "from offpolicy_jax import cli\n"
        "status = cli.main(sys.argv[1:])\n"
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')]\n"
        "print('RSS_KB', hwm[0].split()[1])\n"
        "sys.exit(status)\n"
    )


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")
def test_peak_rss_probe_ignores_the_parent_processes_memory():
    """The probe reads the child's own peak, whatever the (large) parent holds."""
    import subprocess
    import sys

    ballast = np.ones(512 * 1024 * 1024 // 8)  # 512 MiB touched in this process
    script = _peak_rss_script().replace("from offpolicy_jax import cli", "")
    script = script.replace("status = cli.main(sys.argv[1:])", "status = 0")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[1]) < 256 * 1024, done.stdout
    assert ballast.sum() > 0


@pytest.mark.slow  # writes a 27 MB dump and analyses a 2M-token sequence (about a minute)
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")
def test_diagnose_skewed_dump_peak_memory_stays_under_1_gb(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import subprocess
    import sys

    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    lengths = np.array([2_000_000] + [64] * 1023)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    n = int(lengths.sum())
    old = (-rng.exponential(1.0, n)).astype(np.float32)
    rollout = np.minimum(old + rng.normal(0, 0.05, n), -1e-6).astype(np.float32)  # <= 0
    columns = {
        "old_log_probs": old,
        "rollout_log_probs": rollout,
        "response_mask": np.ones(n, np.int8),
    }
    table = {k: pa.ListArray.from_arrays(offsets, pa.array(v)) for k, v in columns.items()}
    pq.write_table(pa.table(table), tmp_path / "skewed.parquet")
    del old, rollout, columns, table
    script = _peak_rss_script()
    argv = ["diagnose", str(tmp_path / "skewed.parquet"), "--out", str(tmp_path / "o")]
    # The default configuration on one device, whatever other tests of this process set.
    env = {k: v for k, v in __import__("os").environ.items() if k != "XLA_FLAGS"}
    env |= {"JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", script, *argv, "--no-progress"],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rss_kb = int(done.stdout.rsplit("RSS_KB", 1)[1].split()[0])
    shown_env = {
        k: v for k, v in env.items() if k.startswith(("JAX", "XLA", "OFFPOLICY", "PYTHON"))
    }
    # was a 7.63 GiB allocation
    assert rss_kb < 1024 * 1024, f"peak RSS {rss_kb / 1024:.0f} MiB with {shown_env}"


def test_value_checks_read_arrays_closed_over_by_a_jitted_function():
    """A concrete array captured by jax.jit is read by the value checks (not a
    TracerBoolConversionError): a bad one gets the named error, a good one passes."""
    z = jnp.zeros((1, 4))
    good, bad = jnp.array([[1, 1, 2, 2]]), jnp.array([[1, 1, 3, 3]])

    def loss(ids):
        return jax.jit(
            lambda lp: opj.policy_loss(
                lp,
                z,
                None,
                z,
                jnp.ones((1, 4), bool),
                opj.LossConfig(),
                segment_ids=ids,
                num_segments=2,
            )[0]
        )(z)

    assert float(loss(good)) == 0.0
    with pytest.raises(ValueError, match="num_segments"):
        loss(bad)
    int_mask = jnp.array([[1, 2, 0, 1]])
    with pytest.raises(ValueError, match="mask"):
        jax.jit(lambda lp: opj.policy_loss(lp, z, None, z, int_mask, opj.LossConfig())[0])(z)
    temperature = jnp.array([[0.7, 0.0]])
    with pytest.raises(ValueError, match="temperature"):
        jax.jit(lambda lg: opj.token_logprobs(lg, jnp.zeros((1, 2), int), temperature=temperature))(
            jnp.zeros((1, 2, 5))
        )
