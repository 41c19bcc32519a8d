"""The command line's entry points work with the extras they name, and no more.

``--help`` and ``--version`` need no extra; a subcommand whose extra is missing exits 2
with one line naming it; ``import offpolicy_jax`` pulls in none of the extras' packages.
A missing package is simulated with ``sys.modules[name] = None`` (what an uninstalled
module looks like to ``import`` and ``importlib.util.find_spec``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from offpolicy_jax import cli

EXTRA_PACKAGES = ("flax", "optax", "matplotlib", "pyarrow", "tqdm")
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )


def _without(monkeypatch, *names: str) -> None:
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)
    # A subcommand imported by an earlier test in this process would hide the missing extra.
    for module in [
        m for m in sys.modules if m.startswith(("offpolicy_jax.demo", "offpolicy_jax.diagnose"))
    ]:
        monkeypatch.delitem(sys.modules, module)


def test_import_pulls_in_no_extra():
    proc = _python(
        "import sys, offpolicy_jax\n"
        f"print(sorted(m for m in {EXTRA_PACKAGES!r} if m in sys.modules))"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("flag", ["--version", "--help"])
def test_version_and_help_need_no_extra(flag, monkeypatch, capsys):
    _without(monkeypatch, *EXTRA_PACKAGES)
    with pytest.raises(SystemExit) as e:
        cli.main([flag])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "offpolicy-jax" in out and ("demo" in out or flag == "--version")


@pytest.mark.parametrize(
    ("command", "absent"), [("demo", ("optax",)), ("diagnose", ("pyarrow", "tqdm"))]
)
def test_missing_extra_is_one_line_naming_it(command, absent, monkeypatch, capsys, tmp_path):
    _without(monkeypatch, *absent)
    with pytest.raises(SystemExit) as e:
        cli.main(
            [command, "--out", str(tmp_path / "o"), *(["x.npz"] if command == "diagnose" else [])]
        )
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("offpolicy-jax: error: ")
    assert f"[{command}]" in err and all(name in err for name in absent)
    assert not (tmp_path / "o").exists()


def test_diagnose_help_with_its_extra_alone(monkeypatch, capsys):
    _without(monkeypatch, "flax", "optax")  # the demo's packages
    with pytest.raises(SystemExit) as e:
        cli.main(["diagnose", "--help"])
    assert e.value.code == 0
    assert "usage: offpolicy-jax diagnose" in capsys.readouterr().out


def test_command_help_without_any_extra(monkeypatch, capsys):
    """diagnose lists its options without its extra; the demo's options need the demo
    (its presets), so its --help names the extra instead of a traceback."""
    _without(monkeypatch, *EXTRA_PACKAGES)
    with pytest.raises(SystemExit) as e:
        cli.main(["diagnose", "--help"])
    assert e.value.code == 0 and "usage: offpolicy-jax diagnose" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--help"])
    assert e.value.code == 2 and "[demo]" in capsys.readouterr().err


@pytest.mark.heavy
def test_python_dash_m_entry_points():
    for module, args in (("offpolicy_jax", ["--version"]), ("offpolicy_jax.diagnose", ["--help"])):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run(
            [sys.executable, "-m", module, *args],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr
        assert "offpolicy-jax" in proc.stdout


def test_unknown_and_missing_command(capsys):
    for argv in (["train"], []):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "demo, diagnose" in err.replace("'", "")
