"""One public surface: what ``offpolicy_jax`` and its public packages export (``__all__``).

The clients (the demo, diagnose, the command line, the integrations), the guides' code
blocks, the examples and the notebooks import only exported names, like any user's
code; every public package declares ``__all__`` and every name in it exists. The
imports are read from the source (``ast``), so modules whose extra is not installed
(tunix, optax) are checked too.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

import pytest
from doc_pages import pages

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
LIB = "offpolicy_jax"

# The public packages and modules; a submodule a public package lists in its
# ``__all__`` (``offpolicy_jax.interop.verl``) is public too. Everything else is internal.
PUBLIC_PACKAGES = (
    LIB,
    f"{LIB}.config",
    f"{LIB}.correction",
    f"{LIB}.demo",
    f"{LIB}.diagnose",
    f"{LIB}.integrations",
    f"{LIB}.interop",
    f"{LIB}.logprobs",
    f"{LIB}.losses",
    f"{LIB}.reduction",
)
PUBLIC_MODULES = (
    *PUBLIC_PACKAGES,
    f"{LIB}.integrations.optax",
    f"{LIB}.integrations.tunix",
    f"{LIB}.objectives",
    f"{LIB}.rules",
)
# A client may import its own package's internals; a module of the command line (a
# subcommand's ``cli``, a ``__main__``) also those of offpolicy_jax.cli.
CLIENT_PACKAGES = (f"{LIB}.demo", f"{LIB}.diagnose", f"{LIB}.integrations")
COMMAND_LINE = (f"{LIB}.cli", f"{LIB}.__main__")


def _module_file(module: str) -> Path | None:
    base = SRC.joinpath(*module.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _declared_all(module: str) -> list[str] | None:
    """The module's ``__all__`` as its source declares it (None: no ``__all__``)."""
    path = _module_file(module)
    if path is None:
        return None
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            value = ast.literal_eval(node.value)  # type: ignore[attr-defined]
            return list(value)
    return None


def _is_public_module(module: str) -> bool:
    if module in PUBLIC_MODULES or "." not in module:
        return module in PUBLIC_MODULES
    parent, _, name = module.rpartition(".")
    return (
        _is_public_module(parent)
        and name in (_declared_all(parent) or [])
        and _module_file(module) is not None
    )


def _free(importer: str | None, module: str) -> bool:
    """Whether ``importer`` (a client module, None for user code) may import ``module``'s
    internals: its own package's, or the command line's for a command-line module."""
    if importer is None:
        return False
    inside = [p for p in CLIENT_PACKAGES if importer == p or importer.startswith(p + ".")]
    if importer in COMMAND_LINE or importer.endswith((".cli", ".__main__")):
        inside += [f"{LIB}.cli"]
    return any(module == p or module.startswith(p + ".") for p in inside)


def _check_name(module: str, name: str) -> str | None:
    """None if ``from module import name`` uses the public surface, else the problem."""
    if name.startswith("__") and name.endswith("__"):
        return None  # __version__ and the like
    if name in (_declared_all(module) or []):
        return None
    if _is_public_module(f"{module}.{name}"):
        return None
    return f"{module}.{name} is not exported (not in {module}.__all__)"


