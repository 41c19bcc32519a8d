"""The end-to-end demo (``offpolicy-jax demo``): a tiny run writes well-formed outputs,
the rollout engine's numerics behave as documented, and bad CLI input fails in one line."""

from __future__ import annotations

import csv
import functools
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("matplotlib")

from run_once import shared_folder

from offpolicy_jax import cli as command_line
from offpolicy_jax.demo import cli, engine, task, train
from offpolicy_jax.demo.experiment import PRESETS
from offpolicy_jax.demo.model import round_mantissa

# The default preset's rows: the tiny run below is also that preset's smoke run.
TINY_ALGOS = PRESETS["default"].algorithms


def run_cli(out: Path, *flags: str) -> subprocess.CompletedProcess:
    """``offpolicy-jax demo --tiny --no-progress --out OUT FLAGS...`` in a child process."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "offpolicy_jax",
            "demo",
            "--tiny",
            "--no-progress",
            *flags,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The console command, as a user runs it, at a tiny size (once per test run)."""

    def build(folder):
        flags = ("--preset", "default", "--steps", "4", "--seeds", "2")
        flags += ("--algorithms", ",".join(TINY_ALGOS))
        proc = run_cli(folder / "out", *flags)
        assert proc.returncode == 0, proc.stderr
        (folder / "stdout.txt").write_text(proc.stdout)

    folder = shared_folder(tmp_path_factory, "demo_tiny_run", build)
    return folder / "out", (folder / "stdout.txt").read_text()


@pytest.mark.slow  # an end-to-end demo run (~20 s); the README quick start runs one too
def test_tiny_demo_writes_table_plot_and_logs(tiny_run):
    out, stdout = tiny_run
    for name in ("results.md", "demo.png", "metrics.csv", "summary.json"):
        assert (out / name).is_file(), name

    png = (out / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(TINY_ALGOS) * 2 * 4
    assert list(rows[0])[:3] == ["algorithm", "seed", "step"]
    assert list(rows[0])[3 : 3 + len(train_metrics())] == train_metrics()
    # Every metric the loss returns is a column, and is filled for the rows that return it.
    assert {c for c in rows[0] if c.startswith("loss/")} == {
        f"loss/{k}" for k in train.loss_metric_keys([train.ALGORITHMS[a] for a in TINY_ALGOS])
    }
    for name in TINY_ALGOS:
        keys = train.loss_metric_keys([train.ALGORITHMS[name]])
        mine = [r for r in rows if r["algorithm"] == name]
        assert all(np.isfinite(float(r[f"loss/{k}"])) for r in mine for k in keys), name
        others = set(rows[0]) - {f"loss/{k}" for k in keys}
        assert all(r[c] == "nan" for r in mine for c in others if c.startswith("loss/"))
    assert {r["algorithm"] for r in rows} == set(TINY_ALGOS)
    for r in rows:
        assert 0.0 <= float(r["reward"]) <= 1.0
        k3 = float(r["mis_k3_kl"])
        assert np.isfinite(k3) and k3 > -1e-6  # K3 >= 0, up to float32 rounding
        assert 0.0 <= float(r["rejected_fraction"]) <= 1.0
        assert float(r["is_weight_max"]) >= float(r["is_weight_mean"]) > 0.0
        assert 0.0 <= float(r["is_weight_above_2"]) <= 1.0
        assert float(r["grad_norm"]) >= 0.0

    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["steps"] == 4 and summary["config"]["seeds"] == 2
    assert [r["algorithm"] for r in summary["results"]] == list(TINY_ALGOS)
    for r in summary["results"]:
        assert len(r["final_reward_per_seed"]) == 2
        assert r["final_reward_std"] >= 0.0

    table = (out / "results.md").read_text()
    assert summary["command"].startswith("offpolicy-jax demo --tiny")
    assert table.count("\n| ") == 1 + len(TINY_ALGOS)  # header + one row per algorithm
    # What the command prints is the table it wrote.
    printed = [ln for ln in stdout.splitlines() if ln.startswith("| ")]
    assert printed == [ln for ln in table.splitlines() if ln.startswith("| ")]


def train_metrics():
    from offpolicy_jax.demo.report import METRICS

    return list(METRICS)


@pytest.mark.slow  # an end-to-end demo run (~20 s); the README quick start runs one too
def test_tiny_demo_uses_common_seeds_and_a_clean_reference(tiny_run):
    with open(tiny_run[0] / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    by = {(r["algorithm"], r["seed"], r["step"]): r for r in rows}
    # The default mismatch is a stale engine: at step 1 nobody has been updated yet, so
    # every algorithm samples the same batch from the same weights.
    for seed in ("0", "1"):
        rewards = {by[(a, seed, "1")]["reward"] for a in TINY_ALGOS}
        assert len(rewards) == 1
    # The reference engine has no mismatch: log-probs equal up to float32 rounding.
    reference = [r for r in rows if r["algorithm"] == "ppo:no-mismatch"]
    assert all(float(r["mis_k3_kl"]) < 1e-6 for r in reference)
    assert all(abs(float(r["is_weight_max"]) - 1) < 1e-4 for r in reference)
    assert any(float(r["mis_k3_kl"]) > 1e-4 for r in rows if r["algorithm"] == "ppo")


def test_round_mantissa_7_bits_is_bfloat16():
    x = jax.random.normal(jax.random.key(0), (4096,)) * 30.0
    np.testing.assert_array_equal(round_mantissa(x, 7), x.astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(round_mantissa(x, 23), x)


def test_sampling_log_probs():
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0, -3.0]])
    plain = engine._sampling_log_probs(logits, jnp.float32(1.0), jnp.float32(1.0))
    np.testing.assert_array_equal(plain, jax.nn.log_softmax(logits))
    # Nucleus 0.9: the smallest set of most likely tokens whose mass reaches 0.8.
    p = jax.nn.softmax(logits)[0]
    nucleus = engine._sampling_log_probs(logits, jnp.float32(1.0), jnp.float32(0.9))[0]
    keep = np.array([True, True, True, False, False])
    assert np.cumsum(p)[1] < 0.9 <= np.cumsum(p)[2]
    np.testing.assert_allclose(np.exp(nucleus[keep]), p[keep] / p[keep].sum(), rtol=1e-6)
    assert np.all(np.isneginf(nucleus[~keep]))
    hot = engine._sampling_log_probs(logits, jnp.float32(2.0), jnp.float32(1.0))
    np.testing.assert_allclose(hot, jax.nn.log_softmax(logits / 2.0), rtol=1e-6)


