"""The ``offpolicy-jax`` command line: ``demo`` and ``diagnose``.

The library itself needs only jax, numpy and pyyaml; each subcommand needs an extra
(``demo``: Flax, optax, matplotlib, tqdm; ``diagnose``: pyarrow, matplotlib, tqdm). So
this module imports a subcommand's code only when that subcommand runs: ``--help`` and
``--version`` work with the library alone, no extra installed (so does ``diagnose --help``),
and a subcommand whose extra is missing stops with one line naming it (exit status 2),
not a traceback.

Bad input gives one line ``offpolicy-jax: error: ...`` on stderr and exit status 2.
Also runnable as ``python -m offpolicy_jax``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from typing import NoReturn

PROG = "offpolicy-jax"

#: The top-level modules each subcommand imports, by the extra that installs them.
EXTRAS = {
    "demo": ("flax", "optax", "matplotlib", "tqdm"),
    "diagnose": ("pyarrow", "matplotlib", "tqdm"),
}

_SUMMARIES = {
    "demo": "train a small RL policy under a training-inference mismatch, once per "
    "algorithm, and compare (needs the [demo] extra)",
    "diagnose": "how bad is the training-inference mismatch in a log-prob dump, and which "
    "correction does it need (needs the [diagnose] extra)",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage dump
        fail(message)


def fail(message: str, status: int = 2) -> NoReturn:
    """Prints ``offpolicy-jax: error: MESSAGE`` on stderr and exits with ``status``."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(status)


def typed(convert, ok, expected: str):
    """An argparse ``type``: ``convert(text)``, rejected unless ``ok(value)``."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    return parse


positive_int = typed(int, lambda v: v >= 1, "a positive integer")


def _version() -> str:
    from offpolicy_jax import __version__

    return __version__


def _top_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="offpolicy-jax command line: rollout correction for LLM RL in JAX.",
        epilog=f"Run '{PROG} COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, summary in _SUMMARIES.items():
        sub.add_parser(name, help=summary, add_help=False)
    return parser


def missing_extra(command: str) -> list[str]:
    """The modules of ``command``'s extra that are not installed (empty when all are)."""
    return [m for m in EXTRAS[command] if importlib.util.find_spec(m) is None]


def _needs_extra(command: str, missing: list[str]) -> NoReturn:
    fail(
        f"'{PROG} {command}' needs the [{command}] extra (missing: {', '.join(missing)}): "
        f'in a clone of offpolicy-jax, pip install -e ".[{command}]" (offpolicy-jax is not '
        f'on PyPI; from a built wheel: pip install "WHEEL[{command}]")'
    )


def _run(command: str, argv: list[str]) -> int:
    missing = missing_extra(command)
    # A command's --help is shown whenever its options can be listed without the extra
    # (diagnose's can; the demo's name its presets, which import the demo).
    if missing and not {"-h", "--help"} & set(argv[1:]):
        _needs_extra(command, missing)
    try:
        module = importlib.import_module(f"offpolicy_jax.{command}.cli")
        parser = _Parser(prog=PROG)
        sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
        module.add_parser(sub, positive_int)
        args = parser.parse_args(argv)
        args.argv = argv
        return module.run(args, fail)
    except ModuleNotFoundError as e:  # an extra installed only in part
        root = (e.name or "").split(".")[0]
        if root in EXTRAS[command]:
            _needs_extra(command, [root])
        raise


def main(argv: list[str] | None = None) -> int:
    """Runs ``offpolicy-jax ARGV...``; returns the exit status (errors raise SystemExit)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in EXTRAS:
        return _run(argv[0], argv)
    _top_parser().parse_args(argv)  # --help and --version exit here, bad input fails
    fail(f"choose a command: {', '.join(EXTRAS)} (see {PROG} --help)")


if __name__ == "__main__":
    sys.exit(main())
