"""Regression tests of issue 30: inputs that gave a plausible number instead of an error.

One test per finding; each failed on 05d9d1f. The campaign properties that would have
caught each class are in tests/test_campaign.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import offpolicy_jax as opj

MIS = opj.CorrectionConfig.preset("mis")


def _packed_batch(seed=0, rows=2, length=12, segments=3):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-1.0, 0.3, (rows, length)).astype(np.float32)
    old = (logp - 0.05).astype(np.float32)
    rollout = (logp + rng.normal(0.0, 0.3, (rows, length))).astype(np.float32)
    adv = rng.normal(size=(rows, length)).astype(np.float32)
    ids = np.repeat(np.arange(1, segments + 1), length // segments)[None].repeat(rows, 0)
    return logp, old, rollout, adv, np.ones((rows, length), bool), ids.astype(np.int32)


# --------------------------------------------------------------------------- packing


def test_segment_ids_above_num_segments_raise_eagerly_and_are_padding_under_jit():
    logp, old, rollout, adv, mask, ids = _packed_batch()
    config = opj.LossConfig(algorithm="decoupled_ppo", correction=MIS)
    with pytest.raises(ValueError, match="segment_ids holds id 3 but num_segments is 2"):
        opj.policy_loss(logp, old, rollout, adv, mask, config, segment_ids=ids, num_segments=2)
    with pytest.raises(ValueError, match="num_segments"):
        opj.compute_correction(old, rollout, mask, MIS, segment_ids=ids, num_segments=2)
    # Under jit the ids are not read (no host sync): an id above K is padding (§10).
    padded = np.where(ids > 2, 0, ids)
    traced = jax.jit(
        lambda ids: opj.policy_loss(
            logp, old, rollout, adv, mask, config, segment_ids=ids, num_segments=2
        )[0]
    )
    want = opj.policy_loss(
        logp, old, rollout, adv, mask, config, segment_ids=padded, num_segments=2
    )
    np.testing.assert_allclose(float(traced(ids)), float(want[0]), rtol=1e-6)


def test_int64_segment_ids_beyond_int32_raise_instead_of_wrapping():
    logp, old, rollout, adv, mask, ids = _packed_batch()
    wide = ids.astype(np.int64)
    wide[:, -2:] = 2**32 + 1  # would wrap to segment 1 in int32
    with pytest.raises(ValueError, match="segment_ids holds ids outside int32"):
        opj.compute_correction(old, rollout, mask, MIS, segment_ids=wide, num_segments=3)


# --------------------------------------------------------------------------- masks


@pytest.mark.parametrize("bad", [2, 255, -1])
def test_integer_mask_other_than_0_1_raises_naming_mask(bad):
    logp, old, rollout, adv, mask, _ = _packed_batch()
    ints = mask.astype(np.int32)
    ints[0, 1] = bad
    config = opj.LossConfig(algorithm="decoupled_ppo", correction=MIS)
    with pytest.raises(ValueError, match="mask is an integer mask holding"):
        opj.policy_loss(logp, old, rollout, adv, ints, config)
    with pytest.raises(ValueError, match="mask"):
        opj.compute_correction(old, rollout, jnp.asarray(ints), MIS)
    # Float values are documented weights: a weighted mean (numerator and denominator).
    weights = np.where(mask, 1.0, 0.0).astype(np.float32)
    weights[0, :6] = 0.5
    got = opj.aggregate(adv, weights, weights, "token_mean").value()
    np.testing.assert_allclose(float(got), np.sum(adv * weights) / np.sum(weights), rtol=1e-6)

