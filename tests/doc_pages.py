"""The documentation as the tests read it: README.md and the Markdown pages of docs/.

Code blocks marked with an HTML comment (``<!-- doc-test -->``, ``<!-- mesh-example: PATH
-->``, ...) just before their fence are run or compared by the tests.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def pages() -> list[Path]:
    """README.md, then every Markdown page under docs/ (sorted)."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def text() -> str:
    """All of the documentation's Markdown, one page after another."""
    return "\n".join(p.read_text(encoding="utf-8") for p in pages() if p.is_file())


def marked_blocks(marker: str, path: Path | None = None, lang: str = "python") -> list[str]:
    """The fenced ``lang`` blocks right after ``<!-- MARKER ... -->`` (in ``path``, or in
    every page), in order; a pattern group in ``marker`` makes the result its matches."""
    source = path.read_text(encoding="utf-8") if path is not None else text()
    return re.findall(rf"<!-- {marker}[^>]*-->\s*```{lang}\n(.*?)```", source, flags=re.S)
