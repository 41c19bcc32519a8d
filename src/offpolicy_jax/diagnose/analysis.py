"""Chunked analysis: library metrics pooled exactly, plus histograms, worst-k and what-ifs.

Every metric comes from :func:`offpolicy_jax.compute_correction`, called per chunk
inside one jitted function. Most metrics of ``compute_correction`` are a mean
``Σ num / D`` over a population of sequences (``reduction="sequence"``: ``D`` = the
number of non-empty sequences of that population) or of tokens (``"token"``:
``D`` = their token count), so chunk values weighted by the chunk's ``D`` and
divided by the total ``D`` give the whole-dump value up to float32 rounding. How a
key pools (:func:`population`):

* ``valid``: sequences with a token in the mask and only finite log-probs (§0):
  every §4 mismatch metric, the weights before/after bounding, the truncation,
  band (IcePop), rejection and veto fractions, and the §8 rules' ``P_mean``,
  ``P_fraction_low/high`` and ``P_seq_fraction`` (per-token statistics average over
  the valid tokens of each sequence, per-sequence ones are one value per sequence);
* ``all``: every non-empty sequence (``mis_nonfinite_seq_fraction``);
* ``final``: sequences that keep a token after rejection
  (``mis_is_ratio_{mean,min,max}_{after_tis_rs,final}``, ``mis_is_ratio_fraction_*_final``;
  min and max are the mean of per-sequence minima/maxima, so they pool like any mean);
  the ``mis_is_ratio_*_before_bound`` shares are ``valid``;
* ``max`` / ``min``: a rule's ``P_max`` / ``P_min`` (``mis_rs_<criterion>_*``,
  ``mis_seq_logprob_error_*``) and the ratio's ``mis_is_ratio_{min,max}_before_bound``
  and ``mis_is_ratio_batch_{min,max}_final`` are batch extremes (their parts are
  :class:`offpolicy_jax.rules.Extreme`, :func:`extreme_kinds`), not means: the max / min over the
  chunks that hold a valid sequence (a chunk without one reports 0, which must not
  win), 0 when no chunk does;
* ``batch``: ``mis_ess`` and ``mis_batch_norm_factor``, functions of batch-wide sums,
  recomputed from the pooled sums.

Batch normalisation (``tis_batch_normalize``) divides by a *global* ``μ``, so the
chunks run without it and ``μ`` is applied once to the pooled mean (§3.6): it is the
pooled ``mis_is_ratio_mean_after_tis_rs`` (taken in the normaliser's own reduction),
through :func:`offpolicy_jax.correction.normalizer`. Refused: mask-mode TIS (its
``mis_tis_weight_after_bound`` averages over a population no output reveals) and
M2PO (``m2po_tau``: its cut-off is a function of the whole batch).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import Iterable
from importlib import resources
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import offpolicy_jax as opj
from offpolicy_jax import correction
from offpolicy_jax.reduction import MeshAxes, layout

# Symmetric log bins for a log-ratio δ: |δ| < 1e-6 is the centre bin, then 20 bins per
# decade up to |δ| = 100 (the last bins hold everything beyond), mirrored for δ < 0.
_DECADE_BINS = 20
_LOG_MIN, _LOG_MAX = -6, 2
_MAG = (_LOG_MAX - _LOG_MIN) * _DECADE_BINS + 1  # magnitude bins incl. the last open one
N_DELTA_BINS = 2 * _MAG + 1
# Rollout probability p = exp(logp): 4 bins per decade from 1 down to 1e-8, the last open.
_PROB_PER_DECADE = 4
N_PROB_BINS = 8 * _PROB_PER_DECADE + 1
# A sequence's mean k3: 10 bins per decade from 1e-10 to 1e22 (k3 per token is at most
# e^50), the first bin holding everything below 1e-10, the last everything above.
_K3_PER_DECADE = 10
_K3_LOG_MIN, _K3_LOG_MAX = -10, 22
N_K3_BINS = (_K3_LOG_MAX - _K3_LOG_MIN) * _K3_PER_DECADE + 2
K3_TOP = 100
"""How many tokens with the largest k3 the report keeps (what drives ``mis_k3_kl``)."""


def delta_bin_edges() -> np.ndarray:
    """Edges of the δ bins (``N_DELTA_BINS + 1``; the outermost are ±inf)."""
    mags = 10.0 ** (_LOG_MIN + np.arange(_MAG) / _DECADE_BINS)  # lower edge of each bucket
    return np.concatenate([[-np.inf], -mags[::-1], mags, [np.inf]])


def delta_bin_centres() -> np.ndarray:
    edges = delta_bin_edges()
    mags = 10.0 ** (_LOG_MIN + (np.arange(_MAG) + 0.5) / _DECADE_BINS)
    mags[-1] = 10.0**_LOG_MAX
    centres = np.concatenate([-mags[::-1], [0.0], mags])
    assert centres.shape[0] == edges.shape[0] - 1
    return centres


def prob_bin_edges() -> np.ndarray:
    """Upper edges of the probability bins, from 1 down; the last bin is ``[0, 1e-8)``."""
    return 10.0 ** (-np.arange(N_PROB_BINS + 1) / _PROB_PER_DECADE)


def k3_bin_centres() -> np.ndarray:
    """A representative value per sequence-k3 bin (geometric centre; 0 for the first)."""
    lower = _K3_LOG_MIN + np.arange(N_K3_BINS - 1) / _K3_PER_DECADE
    return np.concatenate([[0.0], 10.0 ** (lower + 0.5 / _K3_PER_DECADE)])


def _k3_bin(x: jax.Array) -> jax.Array:
    j = jnp.floor((jnp.log10(jnp.maximum(x, 1e-30)) - _K3_LOG_MIN) * _K3_PER_DECADE) + 1
    return jnp.where(x < 10.0**_K3_LOG_MIN, 0, jnp.clip(j, 1, N_K3_BINS - 1)).astype(jnp.int32)


def _delta_bin(x: jax.Array) -> jax.Array:
    a = jnp.abs(x)
    j = jnp.floor((jnp.log10(jnp.maximum(a, 1e-30)) - _LOG_MIN) * _DECADE_BINS) + 1
    j = jnp.where(a < 10.0**_LOG_MIN, 0, jnp.clip(j, 1, _MAG)).astype(jnp.int32)
    return _MAG + jnp.where(x < 0, -j, j)


def _prob_bin(logp: jax.Array) -> jax.Array:
    decades = -logp / jnp.log(10.0)
    return jnp.clip(jnp.floor(decades * _PROB_PER_DECADE), 0, N_PROB_BINS - 1).astype(jnp.int32)


# --------------------------------------------------------------------------- what-if configs


@dataclasses.dataclass(frozen=True)
class WhatIf:
    """One row of the what-if table: a standard correction.

    ``config`` is a :class:`~offpolicy_jax.CorrectionConfig` mapping (hashable pairs,
    so the row is a constant); :meth:`build` makes the config.
    """

    name: str
    description: str
    config: tuple[tuple[str, object], ...]

    def build(self) -> opj.CorrectionConfig:
        return opj.CorrectionConfig.from_dict(dict(self.config))


def _mis_yaml() -> tuple[tuple[str, object], ...]:
    path = resources.files("offpolicy_jax") / "configs" / "mis.yaml"
    return tuple(opj.CorrectionConfig.from_yaml(str(path)).to_dict().items())


_TIS = (("use_tis", True), ("tis_level", "token"), ("tis_mode", "truncate"))
_TIS = (*_TIS, ("tis_upper_bound", 2.0))
GEO_BOUNDS = (0.98, 1.02)
VETO = 1e-4
# verl's IcePop preset (decoupled_token_icepop, rollout_is_threshold "0.5_5.0").
ICEPOP_BOUNDS = (0.5, 5.0)
# Trust Region Masking (verl rollout_rs "seq_max_k2,seq_mean_k3"): the per-sequence mean
# k3 at verl's decoupled_k3_rs* preset threshold, the max token k2 at the 2.5 of the
# Trust Region Masking example in docs/guide/configuration.md.
TRM_MAX_K2 = 2.5
TRM_MEAN_K3 = 0.01
# KPop (verl rollout_rs "binary_kl"): φ is verl's default (its decoupled_token_kpop preset).
KPOP_PHI = 2.0

WHAT_IFS: tuple[WhatIf, ...] = (
    WhatIf("token_tis", "token TIS, truncate at 2 (Yao et al.)", _TIS),
    WhatIf("mis", "shipped mis.yaml: token TIS 2 + token RS [0.5, 2] + veto + norm", _mis_yaml()),
    WhatIf(
        "seq_rs",
        "token TIS 2 + sequence RS: reject sequences with Π ratio outside [0.5, 2]",
        (*_TIS, ("use_rs", True), ("rs_level", "sequence")),
    ),
    WhatIf(
        "geo_rs",
        f"token TIS 2 + geometric RS: reject sequences with geometric-mean ratio outside "
        f"[{GEO_BOUNDS[0]}, {GEO_BOUNDS[1]}]",
        (*_TIS, ("use_rs", True), ("rs_level", "geometric"))
        + (("rs_lower_bound", GEO_BOUNDS[0]), ("rs_upper_bound", GEO_BOUNDS[1])),
    ),
    WhatIf(
        "veto",
        f"token TIS 2 + veto of sequences with a token ratio < {VETO:g}",
        (*_TIS, ("rs_veto_threshold", VETO)),
    ),
    WhatIf(
        "geo_rs_veto",
        "geo_rs + veto (the severe-mismatch recommendation)",
        (*_TIS, ("use_rs", True), ("rs_level", "geometric"))
        + (("rs_lower_bound", GEO_BOUNDS[0]), ("rs_upper_bound", GEO_BOUNDS[1]))
        + (("rs_veto_threshold", VETO),),
    ),
    WhatIf(
        "icepop",
        f"IcePop: token weight set to 0 outside [{ICEPOP_BOUNDS[0]}, {ICEPOP_BOUNDS[1]}], "
        "the token stays in the mask (verl decoupled_token_icepop, '0.5_5.0')",
        (("use_tis", True), ("tis_level", "token"), ("tis_mode", "band"))
        + (("tis_lower_bound", ICEPOP_BOUNDS[0]), ("tis_upper_bound", ICEPOP_BOUNDS[1])),
    ),
    WhatIf(
        "k3_trust_region",
        "token TIS 2 + Trust Region Masking: reject sequences with a token k2 > "
        f"{TRM_MAX_K2:g} or mean k3 > {TRM_MEAN_K3:g} (verl seq_max_k2,seq_mean_k3; "
        f"{TRM_MEAN_K3:g} is verl's decoupled_k3_rs* preset threshold)",
        (*_TIS, ("rs_criteria", (f"seq_max_k2:{TRM_MAX_K2:g}", f"seq_mean_k3:{TRM_MEAN_K3:g}"))),
    ),
    WhatIf(
        "kpop",
        "token TIS 2 + KPop: reject tokens whose binary KL between the two probabilities "
        f"of the sampled token exceeds {KPOP_PHI:g} in either direction (verl rollout_rs "
        "binary_kl, its default φ)",
        (*_TIS, ("rs_criteria", (f"binary_kl:{KPOP_PHI:g}",))),
    ),
)

METRICS_ONLY = opj.CorrectionConfig(probability_metrics=True)


@functools.cache
def extreme_kinds(config: opj.CorrectionConfig) -> dict[str, str]:
    """The metric keys of ``config`` that are batch extremes, with ``"max"`` / ``"min"``:
    the :class:`~offpolicy_jax.rules.Extreme` parts of the correction (read from the
    types its metric parts have, without computing anything)."""
    # The keys that need per-token versions or rewrite the rollout log-probs add no batch
    # extreme to a dump without versions; the chain of the other keys is the config's.
    chain = opj.rules.from_config(
        dataclasses.replace(
            config,
            max_weight_staleness=None,
            mask_offpolicy_in_partial_rollout=False,
            nonfinite_rollout="reject",
        )
    )

    def parts(old, rollout, mask):
        rows = layout(MeshAxes(), None, None, old.shape)
        return chain.parts(old, rollout, mask, reduction="sequence", layout=rows)[2]

    x = jax.ShapeDtypeStruct((1, 2), jnp.float32)
    shapes = jax.eval_shape(parts, x, x, x)
    return {key: p.kind for key, p in shapes.items() if isinstance(p, opj.rules.Extreme)}


def population(key: str, config: opj.CorrectionConfig) -> str:
    """How a metric key of ``config`` pools over chunks (module docstring): the
    population it averages over (``"valid"``, ``"all"``, ``"final"``), ``"max"`` /
    ``"min"`` for a batch extreme, or ``"batch"`` for a function of batch-wide sums."""
    extreme = extreme_kinds(config).get(key)
    if extreme is not None:
        return extreme
    if key.startswith("mis_is_ratio_") and not key.endswith("_before_bound"):
        return "final"
    if key == "mis_nonfinite_seq_fraction":
        return "all"
    if key in ("mis_batch_norm_factor", "mis_ess"):
        return "batch"  # a function of batch-wide sums, not a mean: pooled from those sums
    return "valid"


# --------------------------------------------------------------------------- the kernel


def _count(n: jax.Array, reduction: str) -> jax.Array:
    """``D`` of a population with per-sequence sizes ``n`` (module docstring)."""
    if reduction == "sequence":
        return jnp.sum(jnp.where(n > 0, 1.0, 0.0))
    return jnp.sum(n)


@functools.partial(jax.jit, static_argnames=("configs", "reduction", "position_bin", "top_k"))
def chunk_stats(old, rollout, mask, *, configs, reduction, position_bin, top_k):
    """Everything the report needs from one padded ``[B, T]`` chunk, as small arrays."""
    mask, valid_in, n_all, bad, n_valid, use = _validity(old, rollout, mask)
    delta = jnp.where(use, old - rollout, 0.0)
    out = {
        "tokens": jnp.sum(jnp.where(valid_in, 1, 0)),
        "sequences": jnp.sum(jnp.where(n_all > 0, 1, 0)),
        "nonfinite_tokens": jnp.sum(bad),
        "nonfinite_sequences": jnp.sum(jnp.where(bad > 0, 1, 0)),
        "D": {"valid": _count(n_valid, reduction), "all": _count(n_all, reduction)},
    }
    out["configs"] = {
        name: _config_stats(old, rollout, mask, config, reduction, n_valid)
        for name, config in configs
    }
    out |= _histograms(delta, rollout, use, n_valid, position_bin)
    out |= _worst(old, rollout, delta, use, n_valid, top_k)
    out |= _k3_stats(delta, mask, use, n_valid)
    return out


@functools.partial(jax.jit, static_argnames=("configs", "reduction"))
def config_stats(old, rollout, mask, *, configs, reduction):
    """``chunk_stats(...)["configs"]`` alone: more candidate corrections on a chunk whose
    shared statistics one :func:`chunk_stats` call already has."""
    mask, *_, n_valid, _ = _validity(old, rollout, mask)
    return {
        name: _config_stats(old, rollout, mask, config, reduction, n_valid)
        for name, config in configs
    }


def _validity(old, rollout, mask):
    """The mask with non-positive entries zeroed, and which tokens and sequences are
    valid: a sequence with a NaN/inf log-prob at a valid token is left out whole."""
    # A mask entry that is not > 0 (a JSONL/Parquet null read as NaN) is padding, as in
    # the library (docs/semantics.md §0): summed as NaN it dropped its sequence's count.
    mask = jnp.where(mask > 0, mask, 0.0)
    valid_in = mask > 0
    nonfinite = valid_in & ~(jnp.isfinite(old) & jnp.isfinite(rollout))
    n_all = jnp.sum(mask, -1)
    bad = jnp.sum(jnp.where(nonfinite, 1, 0), -1)
    finite = bad == 0
    n_valid = jnp.where(finite, n_all, 0.0)
    use = valid_in & finite[:, None]
    return mask, valid_in, n_all, bad, n_valid, use


def _k3_stats(delta, mask, use, n_valid):
    """What drives ``mis_k3_kl``: the Σ k3 of the chunk, its :data:`K3_TOP` largest
    token terms and a histogram of each sequence's mean k3 (a robust statistic beside
    the mean, which a few tokens at e^20 can carry alone)."""
    b, t = delta.shape
    k3 = jnp.where(use, correction.k3(delta) * jnp.where(use, mask, 0.0), 0.0)
    seq_mean = jnp.where(n_valid > 0, jnp.sum(k3, -1) / jnp.where(n_valid > 0, n_valid, 1.0), 0.0)
    seq_hist = (
        jnp.zeros(N_K3_BINS, jnp.float32)
        .at[_k3_bin(seq_mean)]
        .add(jnp.where(n_valid > 0, 1.0, 0.0))
    )
    score, index = jax.lax.top_k(jnp.where(use, k3, -1.0).ravel(), min(K3_TOP, b * t))
    top = {"score": score, "row": index // t, "pos": index % t, "delta": delta.ravel()[index]}
    return {"k3_sum": jnp.sum(k3), "k3_top": top, "seq_k3_hist": seq_hist}


def _config_stats(old, rollout, mask, config, reduction, n_valid):
    """One candidate correction's sums on the chunk (its batch normaliser stripped:
    the report applies it to the pooled sums)."""
    stripped = dataclasses.replace(config, tis_batch_normalize=False) if config.use_tis else config
    res = opj.compute_correction(old, rollout, mask, stripped, reduction=reduction)
    n_final = jnp.sum(res.mask, -1)
    kept = res.mask > 0
    entry = {
        "metrics": res.metrics,
        "D_final": _count(n_final, reduction),
        "kept_tokens": jnp.sum(res.mask),
        "valid_tokens": jnp.sum(n_valid),
        "valid_seqs": jnp.sum(jnp.where(n_valid > 0, 1.0, 0.0)),
        "rejected_seqs": jnp.sum(jnp.where((n_valid > 0) & (n_final == 0), 1.0, 0.0)),
        # IcePop's band: kept tokens whose weight is set to 0 (no gradient).
        "zero_weight_tokens": jnp.sum(jnp.where(kept & (res.weights == 0), 1.0, 0.0)),
        "sum_w": jnp.sum(jnp.where(kept, res.weights, 0.0)),
        "sum_w2": jnp.sum(jnp.where(kept, jnp.square(res.weights), 0.0)),
    }
    if config.use_tis and config.tis_batch_normalize:
        how: Any = correction.normalizer_reduction(config.tis_level)  # "token" or "sequence"
        if how != reduction:  # μ averages in its own reduction (§3.6, D4)
            other = opj.compute_correction(old, rollout, mask, stripped, reduction=how)
            entry["mu_mean"] = other.metrics["mis_is_ratio_mean_after_tis_rs"]
            entry["mu_D"] = _count(jnp.sum(other.mask, -1), how)
    return entry


def _histograms(delta, rollout, use, n_valid, position_bin):
    """δ (symmetric log bins) by position bucket and by rollout-probability bin."""
    b, t = delta.shape
    out = {}
    d_bin = _delta_bin(delta)
    pos = jnp.broadcast_to(jnp.arange(t) // position_bin, (b, t))
    n_pos = -(-t // position_bin)
    p_bin = _prob_bin(jnp.where(use, rollout, 0.0))
    weight = jnp.where(use, 1.0, 0.0)

    def hist(index, length, values):
        return jnp.zeros(length, jnp.float32).at[index.ravel()].add(values.ravel())

    out["pos_hist"] = hist(pos * N_DELTA_BINS + d_bin, n_pos * N_DELTA_BINS, weight).reshape(
        n_pos, N_DELTA_BINS
    )
    out["prob_hist"] = hist(p_bin * N_DELTA_BINS + d_bin, N_PROB_BINS * N_DELTA_BINS, weight)
    out["prob_hist"] = out["prob_hist"].reshape(N_PROB_BINS, N_DELTA_BINS)
    out["pos_sum"] = hist(pos, n_pos, delta)
    out["pos_abs"] = hist(pos, n_pos, jnp.abs(delta))
    out["prob_sum"] = hist(p_bin, N_PROB_BINS, delta)
    out["prob_abs"] = hist(p_bin, N_PROB_BINS, jnp.abs(delta))
    seq_sum = jnp.sum(delta, -1)
    seq_mean = jnp.where(n_valid > 0, seq_sum / jnp.where(n_valid > 0, n_valid, 1.0), 0.0)
    out["seq_hist"] = hist(_delta_bin(seq_mean), N_DELTA_BINS, jnp.where(n_valid > 0, 1.0, 0.0))
    return out


def _worst(old, rollout, delta, use, n_valid, top_k):
    """The worst tokens by |δ| and sequences by |Σ δ| (only finite, valid ones)."""
    b, t = delta.shape
    seq_sum = jnp.sum(delta, -1)
    out = {}
    k_tok = min(top_k, b * t)
    score, index = jax.lax.top_k(jnp.where(use, jnp.abs(delta), -1.0).ravel(), k_tok)
    out["worst_tokens"] = {
        "score": score,
        "row": index // t,
        "pos": index % t,
        "old": old.ravel()[index],
        "rollout": rollout.ravel()[index],
    }
    k_seq = min(top_k, b)
    score, index = jax.lax.top_k(jnp.where(n_valid > 0, jnp.abs(seq_sum), -1.0), k_seq)
    out["worst_seqs"] = {
        "score": score,
        "row": index,
        "log_ratio": seq_sum[index],
        "length": n_valid[index],
        "max_abs": jnp.max(jnp.abs(delta), -1)[index],
    }
    return out


# --------------------------------------------------------------------------- accumulation


def _bucket(n: int, minimum: int) -> int:
    """Padded size: powers of two up to 512, then multiples of 512 (few compilations)."""
    if n <= 512:
        return max(minimum, 1 << max(0, (n - 1).bit_length()))
    return -(-n // 512) * 512


MIN_COLS, MIN_ROWS = 64, 32
"""A chunk pads to at least ``MIN_COLS`` tokens and, up to 4096 tokens, ``MIN_ROWS`` rows:
small chunks (short dumps, a file's last rows, short sequences split off a long one)
share one compiled kernel (each shape compiles the whole kernel again, seconds on a CPU)
instead of one per power of two, for a few KB of padding."""


def _padded_shape(b: int, t: int, rows: int) -> tuple[int, int]:
    """``[B, T]`` a ``b x t`` chunk pads to, for chunks of ``rows`` rows."""
    cols = _bucket(t, MIN_COLS)
    # At least MIN_ROWS rows only for short sequences: MIN_ROWS rows of a 2M-token
    # sequence would be 256 MB per [B, T] temporary.
    minimum = MIN_ROWS if cols <= 4096 else 1
    padded = _bucket(b, minimum) if b < rows else -(-b // rows) * rows
    return max(padded, minimum), cols


# Per-config sums of chunk_stats, added over chunks.
_COUNTS = ("kept_tokens", "valid_tokens", "valid_seqs", "rejected_seqs", "zero_weight_tokens")
_COUNTS += ("sum_w", "sum_w2")


CONFIGS_PER_PROGRAM = 4
"""Candidate corrections compiled into one program. XLA:CPU's compilation temporaries
grow with the program and set diagnose's peak memory: all ten in one program need about
a third more than groups of four, for a run about a sixth shorter
(``benchmarks/diagnose_big_results.json``)."""

SPLIT_CELLS = 1 << 20
"""A padded chunk larger than this runs one config per call (see ``Accumulator.add``)."""

LONE_SEQUENCE_COLS = 1 << 16
"""A one-row chunk wider than this drops its compiled programs after use."""

MAX_POSITION_BUCKETS = 1024
"""The position profile never has more buckets: a longer sequence doubles their width."""


def auto_position_bin(length: int) -> int:
    """Bucket width for a dump whose first chunk is ``length`` tokens wide: the largest
    power of two giving at least 32 buckets (1 for short responses)."""
    width = 1
    while width * 2 * 32 <= length:
        width *= 2
    return width


def _drop_programs() -> None:
    """Drops the compiled chunk programs (XLA:CPU's compiled programs and what their
    compilation left behind stay resident while JAX's caches hold them)."""
    for program in (chunk_stats, config_stats):
        program.clear_cache()  # pyright: ignore[reportAttributeAccessIssue]  # jax's stubs lack it


class Accumulator:
    """Pools :func:`chunk_stats` of many chunks; memory is independent of the dump size."""

    def __init__(self, configs, reduction="sequence", *, position_bin=None, top_k=20, rows=1024):
        for name, config in configs:
            if config.use_tis and config.tis_mode == "mask":
                raise ValueError(
                    f"config {name!r}: diagnose cannot pool tis_mode='mask' configs exactly "
                    "(mis_tis_weight_after_bound averages over tokens no output reveals)"
                )
            if config.m2po_tau is not None:
                raise ValueError(
                    f"config {name!r}: diagnose cannot pool m2po_tau configs exactly "
                    "(M2PO's cut-off is a function of the whole batch, not of each chunk)"
                )
        self.configs = tuple(configs)
        self.reduction = reduction
        self.position_bin = position_bin
        self.top_k = top_k
        self.rows = rows
        self.totals = {"tokens": 0, "sequences": 0, "nonfinite_tokens": 0}
        self.totals["nonfinite_sequences"] = 0
        self.sums: dict[str, dict[str, list[float]]] = {name: {} for name, _ in self.configs}
        # Batch extremes of the rules: None until a chunk with a valid sequence reports one.
        self.extremes: dict[str, dict[str, float | None]] = {n: {} for n, _ in self.configs}
        self.extra: dict[str, dict[str, float]] = {name: {} for name, _ in self.configs}
        self.pos_hist = np.zeros((0, N_DELTA_BINS))
        self.pos_sum = np.zeros(0)
        self.pos_abs = np.zeros(0)
        self.prob_hist = np.zeros((N_PROB_BINS, N_DELTA_BINS))
        self.prob_sum = np.zeros(N_PROB_BINS)
        self.prob_abs = np.zeros(N_PROB_BINS)
        self.seq_hist = np.zeros(N_DELTA_BINS)
        self.worst_tokens: list[tuple] = []
        self.worst_seqs: list[tuple] = []
        self.k3_sum = 0.0
        self.k3_top: list[tuple] = []
        self.seq_k3_hist = np.zeros(N_K3_BINS)
        # Top-k divergence sums (dumps that carry top-k log-probs): key -> [num, den].
        self.topk: dict[str, list[float]] = {}
        self.topk_k: int | None = None
        self._counter = 0  # heap tie-breaker

    def add(self, chunk) -> None:
        b, t = chunk.old.shape
        if self.position_bin is None:
            self.position_bin = auto_position_bin(t)
        rows, cols = _padded_shape(b, t, self.rows)
        while -(-t // self.position_bin) > MAX_POSITION_BUCKETS:
            self._coarsen_positions()

        def pad(a):
            return np.pad(a, ((0, rows - b), (0, cols - t)))

        arrays = [jnp.asarray(pad(a)) for a in (chunk.old, chunk.rollout, chunk.mask)]
        kwargs = dict(reduction=self.reduction, position_bin=self.position_bin, top_k=self.top_k)
        # A huge chunk (a very long sequence) runs its configs one call each: one
        # program's temporaries for all ten held ~50 [B, T] arrays at once.
        per = CONFIGS_PER_PROGRAM if rows * cols <= SPLIT_CELLS else 1
        groups = [self.configs[i : i + per] for i in range(0, len(self.configs), per)]
        # A very long sequence analysed alone: its shape (a multiple of 512 tokens)
        # rarely recurs, so each program compiled for it is dropped once run (with the
        # other shapes' programs, compiled again when next needed); kept, the ten of
        # them stacked ~200 MB onto diagnose's peak memory.
        lone = rows == 1 and cols > LONE_SEQUENCE_COLS
        stats = jax.device_get(chunk_stats(*arrays, configs=groups[0], **kwargs))
        for configs in groups[1:]:
            if lone:
                _drop_programs()
            more = config_stats(*arrays, configs=configs, reduction=self.reduction)
            stats["configs"].update(jax.device_get(more))
        if lone:
            _drop_programs()
        self._pool(stats, chunk, b)
        if getattr(chunk, "topk_old", None) is not None:
            self._pool_topk(chunk, rows, cols)

    def _pool_topk(self, chunk, rows: int, cols: int) -> None:
        """Pools the top-k divergences of a chunk that carries top-k log-probs."""
        b, t = chunk.old.shape
        k = chunk.topk_old.shape[-1]
        self.topk_k = k if self.topk_k in (None, k) else -1  # -1: K differs across files

        def pad(a):
            return np.pad(a, ((0, rows - b), (0, cols - t)) + ((0, 0),) * (a.ndim - 2))

        arrays = (chunk.old, chunk.rollout, chunk.mask, chunk.topk_old, chunk.topk_rollout)
        stats = jax.device_get(
            topk_chunk_stats(*(jnp.asarray(pad(a)) for a in arrays), reduction=self.reduction)
        )
        for key, (num, den) in stats.items():
            total = self.topk.setdefault(key, [0.0, 0.0])
            self.topk[key] = [total[0] + float(num), total[1] + float(den)]

    def topk_metrics(self) -> dict[str, float] | None:
        """``mis_topk_tv`` / ``mis_topk_kl`` of the dump (as :func:`offpolicy_jax.policy_loss`
        reports them with ``topk=``) and the shares of tokens beyond DPPO's thresholds;
        None when no chunk carried top-k log-probs."""
        if not self.topk:
            return None
        out = {key: (num / den if den else 0.0) for key, (num, den) in self.topk.items()}
        out["topk_tokens"] = self.topk["topk_tv_above"][1]
        out["topk_k"] = float(self.topk_k or 0)
        return out

    def _coarsen_positions(self) -> None:
        """Doubles the position bucket width, merging the pooled buckets pairwise
        (exact: bucket ``j`` of width ``2w`` is buckets ``2j`` and ``2j + 1`` of width
        ``w``), so that a long sequence after short ones cannot grow the position
        profile without bound (2M positions x 323 δ bins was 2.7 GB)."""
        assert self.position_bin is not None
        self.position_bin *= 2
        n = self.pos_hist.shape[0]
        if n % 2:
            self.pos_hist = np.pad(self.pos_hist, ((0, 1), (0, 0)))
            self.pos_sum, self.pos_abs = np.pad(self.pos_sum, (0, 1)), np.pad(self.pos_abs, (0, 1))
        self.pos_hist = self.pos_hist.reshape(-1, 2, N_DELTA_BINS).sum(1)
        self.pos_sum = self.pos_sum.reshape(-1, 2).sum(1)
        self.pos_abs = self.pos_abs.reshape(-1, 2).sum(1)

    def _pool(self, stats, chunk, b) -> None:
        for key in self.totals:
            self.totals[key] += int(stats[key])
        configs = dict(self.configs)
        for name, entry in stats["configs"].items():
            sums = self.sums[name]
            counts = {**stats["D"], "final": entry["D_final"]}
            extremes = self.extremes[name]
            for key, value in entry["metrics"].items():
                kind = population(key, configs[name])
                if kind == "batch":
                    continue
                if kind in ("max", "min"):
                    # A chunk without a valid (for a _final extreme: a kept) sequence
                    # reports 0: it must not win.
                    best = extremes.setdefault(key, None)
                    present = entry["D_final"] if key.endswith("_final") else entry["valid_seqs"]
                    if present > 0:
                        pick = max if kind == "max" else min
                        best = float(value) if best is None else pick(best, float(value))
                        extremes[key] = best
                    continue
                d = float(counts[kind])
                num, den = sums.setdefault(key, [0.0, 0.0])
                sums[key] = [num + float(value) * d, den + d]
            extra = self.extra[name]
            for key in _COUNTS:
                extra[key] = extra.get(key, 0.0) + float(entry[key])
            if "mu_mean" in entry:
                d = float(entry["mu_D"])
                extra["mu_num"] = extra.get("mu_num", 0.0) + float(entry["mu_mean"]) * d
                extra["mu_den"] = extra.get("mu_den", 0.0) + d
        # The buckets of the chunk's own width: those of its padding hold no token.
        n_pos = -(-chunk.old.shape[1] // self.position_bin)
        if n_pos > self.pos_hist.shape[0]:
            grow = n_pos - self.pos_hist.shape[0]
            self.pos_hist = np.pad(self.pos_hist, ((0, grow), (0, 0)))
            self.pos_sum = np.pad(self.pos_sum, (0, grow))
            self.pos_abs = np.pad(self.pos_abs, (0, grow))
        self.pos_hist[:n_pos] += stats["pos_hist"][:n_pos]
        self.pos_sum[:n_pos] += stats["pos_sum"][:n_pos]
        self.pos_abs[:n_pos] += stats["pos_abs"][:n_pos]
        self.prob_hist += stats["prob_hist"]
        self.prob_sum += stats["prob_sum"]
        self.prob_abs += stats["prob_abs"]
        self.seq_hist += stats["seq_hist"]
        w = stats["worst_tokens"]
        for score, row, pos, old, rollout in zip(
            w["score"], w["row"], w["pos"], w["old"], w["rollout"], strict=True
        ):
            if score < 0 or row >= b:
                continue
            item = {
                "abs_log_ratio": float(score),
                "log_ratio": float(old - rollout),
                "file": int(chunk.file[row]),
                "row": int(chunk.row[row]),
                "position": int(chunk.start[row] + pos),
                "old_logp": float(old),
                "rollout_logp": float(rollout),
            }
            self._push(self.worst_tokens, float(score), item)
        w = stats["worst_seqs"]
        for score, row, log_ratio, length, max_abs in zip(
            w["score"], w["row"], w["log_ratio"], w["length"], w["max_abs"], strict=True
        ):
            if score < 0 or row >= b:
                continue
            item = {
                "abs_log_ratio": float(score),
                "log_ratio": float(log_ratio),
                "geometric_log_ratio": float(log_ratio / length),
                "tokens": int(length),
                "max_abs_token_log_ratio": float(max_abs),
                "file": int(chunk.file[row]),
                "row": int(chunk.row[row]),
                "start": int(chunk.start[row]),
            }
            self._push(self.worst_seqs, float(score), item)
        self._pool_k3(stats, chunk, b)

    def _pool_k3(self, stats, chunk, b) -> None:
        self.k3_sum += float(stats["k3_sum"])
        self.seq_k3_hist += stats["seq_k3_hist"]
        w = stats["k3_top"]
        for score, row, pos, delta in zip(w["score"], w["row"], w["pos"], w["delta"], strict=True):
            if score < 0 or row >= b:
                continue
            item = {
                "k3": float(score),
                "log_ratio": float(delta),
                "file": int(chunk.file[row]),
                "row": int(chunk.row[row]),
                "start": int(chunk.start[row]),
                "position": int(chunk.start[row] + pos),
            }
            self._push(self.k3_top, float(score), item, K3_TOP)

    def _push(self, heap, score, item, limit=None) -> None:
        self._counter += 1
        entry = (score, -self._counter, item)  # earlier items win ties
        if len(heap) < (limit or self.top_k):
            heapq.heappush(heap, entry)
        elif entry > heap[0]:
            heapq.heapreplace(heap, entry)

    # ----------------------------------------------------------------------- results

    def _ess(self, name: str) -> float:
        """``mis_ess`` of the whole dump from its pooled sums (invariant to the normaliser μ)."""
        extra = self.extra[name]
        return float(
            correction.effective_sample_size(
                jnp.float32(extra.get("sum_w", 0.0)),
                jnp.float32(extra.get("sum_w2", 0.0)),
                jnp.float32(extra.get("kept_tokens", 0.0)),
            )
        )

    def metrics(self, name: str) -> dict[str, float]:
        """Pooled metrics of one config: equal to one ``compute_correction`` on the dump."""
        config = dict(self.configs)[name]
        result = {key: (num / den if den else 0.0) for key, (num, den) in self.sums[name].items()}
        result |= {k: 0.0 if v is None else v for k, v in self.extremes[name].items()}
        if not config.use_tis:
            return result
        result["mis_ess"] = self._ess(name)
        mu = 1.0
        if config.tis_batch_normalize:
            if correction.normalizer_reduction(config.tis_level) == self.reduction:
                mean_w = result["mis_is_ratio_mean_after_tis_rs"]
            else:
                extra = self.extra[name]
                mean_w = extra["mu_num"] / extra["mu_den"] if extra.get("mu_den") else 0.0
            mu = float(correction.normalizer(jnp.float32(mean_w)))
            for key in ("mean", "min", "max", "batch_min", "batch_max"):
                result[f"mis_is_ratio_{key}_final"] /= mu
        result["mis_batch_norm_factor"] = mu
        return result

    def what_if(self, name: str) -> dict[str, float | None]:
        """Shares rejected / truncated / zero-weighted, ESS over kept tokens, mean weight.

        ``rejected_token_share`` and ``zero_weight_share`` are shares of the valid
        tokens: outside the final mask, and inside it with weight 0 (IcePop's band,
        ``tis_mode="band"``, zeroes weights but keeps the tokens in the mask; None for
        other modes); their sum is the share that adds no gradient.
        ``truncated_share`` is ``mis_tis_truncate_fraction`` (the metrics' reduction;
        None where the config does not truncate).
        """
        config = dict(self.configs)[name]
        extra, metrics = self.extra[name], self.metrics(name)
        valid_tokens = extra.get("valid_tokens", 0.0)
        kept = extra.get("kept_tokens", 0.0)

        def share(tokens: float) -> float:
            return tokens / valid_tokens if valid_tokens else 0.0

        band = config.use_tis and config.tis_mode == "band"
        return {
            "rejected_token_share": share(valid_tokens - kept),
            "rejected_seq_share": (
                extra["rejected_seqs"] / extra["valid_seqs"] if extra.get("valid_seqs") else 0.0
            ),
            "truncated_share": metrics.get("mis_tis_truncate_fraction"),
            "zero_weight_share": share(extra.get("zero_weight_tokens", 0.0)) if band else None,
            "ess": self._ess(name),
            "mean_weight": metrics.get("mis_is_ratio_mean_final", 0.0),
        }


TOPK_THRESHOLDS = {"tv": 0.15, "kl": 0.05}
"""The DPPO paper's recommended trust-region thresholds δ (TRL's ``epsilon`` guidance)."""


@functools.partial(jax.jit, static_argnames=("reduction",))
def topk_chunk_stats(old, rollout, mask, topk_old, topk_rollout, *, reduction):
    """``key -> (numerator, denominator)`` of the chunk's top-k divergence means.

    ``mis_topk_tv`` / ``mis_topk_kl`` average over the valid tokens (``mask > 0``, a
    finite divergence) of the sequences whose log-probs are all finite there, per token
    or per sequence as ``reduction``; ``topk_{tv,kl}_above`` are the token shares beyond
    :data:`TOPK_THRESHOLDS`.
    """
    valid = mask > 0
    ok = ~jnp.any(valid & ~(jnp.isfinite(old) & jnp.isfinite(rollout)), axis=-1, keepdims=True)
    out = {}
    tv, kl = correction.topk_divergences(topk_old, topk_rollout, valid)
    values = {"tv": tv, "kl": kl}
    use = valid & ok & jnp.isfinite(values["tv"]) & jnp.isfinite(values["kl"])
    weight = jnp.where(use, mask, 0.0)
    count = jnp.sum(weight, axis=-1)
    for kind, value in values.items():
        sums = jnp.sum(jnp.where(use, value, 0.0) * weight, axis=-1)
        if reduction == "token":
            out[f"mis_topk_{kind}"] = (jnp.sum(sums), jnp.sum(count))
        else:
            seqs = count > 0
            means = jnp.where(seqs, sums / jnp.where(seqs, count, 1.0), 0.0)
            out[f"mis_topk_{kind}"] = (jnp.sum(means), jnp.sum(seqs.astype(jnp.float32)))
        above = jnp.where(use & (value > TOPK_THRESHOLDS[kind]), weight, 0.0)
        out[f"topk_{kind}_above"] = (jnp.sum(above), jnp.sum(count))
    return out


def run(chunks: Iterable, configs, reduction="sequence", **kwargs) -> Accumulator:
    acc = Accumulator(configs, reduction, **kwargs)
    for chunk in chunks:
        acc.add(chunk)
    return acc