def test_mismatch_severity():
    assert train.Mismatch("precision", 1).numerics().mantissa_bits == 7  # bfloat16
    assert train.Mismatch("precision", 5).numerics().mantissa_bits == 3  # fp8-e4m3
    assert train.Mismatch("precision", 0).numerics() == engine.Numerics()
    assert train.Mismatch("stale", 4).staleness() == 4
    assert train.Mismatch("stale", 4).numerics() == engine.Numerics()
    s = train.Mismatch("sampling", 2).numerics()
    assert (s.temperature, s.top_p) == (1.5, 0.9)
    assert train.Mismatch("router", 10).numerics().router_noise == pytest.approx(0.3)
    assert train.Mismatch("fp8", 1).numerics().fp8 == "e4m3"
    assert train.Mismatch("fp8", 2).numerics().fp8 == "e5m2"
    assert train.Mismatch("fp8", 0).numerics() == engine.Numerics()


@pytest.mark.heavy
def test_engine_without_mismatch_reports_the_trainers_log_probs():
    cfg = train.TrainConfig(d_model=16, prompt_len=3)
    graphdef, state = train.init_state(cfg, train.Mismatch("precision", 1), [0])
    params = jax.tree.map(lambda x: x[0], state["params"])
    prompts = task.sample_prompts(jax.random.key(1), 8, cfg.prompt_len)
    numerics = train.Mismatch("precision", 1).numerics()

    @jax.jit
    def both(active):
        resp, rollout_logp = engine.generate(
            graphdef, params, prompts, jax.random.key(2), numerics, active=active
        )
        trainer = train.token_logp(graphdef, params, task.join(prompts, resp), cfg.prompt_len)
        return rollout_logp, trainer

    rollout_logp, trainer = both(False)  # same numerics: equal up to float32 rounding
    np.testing.assert_allclose(rollout_logp, trainer, rtol=0, atol=2e-6)
    rollout_logp, trainer = both(True)  # bf16 engine: close, not equal
    assert not np.array_equal(rollout_logp, trainer)
    np.testing.assert_allclose(rollout_logp, trainer, atol=0.1)


