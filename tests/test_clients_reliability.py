"""Regression tests of the clients: diagnose, the demo's summary, the tunix example, install.

Each test failed on the code before its fix: a traceback or a plausible answer where a
one-line error or an honest report belongs.
"""

from __future__ import annotations

import json
import math
import pathlib
import re

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


# --------------------------------------------------------------------------- tunix


def test_tunix_example_patches_no_private_tunix_method():
    import ast

    tree = ast.parse((ROOT / "examples" / "tunix_grpo.py").read_text())
    private = [
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not (node.attr.startswith("__") and node.attr.endswith("__"))
    ]
    assert private == []  # was trainer._post_process_train_step, replaced in place


@pytest.mark.slow  # a tunix GRPO run (about 40 s on CPU)
def test_tunix_example_runs_a_verl_preset_without_a_veto():
    pytest.importorskip("tunix")
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    argv = [sys.executable, "-W", "ignore", str(ROOT / "examples" / "tunix_grpo.py")]
    result = subprocess.run(
        [*argv, "--steps", "1", "--correction", "decoupled_token_is"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    # Was KeyError: 'opj/mis_rs_catastrophic_seq_fraction', and "with the mis correction".
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step 1: " in result.stdout and "mis_k3_kl=" in result.stdout
    assert "mis_rs_catastrophic" not in result.stdout
    assert "done: trained 1 steps with the 'decoupled_token_is' correction" in result.stdout


def test_tunix_step_metrics_hook_reports_the_keys_that_were_logged():
    pytest.importorskip("tunix")
    from tunix.sft import metrics_logger

    from offpolicy_jax.integrations import tunix as otx

    logger = metrics_logger.MetricsLogger()
    mode = metrics_logger.Mode.TRAIN
    for step, value in ((1, 0.25), (2, 0.5)):
        logger.log("actor", "opj/mis_k3_kl", np.float32(value), mode, step)

    class Trainer:  # what tunix's PeftTrainer hands its hooks
        metrics_logger = logger
        metrics_prefix = "actor"

    seen = []
    hook = otx.StepMetricsHook(
        ["opj/mis_k3_kl", "opj/mis_rs_catastrophic_seq_fraction"],
        lambda step, metrics: seen.append((step, metrics)),
    )
    hook.on_train_step_end(Trainer(), 2, np.float32(1.5))
    assert seen == [(2, {"loss": 1.5, "opj/mis_k3_kl": 0.5})]  # the veto key: absent, no error


# --------------------------------------------------------------------------- docs


def _public_names(path: pathlib.Path) -> list[str]:
    import ast

    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__":
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"no __all__ in {path}")


def test_api_index_documents_the_tunix_integration_and_no_cli_internals():
    index = (ROOT / "docs" / "api" / "index.md").read_text()
    assert ".. currentmodule:: offpolicy_jax.integrations.tunix" in index
    section = index.split(".. currentmodule:: offpolicy_jax.integrations.tunix", 1)[1]
    listed = section.split("```", 1)[0]
    names = _public_names(ROOT / "src" / "offpolicy_jax" / "integrations" / "tunix.py")
    constants = {"METRIC_PREFIX", "POLICY_LOSS_NAME"}  # named in the section's text
    for name in names:
        assert (name in listed) if name not in constants else (name in index), name
    # Was ".. automodule:: offpolicy_jax.cli" with main, missing_extra, EXTRAS.
    assert "offpolicy_jax.cli" not in index and "missing_extra" not in index


def _conf():
    source = (ROOT / "docs" / "conf.py").read_text()
    namespace = {"__file__": str(ROOT / "docs" / "conf.py"), "__name__": "conf"}
    exec(compile(source, "docs/conf.py", "exec"), namespace)
    return namespace


def test_semantics_citations_are_links_on_the_site():
    import re

    conf = _conf()
    # Docstrings: rewritten to :ref: roles to labels of semantics.md's sections.
    lines = ["rejected (docs/semantics.md §3, §5.2) and docs/semantics.md §3.6."]
    conf["_link_semantics"](None, "function", "f", None, {}, lines)
    assert lines == [
        "rejected (:ref:`docs/semantics.md §3 <semantics-3>`, :ref:`§5.2 <semantics-5.2>`)"
        " and :ref:`docs/semantics.md §3.6 <semantics-3>`."
    ]
    headings = re.findall(
        r"^#+ §(\d+(?:\.\d+)?) ", (ROOT / "docs" / "semantics.md").read_text(), re.M
    )
    assert set(headings) == conf["_SECTIONS"] and {"0", "5.1", "10"} <= set(headings)
    # Markdown pages: every citation is the text of a link, not plain text.
    for page in (ROOT / "docs").rglob("*.md"):
        for match in re.finditer(r"docs/semantics\.md §", page.read_text()):
            before = page.read_text()[max(0, match.start() - 1) : match.start()]
            # A link's text, or the code span that shows the citation's form.
            assert before in "[`", f"{page}: plain-text citation at {match.start()}"


def test_source_paths_named_in_the_docs_exist():
    import re

    pattern = re.compile(r"`(?:src/)?(offpolicy_jax/[A-Za-z0-9_/]+\.(?:py|yaml))`")
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    missing = [
        f"{page.relative_to(ROOT)}: {path}"
        for page in pages
        for path in pattern.findall(page.read_text())
        if not (ROOT / "src" / path).exists()
    ]
    assert missing == []  # were _objective.py, logprobs.py, policy_losses.py, verl.py


# --------------------------------------------------------------------------- install


def test_install_instructions_do_not_promise_pypi(capsys):
    from offpolicy_jax import cli

    promise = re.compile(r"pip install \"?offpolicy-jax\b")
    for page in ("README.md", "docs/guide/tunix.md", "examples/tunix_grpo.py"):
        text = (ROOT / page).read_text()
        assert not [
            m.group(0)
            for m in promise.finditer(text)
            if "does not" not in text[m.start() - 80 : m.start()]
        ], page
    for module in ("integrations/__init__.py", "integrations/optax.py", "cli.py"):
        assert not promise.search((ROOT / "src" / "offpolicy_jax" / module).read_text()), module
    with pytest.raises(SystemExit):
        cli._needs_extra("demo", ["flax"])
    message = capsys.readouterr().err.strip()
    assert len(message.splitlines()) == 1
    assert 'pip install -e ".[demo]"' in message and "not on PyPI" in message
    assert 'pip install "offpolicy-jax[demo]"' not in message  # was the first advice


def test_ci_builds_the_sdist_and_wheel_and_runs_the_readme_example_with_each():
    script = (ROOT / ".ci" / "run").read_text()
    block = script.split("== packaging:", 1)[1].split("== docs:", 1)[0]
    assert "python -m build" in block and "readme-test" in block
    assert "*.whl" in block and "*.tar.gz" in block and "python3 -m venv" in block
    pyproject = (ROOT / "pyproject.toml").read_text()
    dev = next(line for line in pyproject.splitlines() if line.startswith("dev = "))
    assert '"build' in dev
