"""Hypothesis strategies: ragged, garbage-padded batches of log-probs and configs.

Log-probs are multiples of 1/16, so every log-ratio and per-sequence sum is exact
in float32 and float64 alike and no decision (ratio vs. bound) sits within
rounding of its threshold: the JAX library and the NumPy reference must then make
identical keep/reject decisions.
"""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import strategies as st

import offpolicy_jax as opj

GARBAGE = (np.nan, np.inf, -np.inf, 1e30, -1e30)
BATCH, MAX_LEN = 5, 11  # T not a multiple of anything convenient, on purpose


def fill_garbage(x: np.ndarray, mask: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``x`` with every masked position replaced by NaN / ±inf / ±1e30."""
    junk = rng.choice(np.array(GARBAGE, np.float32), size=x.shape)
    return np.where(mask, x, junk).astype(np.float32)


@st.composite
def ragged_batches(draw, *, batch=BATCH, max_len=MAX_LEN, holes=True, spikes=True, garbage=True):
    """A dict of float32 ``old_logp``, ``rollout_logp``, ``logp``, ``advantages`` and a mask.

    Lengths are ragged and include empty sequences; optional holes are masked
    positions inside a sequence; optional spikes are large log-ratios that hit
    the bounds, the rejection thresholds and the veto.
    """
    lengths = draw(st.lists(st.integers(0, max_len), min_size=batch, max_size=batch))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    mask = np.arange(max_len)[None, :] < np.asarray(lengths)[:, None]
    if holes and draw(st.booleans()):
        mask &= rng.random(mask.shape) > 0.15
    old = rng.integers(-96, 0, size=mask.shape) / 16.0
    delta = rng.integers(-8, 9, size=mask.shape) / 16.0
    if spikes:
        spike = rng.random(mask.shape) < 0.08
        delta = np.where(spike, rng.integers(-200, 40, size=mask.shape) / 16.0, delta)
    rollout = old - delta
    logp = old + rng.integers(-6, 7, size=mask.shape) / 16.0
    advantages = rng.integers(-16, 17, size=mask.shape) / 8.0
    arrays = dict(old_logp=old, rollout_logp=rollout, logp=logp, advantages=advantages)
    if garbage:
        arrays = {k: fill_garbage(v, mask, rng) for k, v in arrays.items()}
    else:
        arrays = {k: v.astype(np.float32) for k, v in arrays.items()}
    arrays["mask"] = mask.astype(np.float32)
    arrays["lengths"] = np.asarray(lengths)
    return arrays


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
