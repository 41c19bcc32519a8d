"""Run the comparison: every selected algorithm × every seed, all in one compiled program."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax.demo import train
from offpolicy_jax.demo.train import Mismatch, TrainConfig

#: The default preset's rows (the table of docs/demo.md).
DEFAULT_ALGORITHMS = (
    "ppo:no-mismatch",
    "ppo",
    "bypass_ppo",
    "decoupled_ppo+is",
    *(f"decoupled_ppo+tis{c:g}" for c in train.TIS_CAPS),
    "decoupled_ppo+mis",
    "reinforce_is+mis",
)


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Everything one demo run depends on."""

    steps: int = 300
    seeds: int = 3
    algorithms: tuple[str, ...] = DEFAULT_ALGORITHMS
    mismatch: Mismatch = dataclasses.field(default_factory=Mismatch)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    threshold: float = 0.9
    chunk: int = 10
    #: The name of the :data:`PRESETS` entry this config started from (for the reports).
    preset: str = "default"
    #: Steps (1-based) whose training batches :func:`run` keeps in ``History.dumps``
    #: (the ``--dump-logprobs`` files); empty = none, and the step returns no batch.
    dump_steps: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "algorithms", tuple(self.algorithms))
        if self.steps < 1:
            raise ValueError(f"steps must be a positive integer, got {self.steps}")
        if self.seeds < 1:
            raise ValueError(f"seeds must be a positive integer, got {self.seeds}")
        if not self.algorithms:
            raise ValueError("algorithms: choose at least one")
        for a in self.algorithms:
            train.row(a)  # ValueError naming an unknown row or LossConfig field
        if len(set(self.algorithms)) != len(self.algorithms):
            raise ValueError("algorithms: each may appear once")
        if self.mismatch.source not in train.MISMATCH_SOURCES:
            raise ValueError(
                f"unknown mismatch source {self.mismatch.source!r} "
                f"(choose from {', '.join(train.MISMATCH_SOURCES)})"
            )
        if not 0 <= self.mismatch.severity < float("inf"):
            raise ValueError(f"severity must be >= 0, got {self.mismatch.severity}")
        if self.mismatch.staleness() > train.MAX_STALENESS:
            raise ValueError(
                f"a stale engine can be at most {train.MAX_STALENESS} updates "
                f"behind, got severity {self.mismatch.severity:g}"
            )
        self._check_routing()
        self._check_async()
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if not 0 < self.train.learning_rate < float("inf"):
            raise ValueError(f"learning rate must be positive, got {self.train.learning_rate}")
        if self.train.trainer_logprobs not in train.TRAINER_LOGPROBS:
            raise ValueError(
                f"trainer log-probs must be one of {', '.join(train.TRAINER_LOGPROBS)}, "
                f"got {self.train.trainer_logprobs!r}"
            )
        object.__setattr__(self, "dump_steps", tuple(sorted(set(self.dump_steps))))
        if any(not 1 <= s <= self.steps for s in self.dump_steps):
            raise ValueError(f"dump_steps must lie in [1, {self.steps}], got {self.dump_steps}")
        if self.train.prompts_per_step % self.train.minibatches:
            raise ValueError("prompts_per_step must be a multiple of minibatches")

    def _check_async(self) -> None:
        """Rows that read policy versions need the ``async`` mismatch (a dense policy)."""
        asynchronous = self.mismatch.source == "async" and self.mismatch.staleness() > 0
        readers = [a for a in self.algorithms if train.reads_versions(train.row(a).loss)]
        if readers and not asynchronous:
            raise ValueError(
                f"rows {', '.join(readers)} read per-token policy versions: they need the async "
                "mismatch with severity >= 1 (--mismatch async)"
            )
        if self.mismatch.source == "async" and self.train.n_experts:
            raise ValueError("the async mismatch needs a dense policy (n_experts = 0)")

    def _check_routing(self) -> None:
        """The routed-policy settings: experts, top-k, and what needs them."""
        experts, top_k = self.train.n_experts, self.train.top_k
        if experts < 0 or (experts and not 1 <= top_k <= experts):
            raise ValueError(
                f"n_experts must be >= 0 and top_k in [1, n_experts], got n_experts={experts}, "
                f"top_k={top_k}"
            )
        source = self.mismatch.source
        if source in train.ROUTED_SOURCES and not experts and self.mismatch.severity > 0:
            raise ValueError(
                f"the {source} mismatch needs a routed policy: set n_experts (--experts N)"
            )
        replaying = [a for a in self.algorithms if train.row(a).routing_replay]
        if replaying and not experts:
            raise ValueError(
                f"routing replay ({', '.join(replaying)}) needs a routed policy: set n_experts "
                "(--experts N)"
            )
        if source == "fp8" and self.mismatch.severity not in (0, *train.FP8_SEVERITY):
            raise ValueError(
                "fp8 severity must be 1 (e4m3) or 2 (e5m2) (0: no mismatch), got "
                f"{self.mismatch.severity:g}"
            )


