"""The code's shape: no function of the package is longer than a screen.

A function's length is its lines of code: docstrings, comments and blank lines aside,
nested functions counted inside the function that holds them.
"""

from __future__ import annotations

import ast
import io
import pathlib
import tokenize

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "src" / "offpolicy_jax"
MAX_LINES = 80


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def _code_lines(source: str) -> set[int]:
    skip = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    }
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines


def function_lengths(path: pathlib.Path) -> list[tuple[str, int, int]]:
    """``(name, first line, lines of code)`` of every function in ``path``."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    code = _code_lines(source) - _docstring_lines(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            span = range(node.lineno, (node.end_lineno or node.lineno) + 1)
            out.append((node.name, node.lineno, sum(1 for line in span if line in code)))
    return out


def test_the_counter_counts_code_not_docstrings_or_comments(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text(
        'def f(x):\n    """Doc.\n\n    More doc.\n    """\n    # why\n\n    y = (x +\n         1)\n'
        "    def g():\n        return y\n    return g\n"
    )
    assert function_lengths(sample) == [("f", 1, 6), ("g", 10, 2)]  # g inside f


@pytest.mark.parametrize(
    "path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE))
)
def test_no_function_is_longer_than_a_screen(path):
    long = [(n, line, k) for n, line, k in function_lengths(path) if k > MAX_LINES]
    assert not long, f"functions over {MAX_LINES} lines of code in {path.name}: {long}"


# The core's data types and the plan the config resolves into: every field has a type a
# checker can follow (``LossConfig.params`` is a config's, typed per surrogate through its
# hyperparameter attributes).
TYPED = [
    *sorted((PACKAGE / "_src" / "losses").glob("*.py")),
    *sorted((PACKAGE / "_src" / "correction").glob("*.py")),
    *sorted((PACKAGE / "_src" / "reduction").glob("*.py")),
    PACKAGE / "_src" / "config" / "plan.py",
]


def any_fields(path: pathlib.Path) -> list[str]:
    """``Class.field`` of every class-body annotation in ``path`` that mentions ``Any``
    (``ClassVar`` declarations aside)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                    continue
                names = {n.id for n in ast.walk(item.annotation) if isinstance(n, ast.Name)}
                if "Any" in names and "ClassVar" not in names:
                    out.append(f"{node.name}.{item.target.id}")
    return out


def test_the_any_finder_finds_an_any_field(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text(
        "class A:\n    x: Any\n    y: int | None\n    z: ClassVar[dict[str, Any]]\n"
        "    w: Mapping[str, Any] | None = None\n"
    )
    assert any_fields(sample) == ["A.x", "A.w"]


@pytest.mark.parametrize("path", TYPED, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_core_data_types_have_no_any_field(path):
    assert any_fields(path) == []