def test_task_reward():
    prompts = jnp.array([[1, 2, 3], [4, 5, 6]])
    responses = jnp.array([[3, 2, 1], [6, 0, 0]])
    np.testing.assert_allclose(task.reward(prompts, responses), [1.0, 1 / 3])


# --------------------------------------------------------------------------- bad input

BAD = {
    "unknown algorithm": ["demo", "--algorithms", "ppo,nope"],
    "negative steps": ["demo", "--steps", "-5"],
    "zero steps": ["demo", "--steps", "0"],
    "non-integer seeds": ["demo", "--seeds", "two"],
    "unknown mismatch": ["demo", "--mismatch", "cosmic-rays"],
    "unknown preset": ["demo", "--preset", "explode"],
    "negative severity": ["demo", "--severity", "-1"],
    "staleness beyond the engine's weight copies": ["demo", "--severity", "1e6"],
    "threshold above 1": ["demo", "--threshold", "1.5"],
    "negative learning rate": ["demo", "--lr", "-0.1"],
    "unknown option": ["demo", "--stpes", "10"],
    "unknown trainer log-probs": ["demo", "--trainer-logprobs", "tempered"],
    "unknown LossConfig field in a row": ["demo", "--algorithms", "ppo/clip_epss=0.1"],
    "bad LossConfig value in a row": ["demo", "--algorithms", "ppo/clip_eps=-1"],
    "zero dump steps": ["demo", "--dump-logprobs", "d", "--dump-steps", "0"],
    "router mismatch of a dense policy": ["demo", "--mismatch", "router"],
    "routing replay of a dense policy": ["demo", "--routing-replay"],
    "fp8 severity beyond e5m2": ["demo", "--mismatch", "fp8", "--severity", "3"],
    "top-k above the experts": ["demo", "--experts", "2", "--top-k", "3"],
    "unknown command": ["train"],
    "no command": [],
}


