"""Policy versions in the asynchronous-RL rules, against integer NumPy references.

* Regressions: a ``[B]`` ``current_version`` is one value per sequence (also when
  ``B == T``); versions are compared as integers (``2**24`` and ``2**24 + 1`` differ, a
  version beyond int32 is refused, not wrapped); a negative version (AReaL's −1) has no
  age, as in AReaL's ``_log_version_staleness_stats``; concrete versions newer than
  ``current_version`` are refused; ``max_weight_staleness`` beyond int32 is refused at
  config build time.
* Properties (``HYPOTHESIS_PROFILE=thorough`` runs 5,000 examples each): the staleness
  rule, the partial-rollout prefix and their metrics equal an int64 NumPy reference at
  versions up to ``2**31 − 1``, jit equals eager, padding never changes a result, the
  proximal ``α`` equals AReaL's formula in float64, and the eager checks refuse exactly
  the valid tokens with a negative age.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import offpolicy_jax as opj
from offpolicy_jax._src.correction import staleness
from offpolicy_jax._src.losses import proximal

INT32_MAX = 2**31 - 1
B, T = 4, 8


def np_rules(versions, current, mask, limit, level, prefix_rule, reduction):
    """(keep, metrics) from the definitions, in int64 (ages exact), float64 metrics.

    A token is *aged* when it is valid and its version is ``>= 0`` (AReaL's
    ``valid_generated_mask``); only aged tokens have an age, can be stale or be part of
    an off-policy prefix.
    """
    v = np.asarray(versions, np.int64)
    c = np.broadcast_to(np.asarray(current, np.int64), v.shape)
    valid = np.asarray(mask) > 0
    aged = valid & (v >= 0)
    age = c - v
    keep = valid.copy()
    metrics = {}
    stale = aged & (age > (limit if limit is not None else np.iinfo(np.int64).max))
    if limit is not None:
        keep &= ~(stale.any(-1, keepdims=True) if level == "sequence" else stale)
    newest = np.where(aged, v, np.iinfo(np.int64).min).max(-1, keepdims=True)
    oldest = np.where(aged, v, np.iinfo(np.int64).max).min(-1, keepdims=True)
    prefix = aged & (v < newest)
    if prefix_rule:
        keep &= ~prefix

    def mean(x, population):
        n = population.sum(-1)
        total = np.where(population, x, 0).astype(np.float64).sum(-1)
        if reduction == "token":
            return total.sum() / max(n.sum(), 1)
        return (total[n > 0] / n[n > 0]).mean() if (n > 0).any() else 0.0

    def seq_mean(per_seq):
        n = valid.sum(-1)
        if reduction == "token":
            return (per_seq * n).sum() / max(n.sum(), 1)
        return per_seq[n > 0].mean() if (n > 0).any() else 0.0

    metrics["mis_staleness_mean"] = mean(age, aged)
    metrics["mis_staleness_max"] = float(age[aged].max()) if aged.any() else 0.0
    if limit is not None:
        metrics["mis_staleness_fraction_high"] = mean(stale, valid)
        metrics["mis_staleness_seq_fraction"] = seq_mean(stale.any(-1).astype(float))
    if prefix_rule:
        metrics["mis_offpolicy_prefix_fraction"] = mean(prefix, valid)
        mixed = (oldest < newest)[..., 0]
        metrics["mis_offpolicy_prefix_seq_fraction"] = seq_mean(mixed.astype(float))
    return keep, metrics


def areal_alpha(versions, current):
    """AReaL ``compute_prox_logp_approximations``'s ``α``, in float64."""
    v = np.asarray(versions, np.float64)
    c = np.broadcast_to(np.asarray(current, np.float64), v.shape)
    diff, gap = c - v, c - 1 - v
    usable = (diff > 0) & (np.asarray(versions) >= 0)
    return np.clip(np.where(usable, gap / np.where(usable, diff, 1), 0.0), 0.0, 1.0)


def _correction(**kwargs):
    return opj.CorrectionConfig(use_tis=True, **kwargs)


def _call(cfg, versions, current, mask=None, reduction="sequence"):
    shape = np.shape(versions)
    z = np.zeros(shape, np.float32)
    mask = np.ones(shape, bool) if mask is None else mask
    return opj.compute_correction(
        z, z, mask, cfg, reduction=reduction, versions=versions, current_version=current
    )


# --------------------------------------------------------------------- regressions


