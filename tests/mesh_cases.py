"""Shared data, configurations and helpers of the sharding / mesh tests.

The sharded tests compare a call on a *padded, sharded* batch against the plain
unsharded call on the *unpadded* batch: padding rows and token columns are filled
with masked garbage (NaN, ±inf, 1e30), so equality also proves that padding to a
shard multiple never changes a result.

Every configuration is evaluated by one jitted program per layout
(:func:`evaluate_all`), so a layout costs one compilation, not one per config.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

import offpolicy_jax as opj

RTOL = 1e-5
# Values that are differences of O(1) float32 numbers (chi², k3-KL, ppo_kl near 0)
# carry an absolute rounding error of a few 1e-8; the conformance pack uses the same.
ATOL = 1e-6

# Real (unpadded) batch: 7 ragged sequences of at most 13 tokens. Neither 7 nor 13
# divides the shard counts, so the sharded calls always see padding (padded_for).
REAL_B, REAL_T = 7, 13
PAD_B, PAD_T = 8, 16
LENGTHS = (13, 0, 5, 1, 9, 13, 7)

_GARBAGE = (np.nan, np.inf, -np.inf, 1e30, -1e30)


def make_batch(
    seed: int = 0, batch: int = REAL_B, length: int = REAL_T, lengths: tuple[int, ...] = LENGTHS
) -> dict[str, np.ndarray]:
    """A ragged batch that exercises every rule: holes in the mask, an empty and a
    one-token sequence, a NaN at a valid position (whole-sequence rejection), a
    catastrophic token (veto), ratios beyond every bound, garbage where masked."""
    rng = np.random.default_rng(seed)
    shape = (batch, length)
    mask = np.arange(length)[None, :] < np.asarray(lengths)[:, None]
    mask &= rng.random(shape) > 0.15  # holes (e.g. tool-output tokens)
    mask[0, 0] = True
    old = rng.normal(-1.3, 0.6, shape).astype(np.float32)
    rollout = (old + rng.normal(0.0, 0.35, shape)).astype(np.float32)
    logp = (old + rng.normal(0.0, 0.25, shape)).astype(np.float32)
    adv = rng.normal(0.0, 1.0, shape).astype(np.float32)
    adv_seq = rng.normal(0.0, 1.0, (batch,)).astype(np.float32)
    # A catastrophic token (o - b = -9 < log 1e-3) in a long sequence, on its last
    # valid token: under context parallelism it lives on a different shard than
    # the start of its sequence.
    last = np.flatnonzero(mask[5])[-1]
    rollout[5, last] = old[5, last] + 9.0
    # A non-finite log-prob at a valid token rejects its whole sequence.
    mask[4, 6] = True
    rollout[4, 6] = np.nan
    # Garbage wherever the mask is 0.
    for arr in (old, rollout, logp, adv):
        hole = ~mask
        arr[hole] = rng.choice(_GARBAGE, size=int(hole.sum()))
    return dict(
        logp=logp, old=old, rollout=rollout, adv=adv, adv_seq=adv_seq, mask=mask.astype(np.float32)
    )


def shard_counts(mesh, token_spec) -> tuple[int, int]:
    """How many shards the batch and the token axes are split into by ``token_spec``."""
    counts = []
    for dim in range(2):
        entry = token_spec[dim] if dim < len(token_spec) else None
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        counts.append(int(np.prod([mesh.shape[n] for n in names])))
    return counts[0], counts[1]


def padded_for(mesh, token_spec, data: Mapping[str, np.ndarray] | None = None) -> dict:
    """The real batch padded up to the next multiple of the shard counts (7 x 13 ->
    8 x 14 on 2 token shards, 8 x 16 on 4 or 8; a token axis that is not split
    keeps its 13)."""
    data = make_batch() if data is None else data
    batch, length = data["mask"].shape
    n_batch, n_token = shard_counts(mesh, token_spec)
    return pad_batch(data, -(-batch // n_batch) * n_batch, -(-length // n_token) * n_token)


def pad_batch(
    data: Mapping[str, np.ndarray], batch: int = PAD_B, length: int = PAD_T, seed: int = 1
) -> dict[str, np.ndarray]:
    """Pads to ``[batch, length]`` with masked garbage (empty rows, masked columns)."""
    rng = np.random.default_rng(seed)
    out = {}
    for key, value in data.items():
        if key == "mask":
            padded = np.zeros((batch, length), np.float32)
        elif value.ndim == 1:
            padded = rng.normal(size=(batch,)).astype(np.float32) * 1e6
        else:
            padded = rng.choice(_GARBAGE, size=(batch, length)).astype(np.float32)
        padded[tuple(slice(0, n) for n in value.shape)] = value
        out[key] = padded
    return out


# --- configurations: every algorithm, every level, every mode --------------------

CORRECTIONS: dict[str, opj.CorrectionConfig] = {
    "token_truncate_norm_veto": opj.CorrectionConfig(
        use_tis=True,
        tis_level="token",
        tis_mode="truncate",
        tis_upper_bound=1.8,
        tis_batch_normalize=True,
        rs_veto_threshold=1e-3,
    ),
    "sequence_mask_rs_geometric": opj.CorrectionConfig(
        use_tis=True,
        tis_level="sequence",
        tis_mode="mask",
        tis_lower_bound=0.02,
        tis_upper_bound=20.0,
        tis_batch_normalize=True,
        use_rs=True,
        rs_level="geometric",
        rs_lower_bound=0.7,
        rs_upper_bound=1.4,
        rs_veto_threshold=1e-3,
    ),
    "geometric_clip_rs_token": opj.CorrectionConfig(
        use_tis=True,
        tis_level="geometric",
        tis_mode="clip",
        tis_lower_bound=0.9,
        tis_upper_bound=1.1,
        tis_batch_normalize=True,
        use_rs=True,
        rs_level="token",
        rs_lower_bound=0.3,
        rs_upper_bound=3.0,
    ),
    "geometric_mask_rs_sequence": opj.CorrectionConfig(
        use_tis=True,
        tis_level="geometric",
        tis_mode="mask",
        tis_lower_bound=0.8,
        tis_upper_bound=1.25,
        use_rs=True,
        rs_level="sequence",
        rs_lower_bound=0.01,
        rs_upper_bound=100.0,
        rs_veto_threshold=1e-3,
    ),
    "metrics_only": opj.CorrectionConfig(use_tis=False, rs_veto_threshold=1e-3),
}

# name -> (config, advantages per "token" or per "sequence")
LOSSES: dict[str, tuple[opj.LossConfig, str]] = {
    "ppo_dual_clip_token_mean": (
        opj.LossConfig(
            algorithm="ppo",
            clip_eps=0.2,
            clip_eps_high=0.28,
            dual_clip_c=3.0,
            aggregation="token_mean",
            get_mismatch_metrics=True,
        ),
        "token",
    ),
    "ppo_metrics_only_correction": (
        opj.LossConfig(
            algorithm="ppo", correction=CORRECTIONS["metrics_only"], metric_reduction="token"
        ),
        "sequence",
    ),
    "bypass_ppo_sequence_sum": (
        opj.LossConfig(algorithm="bypass_ppo", aggregation="sequence_sum"),
        "token",
    ),
    "decoupled_token": (
        opj.LossConfig(
            algorithm="decoupled_ppo",
            correction=CORRECTIONS["token_truncate_norm_veto"],
            metric_reduction="token",
        ),
        "token",
    ),
    "decoupled_sequence_rejected_in_den": (
        opj.LossConfig(
            algorithm="decoupled_ppo",
            correction=CORRECTIONS["sequence_mask_rs_geometric"],
            rejected_in_denominator=True,
        ),
        "sequence",
    ),
    "decoupled_geometric_token_mean": (
        opj.LossConfig(
            algorithm="decoupled_ppo",
            correction=CORRECTIONS["geometric_clip_rs_token"],
            aggregation="token_mean",
        ),
        "token",
    ),
    "decoupled_vanilla_tis": (
        opj.LossConfig(
            algorithm="decoupled_ppo",
            correction=opj.VanillaTIS(clip_low=0.5, clip=1.5),
            get_mismatch_metrics=True,
        ),
        "token",
    ),
    "reinforce_is_sequence": (
        opj.LossConfig(
            algorithm="reinforce_is",
            correction=CORRECTIONS["sequence_mask_rs_geometric"],
            aggregation="sequence_sum",
        ),
        "sequence",
    ),
    "reinforce_is_geometric": (
        opj.LossConfig(
            algorithm="reinforce_is",
            correction=CORRECTIONS["geometric_mask_rs_sequence"],
            metric_reduction="token",
        ),
        "token",
    ),
}


# The surrogates of ``LossConfig.policy_loss`` beyond ppo_clip (docs/semantics.md §5):
# each composed with a correction (weights and rejection), cycling through every
# aggregation (hyperparameters tight enough that every clip / trust region binds on the
# test batches), plus bypass / plain-PPO ones and the KL-to-reference and entropy terms
# (``evaluate_all`` derives ``ref_logp`` and ``entropy`` from the batch for them).
_BYPASS_REJECTION = opj.CorrectionConfig(
    use_tis=True,
    tis_mode="none",
    use_rs=True,
    rs_level="token",
    rs_lower_bound=0.5,
    rs_upper_bound=2.0,
    rs_veto_threshold=1e-3,
)
_SURROGATE_HYPER: dict[str, dict] = {
    "gspo": dict(clip_eps=0.03, clip_eps_high=0.05),
    "gspo_token": dict(clip_eps=3e-4, clip_eps_high=4e-4),
    "cispo": dict(clip_eps_high=0.28),
    "gmpo": dict(clip_eps=0.15, clip_eps_high=0.2),
    "sapo": dict(tau_pos=1.0, tau_neg=1.05),
    "gpg": {},
    "dppo_tv": dict(clip_eps=0.02, clip_eps_high=0.03, dppo_ratio_cap=1.2),
    "dppo_kl": dict(clip_eps=0.002, clip_eps_high=0.003, dppo_ratio_cap=1.2),
    "dro": dict(dro_beta=0.1),
    "prime_dppo": dict(dppo_mask_low=0.02, dppo_mask_high=0.015, kl_tau=0.05),
    "ipo": dict(ipo_threshold=0.02, adv_tau=1.5, kl_tau=0.02),
    "two_sided_clip": dict(clip_eps_high=0.02, clamp_log_prob_coef=1.05),
    # k and λ large enough that φ moves well away from 1 on the test batches' weights.
    "vespo": dict(vespo_k_pos=4.0, vespo_lambda_pos=6.0, vespo_k_neg=6.0, vespo_lambda_neg=4.0),
    "luspo": dict(clip_eps=2e-3, clip_eps_high=2.5e-3),
    # Selections of several tokens on the test batches. clip_cov's random choice (key=KEY
    # below) is by flat position, so it differs between the padded / packed layouts these
    # cases compare (on any batch, test_packing draws some): ratio 1 makes k = n cover
    # every candidate, so no choice is left to the key (tests/test_verl_cov.py checks the
    # random choice, sharded == unsharded included).
    "clip_cov": dict(clip_eps=0.05, clip_cov_ratio=1.0, clip_cov_lb=0.02, clip_cov_ub=5.0),
    "kl_cov": dict(kl_cov_ratio=0.15, ppo_kl_coef=0.5),
    # β₂ large enough that the sequence log-ratio moves the residual on the test batches.
    "oapl": dict(beta2=0.05),
    # Last, so the aggregation cycle of the cases above stays as it was.
    "kpop": dict(kpop_threshold=0.01, adv_tau=1.5, kl_tau=0.02),
}
# The PRNG key of every loss call (policy_loss(key=...)): clip_cov draws its tokens with it.
KEY_SEED = 7
_AGGREGATION_CYCLE = (
    "sequence_mean",
    "token_mean",
    "sequence_sum",
    "sequence_sum_norm",
    "token_sum",
    "row_mean",
)


def _surrogate_losses() -> dict[str, tuple[opj.LossConfig, str]]:
    out = {}
    for i, (name, hyper) in enumerate(_SURROGATE_HYPER.items()):
        aggregation = _AGGREGATION_CYCLE[i % len(_AGGREGATION_CYCLE)]
        out[f"decoupled_{name}_{aggregation}"] = (
            opj.LossConfig(
                algorithm="decoupled_ppo",
                correction=CORRECTIONS["sequence_mask_rs_geometric"],
                policy_loss=name,
                aggregation=aggregation,
                rejected_in_denominator=i % 4 == 1,
                metric_reduction=("sequence", "token")[i % 2],
                **hyper,
            ),
            ("token", "sequence")[i % 2],
        )
    extra = {
        "decoupled_gmpo_token_truncate_token_mean": (
            "decoupled_ppo",
            "gmpo",
            "token_mean",
            CORRECTIONS["token_truncate_norm_veto"],
            {},
        ),
        "decoupled_cispo_geometric_sequence_sum_norm_scaled": (
            "decoupled_ppo",
            "cispo",
            "sequence_sum_norm",
            CORRECTIONS["geometric_clip_rs_token"],
            dict(loss_scale_factor=64.0),
        ),
        "bypass_gspo_token_rejection_token_sum": (
            "bypass_ppo",
            "gspo_token",
            "token_sum",
            _BYPASS_REJECTION,
            {},
        ),
        "bypass_gpg_sequence_mean": ("bypass_ppo", "gpg", "sequence_mean", None, {}),
        "bypass_sapo_rejection_row_mean": (
            "bypass_ppo",
            "sapo",
            "row_mean",
            _BYPASS_REJECTION,
            {},
        ),
        "ppo_dppo_tv_metrics_only_sequence_sum": (
            "ppo",
            "dppo_tv",
            "sequence_sum",
            CORRECTIONS["metrics_only"],
            {},
        ),
        "decoupled_cispo_kl_k3_off_policy_entropy": (
            "decoupled_ppo",
            "cispo",
            "token_mean",
            CORRECTIONS["sequence_mask_rs_geometric"],
            dict(kl_coef=0.05, kl_estimator="k3", kl_off_policy=True, entropy_coef=0.01),
        ),
        "ppo_gspo_kl_k1_sequence_mean": (
            "ppo",
            "gspo",
            "sequence_mean",
            None,
            dict(kl_coef=0.1, kl_estimator="k1"),
        ),
        # prime-rl's own setting: the trainer against the inference engine, no π_old.
        "bypass_prime_dppo_token_mean": ("bypass_ppo", "prime_dppo", "token_mean", None, {}),
        "bypass_ipo_rejection_sequence_sum": (
            "bypass_ppo",
            "ipo",
            "sequence_sum",
            _BYPASS_REJECTION,
            {},
        ),
        "bypass_kpop_rejection_token_mean": (
            "bypass_ppo",
            "kpop",
            "token_mean",
            _BYPASS_REJECTION,
            {},
        ),
        "bypass_vespo_nll_token_mean": (
            "bypass_ppo",
            "vespo",
            "token_mean",
            _BYPASS_REJECTION,
            dict(positive_example_nll_weight=0.1),
        ),
        "ppo_luspo_nll_row_mean": (
            "ppo",
            "luspo",
            "row_mean",
            None,
            dict(positive_example_nll_weight=0.05, kl_coef=0.02, kl_estimator="k3"),
        ),
        # OAPL's own setting: the inference engine's log-probs, each sequence once.
        "bypass_oapl_rejection_sequence_mean": (
            "bypass_ppo",
            "oapl",
            "sequence_mean",
            _BYPASS_REJECTION,
            {},
        ),
        "bypass_dro_kl_k2_entropy_sequence_sum_norm": (
            "bypass_ppo",
            "dro",
            "sequence_sum_norm",
            _BYPASS_REJECTION,
            dict(kl_coef=0.02, kl_estimator="k2", kl_off_policy=True, entropy_coef=-0.01),
        ),
    }
    for key, (algorithm, name, aggregation, correction, fields) in extra.items():
        hyper = {**_SURROGATE_HYPER[name], **fields}
        out[key] = (
            opj.LossConfig(
                algorithm=algorithm,
                correction=correction,
                policy_loss=name,
                aggregation=aggregation,
                **hyper,
            ),
            "token",
        )
    return out


SURROGATE_LOSSES: dict[str, tuple[opj.LossConfig, str]] = _surrogate_losses()


def regulariser_inputs(config: opj.LossConfig, logp, rollout, adv) -> dict:
    """``ref_logp`` / ``entropy`` / ``rewards`` keyword arguments where ``config`` uses them.

    Derived elementwise from the batch (garbage stays where the mask is 0), so the
    packed, padded and sharded layouts all see the same values at the same tokens.
    """
    out = {}
    if config.kl_coef > 0:
        out["ref_logp"] = rollout - 0.125 + 0.5 * (logp - rollout)
    if config.entropy_coef != 0:
        out["entropy"] = abs(adv) + 0.25
    if config.positive_example_nll_weight > 0:
        out["rewards"] = adv - 0.25  # per token: some positive, some not
    return out


# A compact set that still covers every algorithm and every TIS/RS level, for the
# layouts that only shard the batch (cheaper to compile than everything).
CORE_LOSSES = (
    "ppo_dual_clip_token_mean",
    "decoupled_token",
    "decoupled_sequence_rejected_in_den",
    "reinforce_is_geometric",
)
CORE_CORRECTIONS = ("geometric_clip_rs_token",)


# compute_correction itself (weights and mask as outputs, both metric reductions):
# every level and mode is also inside the losses above, so three configs suffice.
FULL_CORRECTIONS = ("token_truncate_norm_veto", "sequence_mask_rs_geometric", "metrics_only")


def config_set(name: str) -> dict:
    """``evaluate_all`` keyword arguments for the ``"full"`` or the ``"core"`` set."""
    if name == "full":
        return dict(losses=LOSSES, corrections={k: CORRECTIONS[k] for k in FULL_CORRECTIONS})
    if name == "core":
        return dict(
            losses={k: LOSSES[k] for k in CORE_LOSSES},
            corrections={k: CORRECTIONS[k] for k in CORE_CORRECTIONS},
        )
    raise ValueError(name)


# The 2-process test: a global [8, 12] batch, 4 rows per process, and a small set
# configuration (decoupled PPO, sequence-level IS with geometric RS, veto and batch
# normalisation, all metrics): small, to compile in a second or two.
MULTIPROCESS_BATCH = dict(seed=5, batch=8, length=12, lengths=(12, 0, 5, 1, 9, 12, 7, 3))
MULTIPROCESS_CONFIGS = dict(
    losses={k: LOSSES[k] for k in ("decoupled_sequence_rejected_in_den",)},
    corrections={},
)


def evaluate_all(
    arrays: Mapping[str, jax.Array],
    axis_names: Any = None,
    losses: Mapping[str, tuple[opj.LossConfig, str]] | None = None,
    corrections: Mapping[str, opj.CorrectionConfig] | None = None,
) -> dict:
    """Every configured loss (value, metrics, gradient) and correction (both reductions).

    Pure and traceable: call it under ``jax.jit`` or inside ``jax.shard_map``.
    """
    losses = LOSSES if losses is None else losses
    corrections = CORRECTIONS if corrections is None else corrections
    a = arrays
    out: dict[str, Any] = {}
    for name, (config, adv_kind) in losses.items():
        adv = a["adv"] if adv_kind == "token" else a["adv_seq"]
        old = None if config.algorithm in ("bypass_ppo", "reinforce_is") else a["old"]

        # Token advantages double as (derived) entropies; per-sequence ones cannot.
        extra = regulariser_inputs(config, a["logp"], a["rollout"], a["adv"])

        def loss_fn(logp, config=config, adv=adv, old=old, extra=extra):
            return opj.policy_loss(
                logp,
                old,
                a["rollout"],
                adv,
                a["mask"],
                config,
                axis_names=axis_names,
                key=jax.random.key(KEY_SEED),
                **extra,
            )

        (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(a["logp"])
        out[f"loss/{name}"] = dict(loss=loss, metrics=metrics, grad=grad)
    for name, config in corrections.items():
        for reduction in ("sequence", "token"):
            res = opj.compute_correction(
                a["old"],
                a["rollout"],
                a["mask"],
                config,
                reduction=reduction,
                axis_names=axis_names,
            )
            out[f"correction/{name}/{reduction}"] = dict(
                weights=res.weights, mask=res.mask, metrics=res.metrics
            )
    return out


def input_specs(token_spec, arrays: Mapping[str, Any]) -> dict:
    """PartitionSpecs of the inputs: ``token_spec`` for ``[B, T]``, its batch part for ``[B]``."""
    from jax.sharding import PartitionSpec as P

    batch_part = token_spec[0] if len(token_spec) else None
    return {k: (token_spec if np.ndim(v) == 2 else P(batch_part)) for k, v in arrays.items()}


def output_specs(outputs_shape, token_spec):
    """Scalars replicated, ``[B, T]`` arrays sharded like the inputs."""
    from jax.sharding import PartitionSpec as P

    return jax.tree.map(lambda s: P() if s.ndim == 0 else token_spec, outputs_shape)


def to_numpy(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def compare(got: dict, want: dict, *, real_shape=(REAL_B, REAL_T)) -> list[str]:
    """Differences between a sharded, padded result and the unsharded reference.

    ``[B, T]`` outputs are compared on the real block; outside it they must be
    exactly 0 (padding never receives weight, mask or gradient). Returns a list
    of failure messages (empty when everything matches).
    """
    failures = []
    rb, rt = real_shape
    if not set(got) <= set(want):
        return [f"unexpected outputs: {sorted(set(got) - set(want))}"]
    want = {k: want[k] for k in got}
    for name in want:
        g, w = got[name], want[name]
        if set(g.get("metrics", {})) != set(w.get("metrics", {})):
            failures.append(
                f"{name}: metric keys differ: {sorted(set(g['metrics']) ^ set(w['metrics']))}"
            )
            continue
        flat_w = {k: v for k, v in w.items() if k != "metrics"}
        flat_w.update({f"metrics[{k}]": v for k, v in w.get("metrics", {}).items()})
        flat_g = {k: v for k, v in g.items() if k != "metrics"}
        flat_g.update({f"metrics[{k}]": v for k, v in g.get("metrics", {}).items()})
        for key, want_value in flat_w.items():
            got_value = np.asarray(flat_g[key])
            if got_value.dtype != np.float32:
                failures.append(f"{name} {key}: dtype {got_value.dtype}")
            if np.ndim(want_value) == 2:
                outside = got_value.copy()
                outside[:rb, :rt] = 0
                if np.any(outside != 0):
                    failures.append(f"{name} {key}: non-zero values in the padding")
                got_value = got_value[:rb, :rt]
            if got_value.shape != np.shape(want_value):
                failures.append(f"{name} {key}: shape {got_value.shape} != {np.shape(want_value)}")
                continue
            if not np.allclose(got_value, want_value, rtol=RTOL, atol=ATOL, equal_nan=False):
                err = np.max(np.abs(got_value - want_value))
                failures.append(
                    f"{name} {key}: max abs err {err:.3g}; "
                    f"got {np.ravel(got_value)[:4]}, want {np.ravel(want_value)[:4]}"
                )
    return failures


_REFERENCE_CACHE: dict[Any, dict] = {}


def cpu_reference(evaluate, seed: int = 0) -> dict:
    """``evaluate`` jitted on the unpadded batch on one CPU device, as NumPy arrays."""
    cpu = jax.devices("cpu")[0]
    data = {k: jax.device_put(v, cpu) for k, v in make_batch(seed).items()}
    return to_numpy(jax.jit(evaluate)(data))


def unsharded_reference(seed: int = 0) -> dict:
    """The plain, unsharded call on the unpadded batch, on one CPU device (cached)."""
    if seed not in _REFERENCE_CACHE:
        corrections = {k: CORRECTIONS[k] for k in FULL_CORRECTIONS + CORE_CORRECTIONS}
        evaluate = functools.partial(evaluate_all, corrections=corrections)
        _REFERENCE_CACHE[seed] = cpu_reference(evaluate, seed)
    return _REFERENCE_CACHE[seed]


# --- compiled-HLO collectives ---------------------------------------------------

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
    "collective-broadcast",
    "ragged-all-to-all",
)
_COLLECTIVE_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<op>" + "|".join(COLLECTIVES) + r")(?:-start)?\("
)
_SHAPE_RE = re.compile(r"\b(?P<dtype>pred|[subf]\d+|bf16|f8\w*|c64|c128)\[(?P<dims>[\d,]*)\]")


def hlo_collectives(hlo_text: str) -> list[dict]:
    """Every collective of a compiled HLO module: op name and the shapes it moves.

    An async pair (``all-reduce-start`` / ``-done``) is counted once, at its start.
    Combined (tuple-shaped) collectives list each of their operands.
    """
    found = []
    for line in hlo_text.splitlines():
        m = _COLLECTIVE_RE.match(line)
        if not m:
            continue
        operands = list(_SHAPE_RE.finditer(m.group("shape")))
        shapes = [tuple(int(d) for d in s.group("dims").split(",") if d) for s in operands]
        found.append(
            dict(
                op=m.group("op"),
                shapes=shapes,
                types=[f"{s.group('dtype')}[{s.group('dims')}]" for s in operands],
                elements=sum(int(np.prod(s)) for s in shapes),
                line=line.strip(),
            )
        )
    return found


def summarize_collectives(collectives: list[dict]) -> str:
    lines = []
    for c in collectives:
        kinds: dict[str, int] = {}
        for t in c["types"]:
            kinds[t] = kinds.get(t, 0) + 1
        desc = ", ".join(f"{n}x {t}" for t, n in kinds.items())
        lines.append(f"{c['op']}: {desc} ({c['elements']} elements)")
    return "\n".join(lines)


def compiled_text(fn: Callable, *args) -> str:
    return fn.lower(*args).compile().as_text()
