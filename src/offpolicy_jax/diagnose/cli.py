"""The ``diagnose`` subcommand of the ``offpolicy-jax`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from offpolicy_jax.diagnose.readers import DEFAULT_COLUMNS


def add_parser(sub, positive_int) -> argparse.ArgumentParser:
    """Registers ``offpolicy-jax diagnose`` on the subparsers ``sub``."""
    p = sub.add_parser(
        "diagnose",
        help="how bad is the training-inference mismatch in a log-prob dump, and which "
        "correction does it need",
        description="Read trainer and rollout log-probs of the same tokens (.npz, Parquet or "
        "JSONL; files, globs or folders), stream them through compute_correction and write "
        "report.md (also printed), report.json, recommended.yaml and plots to --out.",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="dump files, globs or folders (a folder: the files its index.json lists, as "
        "the demo's --dump-logprobs writes, else every dump file in it)",
    )
    p.add_argument("--out", default="diagnose_out", metavar="DIR", help="output directory")
    for key, flag in (("old", "--old-col"), ("rollout", "--rollout-col"), ("mask", "--mask-col")):
        p.add_argument(
            flag,
            default=DEFAULT_COLUMNS[key],
            metavar="NAME",
            help=f"Parquet/JSONL column (default: {DEFAULT_COLUMNS[key]})",
        )
    p.add_argument(
        "--reduction",
        choices=("sequence", "token"),
        default="sequence",
        help="metric reduction (default: sequence)",
    )
    p.add_argument(
        "--chunk-rows",
        type=positive_int,
        default=1024,
        help="sequences per chunk (default 1024)",
    )
    p.add_argument(
        "--position-bin",
        type=positive_int,
        default=None,
        help="position bucket width (default: a power of two giving 32 buckets)",
    )
    p.add_argument(
        "--top-k", type=positive_int, default=20, help="worst sequences/tokens kept (default 20)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run(args: argparse.Namespace, fail: Callable[[str], NoReturn]) -> int:
    """Runs the subcommand; ``fail(message)`` prints one line and exits non-zero."""
    from offpolicy_jax.diagnose import DiagnoseError, diagnose

    out = Path(args.out)
    try:
        result = diagnose(
            args.inputs,
            out,
            old_col=args.old_col,
            rollout_col=args.rollout_col,
            mask_col=args.mask_col,
            reduction=args.reduction,
            chunk_rows=args.chunk_rows,
            position_bin=args.position_bin,
            top_k=args.top_k,
            progress=not args.no_progress,
        )
    except DiagnoseError as e:
        return fail(str(e))
    except OSError as e:
        return fail(f"cannot write to {str(out)!r}: {e.strerror or e}")
    sys.stdout.write((out / "report.md").read_text())
    rec = result["recommendation"]
    print(f"Recommended: {rec['name']} -> {out / 'recommended.yaml'}; wrote {out}/")
    return 0
