"""Hypothesis strategies: ragged, garbage-padded batches of log-probs and configs.

Log-probs are multiples of 1/16, so every log-ratio and per-sequence sum is exact
in float32 and float64 alike and no decision (ratio vs. bound) sits within
rounding of its threshold: the JAX library and the NumPy reference must then make
identical keep/reject decisions.
"""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import offpolicy_jax as opj

FAST_PROFILE = "fast"  # loaded by conftest.py for the fast tier


def examples(n: int) -> int:
    """A property's own example count ``n``; under the fast tier's profile, at most that
    profile's count (an explicit ``@settings(max_examples=...)`` overrides a profile)."""
    if settings.get_current_profile_name() == FAST_PROFILE:
        return min(n, settings.get_profile(FAST_PROFILE).max_examples)
    return n


GARBAGE = (np.nan, np.inf, -np.inf, 1e30, -1e30)
BATCH, MAX_LEN = 5, 11  # T not a multiple of anything convenient, on purpose


def sixteenths(shape, low: int, high: int) -> st.SearchStrategy[np.ndarray]:
    """float32 arrays of multiples of 1/16 in ``[low/16, high/16]`` (exact in every dtype
    the tests use up to |x| = 32); they shrink towards 0."""
    return hnp.arrays(np.int16, shape, elements=st.integers(low, high)).map(
        lambda k: (k / 16.0).astype(np.float32)
    )


def garbage(shape) -> st.SearchStrategy[np.ndarray]:
    """float32 arrays of NaN / ±inf / ±1e30, for the positions a mask excludes."""
    return hnp.arrays(np.float32, shape, elements=st.sampled_from(GARBAGE))


def fill_garbage(x: np.ndarray, mask: np.ndarray, junk: np.ndarray) -> np.ndarray:
    """``x`` with every masked position replaced by the matching entry of ``junk``."""
    return np.where(mask, x, junk).astype(np.float32)


# Log-ratio spikes, in 1/16: mostly none; large ones hit the bounds, the rejection
# thresholds, the veto (log 1e-4 = -9.2) and the ±20 clamp.
SPIKES = (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -400, -200, -160, -48, 24, 40, 80, 320)


@st.composite
def lengths_and_mask(draw, batch: int, max_len: int, *, holes: bool = True):
    """Ragged lengths in ``[0, max_len]`` (empty sequences included) and the bool mask,
    with optional holes (masked positions inside a sequence)."""
    lengths = np.asarray(
        draw(st.lists(st.integers(0, max_len), min_size=batch, max_size=batch)), np.int64
    )
    mask = np.arange(max_len)[None, :] < lengths[:, None]
    if holes and draw(st.booleans()):
        mask &= ~draw(hnp.arrays(np.bool_, mask.shape, elements=st.booleans()))
    return lengths, mask


@st.composite
def ragged_batches(draw, *, batch=BATCH, max_len=MAX_LEN, holes=True, spikes=True, garbage=True):
    """A dict of float32 ``old_logp``, ``rollout_logp``, ``logp``, ``advantages`` and a mask.

    Lengths are ragged and include empty sequences; optional holes are masked
    positions inside a sequence; optional spikes are large log-ratios that hit
    the bounds, the rejection thresholds and the veto. Every array comes from
    ``hypothesis.extra.numpy``, so a failing example shrinks.
    """
    shape = (batch, max_len)
    lengths, mask = draw(lengths_and_mask(batch, max_len, holes=holes))
    old = draw(sixteenths(shape, -96, -1))
    delta = draw(sixteenths(shape, -8, 8))
    if spikes:
        delta = delta + draw(hnp.arrays(np.int16, shape, elements=st.sampled_from(SPIKES))) / 16
    rollout = old - delta
    logp = old + draw(sixteenths(shape, -6, 6))
    advantages = draw(sixteenths(shape, -32, 32)) * 2  # multiples of 1/8 in [-4, 4]
    arrays = dict(old_logp=old, rollout_logp=rollout, logp=logp, advantages=advantages)
    if garbage:
        arrays = {k: fill_garbage(v, mask, draw(_garbage(shape))) for k, v in arrays.items()}
    else:
        arrays = {k: v.astype(np.float32) for k, v in arrays.items()}
    arrays["mask"] = mask.astype(np.float32)
    arrays["lengths"] = lengths
    return arrays


