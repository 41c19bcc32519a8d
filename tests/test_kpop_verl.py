"""KPop as verl reads it (``rollout_rs: binary_kl``, verl PR 6800): a per-token rejection
criterion, ``keep iff max(D_B(o‖b), D_B(b‖o)) ≤ φ`` with o = π_old and b = π_rollout.

Checked against an independent float64 reference (tests/numpy_reference_rules.py) and
against a NumPy port of the PR's torch code (float32 ``exp``, ``torch.clamp`` of the
probabilities to ``[1e-6, 1 − 1e-6]``, ``p·log(p/q) + (1 − p)·log((1 − p)/(1 − q))``).
"""

from __future__ import annotations

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import numpy_reference_rules as rules_ref
import pytest

import offpolicy_jax as opj
from offpolicy_jax import rules
from offpolicy_jax._src.correction.binary_kl import bidirectional_binary_kl, binary_kl

correct = jax.jit(opj.compute_correction, static_argnames=("config", "reduction", "axis_names"))

F32 = np.float32


def verl_binary_kl(log_p, log_q, eps=1e-6):
    """verl PR 6800's ``compute_binary_kl_divergence``, ported op for op to float32 NumPy:
    ``p = clamp(exp(log_p.float()), eps, 1 - eps)`` (torch rounds the bounds to the
    tensor's dtype), then ``p * log(p / q) + (1 - p) * log((1 - p) / (1 - q))``."""
    with np.errstate(all="ignore"):
        p = np.clip(np.exp(np.asarray(log_p, F32)), F32(eps), F32(1.0 - eps))
        q = np.clip(np.exp(np.asarray(log_q, F32)), F32(eps), F32(1.0 - eps))
        one = F32(1.0)
        return p * np.log(p / q) + (one - p) * np.log((one - p) / (one - q))


def verl_keep(old, rollout, threshold):
    """The PR's ``binary_kl`` branch: ``per_token_stat = max(kl_fwd, kl_rev)``, kept iff
    ``per_token_stat <= upper_value``; returns ``(keep, stat)``."""
    stat = np.maximum(verl_binary_kl(old, rollout), verl_binary_kl(rollout, old))
    return stat <= F32(threshold), stat


def verl_rounding(old, rollout):
    """How far the PR's float32 arithmetic may sit from the exact clamped formula, per
    token: its ``1 − p`` of a float32 ``p`` loses up to ``2⁻²⁴ p`` (relative ``2⁻²⁴ p /
    (1 − p)``), which the complement terms carry with weight up to 1 (the ``q`` side the
    same), plus a few float32 ulp of the terms themselves."""
    lo, hi = rules_ref.BINARY_KL_LOW, rules_ref.BINARY_KL_HIGH
    p = np.clip(np.exp(np.asarray(old, np.float64)), lo, hi)
    q = np.clip(np.exp(np.asarray(rollout, np.float64)), lo, hi)

    def lost(x):  # a clamped probability is a float32 number: its complement is exact
        return np.where((x > lo) & (x < hi), x / (1.0 - x), 0.0)

    cancel = 2.0**-23 * (lost(p) + lost(q) + 4.0)
    terms = np.abs(np.log(p)) + np.abs(np.log(q)) + np.abs(np.log1p(-p)) + np.abs(np.log1p(-q))
    return cancel + 2.0**-21 * terms


def _probabilities(seed=0, shape=(6, 12)):
    """Log-probabilities over the whole range: uniform, within 1e-7 of 0 and of 1, both
    clamp ends, equal pairs, and pairs a few ulp apart."""
    rng = np.random.default_rng(seed)
    p = rng.uniform(0.0, 1.0, shape)
    q = np.clip(p * np.exp(rng.normal(0.0, 1.0, shape)), 1e-12, 1.0)
    p[0, :6] = [1e-9, 5e-8, 1e-7, 1 - 1e-7, 1 - 5e-8, 1.0]
    q[0, :6] = [0.5, 1e-7, 1 - 1e-7, 1e-8, 0.9, 1 - 1e-3]
    p[1, :4] = [0.3, 0.999, 1e-6, 1 - 1e-6]
    q[1, :4] = [0.3, 0.999 * (1 + 1e-6), 2e-6, 1 - 2e-6]
    p[2, :3] = [np.exp(-1.0), 0.99, 1e-3]
    q[2, :3] = [np.exp(-0.99999), 0.1, 0.999]
    return np.log(p).astype(F32), np.log(q).astype(F32)