#: Named settings of the demo (``offpolicy-jax demo --preset NAME``); flags override them.
#: docs/demo.md reports both, and ``offpolicy_jax.demo.sweep`` how "collapse" was found.
PRESETS: dict[str, DemoConfig] = {
    "default": DemoConfig(),
    # The sweep's setting where rewards fell and stayed down (docs/demo.md, "The collapse preset"):
    # an engine 128 updates stale, 3x the default learning rate, twice as long.
    "collapse": DemoConfig(
        steps=600,
        algorithms=(
            "ppo:no-mismatch",
            "ppo",
            "decoupled_ppo+is",
            "decoupled_ppo+tis1.5",
            "decoupled_ppo+tis2",
        ),
        mismatch=Mismatch("stale", 128),
        train=TrainConfig(learning_rate=3e-3),
        preset="collapse",
    ),
    # docs/demo_moe.md: a 4-expert top-1 routed policy whose engine flips about a third
    # of the routing decisions (severity 30), lr 1e-2 without gradient clipping: the
    # MoE sweep's setting 0, where uncorrected ppo collapsed and IS / TIS / replay did not.
    "router": DemoConfig(
        steps=300,
        algorithms=(
            "ppo:no-mismatch",
            "ppo",
            "decoupled_ppo+is",
            "decoupled_ppo+tis2",
            "decoupled_ppo+mis",
            "decoupled_ppo+icepop",
            "ppo+replay",
        ),
        mismatch=Mismatch("router", 30),
        train=TrainConfig(n_experts=4, top_k=1, learning_rate=1e-2, max_grad_norm=0.0),
        chunk=20,
        preset="router",
    ),
    # docs/guide/async.md, "In the demo": asynchronous RL, every batch mixing policy
    # versions 0..8 updates old; the staleness rule and the proximal approximation as rows.
    "async": DemoConfig(
        algorithms=(
            "ppo:no-mismatch",
            "ppo",
            "decoupled_ppo+mis",
            f"decoupled_ppo+mis+staleness{train.ASYNC_MAX_STALENESS}",
            "decoupled_ppo+mis+loglinear",
            "decoupled_ppo+mis+linear",
        ),
        mismatch=Mismatch("async", train.DEFAULT_SEVERITY["async"]),
        preset="async",
    ),
}


@dataclasses.dataclass
class History:
    """Per-step metrics: ``metrics[algorithm][name]`` is a float array ``[steps, seeds]``.

    ``dumps[algorithm][key]`` (``key`` in :data:`train.DUMP_KEYS`) holds the training
    batches of ``config.dump_steps``: ``[len(dump_steps), seeds, B, n]`` (advantages
    ``[..., B]``); empty without dump steps.
    """

    config: DemoConfig
    metrics: dict[str, dict[str, np.ndarray]]
    seconds: float
    dumps: dict[str, dict[str, np.ndarray]] = dataclasses.field(default_factory=dict)


def dump_steps(steps: int, count: int) -> tuple[int, ...]:
    """``count`` steps spread evenly over a run of ``steps``, the last one included."""
    count = min(count, steps)
    return tuple(sorted({int(round(x)) for x in np.linspace(steps / count, steps, count)}))


def run(config: DemoConfig, progress: Callable[[int], None] | None = None) -> History:
    """Train every (algorithm, seed) pair for ``config.steps`` steps.

    ``progress(n)`` is called after every chunk with the number of steps just done.
    Seed ``s`` starts from the same weights and sees the same prompts for every algorithm.
    """
    start = time.perf_counter()
    algos = [train.row(a) for a in config.algorithms]
    seeds = list(range(config.seeds))
    graphdef, state = train.init_state(config.train, config.mismatch, seeds)
    # Runs are algorithm-major: row r = (algorithm r // S, seed r % S).
    state = jax.tree.map(lambda x: jnp.concatenate([x] * len(algos)), state)
    algo_index = jnp.repeat(jnp.arange(len(algos), dtype=jnp.int32), len(seeds))
    mismatched = jnp.repeat(jnp.array([a.mismatch for a in algos]), len(seeds))
    dumping = bool(config.dump_steps)
    step = train.make_train_step(graphdef, config.train, algos, config.mismatch, dump=dumping)
    runner = train.make_chunk_runner(step)

    keys = jax.vmap(lambda s: jax.random.split(jax.random.key(s), config.steps))(
        jnp.array(seeds)
    )  # [S, steps]
    keys = jnp.tile(keys.T, (1, len(algos)))  # [steps, R]
    chunks, batches = [], []
    wanted = np.asarray(config.dump_steps, int) - 1  # 0-based
    for lo in range(0, config.steps, config.chunk):
        state, met = runner(state, keys[lo : lo + config.chunk], algo_index, mismatched)
        met = jax.device_get(met)
        if dumping:  # keep only the dump steps' batches: [k, R, ...]
            here = wanted[(wanted >= lo) & (wanted < lo + config.chunk)] - lo
            batches.append({k: met.pop(f"dump/{k}")[here] for k in train.DUMP_KEYS})
        chunks.append(met)
        if progress:
            progress(len(chunks[-1]["reward"]))
    merged = {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}
    dumps = {}
    if dumping:
        stacked = {k: np.concatenate([b[k] for b in batches]) for k in train.DUMP_KEYS}
        dumps = {
            a.name: {k: v[:, i * len(seeds) : (i + 1) * len(seeds)] for k, v in stacked.items()}
            for i, a in enumerate(algos)
        }
    metrics = {
        a.name: {
            k: v[:, i * len(seeds) : (i + 1) * len(seeds)].astype(np.float64)
            for k, v in merged.items()
        }
        for i, a in enumerate(algos)
    }
    return History(config, metrics, time.perf_counter() - start, dumps)
