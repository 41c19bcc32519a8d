"""``offpolicy-jax demo``: does rollout correction fix my training? Train and see.

Bad input gives one line ``offpolicy-jax: error: ...`` on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from offpolicy_jax.cli import PROG, fail, typed

if TYPE_CHECKING:  # the demo's modules import Flax: only where a run needs them
    from offpolicy_jax.demo.experiment import DemoConfig, History
    from offpolicy_jax.demo.train import Mismatch

_fail = fail
_severity = typed(float, lambda v: 0 <= v < float("inf"), "a finite number >= 0")
_fraction = typed(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
_positive = typed(float, lambda v: 0 < v < float("inf"), "a positive number")
_count = typed(int, lambda v: 0 <= v <= 64, "an integer in [0, 64]")


def add_parser(sub, positive_int) -> argparse.ArgumentParser:
    """Registers ``offpolicy-jax demo`` on the subparsers ``sub`` (imports the demo)."""
    demo = sub.add_parser(
        "demo",
        help="train a small RL policy under a training-inference mismatch, once "
        "per algorithm, and compare",
        description="Train a tiny Flax NNX transformer with GRPO on a digit-reversal task. A "
        "separate rollout engine samples with different numerics than the "
        "trainer; every algorithm is trained on the same seeds, and a table, a "
        "plot and per-step logs are written to --out.",
    )
    # The groups add their flags in the order --help lists them.
    _add_run_flags(demo, positive_int)
    _add_mismatch_flags(demo)
    _add_policy_flags(demo, positive_int)
    _add_training_flags(demo)
    _add_dump_flags(demo, positive_int)
    demo.add_argument(
        "--tiny",
        action="store_true",
        help="a seconds-long smoke run (small model and batch, few steps)",
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    return demo


def _add_run_flags(demo: argparse.ArgumentParser, positive_int) -> None:
    """``--preset``, ``--out``, ``--steps``, ``--seeds``: which comparison, how long, where."""
    from offpolicy_jax.demo.experiment import PRESETS

    demo.add_argument(
        "--preset",
        default="default",
        choices=tuple(PRESETS),
        help="named settings, which the other flags override: default (the comparison of "
        "the docs' demo table), collapse (an engine 128 updates behind and a 3x learning "
        "rate, where mismatched training collapses, truncated IS included; see docs/demo.md), "
        "router (a 4-expert routed policy whose engine flips about a third of the routing "
        "decisions, lr 1e-2 without gradient clipping; see docs/demo_moe.md), async (every "
        "batch mixes policy versions 0..8 updates old; the staleness rule and the proximal "
        "approximation as rows; see docs/guide/async.md) "
        "(default: default)",
    )
    demo.add_argument(
        "--out",
        default="demo_out",
        metavar="DIR",
        help="output directory (created; default: demo_out)",
    )
    demo.add_argument(
        "--steps", type=positive_int, default=None, help="training steps per run (default 300)"
    )
    demo.add_argument("--seeds", type=positive_int, default=None, help="seeds per row (default 3)")


def _add_mismatch_flags(demo: argparse.ArgumentParser) -> None:
    """``--algorithms``, ``--mismatch``, ``--severity``: the rows, and what they correct."""
    from offpolicy_jax.demo.train import ALGORITHMS, DEFAULT_SEVERITY, MISMATCH_SOURCES

    demo.add_argument(
        "--algorithms",
        default=None,
        metavar="LIST",
        help="comma-separated rows, named algorithm[+correction]: "
        + ", ".join(ALGORITHMS)
        + "; a row may end in /FIELD=VALUE overrides of its opj.LossConfig (a bare /VALUE "
        "sets policy_loss), e.g. decoupled_ppo+mis/policy_loss=gspo (default: the preset's)",
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
        "sampling = temperature 1 + 0.25·s and top-p 1 − 0.05·s, router = about s%% of the "
        "routing decisions flipped (needs --experts), fp8 = 1 (e4m3) or 2 (e5m2), async = "
        "each prompt group sampled by weights 0..s updates old, drawn per group and step "
        "(asynchronous RL, mixed versions per batch; the loss gets each token's version) "
        "(default: " + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_SEVERITY.items()) + ")",
    )


def _add_policy_flags(demo: argparse.ArgumentParser, positive_int) -> None:
    """``--experts``, ``--top-k``, ``--routing-replay``: a routed (MoE) policy."""
    demo.add_argument(
        "--experts",
        type=_count,
        default=None,
        metavar="N",
        help="a routed policy: every FFN becomes a mixture of N experts (0 = dense; "
        "default: the preset's)",
    )
    demo.add_argument(
        "--top-k",
        type=positive_int,
        default=None,
        metavar="K",
        help="with --experts: experts per token (default: the preset's, 1)",
    )
    demo.add_argument(
        "--routing-replay",
        action="store_true",
        help="routing replay (R3) in every mismatched row: the trainer routes each token "
        "through the experts the engine used (rows get the +replay suffix; needs --experts)",
    )


def _add_training_flags(demo: argparse.ArgumentParser) -> None:
    """``--max-grad-norm``, ``--threshold``, ``--lr``, ``--trainer-logprobs``: the trainer."""
    from offpolicy_jax.demo.train import TRAINER_LOGPROBS

    demo.add_argument(
        "--max-grad-norm",
        type=_severity,
        default=None,
        metavar="NORM",
        help="clip the gradient's global norm at NORM; 0 = no clipping (default: the preset's, 1)",
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
        "--trainer-logprobs",
        default=None,
        choices=TRAINER_LOGPROBS,
        help="how the trainer scores the sampled tokens: raw (log_softmax of its logits) or "
        "sampler (opj.token_logprobs with the engine's temperature and top-p, the "
        "sampler-consistent log-prob; matters for --mismatch sampling) (default: raw)",
    )


def _add_dump_flags(demo: argparse.ArgumentParser, positive_int) -> None:
    """``--dump-logprobs``, ``--dump-steps``: the batches as ``offpolicy-jax diagnose`` input."""
    demo.add_argument(
        "--dump-logprobs",
        default=None,
        metavar="DIR",
        help="also write the training batches' log-probs as dumps that offpolicy-jax "
        "diagnose reads: one DIR/<row>_seed<s>.npz per row and seed (old_logp, "
        "rollout_logp, mask, advantages of --dump-steps steps) and DIR/index.json",
    )
    demo.add_argument(
        "--dump-steps",
        type=positive_int,
        default=8,
        metavar="K",
        help="with --dump-logprobs: dump K steps spread evenly over the run, the last "
        "one included (default 8)",
    )


def _check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        _fail(f"cannot write to output directory {str(out)!r}: {reason}")


def run(args: argparse.Namespace, fail: Callable[[str], NoReturn] = fail) -> int:
    """Runs the subcommand; ``args.argv`` is the command line (recorded in the outputs)."""
    return _demo(args, getattr(args, "argv", ["demo"]))


def _demo(args: argparse.Namespace, argv: list[str]) -> int:
    from offpolicy_jax.demo import experiment

    config = _config(args)
    out = Path(args.out)
    _check_writable(out)
    if args.dump_logprobs is not None:
        _check_writable(Path(args.dump_logprobs))
    command = shlex.join([PROG] + argv)
    progress, close = _progress_bar(args, config)
    history = experiment.run(config, progress)
    close()
    _write_results(history, args, out, command)
    return 0


def _config(args: argparse.Namespace) -> DemoConfig:
    """The run's ``DemoConfig``: the preset, ``--tiny``'s sizes, then the flags (an invalid
    combination fails with ``DemoConfig``'s message)."""
    import dataclasses

    from offpolicy_jax.demo import experiment

    config = dataclasses.replace(experiment.PRESETS[args.preset], preset=args.preset)
    if args.tiny:
        config = _tiny(config)
    changes: dict = {"steps": args.steps, "seeds": args.seeds, "threshold": args.threshold}
    if args.algorithms is not None:
        changes["algorithms"] = tuple(a.strip() for a in args.algorithms.split(",") if a.strip())
    if args.mismatch is not None or args.severity is not None:
        changes["mismatch"] = _mismatch(args, config.mismatch)
    train_changes = _train_changes(args)
    if train_changes:
        changes["train"] = dataclasses.replace(config.train, **train_changes)
    if args.routing_replay:
        changes["algorithms"] = tuple(
            _with_replay(a) for a in changes.get("algorithms") or config.algorithms
        )
    try:
        config = dataclasses.replace(config, **{k: v for k, v in changes.items() if v is not None})
        if args.dump_logprobs is not None:
            steps = experiment.dump_steps(config.steps, args.dump_steps)
            config = dataclasses.replace(config, dump_steps=steps)
    except ValueError as e:
        _fail(str(e))
    return config


def _tiny(config: DemoConfig) -> DemoConfig:
    """``--tiny``: ``config`` shrunk to a seconds-long smoke run."""
    import dataclasses

    return dataclasses.replace(
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


def _mismatch(args: argparse.Namespace, preset: Mismatch) -> Mismatch:
    """``--mismatch`` / ``--severity`` over the preset's ``Mismatch``: a new source without
    ``--severity`` gets that source's default severity, not the preset's."""
    from offpolicy_jax.demo.train import DEFAULT_SEVERITY, Mismatch

    source = args.mismatch or preset.source
    if args.severity is not None:
        severity = args.severity
    elif source == preset.source:
        severity = preset.severity
    else:
        severity = DEFAULT_SEVERITY[source]
    return Mismatch(source, severity)


#: ``TrainConfig`` fields that a flag sets, by the flag's ``args`` name.
_TRAIN_FLAGS = {
    "lr": "learning_rate",
    "trainer_logprobs": "trainer_logprobs",
    "experts": "n_experts",
    "top_k": "top_k",
    "max_grad_norm": "max_grad_norm",
}


def _train_changes(args: argparse.Namespace) -> dict:
    """The ``TrainConfig`` fields the flags set (a flag left out keeps the preset's)."""
    values = {field: getattr(args, flag) for flag, field in _TRAIN_FLAGS.items()}
    return {field: v for field, v in values.items() if v is not None}


def _progress_bar(
    args: argparse.Namespace, config: DemoConfig
) -> tuple[Callable[[int], None], Callable]:
    """``(progress, close)``: a tqdm bar on stderr over the run's steps (none with
    ``--no-progress``; then both do nothing)."""
    algorithms = config.algorithms
    if args.no_progress:
        return (lambda n: None), (lambda: None)
    from tqdm import tqdm

    bar = tqdm(
        total=config.steps,
        unit="step",
        desc=f"{len(algorithms)} algorithms × {config.seeds} seeds (compiling first)",
        file=sys.stderr,
    )

    def progress(n: int) -> None:
        # The first chunk's call ends the compile: the description drops the note.
        bar.set_description(f"{len(algorithms)} algorithms × {config.seeds} seeds")
        bar.update(n)

    return progress, bar.close


def _write_results(history: History, args: argparse.Namespace, out: Path, command: str) -> None:
    """Writes the outputs to ``out`` (and the dumps to ``--dump-logprobs``); prints the
    table and the paths written."""
    from offpolicy_jax.demo import report

    try:
        paths = report.write_outputs(history, out, command)
    except OSError as e:
        _fail(f"cannot write results to {str(out)!r}: {e.strerror or e}")
    if args.dump_logprobs is not None:
        try:
            dumped = write_dumps(history, Path(args.dump_logprobs), command)
        except OSError as e:
            _fail(f"cannot write dumps to {args.dump_logprobs!r}: {e.strerror or e}")
        paths["dumps"] = Path(args.dump_logprobs) / "index.json"
        print(f"Dumped {len(dumped)} log-prob files to {args.dump_logprobs}")
    print(paths["table"].read_text().split("\n", 2)[2])  # the table, without the title
    print(f"Wrote {', '.join(str(p) for p in paths.values())}")


def _with_replay(name: str) -> str:
    """``name`` with routing replay: ``+replay`` after its base row (rows without mismatch
    and rows that already replay are kept)."""
    from offpolicy_jax.demo.train import REPLAY_SUFFIX, row

    try:
        algo = row(name)
    except ValueError:
        return name  # DemoConfig reports the unknown row
    if not algo.mismatch or algo.routing_replay:
        return name
    base, sep, rest = name.partition("/")
    return base + REPLAY_SUFFIX + sep + rest


def dump_name(row: str, seed: int) -> str:
    """File name of one (row, seed) dump: the row name with ``:`` and ``/`` made safe."""
    safe = "".join(c if c.isalnum() or c in "+-._=" else "-" for c in row)
    return f"{safe}_seed{seed}.npz"


def write_dumps(history, directory: Path, command: str = "") -> list[Path]:
    """Writes ``history.dumps`` as ``offpolicy-jax diagnose`` input: one ``.npz`` per
    (row, seed) via :func:`offpolicy_jax.diagnose.write_dump`, arrays ``[K, B, n]``
    (K dumped steps, B sequences per step, n response tokens; ``advantages`` ``[K, B]``),
    and ``index.json`` (command, the dumped steps, the files by row and seed)."""
    import json

    from offpolicy_jax.diagnose import write_dump

    directory.mkdir(parents=True, exist_ok=True)
    cfg = history.config
    written, index = [], {}
    for row, arrays in history.dumps.items():
        index[row] = []
        for seed in range(cfg.seeds):
            path = directory / dump_name(row, seed)
            write_dump(
                path,
                old_logp=arrays["old_logp"][:, seed],
                rollout_logp=arrays["rollout_logp"][:, seed],
                mask=arrays["mask"][:, seed],
                advantages=arrays["advantages"][:, seed],
            )
            written.append(path)
            index[row].append(path.name)
    meta = {
        "command": command,
        "steps": list(cfg.dump_steps),
        "mismatch": {"source": cfg.mismatch.source, "severity": cfg.mismatch.severity},
        "trainer_logprobs": cfg.train.trainer_logprobs,
        "arrays": "old_logp, rollout_logp, mask [steps, B, n]; advantages [steps, B]",
        "files": index,
    }
    (directory / "index.json").write_text(json.dumps(meta, indent=2) + "\n")
    return written
