"""Benchmark suite: ``python -m benchmarks.run`` writes ``results.md`` and ``results.json``.

For every ``[B, T]`` size and for every computation of ``workloads`` (the
``policy_loss`` training step and ``compute_correction``) it measures, in one
run and on whatever JAX backend is present:

* the time of the read-once floor, the jitted library, the same code op by op
  (no jit) and the NumPy oracle: medians of ``--repeats`` calls after warm-up,
  interleaved call by call (floor with jit, then op-by-op with NumPy) so that a
  busy machine slows them alike; every time is reported as a ratio to the floor;
* the cold compile time of the jitted library (trace + lower + compile after
  ``jax.clear_caches()``, median of ``--compile-repeats``);
* the compiled temporary memory (``compiled.memory_analysis()``) as a ratio to
  the bytes of the inputs;
* the time per token, and its ratio to the smallest size's (linear scaling
  keeps it at 1);
* the memory bandwidth of the jitted library: the wall time per call of
  ``--pipeline`` calls dispatched back to back with one wait at the end (as in a
  training loop), the device's busy time in a profiler trace of such calls (on an
  accelerator; the CPU backend's trace has no device streams), the bytes XLA's
  cost analysis says the compiled program accesses, and the bandwidth as a
  fraction of a plain copy's (``x + 1`` in place on ``--copy-bytes``, far larger
  than any cache) measured in the same run.

Timings are noisy on a shared machine: compare ratios within one run, and see
the load average and busy processes recorded in the report.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from benchmarks import workloads

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_SIZES = "64x2048,256x4096,256x8192"
# The copy ceiling's buffer: many times any GPU's L2 and any CPU's last-level cache.
DEFAULT_COPY_BYTES = 2**30
TINY_SIZES = "4x64,8x128"
VARIANTS = ("floor", "jit", "op_by_op", "numpy")
TITLES = {
    "loss": "`policy_loss` forward + backward (decoupled_ppo, mis.yaml, all metrics)",
    "correction": "`compute_correction` forward (mis.yaml)",
    "loss_trm_icepop": (
        "`policy_loss` forward + backward (decoupled_ppo, Trust Region Masking "
        "`seq_max_k2` + `seq_mean_k3` with IcePop weights, all metrics)"
    ),
}


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for item in text.split(","):
        batch, length = item.lower().split("x")
        sizes.append((int(batch), int(length)))
    return sizes


def timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def cold_compile_seconds(comp: workloads.Computation, repeats: int) -> float:
    """Trace + lower + compile with every JAX cache cleared first (median)."""
    times = []
    for _ in range(repeats):
        jax.clear_caches()
        start = time.perf_counter()
        comp.compile(comp.step)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pipelined_seconds(fn, calls: int) -> tuple[float, float]:
    """Seconds per call of ``calls`` back-to-back dispatches followed by one wait, and the
    host's seconds per call to dispatch them (the wait not counted): where the two are
    close, the host, not the device, sets the wall time."""
    jax.block_until_ready(fn())
    start = time.perf_counter()
    outputs = [fn() for _ in range(calls)]
    dispatched = time.perf_counter()
    jax.block_until_ready(outputs)
    return (time.perf_counter() - start) / calls, (dispatched - start) / calls


def looped_step(step: Callable, steps: int) -> Callable:
    """``steps`` calls of ``step`` in one program (``lax.fori_loop``): one dispatch, so its
    wall time per step is the device's, as in a training loop that jits the whole update.

    Every float input is shifted by zero times the previous step's first output, so no
    part of the step is loop-invariant (XLA would hoist it out of the loop), and the
    outputs are carried, so none of them is dead code.
    """

    def run(*args):
        def body(_, carry):
            shift, _ = carry
            shifted = [a + shift if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]
            out = step(*shifted)
            return 0.0 * jnp.ravel(jax.tree.leaves(out)[0])[0].astype(jnp.float32), out

        shapes = jax.eval_shape(step, *args)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        return jax.lax.fori_loop(0, steps, body, (jnp.zeros((), jnp.float32), zeros))[1]

    return run


def device_events(fn, calls: int) -> list[tuple[str, int, int]]:
    """``(name, start ns, duration ns)`` of every kernel and copy on the device's streams in
    a profiler trace of ``calls`` calls of ``fn`` (empty on the CPU backend, which has none)."""
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            jax.block_until_ready([fn() for _ in range(calls)])
        (path,) = pathlib.Path(log_dir).rglob("*.xplane.pb")
        data = jax.profiler.ProfileData.from_file(str(path))
    return [
        (event.name, int(event.start_ns), int(event.duration_ns))
        for plane in data.planes
        if plane.name.startswith("/device:")
        for line in plane.lines
        if line.name.startswith("Stream")
        for event in line.events
    ]


def device_time(fn, calls: int) -> dict | None:
    """The device's own time per call, from :func:`device_events`.

    ``busy``: the summed durations of the kernels and copies (no host dispatch, no launch
    gaps); ``span``: first start to last end; ``kernels``: events per call. None where the
    trace has no device streams (the CPU backend).
    """
    events = device_events(fn, calls)
    if not events:
        return None
    start = min(s for _, s, _ in events)
    end = max(s + d for _, s, d in events)
    return {
        "busy": sum(d for _, _, d in events) / 1e9 / calls,
        "span": (end - start) / 1e9 / calls,
        "kernels": len(events) / calls,
    }


def bytes_accessed(compiled: jax.stages.Compiled) -> int | None:
    """XLA's estimate of the bytes the compiled program reads and writes."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 (some backends do not implement it)
        return None
    if isinstance(analysis, (list, tuple)):  # older jax: one dict per partition
        analysis = analysis[0] if analysis else None
    value = None if not analysis else analysis.get("bytes accessed")
    return None if value is None else int(value)


