"""Every policy loss against decoupled PPO: ``python -m benchmarks.losses``.

Forward + backward of :func:`offpolicy_jax.policy_loss` under ``jax.jit`` on the
benchmark batch (``workloads.make_inputs``), with the reference ``mis.yaml`` correction
(``decoupled_ppo``) and every metric, once per ``LossConfig.policy_loss`` (and for DPPO's
top-k trust region, ``dppo_topk_tv`` / ``dppo_topk_kl``, with the engine's top-20
log-probs of ``workloads.make_topk_inputs``). All variants
run in the same process, interleaved call by call (so that load hits them alike); each
is reported as the median time per token and as a ratio to the clipped-PPO baseline
(``ppo_clip``) of the same run. Target: every case within 1.5x of it. Some cases are
a correction rather than a surrogate, timed under ``ppo_clip``: ``areal_kpop``, AReaL's
KPop rejection (``metric: binary_kl``), and ``ppo_clip+binary_kl``, verl's KPop
criterion added to the reference correction. Each case also gets its paired ratio, the
median of its calls' times over the ``ppo_clip`` call beside each (steadier on a shared
machine); the verdict takes it.

Two further columns are floors, not losses (:data:`FLOORS`): ``dppo_tv`` with its
sampled-token trust region plus one read of the top-k cases' two ``[B, T, 20]`` log-prob
arrays (``topk_read_floor``), and plus the two exponentials per id any top-k total
variation takes (``topk_exp_floor``): the share of a top-k case's time that its inputs
cost whatever the implementation.

Writes ``losses_results.md`` and ``losses_results.json`` beside this file (``--out``
elsewhere).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import offpolicy_jax as opj
from benchmarks import paired, workloads

HERE = pathlib.Path(__file__).resolve().parent
TARGET = 1.5
HYPERPARAMETERS = {
    "ppo_clip": dict(clip_eps_high=0.28, dual_clip_c=3.0),
    "gspo": dict(clip_eps=3e-4, clip_eps_high=4e-4),
    "gspo_token": dict(clip_eps=3e-4, clip_eps_high=4e-4),
    "cispo": dict(clip_eps_high=0.28),
    "gmpo": dict(clip_eps=0.4, clip_eps_high=0.4),
    "sapo": {},
    "gpg": {},
    "dppo_tv": dict(clip_eps_high=0.28),
    "dppo_kl": dict(clip_eps_high=0.28),
    "dro": {},
    "prime_dppo": {},
    "ipo": {},
    "two_sided_clip": dict(clip_eps_high=0.28),
    "vespo": {},  # TRL's defaults
    "luspo": dict(clip_eps=2e-3, clip_eps_high=2.5e-3),  # the paper's (Section 5.1)
    # verl's default ratios (2e-4); a covariance band wide enough that clip_cov has
    # candidates on the benchmark batch (whose advantages and log-probs are small).
    "clip_cov": dict(clip_cov_lb=0.01),
    "kl_cov": {},
    "oapl": {},  # the paper's β₂ = 1e-3
    "kpop": {},  # prime-rl's defaults (φ = 0.1)
    # Not a surrogate: AReaL's KPop is its rejection grid's metric (gsm8k_kpop.yaml's
    # block) in the decoupled loss, timed as ppo_clip with that correction.
    "areal_kpop": dict(
        policy_loss="ppo_clip",
        correction=opj.CorrectionConfig.from_areal({"metric": "binary_kl", "upper": 2.0}),
        aggregation="token_mean",
        rejected_in_denominator=True,
    ),
    # verl's KPop criterion (binary_kl at verl's default φ) added to the mis.yaml correction.
    "ppo_clip+binary_kl": dict(
        policy_loss="ppo_clip",
        correction=opj.CorrectionConfig.from_dict(
            {
                **workloads.reference_loss_config().correction.to_dict(),
                "rs_criteria": ("binary_kl:2.0",),
            }
        ),
    ),
    # DPPO's top-k trust region (TRL's divergence_type) on the engine's top-20 log-probs.
    "dppo_topk_tv": dict(
        policy_loss="dppo_tv", clip_eps_high=0.28, divergence_type="topk_tv", divergence_topk=20
    ),
    "dppo_topk_kl": dict(
        policy_loss="dppo_kl", clip_eps_high=0.28, divergence_type="topk_kl", divergence_topk=20
    ),
}
"""Case name -> LossConfig keywords; a case named otherwise than its loss names the
``policy_loss`` itself."""


def config(name: str) -> opj.LossConfig:
    """The reference config with the case's entry of HYPERPARAMETERS (which may replace
    the surrogate or the correction: a case that is not a surrogate); a case named
    otherwise than its loss names the ``policy_loss`` itself."""
    base = workloads.reference_loss_config()
    fields = {**base.__dict__, "policy_loss": name}
    fields.update(HYPERPARAMETERS[name])
    policy_loss = fields["policy_loss"]
    if policy_loss in ("gmpo", "oapl"):  # each sequence once: their papers' mean
        fields["aggregation"] = "sequence_mean"
    return opj.LossConfig(**fields)


FLOORS = {"topk_read_floor": False, "topk_exp_floor": True}
"""Floor name -> whether it takes the exponentials (:func:`workloads.topk_floor_step` on
``dppo_tv``'s config): what the top-k cases cost beside their loss at the least."""
FLOOR_BASE = "dppo_tv"

CASES = tuple(HYPERPARAMETERS) + tuple(FLOORS)


def step_and_inputs(name: str, plain: tuple, with_topk: tuple) -> tuple:
    """The case's step (loss, top-k loss or floor) and the arguments it takes."""
    key = jax.random.key(0)
    if name in FLOORS:
        step = workloads.topk_floor_step(config(FLOOR_BASE), key, exponentials=FLOORS[name])
        return step, with_topk
    cfg = config(name)
    if cfg.divergence_type is not None and cfg.divergence_type.startswith("topk_"):
        return workloads.topk_loss_step(cfg, key=key), with_topk
    return workloads.loss_step(cfg, key=key), plain


def timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def _paired(these: list[float], those: list[float]) -> dict:
    """:func:`paired.paired_ratio`, or the one ratio as its quartiles for a single call."""
    if len(these) > 1:
        return paired.paired_ratio(these, those)
    ratio = these[0] / those[0]
    return {"paired_ratio": ratio, "paired_quartiles": [ratio, ratio]}


def run(batch: int, length: int, repeats: int, warmup: int, cases=CASES) -> dict:
    host = workloads.make_inputs(batch, length)
    host |= workloads.make_topk_inputs(batch, length)
    plain = tuple(jnp.asarray(host[k]) for k in workloads.LOSS_INPUTS)
    with_topk = plain + tuple(jnp.asarray(host[k]) for k in workloads.TOPK_INPUTS)
    compiled, inputs = {}, {}
    for name in cases:
        step, inputs[name] = step_and_inputs(name, plain, with_topk)
        compiled[name] = jax.jit(step).lower(*inputs[name]).compile()
    for name, fn in compiled.items():
        for _ in range(warmup):
            timed(lambda fn=fn, args=inputs[name]: fn(*args))
    samples = {name: [] for name in compiled}
    for _ in range(repeats):
        for name, fn in compiled.items():
            samples[name].append(timed(lambda fn=fn, args=inputs[name]: fn(*args)))
    tokens = batch * length
    median = {name: statistics.median(times) for name, times in samples.items()}
    base = median["ppo_clip"]
    pairs = {name: _paired(times, samples["ppo_clip"]) for name, times in samples.items()}
    return {
        "size": [batch, length],
        "ns_per_token": {name: t / tokens * 1e9 for name, t in median.items()},
        "ratio_to_ppo_clip": {name: t / base for name, t in median.items()},
        "paired_ratio_to_ppo_clip": {name: p["paired_ratio"] for name, p in pairs.items()},
        "paired_quartiles": {name: p["paired_quartiles"] for name, p in pairs.items()},
        "samples": samples,
    }


def _cell(result: dict, name: str) -> str:
    low, high = result["paired_quartiles"][name]
    return (
        f"{result['ns_per_token'][name]:.2f} ns, {result['ratio_to_ppo_clip'][name]:.2f}x, "
        f"paired **{result['paired_ratio_to_ppo_clip'][name]:.2f}x** ({low:.2f}-{high:.2f})"
    )


def _floor_lines(report: dict) -> list[str]:
    """What the floors say of the top-k cases, when both ran."""
    floors = [n for n in report["cases"] if n in FLOORS]
    topk = [n for n in report["cases"] if n.startswith("dppo_topk_")]
    if not floors or not topk:
        return []
    lines = [
        "",
        f"Floors (not losses): `{FLOOR_BASE}` (the sampled token's trust region) that also "
        "reads the top-k cases' two `[B, T, 20]` log-prob arrays once (`topk_read_floor`: "
        "Σ_k of both), and takes the two exponentials per id of any top-k total variation "
        "(`topk_exp_floor`: Σ_k |e^a − e^b|). Paired ratios:",
        "",
    ]
    for result in report["results"]:
        b, t = result["size"]
        pr = result["paired_ratio_to_ppo_clip"]
        have = ", ".join(f"`{n}` {pr[n]:.2f}x" for n in topk)
        under = ", ".join(f"`{n}` {pr[n]:.2f}x" for n in floors)
        lines.append(f"- {b} x {t}: {have}; floors {under}")
    return lines


def markdown(report: dict) -> str:
    names = list(report["cases"])
    sizes = [f"{b} x {t}" for b, t in (r["size"] for r in report["results"])]
    lines = [
        "# Policy losses: forward + backward time per token",
        "",
        f"Produced by `{report['command']}` on {report['date']}.",
        "",
        f"- backend **{report['backend']}**, jax {report['jax']}, Python {report['python']}",
        f"- {report['cpus']} CPUs, 1-minute load average {report['load_1min']['before']:.2f}"
        f" before and {report['load_1min']['after']:.2f} after the run",
        f"- medians of {report['repeats']} interleaved calls after {report['warmup']} warm-up calls",
        "- every loss with `decoupled_ppo`, the reference `mis.yaml` correction and every metric;"
        " ratio = median time / `ppo_clip`'s median time in the same run; paired = median"
        " (quartiles) of each call's time over the `ppo_clip` call beside it (target <= 1.5)",
        "",
        "| case | " + " | ".join(sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for name in names:
        label = f"`{name}` (floor)" if name in FLOORS else f"`{name}`"
        lines.append(f"| {label} | " + " | ".join(_cell(r, name) for r in report["results"]) + " |")
    worst = max(
        (r["paired_ratio_to_ppo_clip"][n], n, tuple(r["size"]))
        for r in report["results"]
        for n in names
        if n not in FLOORS
    )
    verdict = "met" if worst[0] <= TARGET else "**not met**"
    lines += [
        "",
        f"Slowest: `{worst[1]}` at {worst[2][0]} x {worst[2][1]}, {worst[0]:.2f}x ppo_clip "
        f"paired (target <= {TARGET}): {verdict}",
        *_floor_lines(report),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64x2048,256x4096", help="comma-separated BxT")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=pathlib.Path, default=HERE)
    parser.add_argument(
        "--cases",
        default=",".join(CASES),
        help="comma-separated case names (default: all); ppo_clip, the baseline, always runs",
    )
    args = parser.parse_args(argv)
    cases = ("ppo_clip",) + tuple(
        c for c in dict.fromkeys(args.cases.split(",")) if c and c != "ppo_clip"
    )
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown --cases {unknown}; choose from {', '.join(CASES)}")
    sizes = [tuple(int(v) for v in s.lower().split("x")) for s in args.sizes.split(",")]
    load = [os.getloadavg()[0]]  # the machine may be shared: the ratios are the measure
    results = [run(b, t, args.repeats, args.warmup, cases) for b, t in sizes]
    load.append(os.getloadavg()[0])
    report = {
        "command": "python -m benchmarks.losses "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "cases": list(cases),
        "cpus": os.cpu_count(),
        "load_1min": {"before": load[0], "after": load[1]},
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "losses_results.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (args.out / "losses_results.md").write_text(text)
    print(text)
    worst = max(r["ratio_to_ppo_clip"][n] for r in results for n in cases)
    return 0 if np.isfinite(worst) else 1


if __name__ == "__main__":
    raise SystemExit(main())
