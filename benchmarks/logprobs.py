"""Memory and time of ``token_logprobs_from_hidden`` against the naive log-softmax.

``python -m benchmarks.logprobs`` compiles, at each ``[B, T, D, V]``, the forward +
backward (gradient w.r.t. the hidden states and the unembedding) of
``sum(g · log π(y))`` two ways in the same process:

* **naive**: ``jax.nn.log_softmax(hidden @ W / τ)`` gathered at the tokens, which
  materialises ``[B, T, V]`` float32 logits (and their gradient);
* **chunked**: ``opj.token_logprobs_from_hidden(..., chunk_size=C)``.

It reports XLA's compiled temporary memory (``memory_analysis().temp_size_in_bytes``)
and, for the sizes listed in ``--time``, the median wall time of ``--repeats`` calls
after one warm-up (timing the largest vocabulary on a small CPU machine takes minutes,
so by default it is compiled for memory only). Results go to
``benchmarks/logprobs_results.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

DEFAULT_SIZES = "4x2048x512x32768,4x2048x512x65536,4x2048x512x131072"
DEFAULT_TIME = "4x2048x512x32768,4x2048x512x65536"
TINY_SIZES = "2x64x16x256"


def parse_sizes(text: str) -> list[tuple[int, int, int, int]]:
    sizes = []
    for item in filter(None, text.split(",")):
        parts = item.lower().split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"--sizes: expected BxTxDxV items, got {item!r}")
        sizes.append(tuple(int(p) for p in parts))
    return sizes


def measure(size, chunk_size: int, repeats: int, timed: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import offpolicy_jax as opj

    b, t, d, v = size
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    unembedding = jnp.asarray(rng.normal(size=(d, v)) / np.sqrt(d), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, v, size=(b, t)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(b, t)), jnp.float32)

    def naive(h, w, tok, g):
        logp = jax.nn.log_softmax(h @ w / 0.9, axis=-1)
        return jnp.sum(g * jnp.take_along_axis(logp, tok[..., None], axis=-1)[..., 0])

    def chunked(h, w, tok, g):
        logp = opj.token_logprobs_from_hidden(h, w, tok, temperature=0.9, chunk_size=chunk_size)
        return jnp.sum(g * logp)

    args = (hidden, unembedding, tokens, weights)
    row = {"size": list(size), "chunk_size": chunk_size}
    compiled = {}
    for name, fn in (("naive", naive), ("chunked", chunked)):
        start = time.perf_counter()
        exe = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(*args).compile()
        row[f"{name}_compile_s"] = time.perf_counter() - start
        row[f"{name}_temp_bytes"] = int(exe.memory_analysis().temp_size_in_bytes)
        compiled[name] = exe
    if timed:
        outs = {}
        for name, exe in compiled.items():
            outs[name] = jax.block_until_ready(exe(*args))  # warm-up
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                jax.block_until_ready(exe(*args))
                times.append(time.perf_counter() - start)
            row[f"{name}_s"] = float(np.median(times))
        (ln, (dhn, dwn)), (lc, (dhc, dwc)) = outs["naive"], outs["chunked"]
        row["max_rel_grad_diff"] = float(
            max(
                jnp.max(jnp.abs(dhn - dhc)) / jnp.max(jnp.abs(dhn)),
                jnp.max(jnp.abs(dwn - dwc)) / jnp.max(jnp.abs(dwn)),
            )
        )
        row["loss_rel_diff"] = float(abs(ln - lc) / abs(ln))
    return row


def _seconds(x: float) -> str:
    return f"{x:.2f} s" if x >= 1 else f"{x * 1e3:.2f} ms"


def render(rows: list[dict], command: str) -> str:
    import jax

    lines = [
        "# token_logprobs_from_hidden vs. naive log-softmax (forward + backward)",
        "",
        f"Command: `{command}`  ",
        f"jax {jax.__version__}, backend {jax.default_backend()}, "
        f"{os.cpu_count()} CPUs ({platform.machine()}), float32, temperature 0.9, "
        "gradient w.r.t. hidden and unembedding.",
        "",
        "| [B, T, D, V] | chunk | naive temp | chunked temp | ratio | naive time | "
        "chunked time | time ratio | max rel. grad diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mem_ratio = r["chunked_temp_bytes"] / r["naive_temp_bytes"]
        if "naive_s" in r:
            times = (
                f"{_seconds(r['naive_s'])} | {_seconds(r['chunked_s'])} | "
                f"{r['chunked_s'] / r['naive_s']:.2f} | {r['max_rel_grad_diff']:.1e}"
            )
        else:
            times = "not timed | not timed | | "
        lines.append(
            f"| {' x '.join(map(str, r['size']))} | {r['chunk_size']} | "
            f"{r['naive_temp_bytes'] / 2**20:.0f} MiB | "
            f"{r['chunked_temp_bytes'] / 2**20:.0f} MiB | 1/{1 / mem_ratio:.1f} | {times} |"
        )
    lines += [
        "",
        "temp = XLA's compiled temporary buffers of the jitted `value_and_grad` "
        "(`memory_analysis().temp_size_in_bytes`); times are medians after one warm-up. "
        f"1-minute load average at the end of the run: {os.getloadavg()[0]:.1f}.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="BxTxDxV,... (default %(default)s)")
    parser.add_argument(
        "--time", default=DEFAULT_TIME, help="sizes also timed (default %(default)s); 'all'"
    )
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help=f"sizes {TINY_SIZES}, all timed")
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    args = parser.parse_args(argv)
    if args.chunk_size < 1 or args.repeats < 1:
        raise SystemExit("--chunk-size and --repeats must be >= 1")
    sizes = parse_sizes(TINY_SIZES if args.tiny else args.sizes)
    timed = set(sizes) if args.tiny or args.time == "all" else set(parse_sizes(args.time))
    rows = []
    for size in sizes:
        row = measure(size, args.chunk_size, args.repeats, size in timed)
        print(json.dumps(row), flush=True)
        rows.append(row)
    command = (
        "python -m benchmarks.logprobs"
        + (" " + " ".join(argv if argv is not None else os.sys.argv[1:])).rstrip()
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "logprobs_results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "logprobs_results.md"), "w") as f:
        f.write(render(rows, command))
    print(render(rows, command))


if __name__ == "__main__":
    main()
