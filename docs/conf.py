"""Sphinx configuration of the offpolicy-jax documentation site.

Build: ``pip install -e ".[docs]"`` then ``python -m sphinx -W -b html docs DIR``.
Pages are MyST Markdown; the notebooks (``docs/notebooks`` links to ``notebooks/``) are
rendered with myst-nb from their stored outputs, not executed; the API reference is
generated from the Google-style docstrings (autodoc + napoleon, one page per public
name via autosummary).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # document this checkout, installed or not

import offpolicy_jax  # noqa: E402

project = "offpolicy-jax"
author = "offpolicy-jax developers"
copyright = "offpolicy-jax developers"
release = offpolicy_jax.__version__
version = release

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "_templates", "**.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]

# Markdown (MyST): $…$ math, ::: fences, and anchors for headings down to ###, so that
# pages link to sections as [text](page.md#heading-slug).
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# Notebooks are rendered from their stored outputs: executing them would train models.
nb_execution_mode = "off"

# API reference: one page per public name, documented from its Google-style docstring.
autosummary_generate = True
templates_path = ["_templates"]
# The docstrings' Args give each argument's type and shape in words; the annotations
# (jax.typing.ArrayLike expands to eight types) would only repeat them, less readably.
autodoc_typehints = "none"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# "Attributes:" sections as fields of the class, so that autodoc's own entries for the
# same attributes are not a second description of them.
napoleon_use_ivar = True

# The tunix integration's pages are built without tunix (its own environment pins its own
# stack): autodoc imports the module against stand-ins for tunix's modules.
autodoc_mock_imports = ["tunix"]

html_theme = "furo"
html_title = f"offpolicy-jax {release}"
html_static_path: list[str] = []


# --------------------------------------------------------------------------- semantics links
# Docstrings cite the specification as "docs/semantics.md §N". On the site each such
# citation becomes a link to that section: the sections of semantics.md get the labels
# ``semantics-N`` (from their "§N" titles), and the docstrings' citations are rewritten
# to :ref: roles while autodoc reads them.

_SECTIONS = set(
    re.findall(r"^#+ §(\d+(?:\.\d+)?) ", (ROOT / "docs" / "semantics.md").read_text(), re.M)
)
_CITATION = re.compile(r"docs/semantics\.md((?:(?:,| and|, and)? §\d+(?:\.\d+)*)+)")
_SECTION_REF = re.compile(r"§(\d+(?:\.\d+)*)")


def _label(number: str) -> str | None:
    """The label of section ``number`` of semantics.md, or of the section holding it."""
    while number:
        if number in _SECTIONS:
            return f"semantics-{number}"
        number = number.rpartition(".")[0]
    return None


def _link_citation(match: re.Match) -> str:
    """``docs/semantics.md §3, §5`` -> one :ref: per section, separators kept."""
    text = match.group(1)
    out, pos = [], 0
    for k, ref in enumerate(_SECTION_REF.finditer(text)):
        out.append(text[pos : ref.start()] if k else "")
        shown = ("docs/semantics.md " if k == 0 else "") + ref.group(0)
        label = _label(ref.group(1))
        out.append(f":ref:`{shown} <{label}>`" if label else shown)
        pos = ref.end()
    return "".join(out) + text[pos:]


def _link_semantics(app, what, name, obj, options, lines) -> None:
    for i, line in enumerate(lines):
        if "docs/semantics.md §" in line:
            lines[i] = _CITATION.sub(_link_citation, line)


def _label_semantics_sections(app, doctree) -> None:
    """Labels ``semantics-N`` for the "§N ..." sections of semantics.md."""
    from docutils import nodes

    if app.env.docname != "semantics":
        return
    std = app.env.get_domain("std")
    for section in doctree.findall(nodes.section):
        found = re.match(r"§(\d+(?:\.\d+)?)\s", section[0].astext())
        if found and section["ids"]:
            label = f"semantics-{found.group(1)}"
            std.anonlabels[label] = ("semantics", section["ids"][0])
            std.labels[label] = ("semantics", section["ids"][0], section[0].astext())


def setup(app) -> None:
    app.connect("autodoc-process-docstring", _link_semantics)
    app.connect("doctree-read", _label_semantics_sections)
