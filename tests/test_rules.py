"""The field's rejection rules (docs/semantics.md §8) in compute_correction and the loss,
against the independent NumPy reference: ragged lengths, holes, NaN/inf in padding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import numpy_reference_rules as rules_ref
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import examples, ragged_batches

import offpolicy_jax as opj

correct = jax.jit(opj.compute_correction, static_argnames=("config", "reduction", "axis_names"))

RULE_CONFIGS = {
    "trm_icepop": opj.CorrectionConfig(
        probability_metrics=True,
        use_tis=True,
        tis_mode="band",
        tis_lower_bound=0.5,
        tis_upper_bound=1.8,
        rs_criteria=("seq_max_k2:0.6", "seq_mean_k3:0.02"),
    ),
    "none_k1_family": opj.CorrectionConfig(
        probability_metrics=True,
        use_tis=True,
        tis_mode="none",
        rs_criteria=(
            "token_k1:0.4_2.5",
            "seq_sum_k1:0.3_4.0",
            "seq_mean_k1:0.8_1.2",
            "binary_kl:0.002",
        ),
    ),
    "seq_truncate_logprob_m2po": opj.CorrectionConfig(
        probability_metrics=True,
        use_tis=True,
        tis_level="sequence",
        rs_criteria=("seq_max_k3:1.5",),
        seq_logprob_error_threshold=1.3,
        m2po_tau=0.05,
    ),
    "icepop_seq_bn_k2_k3": opj.CorrectionConfig(
        probability_metrics=True,
        use_tis=True,
        tis_level="sequence",
        tis_mode="band",
        tis_lower_bound=0.2,
        tis_upper_bound=5.0,
        tis_batch_normalize=True,
        rs_criteria=("token_k2:0.5", "token_k3:0.8", "seq_sum_k2:1.0", "seq_mean_k2:0.05"),
        m2po_tau=0.2,
    ),
    "geometric_clip_all": opj.CorrectionConfig(
        use_tis=True,
        tis_level="geometric",
        tis_mode="clip",
        tis_lower_bound=0.8,
        tis_upper_bound=1.25,
        use_rs=True,
        rs_veto_threshold=1e-3,
        rs_criteria=("seq_sum_k3:2.0",),
        seq_logprob_error_threshold=1.1,
    ),
}


def assert_matches_reference(batch, config, reduction):
    res = correct(
        batch["old_logp"], batch["rollout_logp"], batch["mask"], config=config, reduction=reduction
    )
    w, m, metrics = ref.correction(
        batch["old_logp"],
        batch["rollout_logp"],
        batch["mask"],
        reduction=reduction,
        **config.to_dict(),
    )
    np.testing.assert_array_equal(np.asarray(res.mask), m)
    np.testing.assert_allclose(np.asarray(res.weights), w, rtol=1e-5, atol=1e-6)
    missing = set(metrics) - set(res.metrics)
    assert not missing, missing
    for key, value in metrics.items():
        got = float(res.metrics[key])
        assert np.isfinite(got), key
        np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-5, err_msg=key)


@pytest.mark.slow
@settings(max_examples=examples(15))
@given(
    batch=ragged_batches(),
    name=st.sampled_from(sorted(RULE_CONFIGS)),
    reduction=st.sampled_from(["sequence", "token"]),
)
def test_rules_match_numpy_reference(batch, name, reduction):
    assert_matches_reference(batch, RULE_CONFIGS[name], reduction)


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(RULE_CONFIGS))
def test_rules_fixed_batch(name):
    rng = np.random.default_rng(3)
    lengths = np.array([11, 0, 1, 7, 4, 11])
    mask = np.arange(11)[None, :] < lengths[:, None]
    old = (rng.integers(-96, 0, mask.shape) / 16).astype(np.float32)
    delta = (rng.integers(-10, 11, mask.shape) / 16).astype(np.float32)
    batch = {
        "old_logp": np.where(mask, old, np.nan).astype(np.float32),
        "rollout_logp": np.where(mask, old - delta, np.inf).astype(np.float32),
        "mask": mask.astype(np.float32),
    }
    for reduction in ("sequence", "token"):
        assert_matches_reference(batch, RULE_CONFIGS[name], reduction)


def test_all_rejected_gives_zero_weights_and_finite_metrics():
    config = opj.CorrectionConfig(use_tis=True, tis_mode="none", rs_criteria=("token_k2:1e-9",))
    old = jnp.zeros((2, 5))
    res = correct(old, old + 0.5, jnp.ones((2, 5)), config=config)
    assert float(res.mask.sum()) == 0 and float(res.weights.sum()) == 0
    assert all(np.isfinite(float(v)) for v in res.metrics.values())
    assert float(res.metrics["mis_ess"]) == 0.0


def test_icepop_keeps_zero_weight_tokens_in_the_mask():
    config = opj.CorrectionConfig.preset("decoupled_token_icepop")  # [0.5, 5]
    old = jnp.array([[0.0, 0.0, 0.0]])
    rollout = jnp.array([[0.0, 2.0, -2.0]])  # ratios 1, e^-2 (< 0.5), e^2 (> 5)
    res = correct(old, rollout, jnp.ones((1, 3)), config=config)
    np.testing.assert_array_equal(res.mask, [[1, 1, 1]])
    np.testing.assert_allclose(res.weights, [[1, 0, 0]])
    assert float(res.metrics["mis_tis_band_fraction_low"]) == pytest.approx(1 / 3)
    assert float(res.metrics["mis_tis_band_fraction_high"]) == pytest.approx(1 / 3)


def test_trust_region_masking_drops_whole_sequences():
    config = opj.CorrectionConfig(
        use_tis=True, tis_mode="none", rs_criteria=("seq_max_k2:0.5", "seq_mean_k3:0.05")
    )
    old = jnp.zeros((3, 4))
    # row 0: on-policy; row 1: one token with ½λ² = 0.72 > 0.5; row 2: many small drifts
    rollout = jnp.array([[0.0] * 4, [0.0, 1.2, 0.0, 0.0], [-0.4] * 4])
    res = correct(old, rollout, jnp.ones((3, 4)), config=config)
    np.testing.assert_array_equal(res.mask, [[1] * 4, [0] * 4, [0] * 4])
    assert float(res.metrics["mis_rs_seq_max_k2_seq_fraction"]) == pytest.approx(1 / 3)
    assert float(res.metrics["mis_rs_seq_max_k2_max"]) == pytest.approx(0.72, rel=1e-5)


def test_m2po_budget_holds_after_masking():
    rng = np.random.default_rng(0)
    old = jnp.asarray(rng.normal(-1, 0.3, (4, 50)), jnp.float32)
    rollout = old + jnp.asarray(rng.normal(0, 0.4, (4, 50)), jnp.float32)
    config = opj.CorrectionConfig(use_tis=True, m2po_tau=0.04)
    res = correct(old, rollout, jnp.ones((4, 50)), config=config)
    delta = np.asarray(old - rollout)
    kept = np.asarray(res.mask) > 0
    assert 0 < kept.sum() < kept.size
    assert (delta[kept] ** 2).mean() <= 0.04 * (1 + 1e-6)
    assert float(res.metrics["mis_m2po_m2_after"]) <= 0.04 * (1 + 1e-6)
    # the dropped tokens are exactly the largest ones
    assert (delta[~kept] ** 2).min() >= (delta[kept] ** 2).max()


@pytest.mark.heavy
def test_rules_under_vmap_and_grad_free():
    config = RULE_CONFIGS["seq_truncate_logprob_m2po"]
    rng = np.random.default_rng(1)
    old = jnp.asarray(rng.normal(-1, 0.3, (3, 2, 9)), jnp.float32)
    rollout = old + jnp.asarray(rng.normal(0, 0.3, (3, 2, 9)), jnp.float32)
    mask = jnp.ones((3, 2, 9))
    batched = jax.vmap(lambda o, b, m: correct(o, b, m, config=config))(old, rollout, mask)
    for i in range(3):
        single = correct(old[i], rollout[i], mask[i], config=config)
        np.testing.assert_array_equal(batched.mask[i], single.mask)
        np.testing.assert_allclose(batched.weights[i], single.weights, rtol=1e-6)
    grad = jax.grad(lambda o: correct(o, rollout[0], mask[0], config=config).weights.sum())(old[0])
    np.testing.assert_array_equal(grad, 0.0)


def test_seq_logprob_error_statistic_is_nemo_rl():
    config = opj.CorrectionConfig(use_tis=True, tis_mode="none", seq_logprob_error_threshold=1.5)
    old = jnp.zeros((2, 3))
    rollout = jnp.array([[0.1, -0.1, 0.0], [1.0, 0.0, 0.0]])  # means 1.0701, 1.5728
    res = correct(old, rollout, jnp.ones((2, 3)), config=config, reduction="sequence")
    np.testing.assert_array_equal(res.mask, [[1, 1, 1], [0, 0, 0]])
    want = rules_ref.seq_mult_prob_error(np.asarray(old - rollout, np.float64), np.ones((2, 3)))
    assert float(res.metrics["mis_seq_logprob_error_max"]) == pytest.approx(want.max(), rel=1e-6)
    assert float(res.metrics["mis_seq_logprob_error_mean"]) == pytest.approx(want.mean(), rel=1e-6)


# ------------------------------------------------------------------------------ OPSM


def _opsm_batch(seed):
    rng = np.random.default_rng(seed)
    lengths = np.array([9, 0, 1, 6, 9, 3, 8])
    mask = np.arange(9)[None, :] < lengths[:, None]
    old = rng.normal(-1.0, 0.4, mask.shape)
    rollout = old + rng.normal(0.0, 0.3, mask.shape)
    logp = old + rng.normal(0.0, 0.3, mask.shape)
    adv = np.broadcast_to(rng.normal(0.0, 1.0, (mask.shape[0], 1)), mask.shape)

    def garbage(x):
        return np.where(mask, x, np.nan).astype(np.float32)

    return garbage(logp), garbage(old), garbage(rollout), garbage(adv), mask.astype(np.float32)


@pytest.mark.heavy
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("delta", [0.02, 0.1])
@pytest.mark.parametrize("algorithm", ["ppo", "bypass_ppo"])
def test_opsm_matches_reference_and_drops_sequences(seed, delta, algorithm):
    logp, old, rollout, adv, mask = _opsm_batch(seed)
    base = opj.LossConfig(algorithm=algorithm, aggregation="token_mean")
    config = opj.LossConfig(algorithm=algorithm, aggregation="token_mean", opsm_delta=delta)
    keep_seq = rules_ref.opsm_keep(logp, rollout, adv, mask, delta)
    kept_mask = mask * keep_seq[:, None]

    def loss(lp, cfg, m):
        return opj.policy_loss(lp, old, rollout, adv, m, cfg)

    value_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (got, metrics), grad = value_and_grad(logp, config, mask)
    # OPSM == the plain loss on the mask without the dropped sequences (D5: they leave
    # the denominator too).
    (want, _), want_grad = value_and_grad(logp, base, kept_mask)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-7)
    nonempty = mask.sum(-1) > 0
    assert float(metrics["mis_opsm_seq_fraction"]) == pytest.approx(
        (~keep_seq)[nonempty].mean(), abs=1e-6
    )
    stat = np.where(mask > 0, rollout - logp, 0).sum(-1)[nonempty] / mask.sum(-1)[nonempty]
    assert float(metrics["mis_opsm_max"]) == pytest.approx(stat.max(), rel=1e-5)
    assert float(metrics["mis_opsm_mean"]) == pytest.approx(stat.mean(), rel=1e-5, abs=1e-6)


def test_opsm_needs_negative_advantage():
    logp = jnp.zeros((2, 3))
    rollout = jnp.full((2, 3), 1.0)  # mean log(π_rollout / π_θ) = 1 > δ in both rows
    adv = jnp.array([1.0, -1.0])
    config = opj.LossConfig(algorithm="bypass_ppo", opsm_delta=0.5)
    _, metrics = opj.policy_loss(logp, None, rollout, adv, jnp.ones((2, 3)), config)
    assert float(metrics["mis_opsm_seq_fraction"]) == 0.5
    assert float(metrics["mis_opsm_fraction_high"]) == 1.0


@pytest.mark.parametrize("name", ["trm_icepop", "seq_truncate_logprob_m2po", "none_k1_family"])
def test_decoupled_loss_with_rules_matches_reference(name):
    rng = np.random.default_rng(7)
    lengths = np.array([10, 0, 1, 6, 10, 4])
    mask = np.arange(10)[None, :] < lengths[:, None]
    old = rng.integers(-96, 0, mask.shape) / 16
    rollout = old - rng.integers(-8, 9, mask.shape) / 16
    logp = old + rng.integers(-4, 5, mask.shape) / 16
    adv = rng.integers(-16, 17, mask.shape) / 8

    def f32(x):
        return np.where(mask, x, np.nan).astype(np.float32)

    args = (f32(logp), f32(old), f32(rollout), f32(adv), mask.astype(np.float32))
    correction = RULE_CONFIGS[name]
    config = opj.LossConfig(algorithm="decoupled_ppo", correction=correction)
    (loss, metrics), grad = jax.jit(
        jax.value_and_grad(lambda lp: opj.policy_loss(lp, *args[1:], config), has_aux=True)
    )(args[0])
    want_loss, want_grad, want_metrics = ref.policy_loss(
        *args, algorithm="decoupled_ppo", correction=correction.to_dict()
    )
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, np.nan_to_num(want_grad), rtol=1e-5, atol=1e-6)
    for key in ("mis_ess", "mis_js_divergence"):
        np.testing.assert_allclose(metrics[key], want_metrics[key], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------- packed sequences


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["trm_icepop", "seq_truncate_logprob_m2po", "none_k1_family"])
def test_rules_on_packed_rows_equal_one_sequence_per_row(name):
    """docs/semantics.md §10: the rules read "sequence" as (row, segment)."""
    rng = np.random.default_rng(11)
    lengths = [7, 3, 1, 9, 5, 4, 6]
    sequences = []
    for n in lengths:
        old = (rng.integers(-96, 0, n) / 16).astype(np.float32)
        rollout = (old - rng.integers(-8, 9, n) / 16).astype(np.float32)
        sequences.append({"old": old, "rollout": rollout, "mask": np.ones(n, np.float32)})
    packed = opj.pack_sequences(sequences, 12, max_segments=3)
    config = RULE_CONFIGS[name]
    ids, k = jnp.asarray(packed.segment_ids), packed.num_segments
    a = packed.arrays
    got = jax.jit(
        lambda o, b, m, s: opj.compute_correction(o, b, m, config, segment_ids=s, num_segments=k)
    )(a["old"], a["rollout"], a["mask"], ids)
    rows = max(lengths)
    flat = {
        key: np.stack([np.pad(s[key], (0, rows - len(s[key]))) for s in sequences])
        for key in ("old", "rollout", "mask")
    }
    want = correct(flat["old"], flat["rollout"], flat["mask"], config=config)
    got_w, got_m = opj.unpack_sequences(
        (np.asarray(got.weights), np.asarray(got.mask)), packed.segment_ids, k, length=rows
    )
    order = [(r * k + s - 1) for r, s in zip(packed.rows, packed.segments, strict=True)]
    got_w = got_w.reshape(-1, rows)[order]
    got_m = got_m.reshape(-1, rows)[order]
    np.testing.assert_array_equal(got_m, np.asarray(want.mask))
    np.testing.assert_allclose(got_w, np.asarray(want.weights), rtol=1e-5, atol=1e-6)
    for key, value in want.metrics.items():
        np.testing.assert_allclose(got.metrics[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_batch_extremes_pool_as_extremes_over_micro_batches():
    """P_max / P_min are :class:`Extreme` parts: pooled with ``+`` over micro-batches (an
    empty one included) they equal the full batch's extremes, where a mean's pooling would
    give the sequence-weighted mean of the micro-batches' extremes."""
    from offpolicy_jax._src.correction.stages import Extreme, pool

    logp, old, rollout, adv, mask = _opsm_batch(0)
    config = opj.LossConfig(algorithm="bypass_ppo", opsm_delta=0.05)
    # Rows 1 (empty) and 2 (one token) get a micro-batch of their own.
    parts = jax.jit(lambda *a: opj.policy_loss_parts(*a, config)[1])
    full = parts(logp, old, rollout, adv, mask)
    pooled = None
    for rows in (slice(0, 1), slice(1, 2), slice(2, 4), slice(4, 7)):
        p = parts(*(x[rows] for x in (logp, old, rollout, adv, mask)))
        pooled = p if pooled is None else pool(pooled, p)
    assert isinstance(full["mis_opsm_max"], Extreme) and full["mis_opsm_min"].kind == "min"
    got, want = opj.finalize_metrics(pooled), opj.finalize_metrics(full)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7, err_msg=key)
    empty = parts(*(x[1:2] for x in (logp, old, rollout, adv, mask)))
    assert float(empty["mis_opsm_max"].value()) == 0.0  # an empty batch reports 0