def copy_bandwidth(nbytes: int, calls: int, repeats: int) -> dict:
    """Bytes per second of ``x + 1`` on a float32 buffer of ``nbytes`` (read once, written
    once, in place: the buffer is donated, so no call pays for fresh pages): the ceiling the
    bandwidth columns are measured against."""
    add_one = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    x = add_one(jnp.zeros(nbytes // 4, jnp.float32))
    times = []
    for _ in range(repeats):
        jax.block_until_ready(x)
        start = time.perf_counter()
        for _ in range(calls):
            x = add_one(x)
        jax.block_until_ready(x)
        times.append((time.perf_counter() - start) / calls)
    del x
    seconds = statistics.median(times)
    return {"bytes": 2 * nbytes, "seconds": seconds, "bytes_per_second": 2 * nbytes / seconds}


def temp_bytes(compiled: jax.stages.Compiled) -> int | None:
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 (some backends do not implement it)
        return None
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def measure(comp: workloads.Computation, args: argparse.Namespace, progress: tqdm) -> dict:
    """Every number of one computation on one batch."""
    compile_s = cold_compile_seconds(comp, args.compile_repeats)
    floor = comp.compile(workloads.read_once)
    jitted = comp.compile(comp.step)
    fast = {"floor": lambda: floor(*comp.args), "jit": lambda: jitted(*comp.args)}
    slow = {}
    if not args.no_op_by_op:
        slow["op_by_op"] = comp.op_by_op
    if comp.numpy_step is not None and not args.no_numpy:
        slow["numpy"] = comp.numpy_step
    samples = {}
    # Two phases, each interleaved call by call so that load hits its variants alike.
    # The slow variants run apart: between two of their calls (hundreds of MB of
    # temporaries) the floor would start with cold caches and freshly mapped memory.
    for phase in (fast, slow):
        for fn in phase.values():
            for _ in range(args.warmup):
                timed(fn)
        samples.update({name: [] for name in phase})
        for _ in range(args.repeats):
            for name, fn in phase.items():
                samples[name].append(timed(fn))
            progress.update(1)
    median = {name: statistics.median(times) for name, times in samples.items()}
    tokens = int(np.prod(comp.host_inputs["mask"].shape))
    temp = temp_bytes(jitted)
    pipelined = {name: [] for name in fast}
    dispatch = []
    for _ in range(args.repeats):
        for name, fn in fast.items():
            wall, host = pipelined_seconds(fn, args.pipeline)
            pipelined[name].append(wall)
            if name == "jit":
                dispatch.append(host)
    output_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(fast["jit"]()))
    looped = comp.compile(looped_step(comp.step, args.pipeline))
    looped_s = statistics.median(timed(lambda: looped(*comp.args)) for _ in range(3))
    on_device = {name: device_time(fn, args.pipeline) for name, fn in fast.items()}
    return {
        "seconds": median,
        "samples": samples,
        "ratio_to_floor": {name: median[name] / median["floor"] for name in median},
        "compile_seconds": compile_s,
        "temp_bytes": temp,
        "input_bytes": comp.input_bytes,
        "temp_to_input": None if temp is None else temp / comp.input_bytes,
        "ns_per_token": median["jit"] / tokens * 1e9,
        "floor_ns_per_token": median["floor"] / tokens * 1e9,
        "tokens": tokens,
        "pipelined_seconds": {name: statistics.median(t) for name, t in pipelined.items()},
        "dispatch_seconds": statistics.median(dispatch),
        "looped_seconds": looped_s / args.pipeline,
        "output_bytes": output_bytes,
        "device_seconds": on_device,
        "bytes_accessed": {"floor": bytes_accessed(floor), "jit": bytes_accessed(jitted)},
    }


def busy_processes(limit: int = 6) -> list[str]:
    """Other processes using CPU right now (Linux ``ps``; empty elsewhere)."""
    try:
        out = subprocess.run(
            ["ps", "-eo", "pid,pcpu,args", "--sort=-pcpu"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.splitlines()[1:]
    except (OSError, subprocess.SubprocessError):
        return []
    busy = []
    for line in out:
        pid, pcpu, command = line.strip().split(None, 2)
        if int(pid) != os.getpid() and float(pcpu) >= 10.0:
            busy.append(f"{float(pcpu):.0f}% {command[:90]}")
    return busy[:limit]


def environment() -> dict:
    device = jax.devices()[0]
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return {
        "backend": jax.default_backend(),
        "device": f"{device.device_kind} ({device.platform}, {len(jax.devices())} device(s))",
        "jax": jax.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_used": len(os.sched_getaffinity(0)),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def fmt(value, spec=".2f", suffix="") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def _jit_over_floor(result: dict) -> float:
    seconds = result["seconds"]
    return seconds["jit"] / seconds["floor"]


def against(report: dict, baseline: dict, path: pathlib.Path) -> str:
    """Markdown: jit / floor of this run beside a baseline run's, per computation and size.

    Ratios to the floor are what survive a change of machine load between two runs;
    a slowdown beyond 10% is flagged (the ratios are to stay within 10%).
    """
    then = {(r["computation"], r["batch"], r["length"]): r for r in baseline["results"]}
    lines = [
        "",
        f"## Against `{path}` ({baseline['environment'].get('date', '?')})",
        "",
        "| computation | [B, T] | jit / floor then | now | **now / then** |",
        "|---|---|---|---|---|",
    ]
    for result in report["results"]:
        key = (result["computation"], result["batch"], result["length"])
        if key not in then:
            continue
        old, new = _jit_over_floor(then[key]), _jit_over_floor(result)
        flag = " (slower)" if new > 1.10 * old else ""
        lines.append(
            f"| {key[0]} | {key[1]} x {key[2]} | {old:.2f} | {new:.2f} | **{new / old:.2f}**{flag} |"
        )
    return "\n".join(lines) + "\n"


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# offpolicy-jax benchmark results",
        "",
        f"Produced by `{report['command']}` on {env['date']}.",
        "",
        (
            f"- backend **{env['backend']}**, device {env['device']}; jax {env['jax']}, "
            f"Python {env['python']}"
        ),
        f"- CPU: {env['cpu']}, {env['cpu_count']} cores, "
        f"{env.get('cpus_used', env['cpu_count'])} used by this run",
        (
            f"- load average (1 min) before / after: {report['load_before']:.2f} / "
            f"{report['load_after']:.2f}"
        ),
        "- other busy processes at the start: "
        + ("; ".join(f"`{p}`" for p in report["busy_before"]) or "none"),
        "- other busy processes at the end: "
        + ("; ".join(f"`{p}`" for p in report["busy_after"]) or "none"),
    ]
    if report.get("note"):
        lines.append(f"- note: {report['note']}")
    lines += [
        "",
        (
            f"Times are medians of {report['repeats']} interleaved calls after warm-up, as "
            "ratios to the read-once floor (a jitted function that sums each input array "
            "once) measured in the same run. *compile* is cold trace + lower + compile of the "
            "jitted library; *temp / input* is the compiled temporary memory over the input "
            "bytes; *vs smallest* is the time per token over the smallest size's (1 = linear "
            "in B·T); *floor ns/token* shows how far the floor itself is from linear."
        ),
    ]
    for name in TITLES:
        rows = [r for r in report["results"] if r["computation"] == name]
        if not rows:
            continue
        lines += [
            "",
            f"## {TITLES[name]}",
            "",
            (
                "| [B, T] | floor ms | jit ms | **jit / floor** | op-by-op / floor "
                "| NumPy / floor | op-by-op / jit | NumPy / jit | compile s | temp / input "
                "| jit ns/token | vs smallest | floor ns/token |"
            ),
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        smallest = rows[0]["ns_per_token"]
        for r in rows:
            sec, ratio = r["seconds"], r["ratio_to_floor"]
            slow = {v: sec[v] / sec["jit"] if v in sec else None for v in ("op_by_op", "numpy")}
            lines.append(
                f"| {r['batch']} x {r['length']} | {sec['floor'] * 1e3:.2f} "
                f"| {sec['jit'] * 1e3:.2f} | **{ratio['jit']:.2f}** "
                f"| {fmt(ratio.get('op_by_op'), '.1f')} | {fmt(ratio.get('numpy'), '.1f')} "
                f"| {fmt(slow['op_by_op'], '.1f')} | {fmt(slow['numpy'], '.1f')} "
                f"| {r['compile_seconds']:.2f} | {fmt(r['temp_to_input'])} "
                f"| {r['ns_per_token']:.2f} | {r['ns_per_token'] / smallest:.2f} "
                f"| {r['floor_ns_per_token']:.2f} |"
            )
    lines += bandwidth_section(report)
    ragged = ragged_rows(report)
    if ragged:
        lines += [
            "",
            "## Ragged lengths (time per token vs the nearest multiple of 128; target <= 1.25)",
            "",
            "| computation | [B, T] | ns/token | aligned [B, T] | ns/token | **ratio** |",
            "|---|---|---|---|---|---|",
        ]
        for name, r, a in ragged:
            lines.append(
                f"| {name} | {r['batch']} x {r['length']} | {r['ns_per_token']:.2f} "
                f"| {a['batch']} x {a['length']} | {a['ns_per_token']:.2f} "
                f"| **{r['ns_per_token'] / a['ns_per_token']:.2f}** |"
            )
    lines += ["", "## Targets (on the largest size, `policy_loss` forward + backward)", ""]
    lines += [f"- {t}" for t in targets(report)]
    return "\n".join(lines) + "\n"


def step_seconds(result: dict) -> tuple[float, str]:
    """The jitted step's time per call that the bandwidth is taken over: the device's busy
    time where a trace gave it, else the pipelined wall time."""
    on_device = result["device_seconds"]["jit"]
    if on_device is not None:
        return on_device["busy"], "device busy"
    return result["pipelined_seconds"]["jit"], "pipelined"


def bandwidth(result: dict, peak: float) -> dict:
    """The jitted step's bandwidth by XLA's bytes accessed and by its inputs and outputs
    read or written once, each also as a fraction of the copy bandwidth ``peak``."""
    seconds, _ = step_seconds(result)
    accessed = result["bytes_accessed"]["jit"]
    once = result["input_bytes"] + result["output_bytes"]
    out = {"once": once / seconds, "once_fraction": once / seconds / peak}
    if accessed is not None:
        out |= {"accessed": accessed / seconds, "accessed_fraction": accessed / seconds / peak}
        looped = result.get("looped_seconds")
        if looped is not None:
            out["looped_fraction"] = accessed / looped / peak
    return out


def _micro(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e6


def _device_cells(result: dict) -> str:
    on_device = result["device_seconds"]
    floor, jit = on_device.get("floor"), on_device.get("jit")
    return (
        f"| {fmt(None if floor is None else floor['busy'] * 1e6, '.0f')} "
        f"| {fmt(None if jit is None else jit['busy'] * 1e6, '.0f')} "
        f"| {fmt(None if jit is None else jit['span'] * 1e6, '.0f')} "
        f"| {fmt(None if jit is None else jit['kernels'], '.0f')} "
    )


def bandwidth_section(report: dict) -> list[str]:
    copy = report.get("copy_bandwidth")
    if copy is None:
        return []
    peak = copy["bytes_per_second"]
    basis = {step_seconds(r)[1] for r in report["results"]}
    lines = [
        "",
        f"## Memory bandwidth ({report['pipeline']} calls back to back, one wait)",
        "",
        (
            f"Copy ceiling: `x + 1` on {copy['bytes'] // 2 / 2**20:.0f} MiB of float32 moves "
            f"{peak / 1e9:.0f} GB/s (read + write). *pipelined* is wall time per call; "
            "*device busy* sums the kernels' and copies' durations on the device's streams "
            "in a profiler trace of the same calls (no host dispatch), *span* runs from a "
            "call's first kernel to its last. *accessed* is what XLA's cost analysis says "
            "the compiled step reads and writes; *once* counts its inputs read once and its "
            f"outputs written once (the least any implementation moves). GB/s are taken "
            f"over the {' / '.join(sorted(basis))} time. *dispatch* is the host's time per "
            "call to dispatch the same calls (where it is close to *pipelined*, the host sets "
            f"the wall time); *looped* is the wall time per step of {report['pipeline']} steps "
            "in one program (`lax.fori_loop`, one dispatch), and *looped % of copy* the "
            "bytes accessed over it."
        ),
        "",
        (
            "| computation | [B, T] | floor pipelined µs | jit pipelined µs | jit dispatch µs "
            "| jit looped µs | floor device busy µs | jit device busy µs | jit span µs | kernels "
            "| accessed MB | **accessed GB/s** | **% of copy** | looped % of copy | once MB "
            "| once GB/s | % of copy |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        bw = bandwidth(r, peak)
        accessed = r["bytes_accessed"]["jit"]
        lines.append(
            f"| {r['computation']} | {r['batch']} x {r['length']} "
            f"| {r['pipelined_seconds']['floor'] * 1e6:.0f} "
            f"| {r['pipelined_seconds']['jit'] * 1e6:.0f} "
            f"| {fmt(_micro(r.get('dispatch_seconds')), '.0f')} "
            f"| {fmt(_micro(r.get('looped_seconds')), '.0f')} "
            + _device_cells(r)
            + f"| {fmt(None if accessed is None else accessed / 1e6, '.1f')} "
            f"| **{fmt(None if accessed is None else bw['accessed'] / 1e9, '.0f')}** "
            f"| **{fmt(bw.get('accessed_fraction'), '.0%')}** "
            f"| {fmt(bw.get('looped_fraction'), '.0%')} "
            f"| {(r['input_bytes'] + r['output_bytes']) / 1e6:.1f} "
            f"| {bw['once'] / 1e9:.0f} | {bw['once_fraction']:.0%} |"
        )
    return lines


def ragged_rows(report: dict) -> list[tuple[str, dict, dict]]:
    """Each row whose T is not a multiple of 128, with its aligned neighbour, if measured."""
    out = []
    for r in report["results"]:
        if r["length"] % 128 == 0:
            continue
        aligned = workloads.nearest_aligned(r["length"])
        for a in report["results"]:
            same = (a["computation"], a["batch"]) == (r["computation"], r["batch"])
            if same and a["length"] == aligned:
                out.append((r["computation"], r, a))
    return out


def targets(report: dict) -> list[str]:
    """The targets, evaluated on this run (information, not a test)."""
    rows = [r for r in report["results"] if r["computation"] == "loss"]
    if not rows:
        return []
    big = rows[-1]
    per_token = [r["ns_per_token"] / rows[0]["ns_per_token"] for r in rows]
    slowest_other = [
        (r["seconds"][v] / r["seconds"]["jit"], v, r["batch"], r["length"])
        for r in report["results"]
        for v in ("op_by_op", "numpy")
        if v in r["seconds"]
    ]

    def mark(ok):
        return "met" if ok else "**not met**"

    out = [
        (
            f"jit / floor = {big['ratio_to_floor']['jit']:.2f} (target <= 8): "
            f"{mark(big['ratio_to_floor']['jit'] <= 8)}"
        ),
        (
            f"compile = {big['compile_seconds']:.2f} s (target < 2 s): "
            f"{mark(big['compile_seconds'] < 2)}"
        ),
    ]
    if big["temp_to_input"] is not None:
        out.append(
            f"temp / input = {big['temp_to_input']:.2f} (target <= 2): "
            f"{mark(big['temp_to_input'] <= 2)}"
        )
    spread = max(abs(p - 1) for p in per_token)
    out.append(
        "time per token vs the smallest size: "
        + ", ".join(f"{p:.2f}" for p in per_token)
        + f" (target within ±25%): {mark(spread <= 0.25)}"
    )
    copy = report.get("copy_bandwidth")
    if copy is not None:
        bw = bandwidth(big, copy["bytes_per_second"])
        if "accessed_fraction" in bw:
            out.append(
                f"bandwidth ({step_seconds(big)[1]} time) = {bw['accessed_fraction']:.0%} of the "
                f"copy's by the bytes XLA accesses, {bw['once_fraction']:.0%} by the bytes "
                "read and written once "
                f"(target >= 50% on an accelerator): {mark(bw['accessed_fraction'] >= 0.5)}"
            )
        if "looped_fraction" in bw:
            out.append(
                f"bandwidth over the wall time of {report['pipeline']} steps in one program = "
                f"{bw['looped_fraction']:.0%} of the copy's by the bytes XLA accesses "
                f"(target >= 50% on an accelerator): {mark(bw['looped_fraction'] >= 0.5)}"
            )
    trm = [r for r in report["results"] if r["computation"] == "loss_trm_icepop"]
    if trm:
        ratio = trm[-1]["ns_per_token"] / big["ns_per_token"]
        out.append(
            f"Trust Region Masking + IcePop loss / mis.yaml loss, time per token = "
            f"{ratio:.2f} (target <= 1.5): {mark(ratio <= 1.5)}"
        )
    if slowest_other:
        speedup, variant, b, t = min(slowest_other)
        out.append(
            f"slowest alternative is {speedup:.1f}x the jit time ({variant} at {b} x {t}; "
            f"target: jit never slower, > 1): {mark(speedup > 1)}"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help=f"comma-separated BxT batch sizes (default {DEFAULT_SIZES})",
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per variant first")
    parser.add_argument(
        "--compile-repeats", type=int, default=3, help="cold compiles per computation and size"
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=HERE,
        help="directory for results.md and results.json (default: benchmarks/)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help=f"smoke test: sizes {TINY_SIZES}, 2 repeats, 1 warm-up and compile",
    )
    parser.add_argument(
        "--ragged",
        action="store_true",
        help=f"sizes {workloads.RAGGED_SIZES}: odd and prime T beside the nearest multiple "
        "of 128 (time per token within 1.25x)",
    )
    parser.add_argument(
        "--pipeline",
        type=int,
        default=20,
        help="calls dispatched back to back for the bandwidth columns (default 20)",
    )
    parser.add_argument(
        "--copy-bytes",
        type=int,
        default=None,
        help="bytes of the copy ceiling's buffer (default 1 GiB)",
    )
    parser.add_argument("--no-op-by-op", action="store_true", help="skip the op-by-op JAX variant")
    parser.add_argument("--no-numpy", action="store_true", help="skip the NumPy oracle")
    parser.add_argument("--note", default="", help="free text added to results.md")
    parser.add_argument(
        "--against",
        type=pathlib.Path,
        default=None,
        help="a previous results.json: add a table of jit / floor now vs then (a ratio "
        "above 1.10 is flagged; the committed benchmarks/results.json is the baseline)",
    )
    parser.add_argument(
        "--cpus",
        type=int,
        default=None,
        help="pin the run to the first N CPUs before JAX starts its thread "
        "pool (1: XLA:CPU runs every kernel on one thread)",
    )
    args = parser.parse_args(argv)
    if args.cpus is not None:
        available = sorted(os.sched_getaffinity(0))
        if not 1 <= args.cpus <= len(available):
            parser.error(f"--cpus must be between 1 and {len(available)}, got {args.cpus}")
        # Threads inherit the affinity of the thread that starts them, and JAX starts
        # XLA's thread pool on first use, below: so pinning here pins all of it.
        os.sched_setaffinity(0, set(available[: args.cpus]))
    if args.ragged:
        args.sizes = workloads.RAGGED_SIZES
    if args.tiny:
        args.sizes, args.repeats, args.warmup, args.compile_repeats = TINY_SIZES, 2, 1, 1
        args.pipeline, args.copy_bytes = 4, args.copy_bytes or 2**24
    sizes = parse_sizes(args.sizes)

    env = environment()
    print(f"backend: {env['backend']}; device: {env['device']}; jax {env['jax']}", flush=True)
    numpy_reference = None if args.no_numpy else workloads.load_numpy_reference()
    if numpy_reference is None and not args.no_numpy:
        print("tests/numpy_reference.py not found: the NumPy column is skipped", flush=True)
    extra = sys.argv[1:] if argv is None else argv
    report = {
        "command": "python -m benchmarks.run" + (" " + shlex.join(extra) if extra else ""),
        "environment": env,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "note": args.note,
        "load_before": os.getloadavg()[0],
        "busy_before": busy_processes(),
        "pipeline": args.pipeline,
        "copy_bandwidth": copy_bandwidth(
            args.copy_bytes or DEFAULT_COPY_BYTES, args.pipeline, args.repeats
        ),
        "results": [],
    }
    with tqdm(total=len(sizes) * 2 * 2 * args.repeats, desc="benchmark", unit="round") as progress:
        for batch, length in sizes:
            for comp in workloads.computations(batch, length, numpy_reference):
                progress.set_postfix_str(f"{comp.name} {batch}x{length}")
                result = measure(comp, args, progress)
                report["results"].append(
                    {"computation": comp.name, "batch": batch, "length": length, **result}
                )
    report["load_after"] = os.getloadavg()[0]
    report["busy_after"] = busy_processes()

    args.out.mkdir(parents=True, exist_ok=True)
    text = markdown(report)
    if args.against is not None:
        text += against(report, json.loads(args.against.read_text()), args.against)
    (args.out / "results.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    print(text)
    print(f"wrote {args.out / 'results.md'} and {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