@pytest.mark.heavy
def test_per_sequence_current_version_is_read_per_sequence_when_b_equals_t():
    versions = np.full((4, 4), 10)
    current = np.array([10, 10, 10, 20])  # [B], B == T: the last sequence is 10 versions old
    cfg = _correction(max_weight_staleness=2)
    got = _call(cfg, versions, current)
    want, _ = np_rules(versions, current[:, None], np.ones((4, 4)), 2, "sequence", False, "")
    np.testing.assert_array_equal(got.mask, want)
    np.testing.assert_array_equal(np.asarray(got.mask).sum(-1), [4, 4, 4, 0])
    assert float(got.metrics["mis_staleness_max"]) == 10.0
    # [B, 1] and [B, T] say the same; a [T]-long array that is not [B] is refused.
    for same in (current[:, None], np.repeat(current[:, None], 4, -1)):
        np.testing.assert_array_equal(_call(cfg, versions, same).mask, got.mask)
    with pytest.raises(ValueError, match="current_version has shape"):
        _call(cfg, np.full((2, 4), 10), np.array([10, 10, 10, 20]))


@pytest.mark.heavy
def test_versions_are_compared_as_integers():
    big = 2**24
    versions = np.array([[big, big + 1, big + 1]])
    cfg = _correction(mask_offpolicy_in_partial_rollout=True, max_weight_staleness=0)
    got = _call(cfg, versions, big + 1)
    np.testing.assert_array_equal(got.mask, [[0.0, 0.0, 0.0]])  # sequence one version stale
    got = _call(_correction(mask_offpolicy_in_partial_rollout=True), versions, big + 1)
    np.testing.assert_array_equal(got.mask, [[0.0, 1.0, 1.0]])  # the older prefix token
    np.testing.assert_allclose(got.metrics["mis_offpolicy_prefix_seq_fraction"], 1.0)
    # Beyond int32 (x64 off): refused, naming the argument, instead of wrapping.
    with pytest.raises(ValueError, match="current_version holds 1099511627776"):
        _call(cfg, versions, 2**40)
    with pytest.raises(ValueError, match="versions holds"):
        _call(cfg, np.array([[2**40, 2**40, 2**40]]), 2**40 + 1)


def test_version_minus_one_has_no_age_as_in_areal():
    versions = np.array([[-1, 9, 9], [-1, -1, 4]])
    mask = np.ones((2, 3), bool)
    cfg = _correction(max_weight_staleness=2, mask_offpolicy_in_partial_rollout=True)
    got = _call(cfg, versions, 10, mask, reduction="token")
    # AReaL: staleness over valid tokens with version >= 0: ages 1, 1, 6.
    ages = 10 - versions[versions >= 0]
    assert float(got.metrics["mis_staleness_max"]) == ages.max() == 6
    np.testing.assert_allclose(got.metrics["mis_staleness_mean"], ages.mean(), rtol=1e-6)
    # The first sequence keeps every token (its −1 is neither stale nor a prefix).
    np.testing.assert_array_equal(got.mask, [[1, 1, 1], [0, 0, 0]])
    np.testing.assert_allclose(got.metrics["mis_offpolicy_prefix_fraction"], 0.0)
    # α = 0 for −1, as the proximal approximation already did.
    alpha = proximal.interpolation_weight(jnp.asarray(versions), jnp.int32(10))
    np.testing.assert_allclose(alpha, areal_alpha(versions, 10), rtol=1e-6)


def test_concrete_versions_newer_than_current_are_refused():
    cfg = _correction(max_weight_staleness=2)
    with pytest.raises(ValueError, match=r"versions holds 12 at \(0, 2\), newer than current_"):
        _call(cfg, np.array([[3, 4, 12]]), 10)
    with pytest.raises(ValueError, match="current_version must be >= 0"):
        _call(cfg, np.array([[3, 4, 5]]), -1)
    # Padding is never read: a newer version there is fine.
    got = _call(cfg, np.array([[9, 9, 12]]), 10, np.array([[1, 1, 0]], bool))
    np.testing.assert_array_equal(got.mask, [[1, 1, 0]])
    # In the loss too.
    lp = jnp.zeros((1, 3))
    lcfg = opj.LossConfig(
        algorithm="decoupled_ppo", correction=_correction(), prox_logp_method="loglinear"
    )
    with pytest.raises(ValueError, match="newer than current_version"):
        opj.policy_loss(
            lp, None, lp, jnp.ones(1), jnp.ones((1, 3)), lcfg,
            versions=np.array([[3, 4, 12]]), current_version=10,
        )  # fmt: skip