# ---------------------------------------------------------------- the formula


def test_binary_kl_matches_float64_reference_at_the_extremes():
    o, b = _probabilities()
    got = np.asarray(binary_kl(o, b), np.float64)
    want = rules_ref.binary_kl(o.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(got, np.maximum(want, 0.0), rtol=2e-5, atol=2e-6)
    both = np.asarray(bidirectional_binary_kl(o, b), np.float64)
    np.testing.assert_allclose(both, rules_ref.bidirectional_binary_kl(o, b), rtol=2e-5, atol=2e-6)
    assert (both >= 0).all() and np.isfinite(both).all()


def test_binary_kl_never_negative_where_float32_cancels():
    """``log p = −1`` against ``−0.99999``: float32 cancellation gives ``−4.5e-8`` in the
    unclamped formula (as the ports do); the divergence is reported ``≥ 0``."""
    o, b = np.float32(-1.0), np.float32(-0.99999)
    assert verl_binary_kl(o, b) < 0  # the home systems' own rounding
    assert float(binary_kl(o, b)) >= 0.0
    assert float(bidirectional_binary_kl(o, b)) >= 0.0


def test_binary_kl_equals_verl_port_within_its_float32_rounding():
    o, b = _probabilities(seed=1, shape=(16, 64))
    for x, y in ((o, b), (b, o)):
        got = np.asarray(binary_kl(x, y), np.float64)
        want = verl_binary_kl(x, y).astype(np.float64)
        assert (np.abs(got - np.maximum(want, 0.0)) <= verl_rounding(x, y)).all()


def test_clamped_probability_has_verls_float32_complement():
    """A probability at the upper clamp: verl's ``1 − p`` is ``1 − float32(1 − 1e-6) =
    1.0133e-6``, not ``1e-6``; ``D_B(½‖1)`` differs by ``½ log 1.0133 ≈ 0.0066`` between
    the two, far past float32 rounding."""
    o = np.float32(np.log(0.5))
    b = np.float32(0.0)  # p = 1, clamped
    want = float(verl_binary_kl(o, b))
    assert float(binary_kl(o, b)) == pytest.approx(want, rel=1e-6)
    assert float(bidirectional_binary_kl(b, o)) == pytest.approx(want, rel=1e-6)


# ---------------------------------------------------------------- the rule


def _ragged(seed=0):
    """Ragged lengths (an empty sequence), NaN / inf in padding, extreme probabilities."""
    o, b = _probabilities(seed, (6, 12))
    lengths = np.array([12, 0, 1, 7, 4, 12])
    mask = np.arange(12)[None, :] < lengths[:, None]
    old = np.where(mask, o, np.nan).astype(F32)
    rollout = np.where(mask, b, np.inf).astype(F32)
    return old, rollout, mask.astype(F32)


CONFIG = opj.CorrectionConfig(
    use_tis=True, tis_mode="none", rs_criteria=("token_k1:0.2_5.0", "binary_kl:0.5")
)


@pytest.mark.parametrize("reduction", ["sequence", "token"])
def test_rule_matches_numpy_reference(reduction):
    old, rollout, mask = _ragged()
    res = correct(old, rollout, mask, config=CONFIG, reduction=reduction)
    w, m, metrics = ref.correction(old, rollout, mask, reduction=reduction, **CONFIG.to_dict())
    np.testing.assert_array_equal(np.asarray(res.mask), m)
    np.testing.assert_allclose(np.asarray(res.weights), w, rtol=1e-5, atol=1e-6)
    assert set(metrics) == set(res.metrics)
    for key, value in metrics.items():
        np.testing.assert_allclose(
            float(res.metrics[key]), value, rtol=1e-5, atol=2e-6, err_msg=key
        )
    assert 0 < metrics["mis_rs_binary_kl_fraction_high"] < 1
    assert float(res.metrics["mis_rs_binary_kl_min"]) >= 0.0


def test_rule_keeps_what_verls_port_keeps():
    """On the same inputs the PR's float32 code and this rule keep the same tokens, but
    for tokens whose statistic lies within the PR's own rounding of φ."""
    o, b = _probabilities(seed=2, shape=(32, 64))
    for phi in (0.05, 0.1, 0.5, 2.0):
        res = correct(
            o,
            b,
            np.ones(o.shape, F32),
            config=opj.CorrectionConfig(
                use_tis=True, tis_mode="none", rs_criteria=(f"binary_kl:{phi}",)
            ),
        )
        want, _ = verl_keep(o, b, phi)
        exact = rules_ref.bidirectional_binary_kl(o, b)
        clear = np.abs(exact - phi) > verl_rounding(o, b)
        np.testing.assert_array_equal(np.asarray(res.mask, bool)[clear], want[clear])
        assert (~want).any() and want.any()


def test_verl_block_matches_verl_reference():
    old, rollout, mask = _ragged(seed=3)
    block = {
        "rollout_is": None,
        "rollout_rs": "token_k1,binary_kl",
        "rollout_rs_threshold": "5.0,0.3",
    }
    config = opj.CorrectionConfig.from_verl(block)
    assert config.rs_criteria == ("token_k1:0.2_5.0", "binary_kl:0.3")
    res = correct(old, rollout, mask, config=config)
    _, want_mask = rules_ref.verl_correction(old, rollout, mask, block)
    np.testing.assert_array_equal(np.asarray(res.mask), want_mask)


@pytest.mark.heavy
def test_rule_constructor_equals_config():
    old, rollout, mask = _ragged()
    stage = rules.criterion("binary_kl", threshold=0.5)
    assert stage == rules.criterion("binary_kl", threshold="0.5")
    assert rules.criterion("binary_kl") == rules.criterion("binary_kl", threshold=2.0)
    assert stage in rules.from_config(CONFIG).rules
    got = opj.correct(old, rollout, mask, *rules.from_config(CONFIG).rules)
    chained = opj.correct(
        old,
        rollout,
        mask,
        rules.mismatch_metrics(),
        rules.importance_weights(mode="none"),
        rules.criterion("token_k1", threshold="0.2_5.0"),
        stage,
    )
    want = correct(old, rollout, mask, config=CONFIG)
    for res in (got, chained):
        np.testing.assert_array_equal(np.asarray(res.mask), np.asarray(want.mask))
        for key in (
            "mis_rs_binary_kl_mean",
            "mis_rs_binary_kl_max",
            "mis_rs_binary_kl_seq_fraction",
        ):
            np.testing.assert_allclose(res.metrics[key], want.metrics[key], rtol=1e-6, err_msg=key)


def _transcendentals(config: opj.CorrectionConfig, shape: tuple[int, int]) -> Counter:
    """The exponentials and logarithms over ``[B, T]`` in the compiled correction (each
    fused kernel lists the operations it computes)."""
    x = np.zeros(shape, F32)
    text = correct.lower(x, x, np.ones(shape, F32), config=config).compile().as_text()
    kinds = r"(exponential|exponential-minus-one|log|log-plus-one)"
    return Counter(re.findall(rf"f32\[{shape[0]},{shape[1]}\]\S* {kinds}\(", text))


def test_the_statistic_takes_six_transcendentals_per_token_once():
    """``max(D_B(o‖b), D_B(b‖o))`` takes ``e^x``, ``expm1`` and ``log`` of each clamped
    log-prob, and the compiled correction computes them once for the decision and every
    metric (a second kernel that recomputed them would list them again)."""
    one_rule = {"use_tis": True, "tis_mode": "none"}
    kpop = opj.CorrectionConfig(**one_rule, rs_criteria=("binary_kl:2.0",))
    k2 = opj.CorrectionConfig(**one_rule, rs_criteria=("token_k2:2.0",))
    extra = _transcendentals(kpop, (3, 37)) - _transcendentals(k2, (3, 37))
    assert extra == Counter({"exponential": 2, "exponential-minus-one": 2, "log": 2})


@pytest.mark.heavy
def test_rule_under_vmap_and_grad():
    """Batched == one at a time; the decision carries no gradient, and a loss through the
    kept tokens has zero gradient at the rejected ones and finite values everywhere."""
    rng = np.random.default_rng(4)
    old = jnp.asarray(rng.uniform(-4, 0, (3, 2, 9)), jnp.float32)
    rollout = old + jnp.asarray(rng.normal(0, 1.0, (3, 2, 9)), jnp.float32)
    mask = jnp.ones((3, 2, 9))
    config = opj.CorrectionConfig(use_tis=True, tis_mode="truncate", rs_criteria=("binary_kl:0.2",))
    batched = jax.vmap(lambda o, b, m: correct(o, b, m, config=config))(old, rollout, mask)
    for i in range(3):
        single = correct(old[i], rollout[i], mask[i], config=config)
        np.testing.assert_array_equal(batched.mask[i], single.mask)
        np.testing.assert_allclose(batched.weights[i], single.weights, rtol=1e-6)
    kept = np.asarray(correct(old[0], rollout[0], mask[0], config=config).mask, bool)
    assert kept.any() and (~kept).any()

    def loss(logp):
        res = opj.compute_correction(jax.lax.stop_gradient(logp), rollout[0], mask[0], config)
        return jnp.sum(jnp.where(res.mask > 0, res.weights * logp, 0.0))

    grad = np.asarray(jax.jit(jax.grad(loss))(old[0]))
    assert np.isfinite(grad).all()
    np.testing.assert_array_equal(grad[~kept], 0.0)
    assert (grad[kept] != 0).all()
    # o = sg(θ) itself: no gradient through the criterion's statistic
    free = jax.grad(lambda o: correct(o, rollout[0], mask[0], config=config).mask.sum())(old[0])
    np.testing.assert_array_equal(free, 0.0)


@pytest.mark.heavy
def test_all_rejected_gives_zero_loss_and_gradient():
    old = jnp.log(jnp.full((2, 5), 0.9))
    rollout = jnp.log(jnp.full((2, 5), 0.01))  # D_B(0.9‖0.01) ≈ 3.7 > 2
    correction = opj.CorrectionConfig(use_tis=True, tis_mode="none", rs_criteria=("binary_kl:2.0",))
    config = opj.LossConfig(algorithm="decoupled_ppo", correction=correction)
    ones = jnp.ones((2, 5))
    (loss, metrics), grad = jax.value_and_grad(
        lambda lp: opj.policy_loss(lp, old, rollout, ones, ones, config), has_aux=True
    )(old)
    assert float(loss) == 0.0
    np.testing.assert_array_equal(grad, 0.0)
    assert float(metrics["mis_rs_binary_kl_fraction_high"]) == 1.0


def test_packed_rows_equal_one_sequence_per_row():
    rng = np.random.default_rng(11)
    lengths = [7, 3, 1, 9, 5, 4, 6]
    sequences = []
    for n in lengths:
        old = np.log(rng.uniform(1e-4, 1.0, n)).astype(F32)
        rollout = (old + rng.normal(0.0, 1.0, n)).clip(max=0.0).astype(F32)
        sequences.append({"old": old, "rollout": rollout, "mask": np.ones(n, F32)})
    packed = opj.pack_sequences(sequences, 12, max_segments=3)
    ids, k, a = jnp.asarray(packed.segment_ids), packed.num_segments, packed.arrays
    got = jax.jit(
        lambda o, b, m, s: opj.compute_correction(o, b, m, CONFIG, segment_ids=s, num_segments=k)
    )(a["old"], a["rollout"], a["mask"], ids)
    rows = max(lengths)
    flat = {
        key: np.stack([np.pad(s[key], (0, rows - len(s[key]))) for s in sequences])
        for key in ("old", "rollout", "mask")
    }
    want = correct(flat["old"], flat["rollout"], flat["mask"], config=CONFIG)
    got_m = opj.unpack_sequences((np.asarray(got.mask),), packed.segment_ids, k, length=rows)[0]
    order = [(r * k + s - 1) for r, s in zip(packed.rows, packed.segments, strict=True)]
    np.testing.assert_array_equal(got_m.reshape(-1, rows)[order], np.asarray(want.mask))
    assert 0 < float(want.metrics["mis_rs_binary_kl_fraction_high"]) < 1
    for key, value in want.metrics.items():
        np.testing.assert_allclose(got.metrics[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


# ---------------------------------------------------------------- configuration


def test_from_verl_defaults_and_round_trip():
    alone = opj.CorrectionConfig.from_verl({"rollout_is": None, "rollout_rs": "binary_kl"})
    assert alone.rs_criteria == ("binary_kl:2.0",)
    assert (alone.use_tis, alone.tis_mode) == (True, "none")
    shared = opj.CorrectionConfig.from_verl(
        {
            "rollout_is": "token",
            "rollout_is_threshold": 2.0,
            "rollout_rs": "token_k1, binary_kl,token_k1",
            "rollout_rs_threshold": 1.5,
        }
    )
    assert shared.rs_criteria == ("token_k1:0.6666666666666666_1.5", "binary_kl:1.5")
    for config in (alone, shared):
        assert opj.CorrectionConfig.from_dict(config.to_dict()) == config
        assert opj.CorrectionConfig.from_yaml(config.to_yaml()) == config


@pytest.mark.parametrize(
    ("block", "match"),
    [
        (
            {"rollout_rs": "binary_kl", "rollout_rs_threshold": -1.0},
            r"rollout_rs_threshold.*positive",
        ),
        ({"rollout_rs": "binary_kl", "rollout_rs_threshold": 0}, r"rollout_rs_threshold.*positive"),
        (
            {"rollout_rs": "binary_kl", "rollout_rs_threshold": "0.5_2.0"},
            r"rollout_rs_threshold.*single upper",
        ),
        (
            {"rollout_rs": "binary_kl", "rollout_rs_threshold": "abc"},
            r"rollout_rs_threshold.*malformed",
        ),
        (
            {"rollout_rs": "binary_kl", "rollout_rs_threshold": "inf"},
            r"rollout_rs_threshold.*finite",
        ),
        ({"rollout_rs": "token_k1,binary_kl"}, r"rollout_rs_threshold.*explicitly provided"),
        ({"rollout_rs": "binary_k1"}, r"rollout_rs.*did you mean"),
    ],
)
def test_bad_verl_input_names_the_key(block, match):
    with pytest.raises(ValueError, match=match):
        opj.CorrectionConfig.from_verl({"rollout_is": None, **block})


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda: opj.CorrectionConfig(use_tis=True, rs_criteria=("binary_kl:-0.1",)),
            r"rs_criteria.*positive",
        ),
        (
            lambda: opj.CorrectionConfig(use_tis=True, rs_criteria=("binary_kl",)),
            r"rs_criteria.*criterion:threshold",
        ),
        (lambda: rules.criterion("binary_kl", threshold=-2.0), r"criterion.*positive"),
        (lambda: rules.criterion("binary_kl", threshold="nan"), r"criterion.*finite"),
        (lambda: rules.criterion("token_k2"), r"criterion: threshold is required"),
        (lambda: rules.register_rule("binary_kl"), r"built-in"),
    ],
)
def test_bad_native_input_names_the_key(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ---------------------------------------------------------------- diagnose


def _confident_flip_dump(seed=0, batch=64, length=32, share=0.05):
    """Exact tokens, but a ``share`` of confident tokens (rollout p ≥ 0.9999) whose trainer
    probability fell to about 0.52-0.6: ratios inside IcePop's [0.5, 5], binary KL > 2."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, length), bool)
    rollout = -rng.exponential(1.0, (batch, length))
    flip = rng.random((batch, length)) < share
    rollout = np.where(flip, -rng.uniform(0.0, 1e-4, (batch, length)), rollout)
    old = np.where(flip, np.log(rng.uniform(0.52, 0.6, (batch, length))), rollout)
    return old.astype(F32), rollout.astype(F32), mask


@pytest.mark.heavy
def test_diagnose_recommends_kpop_for_confident_token_flips(tmp_path):
    pytest.importorskip("pyarrow")
    from offpolicy_jax.diagnose import diagnose, write_dump

    old, rollout, mask = _confident_flip_dump()
    path = write_dump(tmp_path / "flip.npz", old_logp=old, rollout_logp=rollout, mask=mask)
    report = diagnose(path, tmp_path / "out", chunk_rows=32)
    rec = report["recommendation"]
    assert (rec["name"], rec["severity"]) == ("kpop", "mild"), rec["reason"]
    config = opj.CorrectionConfig.from_dict(rec["config"])
    assert config.rs_criteria == ("binary_kl:2.0",)
    assert opj.CorrectionConfig.from_yaml(str(tmp_path / "out" / "recommended.yaml")) == config
    assert report["what_if"]["icepop"]["table"]["zero_weight_share"] == 0.0
    kpop = report["what_if"]["kpop"]["table"]["rejected_token_share"]
    assert kpop == pytest.approx(mask[old != rollout].size / mask.size, rel=1e-6)
    # the same mismatch at ratios outside the band: IcePop sees it, no KPop recommendation
    far = np.where(old != rollout, np.log(np.float32(0.3)), rollout).astype(F32)
    path = write_dump(tmp_path / "far.npz", old_logp=far, rollout_logp=rollout, mask=mask)
    assert diagnose(path, chunk_rows=32)["recommendation"]["name"] != "kpop"