_garbage = garbage  # ragged_batches' keyword `garbage` shadows the strategy


def _correction_configs():
    configs = []
    for level, mode, bn, rs, veto in itertools.product(
        ("token", "sequence", "geometric"),
        ("truncate", "clip", "mask"),
        (False, True),
        (None, "token", "sequence", "geometric"),
        (None, 1e-4, 0.05),
    ):
        configs.append(
            opj.CorrectionConfig(
                use_tis=True,
                tis_level=level,
                tis_mode=mode,
                tis_lower_bound=0.5,
                tis_upper_bound=2.0,
                tis_batch_normalize=bn,
                use_rs=rs is not None,
                rs_level=rs or "token",
                rs_lower_bound=0.3 if rs else None,
                rs_upper_bound=3.0 if rs else None,
                rs_veto_threshold=veto,
            )
        )
    return configs


ALL_CORRECTION_CONFIGS = _correction_configs() + [opj.CorrectionConfig(use_tis=False)]
correction_configs = st.sampled_from(ALL_CORRECTION_CONFIGS)


def reference_kwargs(config: opj.CorrectionConfig) -> dict:
    """The NumPy reference's keyword arguments for ``config``."""
    return config.to_dict()


# --------------------------------------------------------------------------- campaign
# The adversarial campaign (test_campaign.py) draws its batches from one fixed shape
# and its configs from a fixed pool, so that each property compiles once per (config,
# dtypes) and thousands of examples cost little more than their execution.

CAMPAIGN_BATCH, CAMPAIGN_LEN = 4, 16
DTYPES = ("float32", "bfloat16", "float16")
MASK_DTYPES = ("float32", "bool", "int32")
LOGP_KEYS = ("logp", "old_logp", "rollout_logp")


@st.composite
def campaign_batches(draw, *, batch=CAMPAIGN_BATCH, max_len=CAMPAIGN_LEN, holes=True):
    """Ragged float32 log-probs and advantages padded to ``[batch, max_len]``, with junk.

    Returns a dict: ``logp``, ``old_logp``, ``rollout_logp``, ``advantages`` (finite at
    every position), ``mask`` (bool), ``lengths`` and ``junk`` (a dict of NaN / ±inf /
    ±1e30 arrays for the masked positions of each of the four inputs). ``|logp| <= 44``
    and ``|old − rollout| <= 25.5``, so that every metric of a finite input is finite.
    """
    shape = (batch, max_len)
    lengths, mask = draw(lengths_and_mask(batch, max_len, holes=holes))
    old = draw(sixteenths(shape, -512, 0))
    delta = draw(sixteenths(shape, -8, 8))
    delta = delta + draw(hnp.arrays(np.int16, shape, elements=st.sampled_from(SPIKES))) / 16
    logp = old + draw(sixteenths(shape, -64, 64))
    arrays = dict(
        logp=logp.astype(np.float32),
        old_logp=old,
        rollout_logp=(old - delta).astype(np.float32),
        advantages=draw(sixteenths(shape, -32, 32)),
    )
    arrays["junk"] = {key: draw(garbage(shape)) for key in list(arrays)}
    arrays["mask"] = mask
    arrays["lengths"] = lengths
    return arrays