@pytest.mark.parametrize("argv", list(BAD.values()), ids=list(BAD))
def test_bad_input_is_one_line_and_exit_2(argv, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        command_line.main(argv + (["--out", str(tmp_path / "o")] if argv[:1] == ["demo"] else []))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("offpolicy-jax: error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()  # nothing was trained or written


def test_unwritable_output_dir(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(SystemExit) as e:
        command_line.main(["demo", "--tiny", "--out", str(blocker / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("offpolicy-jax: error: cannot write to output directory")
    assert err.count("\n") == 1


def test_console_entry_point_bad_input_has_no_traceback():
    script = Path(sys.executable).with_name("offpolicy-jax")  # installed by pip install -e .
    command = [str(script)] if script.exists() else [sys.executable, "-m", "offpolicy_jax"]
    proc = subprocess.run(
        [*command, "demo", "--algorithms", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("offpolicy-jax")]
    assert lines == [
        (
            "offpolicy-jax: error: unknown algorithm 'nope' (choose from "
            + ", ".join(train.ALGORITHMS)
            + f"; any of them may end in {train.REPLAY_SUFFIX})"
        )
    ]


def test_docs_results_table_has_the_default_commands_shape():
    """docs/demo.md shows the default command's table: same header (seeds, threshold) and
    one row per default algorithm, in order (the numbers themselves are measured, not rerun)."""
    page = Path(__file__).resolve().parent.parent / "docs" / "demo.md"
    if not page.exists():
        pytest.skip("no docs/demo.md beside the tests")
    head = "## Results of the default command"
    text = page.read_text()
    assert head in text and "offpolicy-jax demo --out demo_out" in text
    section = text.split(head, 1)[1].split("\n## ", 1)[0]

    from offpolicy_jax.demo import report
    from offpolicy_jax.demo.experiment import DemoConfig, History

    cfg = DemoConfig()
    zeros = np.zeros((cfg.steps, cfg.seeds))
    columns = {**dict.fromkeys(report.METRICS, zeros)}
    fake = History(cfg, {a: columns for a in cfg.algorithms}, 0.0)
    header = report.format_table(fake, report.summarize(fake)).splitlines()[0]
    lines = section.splitlines()
    i = lines.index(header)
    names = [ln.split("|")[1].strip() for ln in lines[i + 2 : i + 2 + len(cfg.algorithms)]]
    assert names == [f"`{a}`" for a in cfg.algorithms]
    assert (page.parent / "demo.png").is_file()


def test_table_notes_the_reported_loss_of_log_prob_surrogates():
    """Rows whose loss is −sg(w)·A·log π_θ (CISPO, REINFORCE-IS, ...) get a note that their
    pg_loss is not an objective (it rises while they train); PPO-clip rows do not."""
    from offpolicy_jax.demo import report
    from offpolicy_jax.demo.experiment import DemoConfig, History

    def note(rows):
        cfg = DemoConfig(algorithms=tuple(rows))
        zeros = np.zeros((cfg.steps, cfg.seeds))
        fake = History(cfg, {a: dict.fromkeys(report.METRICS, zeros) for a in rows}, 0.0)
        table = report.format_table(fake, report.summarize(fake))
        return [line for line in table.splitlines() if line.startswith("Note on")]

    assert note(["ppo", "decoupled_ppo+mis", "decoupled_ppo+mis/gspo"]) == []
    [line] = note(["ppo", "decoupled_ppo+mis/cispo", "reinforce_is+mis"])
    assert "`decoupled_ppo+mis/cispo`, `reinforce_is+mis`" in line and "rise" in line


# --------------------------------------------------------------------------- presets, names


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["default", "collapse", "router"])
def test_each_preset_runs_at_a_tiny_size(preset, tmp_path, request):
    """Each preset, all its rows, a few steps: the command works and writes every row."""
    if preset == "default":  # the tiny run is the default preset's, every row of it
        out = request.getfixturevalue("tiny_run")[0]
    else:
        proc = run_cli(tmp_path, "--preset", preset, "--steps", "3")
        assert proc.returncode == 0, proc.stderr
        out = tmp_path
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["preset"] == preset
    assert [r["algorithm"] for r in summary["results"]] == list(PRESETS[preset].algorithms)
    assert summary["config"]["mismatch"] == dataclasses_asdict(PRESETS[preset].mismatch)
    for r in summary["results"]:
        assert np.isfinite(r["final_reward_mean"]) and np.isfinite(r["peak_grad_norm"])


def dataclasses_asdict(x):
    import dataclasses

    return dataclasses.asdict(x)


def test_version(capsys):
    import offpolicy_jax

    with pytest.raises(SystemExit) as e:
        command_line.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"offpolicy-jax {offpolicy_jax.__version__}"


def test_rows_are_library_loss_configs_named_by_algorithm():
    import offpolicy_jax as opj

    for name, algo in train.ALGORITHMS.items():
        assert isinstance(algo.loss, opj.LossConfig)
        assert name.split(":")[0].split("+")[0] == algo.loss.algorithm
    untruncated = train.ALGORITHMS["decoupled_ppo+is"].loss.correction
    assert isinstance(untruncated, opj.VanillaTIS) and untruncated.clip == train.NO_CAP
    for c in train.TIS_CAPS:
        tis = train.ALGORITHMS[f"decoupled_ppo+tis{c:g}"].loss.correction
        assert (tis.clip_low, tis.clip) == (0.0, c)


def test_untruncated_row_weights_are_the_full_ratio():
    """``decoupled_ppo+is`` is TIS without a cap: a token with ratio e^8 keeps weight e^8
    (the loss equals the hand-computed −w·A at ratio 1), while TIS at 2 caps it."""
    import offpolicy_jax as opj

    old = jnp.zeros((1, 3))
    rollout = jnp.array([[-8.0, 0.0, 0.0]])
    adv, mask = jnp.ones(1), jnp.ones((1, 3))
    loss, _ = opj.policy_loss(
        old, old, rollout, adv, mask, train.ALGORITHMS["decoupled_ppo+is"].loss
    )
    np.testing.assert_allclose(loss, -(np.exp(8.0) + 2) / 3, rtol=1e-5)
    loss2, _ = opj.policy_loss(
        old, old, rollout, adv, mask, train.ALGORITHMS["decoupled_ppo+tis2"].loss
    )
    np.testing.assert_allclose(loss2, -(2.0 + 2) / 3, rtol=1e-6)


def test_collapsed_means_fell_and_did_not_recover():
    from offpolicy_jax.demo import report

    steps = 200
    rise = np.minimum(np.arange(steps) / 50, 1.0)
    fall = np.where(np.arange(steps) < 100, rise, 0.3)
    dip = np.where((np.arange(steps) > 80) & (np.arange(steps) < 120), 0.3, rise)  # recovers
    slow = rise * 0.5  # never learns: not a collapse
    got = report.collapsed(np.stack([rise, fall, dip, slow], axis=1))
    assert got.tolist() == [False, True, False, False]


# --------------------------------------------------------------------------- rows, dumps


def test_row_overrides_name_any_loss_config_field():
    import offpolicy_jax as opj

    base = train.row("decoupled_ppo+mis")
    assert base is train.ALGORITHMS["decoupled_ppo+mis"]
    r = train.row("decoupled_ppo+mis/clip_eps=0.1/aggregation=token_mean")
    assert r.loss == opj.LossConfig(
        algorithm="decoupled_ppo", correction=train.MIS, clip_eps=0.1, aggregation="token_mean"
    )
    assert r.name == "decoupled_ppo+mis/clip_eps=0.1/aggregation=token_mean" and r.mismatch
    assert train.row("decoupled_ppo+tis2/clip_eps=0.3").loss.correction == opj.VanillaTIS(clip=2.0)
    with pytest.raises(ValueError, match="'clip_epss' is not a LossConfig field"):
        train.row("ppo/clip_epss=0.1")
    with pytest.raises(ValueError, match="clip_eps"):
        train.row("ppo/clip_eps=-1")
    from offpolicy_jax.demo.experiment import DemoConfig

    cfg = DemoConfig(algorithms=("ppo", "ppo/clip_eps=0.1"))
    assert cfg.algorithms == ("ppo", "ppo/clip_eps=0.1")


def test_vespo_row_builds_and_reports_its_metrics():
    """The demo's loss table gains a ``decoupled_ppo+mis/vespo`` row: it builds from the
    MIS row and its loss runs with the row's metric keys."""
    import offpolicy_jax as opj

    r = train.row("decoupled_ppo+mis/vespo")
    assert r.loss == opj.LossConfig(
        algorithm="decoupled_ppo", correction=train.MIS, policy_loss="vespo"
    )
    assert (r.loss.vespo_k_pos, r.loss.vespo_lambda_neg) == (2.0, 2.0) and r.mismatch
    keys = train.loss_metric_keys([r])
    assert {"vespo_phi", "vespo_clipfrac", "pg_loss"} <= set(keys) and "pg_clipfrac" not in keys


def test_dump_steps_spread_over_the_run():
    from offpolicy_jax.demo.experiment import DemoConfig, dump_steps

    assert dump_steps(300, 8) == (38, 75, 112, 150, 188, 225, 262, 300)
    assert dump_steps(4, 8) == (1, 2, 3, 4)
    assert dump_steps(10, 1) == (10,)
    with pytest.raises(ValueError, match="dump_steps"):
        DemoConfig(steps=5, dump_steps=(6,))
    assert cli.dump_name("ppo:no-mismatch", 2) == "ppo-no-mismatch_seed2.npz"
    assert cli.dump_name("decoupled_ppo+mis/gspo", 0) == "decoupled_ppo+mis-gspo_seed0.npz"


@pytest.mark.heavy
def test_sampler_logprobs_of_trainer_equal_the_engines():
    """Under a sampling mismatch the engine reports opj.token_logprobs(T, top-p); the
    trainer's sampler-consistent log-probs of the same tokens are the same numbers (up to
    float32 rounding of two differently fused forward passes), and its raw ones are not."""
    cfg = train.TrainConfig(d_model=16, prompt_len=3)
    mismatch = train.Mismatch("sampling", 2)  # T 1.5, top-p 0.9
    numerics = mismatch.numerics()
    graphdef, state = train.init_state(cfg, mismatch, [0])
    params = jax.tree.map(lambda x: x[0], state["params"])
    prompts = task.sample_prompts(jax.random.key(1), 32, cfg.prompt_len)

    @jax.jit
    def both():
        resp, rollout_logp = engine.generate(graphdef, params, prompts, jax.random.key(2), numerics)
        tokens = task.join(prompts, resp)
        sampler = (jnp.float32(numerics.temperature), jnp.float32(numerics.top_p))
        return (
            rollout_logp,
            train.token_logp(graphdef, params, tokens, cfg.prompt_len, sampler),
            train.token_logp(graphdef, params, tokens, cfg.prompt_len),
        )

    rollout_logp, consistent, raw = both()
    assert np.all(np.isfinite(rollout_logp))
    np.testing.assert_allclose(consistent, rollout_logp, rtol=0, atol=2e-6)  # f32 rounding
    assert np.abs(np.asarray(raw) - np.asarray(rollout_logp)).max() > 1e-2


@pytest.mark.slow
def test_tiny_sampler_run_has_no_mismatch_and_dumps_its_batches(tmp_path):
    """--trainer-logprobs sampler under --mismatch sampling: K3 is ~0 in every row; the
    dumps hold the batches trained on, as [steps, B, n] arrays that diagnose reads."""
    rows = "ppo:no-mismatch,ppo,decoupled_ppo+mis"
    dumps = tmp_path / "dumps"
    flags = ["--mismatch", "sampling", "--severity", "4", "--trainer-logprobs", "sampler"]
    flags += ["--algorithms", rows, "--dump-logprobs", str(dumps), "--dump-steps", "2"]
    proc = run_cli(tmp_path / "out", *flags)
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "out" / "metrics.csv") as f:
        metrics = list(csv.DictReader(f))
    assert all(abs(float(r["mis_k3_kl"])) < 1e-9 for r in metrics)
    assert all(float(r["nonfinite_seq_fraction"]) == 0.0 for r in metrics)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["config"]["train"]["trainer_logprobs"] == "sampler"
    assert summary["config"]["dump_steps"] == [2, 4]
    index = json.loads((dumps / "index.json").read_text())
    assert index["steps"] == [2, 4] and index["trainer_logprobs"] == "sampler"
    assert list(index["files"]) == rows.split(",")
    for files in index["files"].values():
        assert len(files) == 2  # seeds
        for name in files:
            with np.load(dumps / name) as d:
                assert d["old_logp"].shape == d["rollout_logp"].shape == (2, 16, 3)
                assert d["advantages"].shape == (2, 16)
                np.testing.assert_allclose(d["old_logp"], d["rollout_logp"], rtol=0, atol=2e-6)
                assert np.all(d["mask"] == 1)


# --------------------------------------------------------------------------- MoE, fp8


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_fp8_is_a_scaled_ml_dtypes_cast(fmt):
    """q(x) = s · fp8(x / s) with s = max|x| / F_max, the cast rounding as ml_dtypes does."""
    import ml_dtypes

    from offpolicy_jax.demo.model import quantize_fp8

    x = np.array(jax.random.normal(jax.random.key(0), (512,)), np.float32)
    x[:3] = [40.0, -1e-12, 0.0]  # an outlier, a value that flushes to 0, an exact 0
    dtype = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt]
    scale = np.float32(np.abs(x).max() / np.float32(ml_dtypes.finfo(dtype).max))
    expected = (x / scale).astype(dtype).astype(np.float32) * scale
    got = np.asarray(quantize_fp8(jnp.asarray(x), fmt))
    np.testing.assert_array_equal(got, expected)
    assert got[0] == 40.0 and got[1] == 0.0 and got[2] == 0.0
    assert len(np.unique(got)) < len(np.unique(x))  # it does round
    np.testing.assert_array_equal(quantize_fp8(jnp.zeros(4), fmt), np.zeros(4))


def _routed(top_k=1):
    cfg = train.TrainConfig(d_model=16, prompt_len=3, n_experts=4, top_k=top_k)
    graphdef, state = train.init_state(cfg, train.Mismatch("router", 30), [0])
    return cfg, graphdef, jax.tree.map(lambda x: x[0], state["params"])


@pytest.mark.heavy
def test_routing_replay_makes_engine_and_trainer_log_probs_equal():
    """A router-mismatched engine (same weights) flips some routes; the trainer replaying
    its routes computes its log-probs (K3 <= 1e-12), without replay it does not."""
    from offpolicy_jax.demo.model import Routing

    cfg, graphdef, params = _routed()
    prompts = task.sample_prompts(jax.random.key(1), 64, cfg.prompt_len)
    numerics = train.Mismatch("router", 30).numerics()
    n = cfg.prompt_len

    @jax.jit
    def both():
        resp, rollout_logp, routes = engine.generate_routed(
            graphdef, params, prompts, jax.random.key(2), numerics
        )
        tokens = task.join(prompts, resp)
        replayed = train.token_logp(
            graphdef, params, tokens, n, routing=Routing(routes=routes, replay=True)
        )
        own, own_routes = train.token_logp_and_routes(graphdef, params, tokens, n)
        return rollout_logp, replayed, own, routes, own_routes

    rollout_logp, replayed, own, routes, own_routes = map(np.asarray, both())
    assert routes.shape == (1, 64, 2 * n + 1, 1) and routes.dtype == np.int32

    def k3(a, b):
        d = a.astype(np.float64) - b
        return float(np.mean(np.exp(d) - d - 1))

    assert k3(replayed, rollout_logp) <= 1e-12
    flipped = (routes != own_routes)[0, :, n : 2 * n, 0]
    assert 0.05 < flipped.mean() < 0.9  # severity 30: about a third of the decisions
    assert k3(own, rollout_logp) > 1e-6
    # Only flipped positions differ (one layer: a route changes its own position's output).
    np.testing.assert_allclose(own[~flipped], rollout_logp[~flipped], rtol=0, atol=2e-6)


@pytest.mark.heavy
def test_routed_policy_trains():
    """A top-2 routed policy fits a batch of sequences: the loss falls over a few Adam
    steps and the router, the experts and attention all get gradient."""
    import optax
    from flax import nnx

    cfg, graphdef, params = _routed(top_k=2)
    tokens = task.join(*[task.sample_prompts(jax.random.key(3), 32, cfg.prompt_len)] * 2)
    tx = optax.adam(1e-2)

    def loss(p):
        return -jnp.mean(train.token_logp(graphdef, p, tokens, cfg.prompt_len))

    @jax.jit
    def step(p, opt):
        value, grads = jax.value_and_grad(loss)(p)
        updates, opt = tx.update(grads, opt, p)
        return optax.apply_updates(p, updates), opt, value, grads

    opt = tx.init(params)
    values = []
    for _ in range(4):
        params, opt, value, grads = step(params, opt)
        values.append(float(value))
    assert values[-1] < values[0] - 0.05, values
    flat = dict(nnx.to_flat_state(grads))
    moe = {"/".join(map(str, k)): v for k, v in flat.items() if "moe" in k}
    for name in ("router/kernel", "w_up", "w_down"):
        g = next(v for k, v in moe.items() if name in k)
        assert float(jnp.abs(g[...]).max()) > 0, name


@pytest.mark.heavy
def test_fp8_engine_differs_a_little_and_e5m2_more():
    """The fp8 engine's forward pass (fp8 weights and matmul inputs, bf16 rest) is close
    to the trainer's, e5m2 (2 mantissa bits) farther than e4m3 (3 bits)."""
    from flax import nnx

    cfg, graphdef, params = _routed()
    tokens = task.join(*[task.sample_prompts(jax.random.key(1), 16, cfg.prompt_len)] * 2)
    exact = nnx.merge(graphdef, params)(tokens)

    @functools.partial(jax.jit, static_argnums=0)
    def gap(fmt):
        quantized, rnd, quant = engine._fp8_numerics(params, fmt, True)
        logits = nnx.merge(graphdef, quantized)(tokens, rnd, quant=quant)
        return jnp.abs(jax.nn.log_softmax(logits) - jax.nn.log_softmax(exact)).mean()

    e4m3, e5m2 = float(gap("e4m3")), float(gap("e5m2"))
    assert 0 < e4m3 < e5m2 < 0.5


def test_replay_rows_and_the_routing_replay_flag():
    r = train.row("decoupled_ppo+tis2+replay/clip_eps=0.1")
    assert (
        r.routing_replay
        and r.loss.correction == train.ALGORITHMS["decoupled_ppo+tis2"].loss.correction
    )
    assert not train.row("decoupled_ppo+tis2").routing_replay
    with pytest.raises(ValueError, match="nothing to replay"):
        train.row("ppo:no-mismatch+replay")
    assert cli._with_replay("decoupled_ppo+tis2/gspo") == "decoupled_ppo+tis2+replay/gspo"
    assert cli._with_replay("ppo:no-mismatch") == "ppo:no-mismatch"
    assert cli._with_replay("ppo+replay") == "ppo+replay"


@pytest.mark.slow  # an end-to-end routed run (~30 s)
def test_tiny_routed_run_with_replay(tmp_path):
    """--experts, --mismatch router, --routing-replay: the replay rows have no mismatch
    (K3 ~ 0, weights 1) while routes still differ; the table has the routing columns."""
    flags = ["--experts", "4", "--mismatch", "router", "--severity", "30", "--routing-replay"]
    flags += ["--algorithms", "ppo:no-mismatch,ppo,decoupled_ppo+icepop", "--max-grad-norm", "0"]
    proc = run_cli(tmp_path, *flags)
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "metrics.csv") as f:
        metrics = list(csv.DictReader(f))
    replay = [r for r in metrics if r["algorithm"].endswith("+replay")]
    assert {r["algorithm"] for r in replay} == {"ppo+replay", "decoupled_ppo+icepop+replay"}
    assert all(abs(float(r["mis_k3_kl"])) < 1e-9 for r in replay)
    assert any(float(r["route_flip_fraction"]) > 0 for r in replay)
    assert "routes differ" in (tmp_path / "results.md").read_text()


def test_diagnose_heavy_tail_section():
    """diagnose's heavy-tail summary: 1% of tokens at |log ρ| = 3 and the rest near 0 is
    heavy-tailed (quantiles, tail share); a smooth N(0, 0.3) mismatch is not."""
    from offpolicy_jax.diagnose import analysis, report

    edges = analysis.delta_bin_edges()
    rng = np.random.default_rng(0)
    spiky = np.concatenate([rng.normal(0, 1e-3, 9900), np.full(50, 3.0), np.full(50, -3.0)])
    smooth = rng.normal(0, 0.3, 10000)
    worst = [{"abs_log_ratio": 3.0}]
    tail = report.heavy_tail(np.histogram(spiky, edges)[0], worst)
    assert tail["heavy"] and tail["tail_token_share"] == pytest.approx(0.01)
    assert tail["tail_abs_log_ratio_share"] > 0.9
    q = tail["weight_quantiles"]
    assert q["0.5"] == pytest.approx(1.0, abs=0.01)
    assert q["0.999"] == pytest.approx(np.exp(3.0), rel=0.15)  # log bins: ±6% in δ
    assert q["0.001"] == pytest.approx(np.exp(-3.0), rel=0.15)
    calm = report.heavy_tail(np.histogram(smooth, edges)[0], worst)
    assert not calm["heavy"] and calm["tail_token_share"] < 0.01
    text = "\n".join(report._heavy_tail_lines(tail))
    assert "Heavy-tailed" in text and "routing replay" in text
    # A severe but discrete mismatch (exact bulk) gets the per-token cap, not rejection.
    assert tail["discrete"] and not calm["discrete"]
    severe = {"mis_k3_kl": 0.05}
    rec = report.recommend(severe, {}, tail)
    assert (rec["name"], rec["severity"]) == ("token_tis", "severe")
    assert report.recommend(severe, {}, calm)["name"] in ("geo_rs_veto", "mis")
    assert report.recommend(severe, {})["name"] in ("geo_rs_veto", "mis")
