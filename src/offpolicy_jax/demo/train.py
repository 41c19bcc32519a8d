"""The trainer: GRPO-style RL on the digit task, with a separate rollout engine.

Every (algorithm, seed) run is one row of a batched state, trained by ONE jitted step:
the engine samples a batch and reports its log-probs, the trainer recomputes float32
log-probs of the same tokens, and the policy is updated with ``opj.policy_loss`` on a few
minibatches. The algorithms differ only in their (static) ``LossConfig``; a
``lax.switch`` on each row's algorithm index picks its loss, so all runs share one
compiled program and advance together. Steps are ``lax.scan``-ned in chunks so that a
progress bar can follow.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import offpolicy_jax as opj
from offpolicy_jax.correction import topk_divergence
from offpolicy_jax.demo import engine, task
from offpolicy_jax.demo.model import Policy, Routing

Array = jax.Array

MISMATCH_SOURCES = ("precision", "stale", "sampling", "router", "fp8", "async")
#: Sources that need a routed (MoE) policy (``TrainConfig.n_experts > 0``).
ROUTED_SOURCES = ("router",)
#: The ``router`` engine's perturbation per unit of severity, in units of each token's
#: router-logit standard deviation: calibrated so that severity s flips about s% of the
#: routing decisions of a freshly initialised 4-expert top-1 policy (the share then moves
#: with training; ``route_flip_fraction`` reports it).
ROUTER_NOISE_PER_SEVERITY = 0.03
#: ``fp8`` severities: 1 = e4m3 weights and matmul inputs, 2 = e5m2.
FP8_SEVERITY = {1: "e4m3", 2: "e5m2"}
TRAINER_LOGPROBS = ("raw", "sampler")
#: Default severity per source. The stale default is deliberately severe: in this tiny
#: problem milder mismatches give smaller gaps (docs/demo.md has the numbers).
DEFAULT_SEVERITY = {
    "stale": 64.0,
    "precision": 1.0,
    "sampling": 1.0,
    "router": 10.0,
    "fp8": 1.0,
    "async": 8.0,
}
MAX_STALENESS = 256

#: The reference rollout-correction settings, as shipped with the package (mis.yaml).
MIS = opj.CorrectionConfig.from_yaml(
    importlib.resources.files("offpolicy_jax").joinpath("configs", "mis.yaml").read_text()
)


#: The caps C of the truncated-IS sweep (Yao et al. 2025 use C = 2).
TIS_CAPS = (1.5, 2.0, 5.0, 10.0)
#: "No cap": ``VanillaTIS(clip=math.inf)`` is the untruncated ("vanilla") IS weight.
NO_CAP = math.inf
#: The monitor's bound (``CorrectionConfig`` bounds must be finite): the largest float32,
#: so ``min(w, bound) = w`` for every finite weight.
_MONITOR_BOUND = float(np.finfo(np.float32).max)
#: The C of the ``is_weight_above_2`` diagnostic: the paper's cap, the same for every row.
DIAGNOSTIC_CAP = 2.0


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One row of the comparison: a library ``LossConfig``, and whether the engine mismatches.

    ``name`` is ``algorithm[+correction]`` in the library's words (``is`` = untruncated
    importance weight, ``tis<C>`` = weight truncated at C, ``mis`` = the shipped
    mis.yaml); the row without mismatch is ``ppo:no-mismatch``.
    """

    name: str
    label: str
    loss: opj.LossConfig
    mismatch: bool = True
    #: Routing replay (R3): the trainer routes each token through the experts the engine
    #: used (a routed policy only); row names end in ``+replay``.
    routing_replay: bool = False


#: IcePop's band (verl ``decoupled_token_icepop``, ``rollout_is_threshold "0.5_5.0"``):
#: token weight π_old/π_rollout kept inside [0.5, 5], set to 0 outside (no gradient).
ICEPOP = opj.CorrectionConfig(
    use_tis=True, tis_level="token", tis_mode="band", tis_lower_bound=0.5, tis_upper_bound=5.0
)

#: ``offpolicy-jax diagnose``'s severe-mismatch recommendation (``geo_rs_veto``): token TIS
#: at 2, sequences rejected when their geometric-mean ratio leaves [0.98, 1.02], and
#: sequences with a token ratio below 1e-4 vetoed.
GEO_RS_VETO = opj.CorrectionConfig(
    use_tis=True,
    tis_level="token",
    tis_mode="truncate",
    tis_upper_bound=2.0,
    use_rs=True,
    rs_level="geometric",
    rs_lower_bound=0.98,
    rs_upper_bound=1.02,
    rs_veto_threshold=1e-4,
)

#: KPop's φ (verl ``rollout_rs: binary_kl``): the KPop paper's and prime-rl's default 0.1,
#: and verl's default 2.0. A token is kept iff the binary KL of its probability under π_old
#: and π_rollout is within φ in both directions; at 2.0 that needs near-certain disagreement
#: (π_old = 0.5 against π_rollout = 0.01 is 1.6), so verl's default rarely masks a token of
#: this demo (docs/demo_moe.md has the counts).
KPOP_PHI = 0.1
KPOP_PHI_VERL = 2.0


def _kpop(phi: float) -> opj.CorrectionConfig:
    """KPop as verl reads it: binary-KL rejection at φ, no importance weight."""
    return opj.CorrectionConfig.from_verl({"rollout_rs": "binary_kl", "rollout_rs_threshold": phi})


#: The engine's top-k for DPPO's top-k trust region: TRL's ``divergence_topk`` default 20,
#: capped at the demo's vocabulary of 11 tokens, so the "top-k" support is the whole
#: vocabulary and the row's divergence is the exact one (the rest bucket is empty).
DEMO_TOPK = min(20, task.VOCAB)

#: TRL's DPPO with the top-k TV trust region (``DPPOConfig(divergence_type="topk_tv")``):
#: the ratio against the engine's π_rollout (TRL's two-policy setup, ``bypass_ppo``), and
#: TRL's defaults ``epsilon = epsilon_high = 0.15``, ``clip_ratio_c = 20``.
DPPO_TOPK_TV = opj.LossConfig(
    algorithm="bypass_ppo",
    policy_loss="dppo_tv",
    clip_eps=0.15,
    clip_eps_high=0.15,
    dppo_ratio_cap=20.0,
    divergence_type="topk_tv",
    divergence_topk=DEMO_TOPK,
)

#: A row name ending in this (before any ``/`` override) trains with routing replay.
REPLAY_SUFFIX = "+replay"


