"""``offpolicy-jax diagnose`` on a Parquet dump larger than it ever holds in memory.

Writes a synthetic dump of ``--gb`` gigabytes on disk (one row per sequence, list
columns ``old_log_probs`` / ``rollout_log_probs`` float32 and ``response_mask`` int8,
lengths uniform in [64, 1024]), runs :func:`offpolicy_jax.diagnose.diagnose` on it and
prints wall time, tokens/s and the peak resident set size of the process, then deletes
the dump unless ``--keep``. Run it niced; the dump goes to ``--dir`` (default: a
temporary directory)::

    nice python benchmarks/diagnose_big.py --gb 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def generate(path: Path, gigabytes: float, seed: int = 0, rows_per_group: int = 8192) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    target = int(gigabytes * 1e9)
    schema = pa.schema(
        [
            ("old_log_probs", pa.list_(pa.float32())),
            ("rollout_log_probs", pa.list_(pa.float32())),
            ("response_mask", pa.list_(pa.int8())),
        ]
    )
    rows = tokens = 0
    with pq.ParquetWriter(path, schema) as writer:
        while os.path.getsize(path) < target:
            lengths = rng.integers(64, 1025, rows_per_group)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            n = int(offsets[-1])
            old = -rng.exponential(1.0, n).astype(np.float32)
            drift = np.repeat(rng.normal(0, 0.01, rows_per_group), lengths).astype(np.float32)
            noise = rng.normal(0, 0.05, n).astype(np.float32)
            rollout = np.minimum(old + noise + drift, -1e-6).astype(np.float32)
            mask = np.ones(n, np.int8)
            off = pa.array(offsets)
            table = pa.Table.from_arrays(
                [pa.ListArray.from_arrays(off, pa.array(v)) for v in (old, rollout, mask)],
                schema=schema,
            )
            writer.write_table(table)
            rows += rows_per_group
            tokens += n
    return {"rows": rows, "tokens": tokens, "bytes": os.path.getsize(path)}


def measure(path: Path, out: Path, chunk_rows: int, configs_per_program: int) -> dict:
    """Runs diagnose in this process; peak RSS is this process's (a fresh one)."""
    from offpolicy_jax.diagnose import analysis, diagnose

    analysis.CONFIGS_PER_PROGRAM = configs_per_program
    start = time.perf_counter()
    report = diagnose(path, out, chunk_rows=chunk_rows, progress=True)
    seconds = time.perf_counter() - start
    tokens = report["totals"]["tokens"]
    return {
        "tokens_seen": tokens,
        "sequences_seen": report["totals"]["sequences"],
        "diagnose_s": round(seconds, 1),
        "tokens_per_s": round(tokens / seconds),
        "peak_rss_mib": _peak_rss_mib(),
        "recommendation": report["recommendation"]["name"],
        "configs_per_program": configs_per_program,
    }


def _peak_rss_mib() -> int:
    """This process's own peak RSS. Linux's ``ru_maxrss`` would carry the forking
    parent's (the generator's) high-water mark across ``execve``; VmHWM does not."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024)  # kB
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # not Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="dump size on disk (GB)")
    parser.add_argument("--dir", default=None, help="where to write the dump")
    parser.add_argument("--chunk-rows", type=int, default=1024)
    parser.add_argument("--keep", action="store_true", help="do not delete the dump")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument(
        "--configs-per-program",
        type=int,
        nargs="+",
        default=[4, 10],
        help="candidate corrections per compiled program, one diagnose run each "
        "(the library's default first; 10 is all in one program)",
    )
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args()
    if args.measure:
        out = Path(args.measure).parent / "out"
        per = args.configs_per_program[0]
        print(json.dumps(measure(Path(args.measure), out, args.chunk_rows, per)))
        return

    workdir = Path(args.dir or tempfile.mkdtemp(prefix="diagnose_big_"))
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "dump.parquet"
    try:
        start = time.perf_counter()
        info = generate(path, args.gb)
        info["generate_s"] = round(time.perf_counter() - start, 1)
        print(f"wrote {info['bytes'] / 1e9:.2f} GB: {info}", flush=True)
        runs = []
        for per in args.configs_per_program:
            # A fresh process, so that its peak RSS is diagnose's and not the generator's.
            child = [sys.executable, __file__, "--measure", str(path)]
            child += ["--chunk-rows", str(args.chunk_rows), "--configs-per-program", str(per)]
            done = subprocess.run(child, stdout=subprocess.PIPE, text=True, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        result = {**info, "runs": runs, "cpus": len(os.sched_getaffinity(0))}
        print(json.dumps(result, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