def _resolve(importer: str | None, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    assert importer is not None, "a relative import outside the package"
    is_package = _module_file(importer) == SRC.joinpath(*importer.split("."), "__init__.py")
    base = importer.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def surface_problems(source: str, importer: str | None = None) -> list[str]:
    """What ``source`` imports (or reaches as ``opj.NAME``) outside the public surface."""
    tree = ast.parse(source)
    problems: list[str] = []
    bound: dict[str, str] = {}  # local name -> the public module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                module = alias.name
                if module.split(".")[0] != LIB or _free(importer, module):
                    continue
                if not _is_public_module(module):
                    problems.append(f"import {module}: not a public module")
                elif alias.asname:
                    bound[alias.asname] = module
                else:
                    bound[LIB] = LIB
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(importer, node)
            if module.split(".")[0] != LIB or _free(importer, module):
                continue
            if not _is_public_module(module):
                problems.append(f"from {module} import ...: not a public module")
                continue
            for alias in node.names:
                if alias.name == "*":
                    problems.append(f"from {module} import *")
                    continue
                problem = _check_name(module, alias.name)
                if problem:
                    problems.append(problem)
                elif _is_public_module(f"{module}.{alias.name}"):
                    bound[alias.asname or alias.name] = f"{module}.{alias.name}"
    problems += _attribute_problems(tree, bound)
    return problems


def _attribute_problems(tree: ast.AST, bound: dict[str, str]) -> list[str]:
    """``opj.NAME`` (and ``opj.rules.NAME``, ...) on a name bound to a public module."""
    problems = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = [node.attr]
        value = node.value
        while isinstance(value, ast.Attribute):
            chain.insert(0, value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in bound:
            continue
        module = bound[value.id]
        for name in chain:
            problem = _check_name(module, name)
            if problem:
                problems.append(problem)
                break
            if not _is_public_module(f"{module}.{name}"):
                break  # an exported object: its attributes are its own
            module = f"{module}.{name}"
    return sorted(set(problems))


# --------------------------------------------------------------------------- sources


def _client_modules() -> list[tuple[str, Path]]:
    package = SRC / LIB
    files = [package / "cli.py", package / "__main__.py"]
    for sub in ("demo", "diagnose", "integrations"):
        files += sorted((package / sub).rglob("*.py"))
    return [(".".join(p.relative_to(SRC).with_suffix("").parts), p) for p in files]


def _doc_blocks() -> list[tuple[str, str]]:
    """(page, python code block) of README.md and every page of docs/."""
    blocks = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        for block in re.findall(r"```(?:python|py)\n(.*?)```", text, flags=re.S):
            blocks.append((str(page.relative_to(ROOT)), block))
    return blocks


def _parseable(code: str) -> str:
    """The code, or (a fragment with ``...`` elisions or ``>>>`` prompts) its import lines."""
    lines = [re.sub(r"^(>>>|\.\.\.) ?", "", line) for line in code.splitlines()]
    code = "\n".join(line for line in lines if not line.lstrip().startswith(("%", "!")))
    try:
        ast.parse(code)
        return code
    except SyntaxError:
        imports = re.findall(r"^\s*((?:from|import) offpolicy_jax[^\n(]*)$", code, flags=re.M)
        uses = re.findall(r"\bopj(?:\.\w+)+", code)
        return "\n".join([s.strip() for s in imports] + uses)


def _notebook_code(path: Path) -> str:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


CLIENTS = _client_modules()
DOC_BLOCKS = _doc_blocks()
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize(("module", "path"), CLIENTS, ids=[m for m, _ in CLIENTS])
def test_clients_import_only_the_public_surface(module, path):
    problems = surface_problems(path.read_text(encoding="utf-8"), importer=module)
    assert not problems, f"{path.relative_to(ROOT)}: {problems}"


def test_guides_import_only_the_public_surface():
    assert len(DOC_BLOCKS) > 20
    problems = []
    for page, block in DOC_BLOCKS:
        problems += [f"{page}: {p}" for p in surface_problems(_parseable(block))]
    assert not problems, problems


@pytest.mark.parametrize("path", EXAMPLES + NOTEBOOKS, ids=lambda p: p.name)
def test_examples_and_notebooks_import_only_the_public_surface(path):
    code = path.read_text(encoding="utf-8") if path.suffix == ".py" else _notebook_code(path)
    problems = surface_problems(_parseable(code))
    assert not problems, f"{path.relative_to(ROOT)}: {problems}"


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_module_declares_all(module):
    exported = _declared_all(module)
    assert exported is not None, f"{module} declares no __all__"
    assert len(exported) == len(set(exported)), f"{module}.__all__ repeats a name"
    for name in exported:  # every submodule a package exports is public: it has one too
        if _module_file(f"{module}.{name}") is not None:
            assert _declared_all(f"{module}.{name}") is not None, f"{module}.{name}: no __all__"


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_exported_name_exists(module):
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as e:  # an integration whose framework is not installed
        if (e.name or "").split(".")[0] == LIB:
            raise
        pytest.skip(f"{module} needs {e.name}")
    missing = [n for n in imported.__all__ if not hasattr(imported, n)]
    assert not missing, f"{module}.__all__ names {missing}, which it does not define"


@pytest.mark.parametrize(
    ("source", "importer", "problem"),
    [
        ("from offpolicy_jax.correction.normalize import normalizer", None, "not a public"),
        ("from offpolicy_jax.correction import ratios", None, "not exported"),
        ("from offpolicy_jax.reduction import plain", None, "not exported"),
        ("import offpolicy_jax._validation", None, "not a public"),
        ("import offpolicy_jax as opj\nopj.vcpo.sequence_ess", None, "not exported"),
        ("import offpolicy_jax as opj\nopj.rules.compute", None, "not exported"),
        ("from offpolicy_jax import rules\nrules.stages", None, "not exported"),
        ("from offpolicy_jax.demo.train import row", f"{LIB}.diagnose.report", "not a public"),
        ("from offpolicy_jax.cli import fail", f"{LIB}.integrations.optax", "not a public"),
        ("from ..correction import stages", f"{LIB}.diagnose.analysis", "not exported"),
        ("from offpolicy_jax.diagnose import *", None, "import *"),
    ],
)
def test_the_checker_finds_internal_imports(source, importer, problem):
    problems = surface_problems(source, importer)
    assert problems and problem in problems[0], problems


@pytest.mark.parametrize(
    ("source", "importer"),
    [
        ("import offpolicy_jax as opj\nopj.rules.Stage\nopj.CorrectionConfig.preset", None),
        ("from offpolicy_jax import objectives, rules\nrules.chain", None),
        ("from offpolicy_jax.integrations import tunix as otx\notx.metric_keys", None),
        ("from offpolicy_jax.interop import verl\nverl.VERL_VERSION", None),
        ("from offpolicy_jax import __version__", None),
        ("from offpolicy_jax.demo.train import row", f"{LIB}.demo.report"),
        ("from offpolicy_jax.cli import PROG, fail", f"{LIB}.demo.cli"),
        ("from . import analysis", f"{LIB}.diagnose"),
    ],
)
def test_the_checker_accepts_the_public_surface(source, importer):
    assert surface_problems(source, importer) == []


def _library_modules() -> list[str]:
    modules = []
    for path in sorted((SRC / LIB).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules.append(".".join(parts))
    return modules


def _behind_the_wall(module: str) -> bool:
    """Private by its path: under ``offpolicy_jax._src``, or a module whose name (or a
    parent's) starts with an underscore (``__main__`` and ``_rowchunks`` alike)."""
    return any(part.startswith("_") for part in module.split(".")[1:])


def test_everything_else_is_behind_the_wall():
    """The rlax / optax wall: every module of the package is public (exported by a
    public package, or one itself), a client's own module, or private by its path: no
    public-looking module that is not part of the API."""
    loose = [
        m
        for m in _library_modules()
        if not (
            _is_public_module(m)
            or _behind_the_wall(m)
            or m.startswith(tuple(f"{c}." for c in CLIENT_PACKAGES))
            or m in COMMAND_LINE
        )
    ]
    assert not loose, f"public-looking modules outside the API: {loose}"
    assert f"{LIB}._src.correction.criteria" in _library_modules()