def test_newer_versions_under_jit_read_as_negative_ages():
    """Traced values are not read: a newer version is a negative age (documented)."""
    cfg = _correction(max_weight_staleness=0, mask_offpolicy_in_partial_rollout=True)
    z = jnp.zeros((1, 3))
    fn = jax.jit(
        lambda v, c: opj.compute_correction(z, z, z + 1, cfg, versions=v, current_version=c)
    )
    got = fn(jnp.array([[10, 12, 12]]), 10)
    np.testing.assert_array_equal(got.mask, [[0, 1, 1]])  # never stale; 10 is the prefix
    np.testing.assert_allclose(got.metrics["mis_staleness_mean"], -4 / 3, rtol=1e-6)
    assert float(got.metrics["mis_staleness_max"]) == 0.0
    alpha = jax.jit(proximal.interpolation_weight)(jnp.array([12]), jnp.int32(10))
    assert float(alpha[0]) == 0.0  # AReaL: no interpolation where c <= v


def test_max_weight_staleness_beyond_int32_is_refused_at_build_time():
    with pytest.raises(ValueError, match=r"CorrectionConfig.max_weight_staleness must be an int"):
        _correction(max_weight_staleness=2**31)
    with pytest.raises(ValueError, match="max_weight_staleness"):
        opj.CorrectionConfig.from_yaml("use_tis: true\nmax_weight_staleness: 2147483648\n")
    got = _call(_correction(max_weight_staleness=INT32_MAX), np.array([[0, 5]]), INT32_MAX)
    np.testing.assert_array_equal(got.mask, [[1, 1]])  # age 2**31 − 1 is not > the limit


def test_int64_versions_under_x64_stay_exact_under_jit():
    """With jax_enable_x64 versions are int64: ages, the prefix order and α stay exact."""
    big = 2**40
    with jax.enable_x64(True):
        versions = jnp.array([[big, big + 1, big + 1, -1]], jnp.int64)

        @jax.jit
        def read(v, c):
            v, c = staleness.check_versions(v, c, (1, 4), needed_by=None)
            age = c - v
            return v, age, staleness.prefix_order(v, age), proximal.interpolation_weight(v, c)

        v, age, order, alpha = read(versions, jnp.int64(big + 2))
        assert v.dtype == jnp.int64
        np.testing.assert_array_equal(age[0, :3], [2, 1, 1])
        assert order.dtype == jnp.int32 and order[0, 0] < order[0, 1] == order[0, 2]
        np.testing.assert_allclose(alpha, [[0.5, 0.0, 0.0, 0.0]])


# ----------------------------------------------------------------------- properties

LIMITS = (None, 0, 3, INT32_MAX)
BASES = (0, 7, 2**24 - 6, 2**31 - 40)


