"""This checkout against another commit of the library, side by side in one process.

``python -m benchmarks.compare --commit 7737661`` extracts ``src/offpolicy_jax`` of that
commit (``git archive``) into a temporary package with its imports renamed, builds the
same two computations with each version's own public API (``policy_loss`` forward +
backward and ``compute_correction``, ``decoupled_ppo`` with the shipped ``mis.yaml``
and every metric), compiles both and times them call by call, interleaved, so that a
busy machine slows them alike. It writes ``compare_results.md`` / ``.json``: the median
time of each version and their ratio per computation and size, each version's cold
compile time (``--compile-repeats`` interleaved compiles) and its paired ratio, and the
metric keys that only one of them reports (work the other does not do).

Why not ``run.py --against``: that compares jit / floor ratios between two runs, which
is only meaningful on the same machine; this compares the code itself.
``--env NAME=VALUE`` (repeatable) traces one copy of the other commit per setting, for a
switch read at trace time: ``--commit dc27304 --env OFFPOLICY_JAX_REDUCTION=plain --env
OFFPOLICY_JAX_REDUCTION=fused`` times that commit's two reduction paths beside this
checkout.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib import resources
from types import ModuleType

import jax
import jax.numpy as jnp

from benchmarks import workloads
from benchmarks.paired import environment, environment_line, paired_cell, paired_ratio

HERE = pathlib.Path(__file__).resolve().parent
PHASE_1 = "7737661"


def load_commit(commit: str, workdir: pathlib.Path, suffix: str = "") -> tuple[ModuleType, str]:
    """``src/offpolicy_jax`` at ``commit`` as an importable package (imports renamed);
    ``suffix`` tells apart two copies of one commit loaded into one process."""
    sha = subprocess.run(
        ["git", "rev-parse", "--short", commit],
        cwd=workloads.REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    name = f"offpolicy_jax_{sha}{suffix}"
    archive = subprocess.run(
        ["git", "archive", sha, "src/offpolicy_jax"],
        cwd=workloads.REPO,
        check=True,
        capture_output=True,
    ).stdout
    workdir = workdir / name  # a directory of its own: copies do not collide
    workdir.mkdir()
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        # The "data" filter exists from Python 3.11.4 on; the archive is our own tree.
        if hasattr(tarfile, "data_filter"):
            tar.extractall(workdir, filter="data")
        else:
            tar.extractall(workdir)  # noqa: S202
    package = workdir / name
    shutil.move(workdir / "src" / "offpolicy_jax", package)
    shutil.rmtree(workdir / "src")
    for path in package.rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\boffpolicy_jax\b", name, text))
    sys.path.insert(0, str(workdir))
    return importlib.import_module(name), sha


def programs(opj: ModuleType, inputs: dict[str, jax.Array]) -> dict[str, tuple]:
    """The loss and correction steps of one version (functions), with their arguments."""
    mis_yaml = resources.files("offpolicy_jax") / "configs" / "mis.yaml"
    correction = opj.CorrectionConfig.from_yaml(mis_yaml)
    loss_config = opj.LossConfig(
        algorithm="decoupled_ppo", correction=correction, get_mismatch_metrics=True
    )

    def loss(logp, old_logp, rollout_logp, advantages, mask):
        return jax.value_and_grad(
            lambda lp: opj.policy_loss(lp, old_logp, rollout_logp, advantages, mask, loss_config),
            has_aux=True,
        )(logp)

    def correct(old_logp, rollout_logp, mask):
        return opj.compute_correction(old_logp, rollout_logp, mask, correction)

    return {
        name: (fn, tuple(inputs[k] for k in keys))
        for name, fn, keys in (
            ("loss", loss, workloads.LOSS_INPUTS),
            ("correction", correct, workloads.CORRECTION_INPUTS),
        )
    }


def compile_under(setting: str, fn, args) -> jax.stages.Compiled:
    """``fn`` traced, lowered and compiled with the ``NAME=VALUE`` variable ``setting`` set
    (a variable read when a program is traced), restored afterwards."""
    name, _, value = setting.partition("=")
    if not name:
        return jax.jit(fn).lower(*args).compile()
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        return jax.jit(fn).lower(*args).compile()
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def traced(setting: str, steps: dict[str, tuple]) -> dict[str, tuple]:
    """The compiled :func:`programs` ``steps`` (``{name: (compiled, args)}``), traced with
    ``setting`` (:func:`compile_under`)."""
    return {name: (compile_under(setting, fn, args), args) for name, (fn, args) in steps.items()}


def compile_times(versions: dict[str, tuple], repeats: int) -> dict[str, list[float]]:
    """Each version's cold trace + lower + compile (``{label: (setting, fn, args)}``),
    ``repeats`` times, interleaved, after dropping JAX's caches each time."""
    times: dict[str, list[float]] = {v: [] for v in versions}
    for _ in range(repeats):
        for version, (setting, fn, args) in versions.items():
            jax.clear_caches()
            start = time.perf_counter()
            compile_under(setting, fn, args)
            times[version].append(time.perf_counter() - start)
    return times


def timed(versions: dict[str, tuple], repeats: int) -> dict[str, list[float]]:
    """Each version's compiled step called ``repeats`` times, interleaved."""
    for compiled, call_args in versions.values():
        for _ in range(3):
            jax.block_until_ready(compiled(*call_args))
    times: dict[str, list[float]] = {v: [] for v in versions}
    for _ in range(repeats):
        for version, (compiled, call_args) in versions.items():
            start = time.perf_counter()
            jax.block_until_ready(compiled(*call_args))
            times[version].append(time.perf_counter() - start)
    return times


