"""``offpolicy-jax demo``: does rollout correction fix my training? Train and see.

Bad input gives one line ``offpolicy-jax: error: ...`` on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

PROG = "offpolicy-jax"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        _fail(message)


def _fail(message: str, status: int = 2):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(status)


def _typed(convert, ok, expected: str):
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


_positive_int = _typed(int, lambda v: v >= 1, "a positive integer")
_severity = _typed(float, lambda v: 0 <= v < float("inf"), "a finite number >= 0")
_fraction = _typed(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
_positive = _typed(float, lambda v: 0 < v < float("inf"), "a positive number")


def build_parser() -> argparse.ArgumentParser:
    from offpolicy_jax import __version__
    from offpolicy_jax.demo.experiment import PRESETS
    from offpolicy_jax.demo.train import ALGORITHMS, DEFAULT_SEVERITY, MISMATCH_SOURCES

    parser = _Parser(prog=PROG, description="offpolicy-jax command line.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="train a small RL policy under a training-inference mismatch, once "
        "per algorithm, and compare",
        description="Train a tiny Flax NNX transformer with GRPO on a digit-reversal task. A "
        "separate rollout engine samples with different numerics than the "
        "trainer; every algorithm is trained on the same seeds, and a table, a "
        "plot and per-step logs are written to --out.",
    )
    demo.add_argument(
        "--preset",
        default="default",
        choices=tuple(PRESETS),
        help="named settings, which the other flags override: default (the comparison of "
        "README.md's table), collapse (a setting where untruncated or uncorrected training "
        "collapses; see README.md) (default: default)",
    )
    demo.add_argument(
        "--out",
        default="demo_out",
        metavar="DIR",
        help="output directory (created; default: demo_out)",
    )
    demo.add_argument(
        "--steps", type=_positive_int, default=None, help="training steps per run (default 300)"
    )
    demo.add_argument("--seeds", type=_positive_int, default=None, help="seeds per row (default 3)")
    demo.add_argument(
        "--algorithms",
        default=None,
        metavar="LIST",
        help="comma-separated rows, named algorithm[+correction]: "
        + ", ".join(ALGORITHMS)
        + " (default: the preset's)",
    )
    demo.add_argument(
        "--mismatch",
        default=None,
        choices=MISMATCH_SOURCES,
        help="source of the mismatch (default: the preset's, stale)",
    )
    demo.add_argument(
        "--severity",
        type=_severity,
        default=None,
        help="how strong the mismatch is, 0 = none: precision = 8 − mantissa "
        "bits kept (1 = bfloat16), stale = optimizer updates behind, "
        "sampling = temperature 1 + 0.25·s and top-p 1 − 0.05·s (default: "
        + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_SEVERITY.items())
        + ")",
    )
    demo.add_argument(
        "--threshold",
        type=_fraction,
        default=None,
        help="reward threshold for the steps-to-threshold column (default 0.9)",
    )
    demo.add_argument(
        "--lr",
        type=_positive,
        default=None,
        help="Adam learning rate (default: the preset's, 1e-3 for default)",
    )
    demo.add_argument(
        "--tiny",
        action="store_true",
        help="a seconds-long smoke run (small model and batch, few steps)",
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    from offpolicy_jax.diagnose.cli import add_parser as add_diagnose

    add_diagnose(sub, _positive_int)
    return parser


def _check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        _fail(f"cannot write to output directory {str(out)!r}: {reason}")


def _demo(args: argparse.Namespace, argv: list[str]) -> int:
    import dataclasses

    from offpolicy_jax.demo import experiment, report
    from offpolicy_jax.demo.train import DEFAULT_SEVERITY, Mismatch

    config = dataclasses.replace(experiment.PRESETS[args.preset], preset=args.preset)
    if args.tiny:
        config = dataclasses.replace(
            config,
            steps=4,
            seeds=2,
            chunk=2,
            train=dataclasses.replace(
                config.train,
                d_model=16,
                prompts_per_step=4,
                group_size=4,
                prompt_len=3,
                eval_prompts=8,
            ),
        )
    changes: dict = {"steps": args.steps, "seeds": args.seeds, "threshold": args.threshold}
    if args.algorithms is not None:
        changes["algorithms"] = tuple(a.strip() for a in args.algorithms.split(",") if a.strip())
    if args.mismatch is not None or args.severity is not None:
        source = args.mismatch or config.mismatch.source
        if args.severity is not None:
            severity = args.severity
        elif source == config.mismatch.source:
            severity = config.mismatch.severity
        else:
            severity = DEFAULT_SEVERITY[source]
        changes["mismatch"] = Mismatch(source, severity)
    if args.lr is not None:
        changes["train"] = dataclasses.replace(config.train, learning_rate=args.lr)
    try:
        config = dataclasses.replace(config, **{k: v for k, v in changes.items() if v is not None})
    except ValueError as e:
        _fail(str(e))
    algorithms = config.algorithms
    out = Path(args.out)
    _check_writable(out)

    command = shlex.join([PROG] + argv)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(
            total=config.steps,
            unit="step",
            desc=f"{len(algorithms)} algorithms × {config.seeds} seeds (compiling first)",
            file=sys.stderr,
        )

    def progress(n: int) -> None:
        if bar is not None:
            bar.set_description(f"{len(algorithms)} algorithms × {config.seeds} seeds")
            bar.update(n)

    history = experiment.run(config, progress)
    if bar is not None:
        bar.close()
    try:
        paths = report.write_outputs(history, out, command)
    except OSError as e:
        _fail(f"cannot write results to {str(out)!r}: {e.strerror or e}")
    print(paths["table"].read_text().split("\n", 2)[2])  # the table, without the title
    print(f"Wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        _fail("choose a command: demo, diagnose (see offpolicy-jax --help)")
    if args.command == "diagnose":
        from offpolicy_jax.diagnose.cli import run as diagnose

        return diagnose(args, _fail)
    return _demo(args, argv)


if __name__ == "__main__":
    sys.exit(main())