def _campaign_loss_configs():
    mis = opj.CorrectionConfig(
        use_tis=True,
        use_rs=True,
        tis_lower_bound=0.5,
        tis_upper_bound=2.0,
        rs_veto_threshold=1e-4,
        tis_batch_normalize=True,
    )
    seq_clip = opj.CorrectionConfig(
        use_tis=True, tis_level="sequence", tis_mode="clip", tis_lower_bound=0.5
    )
    geo_mask = opj.CorrectionConfig(
        use_tis=True,
        tis_level="geometric",
        tis_mode="mask",
        tis_upper_bound=1.5,
        rs_veto_threshold=1e-3,
        tis_batch_normalize=True,
    )
    token_mask_seq_rs = opj.CorrectionConfig(
        use_tis=True,
        tis_mode="mask",
        use_rs=True,
        rs_level="sequence",
        rs_lower_bound=0.3,
        rs_upper_bound=3.0,
    )
    truncate_geo_rs = opj.CorrectionConfig(
        use_tis=True,
        tis_upper_bound=3.0,
        use_rs=True,
        rs_level="geometric",
        rs_lower_bound=0.5,
        rs_upper_bound=2.0,
    )
    metrics_only = opj.CorrectionConfig(use_tis=False, rs_veto_threshold=1e-4)
    vanilla, vanilla_two_sided = opj.VanillaTIS(), opj.VanillaTIS(clip_low=0.5, clip=3.0)
    L = opj.LossConfig  # noqa: N806
    return [
        L("ppo"),
        L("ppo", aggregation="token_mean", correction=metrics_only, clip_eps_high=0.28),
        L(
            "ppo",
            aggregation="sequence_sum",
            get_mismatch_metrics=True,
            dual_clip_c=3.0,
            metric_reduction="token",
        ),
        L("bypass_ppo", get_mismatch_metrics=True, clip_eps_high=0.28),
        L("bypass_ppo", aggregation="token_mean", dual_clip_c=3.0),
        L("bypass_ppo", aggregation="sequence_sum", correction=metrics_only),
        L("decoupled_ppo", correction=mis),
        L("decoupled_ppo", correction=vanilla, get_mismatch_metrics=True),
        L(
            "decoupled_ppo",
            aggregation="token_mean",
            correction=geo_mask,
            rejected_in_denominator=True,
        ),
        L(
            "decoupled_ppo",
            aggregation="sequence_sum",
            correction=token_mask_seq_rs,
            dual_clip_c=3.0,
            metric_reduction="token",
        ),
        L("reinforce_is", correction=seq_clip),
        L("reinforce_is", aggregation="token_mean", correction=vanilla_two_sided),
        L("reinforce_is", aggregation="token_mean", correction=mis, metric_reduction="token"),
        L(
            "reinforce_is",
            aggregation="sequence_sum",
            correction=truncate_geo_rs,
            rejected_in_denominator=True,
        ),
    ]


CAMPAIGN_LOSS_CONFIGS = _campaign_loss_configs()
CAMPAIGN_CORRECTION_CONFIGS = list(
    dict.fromkeys(
        c.correction
        for c in CAMPAIGN_LOSS_CONFIGS
        if isinstance(c.correction, opj.CorrectionConfig)
    )
)


def _log_uniform(low_exp: float, high_exp: float) -> st.SearchStrategy[float]:
    return st.floats(low_exp, high_exp).map(lambda e: float(10.0**e))


F32 = np.finfo(np.float32)
EDGE_NUMBERS = (
    0.0,
    -1.0,
    float("nan"),
    float("inf"),
    float(F32.tiny),
    float(F32.tiny) / 2,
    float(F32.max),
    3.5e38,
    1e-38,
    1e38,
    1.0,
    0.5,
    2.0,
    1.0 + 1e-9,
    1.0 - 1e-9,
)
# Any number a hostile config could hold: log-uniform from 1e-46 to 1e39 (float32
# underflow to overflow) plus the edges; they shrink towards the first edges.
hostile_numbers = st.one_of(st.sampled_from(EDGE_NUMBERS), _log_uniform(-46, 39))
optional_hostile_numbers = st.one_of(st.none(), hostile_numbers)