def row(name, batch, length, times, compiles, ours, theirs) -> dict:
    """One computation and size: this checkout's median and, per other version, its
    median, paired ratio, compile times and the metric keys only one of the two reports."""
    now = statistics.median(times["this checkout"]) * 1e3
    keys_now = metric_keys(*ours[name])
    others = []
    for label, steps_then in theirs.items():
        keys_then = metric_keys(*steps_then[name])
        others.append(
            {
                "version": label,
                "other_ms": statistics.median(times[label]) * 1e3,
                **paired_ratio(times["this checkout"], times[label]),
                "other_compile_s": statistics.median(compiles[label]),
                "compile_ratio": paired_ratio(compiles["this checkout"], compiles[label]),
                "only_this": sorted(keys_now - keys_then),
                "only_other": sorted(keys_then - keys_now),
            }
        )
    return {
        "computation": name,
        "size": f"{batch} x {length}",
        "this_ms": now,
        "this_compile_s": statistics.median(compiles["this checkout"]),
        "others": others,
    }


def metric_keys(compiled, args) -> set[str]:
    result = compiled(*args)
    metrics = result[0][1] if isinstance(result, tuple) else result.metrics
    return set(metrics)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", default=PHASE_1, help="the other version (git revision)")
    parser.add_argument("--sizes", default="64x2048,256x4096,256x8192", help="BxT,BxT,...")
    parser.add_argument("--repeats", type=int, default=21, help="timed calls per version")
    parser.add_argument(
        "--compile-repeats",
        type=int,
        default=3,
        help="cold compiles per version, interleaved (at least 2: a paired ratio's quartiles)",
    )
    parser.add_argument("--out", default=None, help="directory for compare_results.md/.json")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="trace another copy of the other commit with this environment variable set "
        "(repeatable: each copy is timed beside this checkout; the first is the headline)",
    )
    args = parser.parse_args(argv)
    if args.compile_repeats < 2:
        parser.error(f"--compile-repeats must be at least 2, got {args.compile_repeats}")

    import offpolicy_jax as current

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        others = []
        for i, setting in enumerate(args.env or [""]):
            module, sha = load_commit(args.commit, pathlib.Path(tmp), suffix=f"_{i}")
            others.append((f"{sha} {setting}".strip(), setting, module))
        load_before = os.getloadavg()[0]
        for item in args.sizes.split(","):
            batch, length = (int(x) for x in item.lower().split("x"))
            inputs = {k: jnp.asarray(v) for k, v in workloads.make_inputs(batch, length).items()}
            fns = {"this checkout": ("", programs(current, inputs))}
            fns |= {label: (setting, programs(module, inputs)) for label, setting, module in others}
            ours = traced(*fns["this checkout"])
            theirs = {label: traced(*fns[label]) for label, _, _ in others}
            for name in ours:
                versions = {"this checkout": ours[name]}
                versions |= {label: theirs[label][name] for label in theirs}
                times = timed(versions, args.repeats)
                compiles = compile_times(
                    {label: (setting, *fn[name]) for label, (setting, fn) in fns.items()},
                    args.compile_repeats,
                )
                rows.append(row(name, batch, length, times, compiles, ours, theirs))
                print(
                    f"{name:>10} {batch}x{length}: "
                    + "; ".join(
                        f"{o['version']}: paired {o['paired_ratio']:.2f}, compile "
                        f"{o['compile_ratio']['paired_ratio']:.2f}"
                        for o in rows[-1]["others"]
                    )
                )
    report = {
        "commit": sha,
        "versions": [label for label, _, _ in others],
        "command": "python -m benchmarks.compare "
        + " ".join(sys.argv[1:] if argv is None else argv),
        **environment(load_before),
        "rows": rows,
    }
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare_results.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "compare_results.md").write_text(render(report))


def render(report: dict) -> str:
    versions = report["versions"]
    lines = [
        f"# This checkout against commit `{report['commit']}`",
        "",
        f"{environment_line(report)}.",
        "",
        "All versions run in one process on the same inputs (decoupled PPO with the shipped "
        "`mis.yaml`, every metric, `policy_loss` forward + backward and "
        "`compute_correction`), compiled, then timed call by call, interleaved, so that a "
        "busy machine slows them alike. *paired*: the median over calls of each call's time "
        "of this checkout over the other version's call beside it (quartiles in brackets), "
        "steadier than the ratio of medians when the machine's speed drifts. *only here* / "
        "*only there*: metric keys one version reports and the other does not. *compile*: "
        "cold trace + lower + compile in seconds (median of the interleaved repeats, JAX's "
        "caches dropped before each) and its paired ratio.",
        "",
        "| computation | [B, T] | this checkout ms | "
        + " | ".join(f"`{v}` ms | **this / `{v}`, paired**" for v in versions)
        + " | this compile s | "
        + " | ".join(f"`{v}` compile s | compile this / `{v}`" for v in versions)
        + " | only here | only there |",
        "|---|---|---|"
        + "---|---|" * len(versions)
        + "---|"
        + "---|---|" * len(versions)
        + "---|---|",
    ]
    for r in report["rows"]:
        cells = " | ".join(f"{o['other_ms']:.2f} | {paired_cell(o)}" for o in r["others"])
        compiles = " | ".join(
            f"{o['other_compile_s']:.2f} | {paired_cell(o['compile_ratio'])}" for o in r["others"]
        )
        first = r["others"][0]
        lines.append(
            f"| {r['computation']} | {r['size']} | {r['this_ms']:.2f} | {cells} | "
            f"{r['this_compile_s']:.2f} | {compiles} | "
            f"{', '.join(f'`{k}`' for k in first['only_this']) or '–'} | "
            f"{', '.join(f'`{k}`' for k in first['only_other']) or '–'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
