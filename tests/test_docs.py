"""The documentation covers what it must: every public name has an API page, the layout
names every module, README.md stays a front page whose links lead somewhere, and the
site's link checker finds broken links (the Sphinx build itself runs in .ci/run)."""

from __future__ import annotations

import importlib.util
import re

import pytest
from doc_pages import DOCS, README, ROOT

import offpolicy_jax

API_INDEX = DOCS / "api" / "index.md"


def _autosummary_names(module: str) -> set[str]:
    """Names listed in the autosummary blocks of docs/api/index.md under ``module``."""
    names: set[str] = set()
    for block in re.findall(r"```\{eval-rst\}\n(.*?)```", API_INDEX.read_text(), re.S):
        current = re.search(r"\.\. currentmodule:: (\S+)", block)
        if current is None or current.group(1) != module or "autosummary::" not in block:
            continue
        entries = block.split("autosummary::", 1)[1].splitlines()
        names |= {e.strip() for e in entries if e.strip() and not e.strip().startswith(":")}
    return names


def test_every_public_name_has_an_api_page():
    listed = _autosummary_names("offpolicy_jax")
    missing = sorted(set(offpolicy_jax.__all__) - listed)
    assert not missing, f"add {missing} to an autosummary list of docs/api/index.md"
    unknown = sorted(listed - set(offpolicy_jax.__all__))
    assert not unknown, f"docs/api/index.md lists names outside offpolicy_jax.__all__: {unknown}"


def test_every_public_name_has_a_docstring():
    bare = [n for n in offpolicy_jax.__all__ if not (getattr(offpolicy_jax, n).__doc__ or "")]
    assert not bare or bare == ["METRIC_LOG_CAP"], bare


def test_layout_names_every_module():
    layout = (DOCS / "development.md").read_text().split("## Layout", 1)[1]
    package = ROOT / "src" / "offpolicy_jax"
    subpackages = [p for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    modules = [p.name for p in package.glob("*.py")] + [f"{p.name}/" for p in subpackages]
    core = package / "_src"
    modules += [p.name for p in core.glob("*.py") if p.name != "__init__.py"]
    modules += [  # the layers' modules (demo/ and diagnose/ are described as a whole)
        m.name
        for sub in [*subpackages, *(p for p in core.iterdir() if (p / "__init__.py").exists())]
        if sub.name in ("config", "correction", "losses", "logprobs", "interop", "reduction")
        for m in sub.glob("*.py")
        if m.name != "__init__.py"
    ]
    missing = [m for m in sorted(modules) if not re.search(rf"^\s+{re.escape(m)}", layout, re.M)]
    assert not missing, f"docs/development.md's layout does not name {missing}"


def test_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert "<!-- quickstart" in text and 'CorrectionConfig.preset("mis")' in text
    for target in re.findall(r"\]\(((?:docs/)[^)#]+)", text):
        assert (ROOT / target).is_file(), f"README links to a missing {target}"


def test_every_guide_page_is_reachable_from_the_toctree():
    index = (DOCS / "index.md").read_text()
    assert "guide/*" in index  # the glob picks up pages added under docs/guide/
    for page in ("getting_started", "entry_points", "demo", "diagnose", "benchmarks"):
        assert f"\n{page}\n" in index, page
    for page in ("semantics", "api/index", "coming_from"):
        assert f"\n{page}\n" in index, page


def _link_checker():
    spec = importlib.util.spec_from_file_location("check_links", DOCS / "check_links.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_link_checker_finds_missing_pages_and_anchors(tmp_path):
    check = _link_checker()
    (tmp_path / "a.html").write_text(
        '<h1 id="top">A</h1><a href="b.html#there">ok</a><a href="#top">self</a>'
        '<a href="https://example.org/x">external</a>'
    )
    (tmp_path / "b.html").write_text(
        '<p id="there"></p><a href="c.html">gone</a><a href="a.html#nowhere">bad anchor</a>'
    )
    problems = check.broken_links(tmp_path)
    assert problems == [
        "b.html: c.html (no such file)",
        "b.html: a.html#nowhere (no anchor #nowhere)",
    ]
    assert set(check.missing_api_pages(tmp_path)) == set(offpolicy_jax.__all__)


@pytest.mark.parametrize("name", ["getting_started.md", "entry_points.md", "guide/losses.md"])
def test_pages_have_a_title(name):
    assert (DOCS / name).read_text().startswith("# ")