def _tis(cap: float) -> opj.LossConfig:
    return opj.LossConfig(
        algorithm="decoupled_ppo", correction=opj.VanillaTIS(clip_low=0.0, clip=cap)
    )


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm(
            "ppo:no-mismatch",
            "ppo, engine without mismatch (reference)",
            opj.LossConfig(algorithm="ppo"),
            False,
        ),
        Algorithm("ppo", "ppo, mismatch ignored", opj.LossConfig(algorithm="ppo")),
        Algorithm("bypass_ppo", "bypass_ppo", opj.LossConfig(algorithm="bypass_ppo")),
        Algorithm("decoupled_ppo+is", "decoupled_ppo + IS, no cap", _tis(NO_CAP)),
        *(
            Algorithm(f"decoupled_ppo+tis{c:g}", f"decoupled_ppo + TIS, C = {c:g}", _tis(c))
            for c in TIS_CAPS
        ),
        Algorithm(
            "decoupled_ppo+mis",
            "decoupled_ppo + MIS (mis.yaml)",
            opj.LossConfig(algorithm="decoupled_ppo", correction=MIS),
        ),
        Algorithm(
            "reinforce_is+mis",
            "reinforce_is + MIS (mis.yaml)",
            opj.LossConfig(algorithm="reinforce_is", correction=MIS),
        ),
        Algorithm(
            "decoupled_ppo+icepop",
            "decoupled_ppo + IcePop band [0.5, 5]",
            opj.LossConfig(algorithm="decoupled_ppo", correction=ICEPOP),
        ),
        Algorithm(
            "decoupled_ppo+geo_rs_veto",
            "decoupled_ppo + TIS 2, geometric RS [0.98, 1.02], veto 1e-4",
            opj.LossConfig(algorithm="decoupled_ppo", correction=GEO_RS_VETO),
        ),
        *(
            Algorithm(
                name,
                f"decoupled_ppo + KPop, binary-KL rejection at φ = {phi:g} (verl)",
                opj.LossConfig(algorithm="decoupled_ppo", correction=_kpop(phi)),
            )
            for name, phi in (
                ("decoupled_ppo+kpop", KPOP_PHI),
                (f"decoupled_ppo+kpop{KPOP_PHI_VERL:g}", KPOP_PHI_VERL),
            )
        ),
        Algorithm(
            "bypass_ppo+topk_tv",
            f"DPPO, top-{DEMO_TOPK} TV trust region δ = 0.15 against π_rollout (TRL)",
            DPPO_TOPK_TV,
        ),
    )
}

#: The ``async`` mismatch's staleness rule: groups more than this many versions old leave
#: the loss (miles ``--max-weight-staleness``; the row ``decoupled_ppo+mis+staleness4``).
ASYNC_MAX_STALENESS = 4


# Rows of the asynchronous (``async``) mismatch: they read the per-token policy versions,
# so they need ``Mismatch("async", ...)`` (docs/guide/async.md, "In the demo").
ASYNC_ROWS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm(
            f"decoupled_ppo+mis+staleness{ASYNC_MAX_STALENESS}",
            f"decoupled_ppo + MIS, groups > {ASYNC_MAX_STALENESS} versions old rejected",
            opj.LossConfig(
                algorithm="decoupled_ppo",
                correction=dataclasses.replace(MIS, max_weight_staleness=ASYNC_MAX_STALENESS),
            ),
        ),
        *(
            Algorithm(
                f"decoupled_ppo+mis+{m}",
                f"decoupled_ppo + MIS, π_old approximated ({m}), no π_old pass",
                opj.LossConfig(algorithm="decoupled_ppo", correction=MIS, prox_logp_method=m),
            )
            for m in ("loglinear", "linear")
        ),
    )
}
ALGORITHMS.update(ASYNC_ROWS)


def reads_versions(loss: opj.LossConfig) -> bool:
    """Whether ``loss`` needs the per-token policy versions (the ``async`` mismatch)."""
    correction = loss.correction
    rule = isinstance(correction, opj.CorrectionConfig) and correction.uses_versions
    return rule or loss.approximates_old


def topk_of(loss: opj.LossConfig) -> int:
    """The engine's top-k ids per position that ``loss`` reads (DPPO's ``divergence_type``
    ``"topk_tv"`` / ``"topk_kl"``: its ``divergence_topk``), 0 for every other loss."""
    k = loss.divergence_topk
    if str(loss.divergence_type or "").startswith("topk_") and k is not None:
        return int(k)
    return 0


def needs_old_pass(loss: opj.LossConfig) -> bool:
    """Whether ``loss`` reads the recomputed π_old (``old_logp``): a forward pass."""
    return loss.algorithm in ("ppo", "decoupled_ppo") and not loss.approximates_old


#: The ``LossConfig`` field a bare override names: ``ROW/gspo`` = ``ROW/policy_loss=gspo``.
DEFAULT_OVERRIDE = "policy_loss"


