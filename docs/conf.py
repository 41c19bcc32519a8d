"""Sphinx configuration of the offpolicy-jax documentation site.

Build: ``pip install -e ".[docs]"`` then ``python -m sphinx -W -b html docs DIR``.
Pages are MyST Markdown; the notebooks (``docs/notebooks`` links to ``notebooks/``) are
rendered with myst-nb from their stored outputs, not executed; the API reference is
generated from the Google-style docstrings (autodoc + napoleon, one page per public
name via autosummary).
"""

from __future__ import annotations

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

html_theme = "furo"
html_title = f"offpolicy-jax {release}"
html_static_path: list[str] = []
