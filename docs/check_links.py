"""Checks the links inside a built copy of this site, without the network.

    python docs/check_links.py BUILD_DIR

Every relative ``href`` and ``src`` of every HTML page must lead to a file of the
build, and every ``#fragment`` to an ``id`` (or ``name``) on the page it points to;
every name of ``offpolicy_jax.__all__`` must have its API page. External links
(``http:``, ``mailto:``, ...) are not followed. Prints each broken link and exits 1 if
there is any.
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

API_PAGE = "api/generated/offpolicy_jax.{name}.html"


class _Page(HTMLParser):
    """The ids a page defines and the links it makes."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        for key in ("id", "name"):
            if values.get(key):
                self.ids.add(str(values[key]))
        for key in ("href", "src"):
            if tag in ("a", "img", "link", "script") and values.get(key):
                self.links.append(str(values[key]))


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8", errors="replace"))
    return page


def _site_pages(root: Path) -> list[Path]:
    """The site's HTML pages; ``_static`` holds the theme's template fragments."""
    return [p for p in sorted(root.rglob("*.html")) if "_static" not in p.relative_to(root).parts]


def broken_links(root: Path) -> list[str]:
    """``"page: link (reason)"`` for every internal link of the build that leads nowhere."""
    pages = {p: _parse(p) for p in _site_pages(root)}
    problems = []
    for path, page in pages.items():
        for link in page.links:
            parts = urlsplit(link)
            if parts.scheme or link.startswith("//"):
                continue  # external: not checked without the network
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            where = f"{path.relative_to(root)}: {link}"
            if not target.exists():
                problems.append(f"{where} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    problems.append(f"{where} (no anchor #{parts.fragment})")
    return problems


def missing_api_pages(root: Path) -> list[str]:
    """The names of ``offpolicy_jax.__all__`` without an API page in the build."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import offpolicy_jax

    return [n for n in offpolicy_jax.__all__ if not (root / API_PAGE.format(name=n)).is_file()]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    root = Path(argv[0]).resolve()
    if not (root / "index.html").is_file():
        print(f"check_links: {root} holds no built site (no index.html)", file=sys.stderr)
        return 2
    problems = broken_links(root)
    problems += [f"no API page for offpolicy_jax.{n}" for n in missing_api_pages(root)]
    for problem in problems:
        print(f"check_links: {problem}")
    count = len(_site_pages(root))
    print(f"check_links: {count} pages, {len(problems)} broken link(s) or missing page(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