def row(name: str) -> Algorithm:
    """The row called ``name``: ``ROW[/field=value]...``.

    ``ROW`` is a row of :data:`ALGORITHMS`, optionally followed by
    ``+replay`` (routing replay, R3: the trainer reuses the engine's expert choices;
    ``ppo+replay``, ``decoupled_ppo+tis2+replay``); each ``/field=value`` replaces
    one field of its ``opj.LossConfig`` (the value is read as a YAML scalar:
    ``/clip_eps=0.1``, ``/aggregation=token_mean``), and a bare ``/value`` sets
    :data:`DEFAULT_OVERRIDE` (``decoupled_ppo+mis/gspo`` is ``decoupled_ppo+mis`` with
    ``policy_loss="gspo"``). So any field of the library's ``LossConfig``, present or
    future, can be named in a row without a code change.

    Raises:
      ValueError: an unknown row or field, or a value ``LossConfig`` rejects.
    """
    import yaml

    base, *overrides = name.split("/")
    replay = base.endswith(REPLAY_SUFFIX) and base.removesuffix(REPLAY_SUFFIX) in ALGORITHMS
    if replay:
        base = base.removesuffix(REPLAY_SUFFIX)
    if base not in ALGORITHMS:
        raise ValueError(
            f"unknown algorithm {base!r} (choose from {', '.join(ALGORITHMS)}; any of them "
            f"may end in {REPLAY_SUFFIX})"
        )
    algo = ALGORITHMS[base]
    if replay:
        if not algo.mismatch:
            raise ValueError(f"row {name!r}: a row without mismatch has nothing to replay")
        label = algo.label + ", routing replay (R3)"
        algo = Algorithm(base + REPLAY_SUFFIX, label, algo.loss, algo.mismatch, True)
    if not overrides:
        return algo
    fields = list(opj.LossConfig.keys())  # its fields and every surrogate's hyperparameters
    changes: dict = {}
    for item in overrides:
        key, eq, text = item.partition("=")
        if not eq:
            key, text = DEFAULT_OVERRIDE, item
        if key not in fields or key in ("algorithm", "correction"):
            allowed = [f for f in fields if f not in ("algorithm", "correction")]
            raise ValueError(
                f"row {name!r}: {key!r} is not a LossConfig field that a row can set "
                f"(choose from {', '.join(allowed)}; the algorithm and correction are the "
                "row's own)"
            )
        try:
            changes[key] = yaml.safe_load(text) if text else None
        except yaml.YAMLError:
            changes[key] = text
    try:
        loss = dataclasses.replace(algo.loss, **changes)
    except (TypeError, ValueError) as e:
        raise ValueError(f"row {name!r}: {e}") from None
    label = algo.label + ", " + ", ".join(f"{k}={v}" for k, v in changes.items())
    return Algorithm(name, label, loss, algo.mismatch, algo.routing_replay)


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """Where the engine's numerics differ from the trainer's, and how much.

    ``severity`` 0 is no mismatch, larger is worse:

    - ``precision``: weights and activations keep ``8 - severity`` mantissa bits
      (1 = bfloat16's 7 bits, 5 = the 3 bits of fp8-e4m3; 7 and above keep 1 bit);
    - ``stale``: the engine samples with weights ``severity`` optimizer updates old,
      as an asynchronous RL system does (at most ``MAX_STALENESS``: the engine keeps
      that many copies of the weights per run);
    - ``sampling``: the engine samples at temperature ``1 + 0.25 * severity`` with
      top-p ``1 - 0.05 * severity`` (at least 0.05), which the trainer does not apply;
    - ``router`` (a routed policy): the engine picks experts by router logits perturbed
      by ``ROUTER_NOISE_PER_SEVERITY * severity`` times each token's router-logit standard
      deviation (Gaussian), so near-ties flip: severity ≈ the percentage of routing
      decisions that differ from the trainer's at equal weights at initialisation
      (measured each step: ``route_flip_fraction``);
    - ``fp8``: the engine's matmul weights and inputs in fp8 with per-tensor scales, the
      rest in bfloat16; severity 1 = e4m3, 2 = e5m2 (:data:`FP8_SEVERITY`);
    - ``async``: asynchronous RL with mixed versions per batch: each prompt group is
      sampled by the weights of ``d`` updates ago, ``d`` drawn uniformly from
      ``0..severity`` per group and step (from the step's key, so the same for every row
      of a seed); the trainer passes each token's version and the current one to the loss.
    """

    source: str = "stale"
    severity: float = DEFAULT_SEVERITY["stale"]

    def numerics(self) -> engine.Numerics:
        s = self.severity
        if self.source == "precision" and s > 0:
            return engine.Numerics(mantissa_bits=max(1, 8 - round(s)))
        if self.source == "sampling" and s > 0:
            return engine.Numerics(temperature=1.0 + 0.25 * s, top_p=max(0.05, 1.0 - 0.05 * s))
        if self.source == "router" and s > 0:
            return engine.Numerics(router_noise=ROUTER_NOISE_PER_SEVERITY * s)
        if self.source == "fp8" and s > 0:
            return engine.Numerics(fp8=FP8_SEVERITY[min(2, max(1, round(s)))])
        return engine.Numerics()

    def staleness(self) -> int:
        """The engine's ring of weights, in copies (0: none): ``severity`` for ``stale``,
        ``severity + 1`` for ``async`` (ages 0..severity)."""
        if self.source == "async" and round(self.severity) > 0:
            return round(self.severity) + 1
        return round(self.severity) if self.source == "stale" else 0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Model, batch and optimiser sizes."""

    prompt_len: int = 4
    d_model: int = 32
    n_heads: int = 2
    n_layers: int = 1
    prompts_per_step: int = 16
    group_size: int = 8
    minibatches: int = 2
    learning_rate: float = 1e-3
    #: Global-norm gradient clip; 0 or inf: no clipping.
    max_grad_norm: float = 1.0
    eval_prompts: int = 64
    #: How the trainer scores the sampled tokens: ``"raw"`` (``log_softmax`` of its
    #: logits, temperature 1, no top-p) or ``"sampler"`` (``opj.token_logprobs`` with
    #: the engine's temperature and top-p: the sampler-consistent log-prob).
    trainer_logprobs: str = "raw"
    #: Experts per block (0: the dense FFN) and how many each token is routed to.
    n_experts: int = 0
    top_k: int = 1
    #: The engine also returns its top-k ids and log-probs per position (0: no), and the
    #: metrics gain ``topk_tv`` and ``binary_kl`` (π_old against π_rollout). A row whose
    #: loss reads top-k log-probs turns this on with its own ``divergence_topk``.
    topk_logprobs: int = 0


def make_model(cfg: TrainConfig, seed: int | Array) -> Policy:
    return Policy(
        task.VOCAB,
        2 * cfg.prompt_len + 1,
        cfg.d_model,
        cfg.n_heads,
        cfg.n_layers,
        cfg.n_experts,
        cfg.top_k,
        rngs=nnx.Rngs(jax.random.key(seed)),
    )


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    if cfg.max_grad_norm in (0.0, math.inf):
        return optax.adam(cfg.learning_rate)
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), optax.adam(cfg.learning_rate))


def token_logp(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens: Array,
    n: int,
    sampler: tuple[Array, Array] | None = None,
    routing: Routing | None = None,
) -> Array:
    """float32 log-prob of each response token under the trainer's policy, ``[B, n]``.

    ``sampler = (temperature, top_p)`` scores the tokens with
    ``opj.token_logprobs(..., temperature=, top_p=)``, the distribution the engine
    sampled from (−inf for a token outside the trainer's own top-p support); None
    is the raw ``log_softmax`` of the logits. ``routing`` (a routed policy) replays
    the engine's routes (:class:`~offpolicy_jax.demo.model.Routing`).
    """
    logits = nnx.merge(graphdef, params)(tokens, routing=routing or Routing())
    assert isinstance(logits, jax.Array)  # return_routes=False: the logits alone
    return _score(logits[:, n : 2 * n].astype(jnp.float32), tokens, n, sampler)


def token_logp_and_routes(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens: Array,
    n: int,
    sampler: tuple[Array, Array] | None = None,
    routing: Routing | None = None,
) -> tuple[Array, Array]:
    """:func:`token_logp` of a routed policy, and the experts the trainer's router itself
    picks (whatever ``routing`` replays), ``int32 [n_layers, B, 2n + 1, top_k]``."""
    model = nnx.merge(graphdef, params)
    out = model(tokens, routing=routing or Routing(), return_routes=True)
    assert isinstance(out, tuple)  # return_routes=True: (logits, used, own)
    logits, _, own = out
    return _score(logits[:, n : 2 * n].astype(jnp.float32), tokens, n, sampler), own


def token_logp_topk(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens: Array,
    n: int,
    ids: Array,
    sampler: tuple[Array, Array] | None = None,
    routing: Routing | None = None,
    mask: Array | None = None,
) -> tuple[Array, Array, Array | None]:
    """:func:`token_logp`, the trainer's log-probs of the engine's top-k ``ids [B, n, k]``
    from the same logits (``opj.topk_logprobs``, at the sampler's temperature; 0 where
    ``mask [B, n]`` is 0), and, for a routed policy (``routing`` given), the experts its
    router picks (:func:`token_logp_and_routes`), else None."""
    model = nnx.merge(graphdef, params)
    if routing is not None:
        out = model(tokens, routing=routing, return_routes=True)
        assert isinstance(out, tuple)  # return_routes=True: (logits, used, own)
        logits, _, own = out
    else:
        logits, own = model(tokens, routing=Routing()), None
        assert isinstance(logits, jax.Array)
    logits = logits[:, n : 2 * n].astype(jnp.float32)
    temperature = 1.0 if sampler is None else sampler[0]
    topk = opj.topk_logprobs(logits, ids, temperature=temperature, mask=mask)
    return _score(logits, tokens, n, sampler), topk, own


def _score(logits: Array, tokens: Array, n: int, sampler: tuple[Array, Array] | None) -> Array:
    """Log-prob of each response token from the logits that score it, ``[B, n]``."""
    if sampler is not None:
        temperature, top_p = sampler
        logp = opj.token_logprobs(logits, tokens[:, n + 1 :], temperature=temperature, top_p=top_p)
        assert isinstance(logp, jax.Array)  # return_entropy=False: the log-probs alone
        return logp
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, tokens[:, n + 1 :, None], axis=-1)[..., 0]


def group_advantages(rewards: Array, group_size: int) -> Array:
    """GRPO: reward minus its group mean, over the group std (one value per sequence)."""
    r = rewards.reshape(-1, group_size)
    adv = (r - r.mean(-1, keepdims=True)) / (r.std(-1, keepdims=True) + 1e-6)
    return adv.reshape(-1)


def init_state(cfg: TrainConfig, mismatch: Mismatch, seeds: Sequence[int]):
    """``(graphdef, state)``: one state row per seed, stacked on a leading axis."""
    tx = make_optimizer(cfg)
    k = mismatch.staleness()
    graphdef = nnx.graphdef(make_model(cfg, 0))

    def init(seed):
        params = nnx.state(make_model(cfg, seed), nnx.Param)
        # The engine's copies of the weights, a ring buffer: slot step % k holds the
        # weights of k updates ago, which the engine samples with.
        ring = jax.tree.map(lambda p: jnp.stack([p] * k), params) if k else None
        return {
            "params": params,
            "opt": tx.init(params),
            "ring": ring,
            "step": jnp.zeros((), jnp.int32),
        }

    return graphdef, jax.jit(jax.vmap(init))(jnp.asarray(seeds))


#: What ``make_train_step(..., dump=True)`` adds to the metrics: the batch trained on.
DUMP_KEYS = ("old_logp", "rollout_logp", "mask", "advantages", "versions")

#: Per-step metrics of the demo itself (the loss's own metrics follow as ``loss/<key>``).
STEP_METRICS = (
    "policy_reward",
    "policy_exact_match",
    "reward",
    "mis_k3_kl",
    "rejected_fraction",
    "grad_norm",
    "is_weight_max",
    "is_weight_mean",
    "is_weight_above_2",
    "nonfinite_seq_fraction",
    "log_ratio_above_1",
    "route_flip_fraction",
    "staleness_mean",
)

#: The metrics of :func:`make_train_step`'s ``diagnostics`` (π_old against π_rollout).
DIAGNOSTIC_KEYS = (
    "log_ratio_above_1",
    "mis_k3_kl",
    "is_weight_max",
    "is_weight_mean",
    "is_weight_above_2",
    "nonfinite_seq_fraction",
)

#: ``jax.random.fold_in`` tag of the ``async`` engine's ages (the step's other keys are
#: split as before, so every other mismatch samples exactly as it did).
ASYNC_KEY = 7

#: The monitor: the untruncated per-token weight π_old / π_rollout as the library computes
#: it (log-ratio clamped to ±20), and the §4 mismatch metrics. Metrics only for the run.
_MONITOR = opj.CorrectionConfig(use_tis=True, tis_mode="truncate", tis_upper_bound=_MONITOR_BOUND)


def loss_metric_keys(algorithms: Sequence[Algorithm], versions: bool = False) -> tuple[str, ...]:
    """The union of the metric keys ``opj.policy_loss`` returns for these algorithms,
    sorted (the key set depends on the config only, so an abstract evaluation finds it).
    ``versions``: the losses receive per-token policy versions (the ``async`` mismatch)."""
    x = jax.ShapeDtypeStruct((2, 3), jnp.float32)
    a = jax.ShapeDtypeStruct((2,), jnp.float32)
    v = jax.ShapeDtypeStruct((2, 3), jnp.int32) if versions else None
    keys: set[str] = set()
    for alg in algorithms:
        k = topk_of(alg.loss)
        ids = jax.ShapeDtypeStruct((2, 3, k), jnp.int32)
        topk_lp = jax.ShapeDtypeStruct((2, 3, k), jnp.float32)
        _, met = jax.eval_shape(
            lambda lp, adv, ver, ids, tlp, lcfg=alg.loss, k=k: opj.policy_loss(
                lp,
                lp,
                lp,
                adv,
                lp,
                lcfg,
                versions=ver,
                current_version=None if ver is None else 3,
                topk=opj.TopKLogprobs(ids, tlp, tlp) if k else None,
            ),
            x,
            a,
            v,
            ids,
            topk_lp,
        )
        keys |= set(met)
    return tuple(sorted(keys))


def async_generate(
    graphdef: nnx.GraphDef,
    ring: nnx.State,
    step: Array,
    prompts: Array,
    keys: tuple[Array, Array],
    group_size: int,
    mismatched: Array | bool = True,
) -> tuple[Array, Array, Array]:
    """The ``async`` engine: mixed policy versions in one batch.

    Prompt group j (``group_size`` consecutive rows of ``prompts``) is sampled by the
    weights of ``d_j`` updates ago, ``d_j`` uniform in ``0 .. K − 1`` (``K`` = the ring's
    length, severity + 1), drawn from ``keys[0]`` (0 everywhere without mismatch);
    ``keys[1]`` is split into one sampling key per group. At step ``s`` the ring's slot
    ``(v − 1) % K`` holds version ``v`` (written at the end of step ``v − 1``), so it holds
    versions ``s − K + 1 .. s`` and age 0 is the current weights; before step ``d`` it
    still holds the initial weights, version 0.

    Returns:
      ``(responses, rollout_logp, versions)``, all ``[B, n]``: ``versions`` (int32) is the
      version that sampled each token, ``max(step − d_j, 0)``.
    """
    ages_key, sample_key = keys
    slots = jax.tree.leaves(ring)[0].shape[0]
    groups, n = len(prompts) // group_size, prompts.shape[-1]
    ages = jax.random.randint(ages_key, (groups,), 0, slots)
    ages = jnp.where(mismatched, ages, 0)
    group_params = jax.tree.map(lambda r: r[(step - ages - 1) % slots], ring)
    sample = functools.partial(engine.generate, graphdef, numerics=engine.Numerics())
    responses, logq = jax.vmap(sample)(
        group_params,
        prompts.reshape(groups, group_size, n),
        jax.random.split(sample_key, groups),
    )
    versions = jnp.repeat(jnp.maximum(step - ages, 0).astype(jnp.int32), group_size)
    return (
        responses.reshape(-1, n),
        logq.reshape(-1, n),
        jnp.broadcast_to(versions[:, None], (len(prompts), n)),
    )


@dataclasses.dataclass(frozen=True)
class _StepPlan:
    """What :func:`make_train_step` fixes before tracing: the step's static settings.

    Per-algorithm tables are tuples indexed by the run's ``algo_index`` (a traced value),
    so a row's loss, monitor and replay flag are chosen inside the compiled step.
    """

    graphdef: nnx.GraphDef
    cfg: TrainConfig
    tx: optax.GradientTransformation
    numerics: engine.Numerics
    #: The engine's ring of weights, in copies (``Mismatch.staleness``; 0: none).
    stale: int
    asynchronous: bool
    routed: bool
    #: No π_old forward pass: ``old_logp`` is a placeholder and its monitors are NaN.
    skip_old: bool
    dump: bool
    #: Distinct losses (one ``lax.switch`` branch each) and each algorithm's branch.
    loss_configs: tuple[opj.LossConfig, ...]
    loss_index: tuple[int, ...]
    loss_keys: tuple[str, ...]
    replay_rows: tuple[bool, ...]
    #: Distinct rejections (one branch each) and each algorithm's, for ``rejected_fraction``.
    monitors: tuple[opj.CorrectionConfig, ...]
    monitor_index: tuple[int, ...]
    #: The engine's top-k ids per position (0: none): a row's ``divergence_topk`` or
    #: ``TrainConfig.topk_logprobs``.
    topk: int = 0


def _skips_old_pass(
    algorithms: Sequence[Algorithm], asynchronous: bool, old_pass: bool | None
) -> bool:
    """Whether the step skips the π_old forward pass (``make_train_step``'s ``old_pass``)."""
    # No row reads the recomputed π_old (every decoupled row approximates it): the
    # trainer skips that forward pass, the saving the proximal approximation is for.
    can_skip = asynchronous and not any(needs_old_pass(a.loss) for a in algorithms)
    if old_pass is False and not can_skip:
        raise ValueError(
            "old_pass=False: a row reads π_old (or the mismatch is not async); only rows that "
            "approximate it (prox_logp_method loglinear / linear) can skip the pass"
        )
    return can_skip if old_pass is None else not old_pass


def _step_plan(
    graphdef: nnx.GraphDef,
    cfg: TrainConfig,
    algorithms: Sequence[Algorithm],
    mismatch: Mismatch,
    dump: bool,
    old_pass: bool | None,
) -> _StepPlan:
    """Validates :func:`make_train_step`'s arguments and fixes its :class:`_StepPlan`."""
    if cfg.trainer_logprobs not in TRAINER_LOGPROBS:
        raise ValueError(
            f"trainer_logprobs must be one of {', '.join(TRAINER_LOGPROBS)}, "
            f"got {cfg.trainer_logprobs!r}"
        )
    stale, routed = mismatch.staleness(), cfg.n_experts > 0
    if any(a.routing_replay for a in algorithms) and not routed:
        raise ValueError("routing replay (+replay rows) needs a routed policy (n_experts > 0)")
    # Runs that share a loss share a switch branch (e.g. ppo:no-mismatch and ppo).
    loss_configs = tuple(dict.fromkeys(a.loss for a in algorithms))
    asynchronous = mismatch.source == "async" and stale > 0
    # The rejection each algorithm's correction applies, run once per batch to count the
    # tokens it drops (a VanillaTIS or no correction drops none).
    applied = [
        a.loss.correction
        if isinstance(a.loss.correction, opj.CorrectionConfig)
        else opj.CorrectionConfig()
        for a in algorithms
    ]
    monitors = tuple(dict.fromkeys(applied))
    topk = _plan_topk(cfg, algorithms, asynchronous)
    return _StepPlan(
        graphdef=graphdef,
        cfg=cfg,
        tx=make_optimizer(cfg),
        numerics=mismatch.numerics(),
        stale=stale,
        asynchronous=asynchronous,
        routed=routed,
        skip_old=_skips_old_pass(algorithms, asynchronous, old_pass),
        dump=dump,
        loss_configs=loss_configs,
        loss_index=tuple(loss_configs.index(a.loss) for a in algorithms),
        loss_keys=loss_metric_keys(algorithms, versions=asynchronous),
        replay_rows=tuple(a.routing_replay for a in algorithms),
        monitors=monitors,
        monitor_index=tuple(monitors.index(c) for c in applied),
        topk=topk,
    )


def _plan_topk(cfg: TrainConfig, algorithms: Sequence[Algorithm], asynchronous: bool) -> int:
    """The one ``k`` the engine's top-k returns for every row (0: none)."""
    wanted = {topk_of(a.loss) for a in algorithms} | {cfg.topk_logprobs}
    wanted.discard(0)
    if len(wanted) > 1:
        raise ValueError(
            f"the rows and topk_logprobs ask for different top-k sizes {sorted(wanted)}; the "
            "engine returns one k per run: give every top-k row the same divergence_topk"
        )
    k = wanted.pop() if wanted else 0
    if k > task.VOCAB or k < 0:
        raise ValueError(
            f"divergence_topk / topk_logprobs must be in [1, {task.VOCAB}] (the demo's "
            f"vocabulary), got {k}"
        )
    if k and asynchronous:
        raise ValueError("top-k log-probs (topk_logprobs, top-k rows) need a synchronous engine")
    return k


def make_train_step(
    graphdef: nnx.GraphDef,
    cfg: TrainConfig,
    algorithms: Sequence[Algorithm],
    mismatch: Mismatch,
    dump: bool = False,
    old_pass: bool | None = None,
) -> Callable:
    """``train_step(state, key, algo_index, mismatched) -> (state, metrics)`` for one run
    (vmap it over runs). ``algo_index`` picks ``algorithms[algo_index].loss``;
    ``mismatched`` turns the engine's mismatch on. ``metrics`` holds
    :data:`STEP_METRICS` and every metric of the loss as ``loss/<key>`` (mean over the
    minibatches; NaN for a key that this run's loss does not return). ``dump=True``
    adds the batch the step trained on: ``dump/old_logp``, ``dump/rollout_logp``,
    ``dump/mask``, ``dump/versions`` ``[B, n]`` and ``dump/advantages`` ``[B]``
    (:data:`DUMP_KEYS`).
    ``old_pass``: whether the trainer computes π_old (a forward pass at the current
    weights, which ppo / decoupled_ppo rows read and the monitor metrics compare with
    π_rollout); None (default) skips it exactly when the mismatch is ``async`` and no row
    reads it (every decoupled row approximates it, ``prox_logp_method``), and False
    outside that case is a ValueError. True keeps it where it could be skipped: the
    comparison that times the pass (benchmarks/async_demo.py)."""
    plan = _step_plan(graphdef, cfg, algorithms, mismatch, dump, old_pass)
    return functools.partial(_train_step, plan)


def _version_args(plan: _StepPlan, versions: Array, current: Array) -> dict:
    """The per-token versions for the library's calls, under the ``async`` mismatch only."""
    return {"versions": versions, "current_version": current} if plan.asynchronous else {}


def _branch_loss(
    plan: _StepPlan,
    lcfg: opj.LossConfig,
    logp,
    old_logp,
    rollout_logp,
    adv,
    mask,
    versions,
    current,
    topk,
):
    """One ``lax.switch`` branch: ``lcfg``'s loss and its metrics over ``plan.loss_keys``
    (NaN where ``lcfg`` returns no such key, so that every branch returns the same tree).
    ``topk`` (an ``opj.TopKLogprobs`` or None) reaches only a loss that reads it."""
    loss, met = opj.policy_loss(
        logp,
        old_logp if needs_old_pass(lcfg) else None,
        rollout_logp,
        adv,
        mask,
        lcfg,
        **_version_args(plan, versions, current),
        topk=topk if topk_of(lcfg) else None,
    )
    nan = jnp.float32(jnp.nan)
    return loss, {k: jnp.asarray(met.get(k, nan), jnp.float32) for k in plan.loss_keys}


def _routing(plan: _StepPlan, algo_index: Array, routes: Array | None) -> Routing | None:
    """The trainer's routing: the engine's routes in a replay row (``routes`` is
    ``[n_layers, B, L, k]``), its own pick otherwise; None for a dense policy."""
    if not plan.routed:
        return None
    return Routing(routes=routes, replay=jnp.array(plan.replay_rows)[algo_index])


def _minibatch_loss(
    plan: _StepPlan,
    params: nnx.State,
    algo_index: Array,
    sampler: tuple[Array, Array] | None,
    current: Array,
    tokens: Array,
    old_logp: Array,
    rollout_logp: Array,
    adv: Array,
    mask: Array,
    routes: Array,
    versions: Array,
    topk_ids: Array,
    topk_rollout_logp: Array,
):
    """``(loss, loss metrics)`` of this run's algorithm on one minibatch, at ``params``."""
    # Minibatches split the leading axis: routes travel batch-major, [B, n_layers, L, k].
    route = _routing(plan, algo_index, jnp.moveaxis(routes, 0, 1) if plan.routed else None)
    n, topk = plan.cfg.prompt_len, None
    if plan.topk:
        # The trust region compares the current policy with the engine (TRL's DPPO), so the
        # trainer's top-k log-probs come from this forward pass, without gradient.
        logp, topk_logp, _ = token_logp_topk(
            plan.graphdef, params, tokens, n, topk_ids, sampler, route, mask
        )
        topk = opj.TopKLogprobs(topk_ids, topk_rollout_logp, jax.lax.stop_gradient(topk_logp))
    else:
        logp = token_logp(plan.graphdef, params, tokens, n, sampler, route)
    losses = [functools.partial(_branch_loss, plan, c) for c in plan.loss_configs]
    loss_index = jnp.array(plan.loss_index, jnp.int32)
    operands = (logp, old_logp, rollout_logp, adv, mask, versions, current, topk)
    return jax.lax.switch(loss_index[algo_index], losses, *operands)


def _dropped_fraction(correction, old_logp, rollout_logp, mask, version_args) -> Array:
    """The share of ``mask``'s tokens that ``correction``'s rejection drops."""
    res = opj.compute_correction(
        old_logp, rollout_logp, mask, correction, reduction="token", **version_args
    )
    return (mask.sum() - res.mask.sum()) / jnp.maximum(mask.sum(), 1.0)


def _rejected_fraction(plan, algo_index, old_logp, rollout_logp, mask, versions, current) -> Array:
    """``rejected_fraction``: the tokens this run's correction drops from the batch."""
    ver = _version_args(plan, versions, current)
    branches = [
        functools.partial(_dropped_fraction, c, old_logp, rollout_logp, mask, ver)
        for c in plan.monitors
    ]
    monitor_index = jnp.array(plan.monitor_index, jnp.int32)
    return jax.lax.switch(monitor_index[algo_index], branches)


def _diagnostics(old_logp: Array, rollout_logp: Array, mask: Array) -> dict[str, Array]:
    """The :data:`DIAGNOSTIC_KEYS`: π_old against π_rollout under the untruncated monitor."""
    res = opj.compute_correction(old_logp, rollout_logp, mask, _MONITOR, reduction="token")
    # Sequences with a non-finite log-prob (a token outside the trainer's top-p
    # support) leave every metric, as compute_correction drops them (§0).
    valid = res.mask > 0
    log_ratio = jnp.where(valid, old_logp - rollout_logp, 0.0)
    return {
        "log_ratio_above_1": jnp.sum(valid & (jnp.abs(log_ratio) > 1.0))
        / jnp.maximum(jnp.sum(valid), 1),
        "mis_k3_kl": res.metrics["mis_k3_kl"],
        "is_weight_max": jnp.max(jnp.where(valid, res.weights, 0.0)),
        "is_weight_mean": res.metrics["mis_tis_weight_before_bound"],
        "is_weight_above_2": jnp.sum(valid & (res.weights > DIAGNOSTIC_CAP))
        / jnp.maximum(jnp.sum(valid), 1),
        "nonfinite_seq_fraction": res.metrics["mis_nonfinite_seq_fraction"],
    }


#: KPop's statistic as a monitor: the bidirectional binary KL of π_old and π_rollout per
#: token, its mean and the share above KPop's φ (``mis_rs_binary_kl_*``). Metrics only.
_KPOP_MONITOR = _kpop(KPOP_PHI)


def _kpop_topk_diagnostics(old_logp, rollout_logp, scored, rollout) -> dict[str, Array]:
    """With the engine's top-k: ``binary_kl`` (the mean of KPop's bidirectional binary KL),
    ``binary_kl_above_phi`` (the share above :data:`KPOP_PHI`) and ``topk_tv`` (the mean
    top-k TV of π_old from π_rollout, DPPO's divergence), over every sampled token."""
    res = opj.compute_correction(
        old_logp, rollout_logp, scored.mask, _KPOP_MONITOR, reduction="token"
    )
    valid = scored.mask > 0
    tv = topk_divergence(scored.old_topk, rollout.topk_logp, valid, divergence="tv")
    return {
        "binary_kl": res.metrics["mis_rs_binary_kl_mean"],
        "binary_kl_above_phi": res.metrics["mis_rs_binary_kl_fraction_high"],
        "topk_tv": jnp.sum(jnp.where(valid, tv, 0.0)) / jnp.maximum(jnp.sum(valid), 1),
    }


class _Rollout(NamedTuple):
    """One step's batch as the engine returns it (B = prompts_per_step · group_size)."""

    prompts: Array  # [B, n]
    responses: Array  # [B, n]
    rollout_logp: Array  # [B, n]
    #: The engine's experts, ``[n_layers, B, 2n + 1, top_k]``; empty for a dense policy.
    routes: Array
    versions: Array  # [B, n] int32: the policy version that sampled each token
    #: The engine's top-k ids and log-probs ``[B, n, k]`` (``k = plan.topk``; 0: empty).
    topk_ids: Array
    topk_logp: Array


def _ring_slot(plan: _StepPlan, step: Array) -> Array | int:
    """The ring's slot that holds the weights ``plan.stale`` updates old (0 without a ring)."""
    return step % plan.stale if plan.stale else 0


def _sample_batch(plan, state, key, k_prompt, k_sample, mismatched) -> _Rollout:
    """The engine's rollout: ``prompts_per_step`` prompts, each sampled ``group_size`` times,
    with the mismatch's weights (stale or mixed versions) and numerics where ``mismatched``."""
    cfg, n, params = plan.cfg, plan.cfg.prompt_len, state["params"]
    prompts = task.sample_prompts(k_prompt, cfg.prompts_per_step, n)
    prompts = jnp.repeat(prompts, cfg.group_size, axis=0)
    if plan.stale and not plan.asynchronous:
        old = jax.tree.map(lambda r: r[_ring_slot(plan, state["step"])], state["ring"])
        engine_params = jax.tree.map(lambda o, p: jnp.where(mismatched, o, p), old, params)
    else:
        engine_params = params
    routes = jnp.zeros(0, jnp.int32)  # a dense policy has none
    current = state["step"]  # the policy version: updates so far
    versions = jnp.full((len(prompts), n), current, jnp.int32)
    if plan.asynchronous:
        ages_key = jax.random.fold_in(key, ASYNC_KEY)
        responses, rollout_logp, versions = async_generate(
            plan.graphdef,
            state["ring"],
            current,
            prompts,
            (ages_key, k_sample),
            cfg.group_size,
            mismatched,
        )
    elif plan.topk:
        sample = engine.generate_topk(
            plan.graphdef,
            engine_params,
            prompts,
            k_sample,
            plan.numerics,
            plan.topk,
            mismatched,
            return_routes=plan.routed,
        )
        routes = routes if sample.routes is None else sample.routes
        return _Rollout(
            prompts, sample.responses, sample.rollout_logp, routes, versions, *sample[3:]
        )
    elif plan.routed:
        responses, rollout_logp, routes = engine.generate_routed(
            plan.graphdef, engine_params, prompts, k_sample, plan.numerics, mismatched
        )
    else:
        responses, rollout_logp = engine.generate(
            plan.graphdef, engine_params, prompts, k_sample, plan.numerics, active=mismatched
        )
    empty = jnp.zeros((len(prompts), n, 0), jnp.int32)
    return _Rollout(
        prompts, responses, rollout_logp, routes, versions, empty, empty.astype(jnp.float32)
    )


def _trainer_sampler(plan: _StepPlan, mismatched: Array) -> tuple[Array, Array] | None:
    """``(temperature, top_p)`` the trainer scores with (``trainer_logprobs="sampler"``)."""
    if plan.cfg.trainer_logprobs != "sampler":
        return None
    # The engine's own T and top-p (plain float32 sampling in rows without mismatch).
    return (
        jnp.where(mismatched, plan.numerics.temperature, 1.0),
        jnp.where(mismatched, plan.numerics.top_p, 1.0),
    )


def _route_flips(routes: Array, own: Array, n: int) -> Array:
    """The share of routing decisions whose set of experts differs, at the positions whose
    outputs score the response tokens (n .. 2n - 1), in any layer."""
    differ = jnp.any(jnp.sort(routes, -1) != jnp.sort(own, -1), -1)[:, :, n : 2 * n]
    return jnp.mean(differ.astype(jnp.float32))


def _old_logp(plan, params, algo_index, tokens, rollout, sampler) -> tuple[Array, Array, Array]:
    """``(old_logp, route_flip_fraction, old_topk)``: the trainer's π_old of the sampled
    tokens at the current weights (stop-gradient), how many routing decisions differ from
    the engine's (NaN for a dense policy), and π_old of the engine's top-k ids
    ``[B, n, plan.topk]`` (empty without top-k)."""
    n = plan.cfg.prompt_len
    if plan.topk:
        routing = _routing(plan, algo_index, rollout.routes)
        old_logp, old_topk, own = jax.lax.stop_gradient(
            token_logp_topk(plan.graphdef, params, tokens, n, rollout.topk_ids, sampler, routing)
        )
        flips = jnp.float32(jnp.nan) if own is None else _route_flips(rollout.routes, own, n)
        return old_logp, flips, old_topk
    if plan.routed:
        old_logp, own = token_logp_and_routes(
            plan.graphdef, params, tokens, n, sampler, _routing(plan, algo_index, rollout.routes)
        )
        old_logp = jax.lax.stop_gradient(old_logp)
        return old_logp, _route_flips(rollout.routes, own, n), rollout.topk_logp
    if plan.skip_old:
        # A placeholder no loss reads (needs_old_pass).
        return rollout.rollout_logp, jnp.float32(jnp.nan), rollout.topk_logp
    old_logp = jax.lax.stop_gradient(token_logp(plan.graphdef, params, tokens, n, sampler))
    return old_logp, jnp.float32(jnp.nan), rollout.topk_logp


def _train_mask(mask: Array, old_logp: Array, rollout_logp: Array, sampler) -> Array:
    """The tokens every row trains on: ``mask``, less sequences the trainer cannot score."""
    if sampler is None:
        return mask
    # A token outside the trainer's top-p support has log π_old = −inf. The
    # correction rejects such a sequence (§0); the trainer drops it for every row
    # alike, so that rows without a correction (ppo) do not train on −inf either.
    finite = jnp.all(jnp.isfinite(old_logp) & jnp.isfinite(rollout_logp), axis=-1)
    return jnp.where(finite[:, None], mask, 0.0)


def _minibatch_updates(plan, params, opt, algo_index, sampler, current, batch):
    """One PPO epoch: an optimizer update per minibatch of ``batch`` (whole groups, in
    order). Returns ``(params, opt, loss metrics [mbs], grad norms [mbs])``."""
    grad_fn = jax.value_and_grad(functools.partial(_minibatch_loss, plan), has_aux=True)

    def update(carry, mb):
        params, opt = carry
        (_, loss_met), grads = grad_fn(params, algo_index, sampler, current, *mb)
        updates, opt = plan.tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), (loss_met, optax.tree.norm(grads))

    mbs = plan.cfg.minibatches
    # Explicit sizes: a -1 cannot be inferred for the empty top-k arrays [B, n, 0].
    batch = jax.tree.map(lambda x: x.reshape((mbs, len(x) // mbs) + x.shape[1:]), batch)
    (params, opt), (loss_met, grad_norm) = jax.lax.scan(update, (params, opt), batch)
    return params, opt, loss_met, grad_norm


def _policy_rewards(plan: _StepPlan, params: nnx.State, k_prompt: Array, k_sample: Array):
    """The trained policy itself, sampled with exact float32 numerics on fresh prompts:
    the model you would ship, free of the engine's distortion and lag. ``[eval_prompts]``."""
    n = plan.cfg.prompt_len
    eval_prompts = task.sample_prompts(k_prompt, plan.cfg.eval_prompts, n)
    eval_responses, _ = engine.generate(
        plan.graphdef, params, eval_prompts, k_sample, engine.Numerics(), active=False
    )
    return task.reward(eval_prompts, eval_responses)


class _Scored(NamedTuple):
    """The batch as the trainer scores it."""

    tokens: Array  # [B, 2n + 1]: prompt, then response
    #: [B, n] π_old (stop-gradient), or rollout_logp as a placeholder when the pass is skipped.
    old_logp: Array
    flips: Array  # route_flip_fraction (NaN for a dense policy)
    mask: Array  # [B, n] every sampled token
    train_mask: Array  # [B, n] the tokens trained on
    old_topk: Array  # [B, n, k] π_old of the engine's top-k ids (k = 0: none)


def _score_batch(plan, params, algo_index, rollout: _Rollout, sampler) -> _Scored:
    """The trainer's log-probs of the engine's rollout, and the tokens it trains on."""
    tokens = task.join(rollout.prompts, rollout.responses)
    old_logp, flips, old_topk = _old_logp(plan, params, algo_index, tokens, rollout, sampler)
    mask = jnp.ones_like(old_logp)
    train_mask = _train_mask(mask, old_logp, rollout.rollout_logp, sampler)
    return _Scored(tokens, old_logp, flips, mask, train_mask, old_topk)


def _step_metrics(plan, algo_index, current, rollout, scored, rewards, trained) -> dict:
    """The step's metrics (:func:`make_train_step`): :data:`STEP_METRICS`, ``loss/<key>``.

    ``rewards`` is ``(rollout rewards, the trained policy's)``; ``trained`` is ``(loss
    metrics, gradient norms)`` of the minibatch updates, one entry per minibatch.
    """
    (rollout_rewards, policy_rewards), (loss_met, grad_norm) = rewards, trained
    old_logp, rollout_logp, versions = scored.old_logp, rollout.rollout_logp, rollout.versions
    metrics = {
        "policy_reward": policy_rewards.mean(),
        "policy_exact_match": (policy_rewards == 1.0).mean(),
        "reward": rollout_rewards.mean(),
        "rejected_fraction": _rejected_fraction(
            plan, algo_index, old_logp, rollout_logp, scored.train_mask, versions, current
        ),
        # Before clipping: the size of the raw update direction.
        "grad_norm": grad_norm.mean(),
        **_diagnostics(old_logp, rollout_logp, scored.mask),
        "staleness_mean": jnp.mean((current - versions).astype(jnp.float32)),
        "route_flip_fraction": scored.flips,
        **{f"loss/{k}": v.mean() for k, v in loss_met.items()},
    }
    if plan.topk:
        metrics |= _kpop_topk_diagnostics(old_logp, rollout_logp, scored, rollout)
    if plan.skip_old:
        # No π_old was computed: the monitors of π_old / π_rollout have nothing to read.
        for k in ("rejected_fraction", *DIAGNOSTIC_KEYS):
            metrics[k] = jnp.float32(jnp.nan)
    return metrics


def _train_step(plan: _StepPlan, state, key, algo_index, mismatched):
    """:func:`make_train_step`'s ``train_step`` under ``plan``."""
    params, current = state["params"], state["step"]  # the policy version: updates so far
    k_prompt, k_sample, k_eval_prompt, k_eval = jax.random.split(key, 4)
    rollout = _sample_batch(plan, state, key, k_prompt, k_sample, mismatched)
    rewards = task.reward(rollout.prompts, rollout.responses)
    sampler = _trainer_sampler(plan, mismatched)
    scored = _score_batch(plan, params, algo_index, rollout, sampler)
    advantages = group_advantages(rewards, plan.cfg.group_size)
    routes = jnp.moveaxis(rollout.routes, 1, 0) if plan.routed else jnp.zeros(len(scored.tokens))
    batch = (
        scored.tokens,
        scored.old_logp,
        rollout.rollout_logp,
        advantages,
        scored.train_mask,
        routes,
        rollout.versions,
        rollout.topk_ids,
        rollout.topk_logp,
    )
    params, opt, *trained = _minibatch_updates(
        plan, params, state["opt"], algo_index, sampler, current, batch
    )
    policy_rewards = _policy_rewards(plan, params, k_eval_prompt, k_eval)
    ring = state["ring"]
    if plan.stale:
        slot = _ring_slot(plan, current)
        ring = jax.tree.map(lambda r, p: r.at[slot].set(p), ring, params)
    metrics = _step_metrics(
        plan, algo_index, current, rollout, scored, (rewards, policy_rewards), trained
    )
    if plan.dump:
        metrics.update(
            {
                "dump/old_logp": scored.old_logp,
                "dump/rollout_logp": rollout.rollout_logp,
                "dump/mask": scored.mask,
                "dump/advantages": advantages,
                "dump/versions": rollout.versions,
            }
        )
    return {"params": params, "opt": opt, "ring": ring, "step": current + 1}, metrics


def make_chunk_runner(train_step: Callable) -> Callable:
    """Jitted ``run(state, keys [n, R], algo_index [R], mismatched [R]) -> (state,
    metrics [n, R])``: ``n`` steps of all R runs at once (one compile per chunk length)."""
    vstep = jax.vmap(train_step)

    @functools.partial(jax.jit, donate_argnums=0)
    def run(state, keys, algo_index, mismatched):
        return jax.lax.scan(lambda s, k: vstep(s, k, algo_index, mismatched), state, keys)

    return run