@st.composite
def version_batches(draw, length=T):
    """int32 versions near a base up to ``2**31 − 40``, with −1s, ancient tokens, holes
    and garbage (any int32, newer ones too) at padding; ``current_version`` as a scalar,
    ``[B]``, ``[B, 1]`` or ``[B, T]``."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base = draw(st.sampled_from(BASES) | st.integers(0, 2**31 - 40))
    kind = draw(st.sampled_from(["scalar", "seq", "seq1", "token"]))
    per_row = base + 20 - rng.integers(0, 6, size=(B, 1))
    current = np.full((B, 1), base + 20) if kind == "scalar" else per_row
    versions = current - rng.integers(0, 9, size=(B, length))
    versions = np.where(rng.random((B, length)) < 0.15, -1, versions)
    versions = np.where(rng.random((B, length)) < 0.05, rng.integers(0, 3), versions)
    lengths = rng.integers(0, length + 1, size=B)
    mask = (np.arange(length) < lengths[:, None]) & (rng.random((B, length)) > 0.1)
    garbage = rng.integers(-(2**31), 2**31, size=(B, length))
    versions = np.where(mask, versions, garbage).astype(np.int32)
    as_given = {
        "scalar": np.int32(base + 20),
        "seq": current[:, 0].astype(np.int32),
        "seq1": current.astype(np.int32),
        "token": np.broadcast_to(current, (B, length)).astype(np.int32),
    }[kind]
    return versions, as_given, current, mask


configs = st.builds(
    lambda limit, level, prefix: _correction(
        max_weight_staleness=limit, staleness_level=level, mask_offpolicy_in_partial_rollout=prefix
    ),
    st.sampled_from(LIMITS),
    st.sampled_from(["sequence", "token"]),
    st.booleans(),
)
reductions = st.sampled_from(["sequence", "token"])


@functools.cache
def _jitted(cfg, reduction):
    def fn(versions, current, mask):
        z = jnp.zeros(versions.shape, jnp.float32)
        return opj.compute_correction(
            z, z, mask, cfg, reduction=reduction, versions=versions, current_version=current
        )

    return jax.jit(fn)


def _assert_matches(got, keep, metrics, cols=slice(None)):
    np.testing.assert_array_equal(np.asarray(got.mask)[:, cols], keep)
    for key, want in metrics.items():
        np.testing.assert_allclose(got.metrics[key], want, rtol=2e-6, atol=1e-6, err_msg=key)


@given(version_batches(), configs, reductions)
def test_async_rules_equal_the_integer_reference(batch, cfg, reduction):
    versions, current, current_bt, mask = batch
    got = _jitted(cfg, reduction)(versions, current, mask)
    level, prefix = cfg.staleness_level, cfg.mask_offpolicy_in_partial_rollout
    keep, metrics = np_rules(
        versions, current_bt, mask, cfg.max_weight_staleness, level, prefix, reduction
    )
    _assert_matches(got, keep, metrics)
    assert float(got.metrics["mis_staleness_max"]) >= 0.0  # no valid token has a negative age


@given(version_batches(), configs, reductions)
@pytest.mark.heavy
def test_async_rules_eager_equal_jit(batch, cfg, reduction):
    versions, current, _, mask = batch
    eager = _call(cfg, versions, current, mask, reduction)  # its concrete checks pass
    jitted = _jitted(cfg, reduction)(versions, current, mask)
    np.testing.assert_array_equal(eager.mask, jitted.mask)
    for key, value in jitted.metrics.items():
        np.testing.assert_allclose(eager.metrics[key], value, rtol=1e-6, err_msg=key)


@given(version_batches(length=T - 2), configs, reductions, st.integers(0, 2**32 - 1))
def test_padding_never_changes_the_async_rules(batch, cfg, reduction, seed):
    versions, current, current_bt, mask = batch
    rng = np.random.default_rng(seed)
    pad = rng.integers(-(2**31), 2**31, size=(B, 2)).astype(np.int32)  # any version
    padded_versions = np.concatenate([versions, pad], -1)
    padded_mask = np.concatenate([mask, np.zeros((B, 2), bool)], -1)
    if np.ndim(current) == 2 and np.shape(current)[-1] > 1:  # per token: pad it too
        current = np.concatenate([current, current[:, :2]], -1)
    got = _jitted(cfg, reduction)(padded_versions, current, padded_mask)
    level, prefix = cfg.staleness_level, cfg.mask_offpolicy_in_partial_rollout
    keep, metrics = np_rules(
        versions, current_bt, mask, cfg.max_weight_staleness, level, prefix, reduction
    )
    _assert_matches(got, keep, metrics, cols=slice(0, T - 2))
    np.testing.assert_array_equal(np.asarray(got.mask)[:, T - 2 :], 0.0)


_alpha = jax.jit(proximal.interpolation_weight)


@given(version_batches())
def test_proximal_alpha_equals_areal_in_float64(batch):
    versions, current, current_bt, mask = batch
    versions = np.where(mask, versions, -1)  # AReaL's prompt tokens
    got = np.asarray(_alpha(jnp.asarray(versions), jnp.asarray(current_bt, jnp.int32)))
    want = areal_alpha(versions, current_bt)
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)
    assert ((got >= 0) & (got <= 1)).all()
    np.testing.assert_array_equal(got[versions < 0], 0.0)
    np.testing.assert_array_equal(got[versions == current_bt - 1], 0.0)  # the proximal version


@given(version_batches(), st.integers(0, B * T - 1), st.integers(1, 2**20))
def test_eager_checks_refuse_exactly_negative_ages(batch, where, ahead):
    versions, current, current_bt, mask = batch
    versions = versions.copy()
    i, j = divmod(where, T)
    newer = int(np.broadcast_to(current_bt, versions.shape)[i, j]) + ahead
    versions[i, j] = min(newer, INT32_MAX)
    shape = versions.shape
    args = dict(needed_by=None, mask=jnp.asarray(mask, jnp.float32))
    if mask[i, j]:  # a valid token one or more versions ahead
        with pytest.raises(ValueError, match="newer than current_version"):
            staleness.check_versions(versions, current, shape, **args)
    else:
        v, c = staleness.check_versions(versions, current, shape, **args)
        aged = mask & (np.asarray(v) >= 0)
        assert (np.broadcast_to(np.asarray(c), shape) - np.asarray(v))[aged].min(initial=0) >= 0
