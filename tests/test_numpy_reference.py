"""Validate the pure-NumPy oracle (``tests/numpy_reference.py``) against the
conformance pack and against its own analytic-gradient / masking invariants.

The conformance pack lives at ``<repo>/../shared/conformance`` (or wherever
``OFFPOLICY_JAX_CONFORMANCE`` points); the pack tests skip when it is absent.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # also set by pyproject
import numpy_reference as ref  # noqa: E402


def _conformance_dir() -> pathlib.Path:
    env = os.environ.get("OFFPOLICY_JAX_CONFORMANCE")
    if env:
        return pathlib.Path(env)
    return pathlib.Path(__file__).resolve().parents[2] / "shared" / "conformance"


CONFORMANCE = _conformance_dir()
_MANIFEST = CONFORMANCE / "manifest.json"
if _MANIFEST.is_file():
    _ALL = json.loads(_MANIFEST.read_text())["cases"]
    CASES = [c for c in _ALL if not c["expect_error"]["raised"]]
else:
    CASES = []
_SKIP_MSG = f"conformance pack not found at {CONFORMANCE} (set OFFPOLICY_JAX_CONFORMANCE)"

CORRECTION_CASES = [c for c in CASES if c["kind"] == "correction"]
LOSS_CASES = [c for c in CASES if c["kind"] == "loss"]


def _params(cases):
    if not cases:
        return [pytest.param(None, id="no-conformance-pack")]
    return [pytest.param(c, id=c["name"]) for c in cases]


def _load(case):
    data = np.load(CONFORMANCE / case["file"])
    inp = {}
    for key, dtype in case["inputs"].items():
        if dtype is None:
            inp[key] = None
        elif dtype == "bfloat16":
            import ml_dtypes

            inp[key] = data[key].view(ml_dtypes.bfloat16)
        else:
            inp[key] = data[key]
    return inp, data


def _close(got, want, case, key):
    tol = case.get("tolerance_overrides", {}).get(key, case["tolerance"])
    np.testing.assert_allclose(
        np.asarray(got, np.float64),
        np.asarray(want, np.float64),
        rtol=tol["rtol"],
        atol=tol["atol"],
        err_msg=f"{case['name']}: {key}",
    )


def _loss_correction(case):
    corr = case["config"]["correction"]
    if corr is None:
        return None
    if case["correction_type"] == "VanillaTIS":
        return ("vanilla_tis", corr.get("clip_low", 0.0), corr.get("clip", 2.0))
    return dict(corr)


# --------------------------------------------------------------------------------------
# conformance pack
# --------------------------------------------------------------------------------------


@pytest.mark.conformance
@pytest.mark.parametrize("case", _params(CORRECTION_CASES))
def test_correction_case(case):
    if case is None:
        pytest.skip(_SKIP_MSG)
    inp, data = _load(case)
    for reduction, tag in (("sequence", "seq"), ("token", "tok")):
        weights, mask_out, metrics = ref.correction(
            inp["old_logp"], inp["rollout_logp"], inp["mask"], reduction=reduction, **case["config"]
        )
        assert weights.shape == mask_out.shape == np.shape(inp["mask"])
        assert np.all(np.isfinite(weights))
        if case["compare"]["weights"]:
            _close(weights, data["weights"], case, "weights")
            np.testing.assert_array_equal(
                mask_out, data["mask_out"], err_msg=f"{case['name']}: mask_out"
            )
        missing = set(case["compare"]["metrics"]) - set(metrics)
        assert not missing, f"{case['name']}: metrics not emitted: {sorted(missing)}"
        for key in case["compare"]["metrics"]:
            assert np.isfinite(metrics[key]), key
            _close(metrics[key], data[f"metric_{tag}__{key}"], case, f"metric_{tag}__{key}")


@pytest.mark.conformance
@pytest.mark.parametrize("case", _params(LOSS_CASES))
def test_loss_case(case):
    if case is None:
        pytest.skip(_SKIP_MSG)
    inp, data = _load(case)
    cfg = {k: v for k, v in case["config"].items() if k != "correction"}
    loss, grad, metrics = ref.policy_loss(
        inp["logp"],
        inp["old_logp"],
        inp["rollout_logp"],
        inp["advantages"],
        inp["mask"],
        correction=_loss_correction(case),
        **cfg,
    )
    assert np.all(np.isfinite(grad))
    if case["compare"]["loss"]:
        _close(loss, data["loss"], case, "loss")
    if case["compare"]["grad_logp"]:
        _close(grad, data["grad_logp"], case, "grad_logp")
    missing = set(case["compare"]["metrics"]) - set(metrics)
    assert not missing, f"{case['name']}: metrics not emitted: {sorted(missing)}"
    for key in case["compare"]["metrics"]:
        _close(metrics[key], data[f"metric__{key}"], case, f"metric__{key}")


@pytest.mark.conformance
def test_every_non_error_case_is_covered():
    if not CASES:
        pytest.skip(_SKIP_MSG)
    assert len(CORRECTION_CASES) + len(LOSS_CASES) == len(CASES)
    assert all(c["kind"] in ("correction", "loss") for c in CASES)


# --------------------------------------------------------------------------------------
# self-checks that do not need the pack
# --------------------------------------------------------------------------------------


def _random_batch(rng, shape=(4, 9), spread=0.3):
    theta = rng.normal(-1.0, 0.5, shape).astype(np.float32)
    old = (theta + rng.normal(0.0, spread, shape)).astype(np.float32)
    roll = (old + rng.normal(0.0, spread, shape)).astype(np.float32)
    adv = rng.normal(0.0, 1.0, shape).astype(np.float32)
    lengths = rng.integers(1, shape[-1] + 1, shape[:-1])
    mask = (np.arange(shape[-1]) < lengths[..., None]).astype(np.float32)
    return theta, old, roll, adv, mask


_LOSS_CONFIGS = [
    dict(algorithm="ppo"),
    dict(algorithm="ppo", clip_eps_high=0.28, dual_clip_c=3.0, aggregation="token_mean"),
    dict(algorithm="bypass_ppo", aggregation="sequence_sum"),
    dict(algorithm="decoupled_ppo", correction=("vanilla_tis", 0.0, 2.0)),
    dict(
        algorithm="decoupled_ppo",
        correction=dict(
            use_tis=True,
            tis_mode="mask",
            tis_lower_bound=0.7,
            tis_upper_bound=1.4,
            tis_batch_normalize=True,
        ),
        rejected_in_denominator=True,
    ),
    dict(
        algorithm="decoupled_ppo",
        correction=dict(
            use_tis=True,
            tis_level="geometric",
            tis_mode="clip",
            tis_lower_bound=0.9,
            tis_upper_bound=1.1,
            use_rs=True,
            rs_level="sequence",
            rs_lower_bound=0.2,
            rs_upper_bound=5.0,
        ),
    ),
    dict(
        algorithm="reinforce_is",
        correction=dict(use_tis=True, tis_mode="truncate", tis_upper_bound=1.5),
    ),
]


@pytest.mark.parametrize("cfg", _LOSS_CONFIGS, ids=lambda c: c["algorithm"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_analytic_gradient_matches_finite_differences(cfg, seed):
    """The hand-derived gradient equals central differences away from kinks.

    ``reinforce_is`` weights are stop-gradient, so its weights are frozen by
    differentiating only the explicit ``θ`` factor (checked through linearity).
    """
    rng = np.random.default_rng(seed)
    theta, old, roll, adv, mask = _random_batch(rng)
    theta64 = theta.astype(np.float64)
    kw = dict(cfg)
    _, grad, _ = ref.policy_loss(theta64, old, roll, adv, mask, **kw)
    if cfg["algorithm"] == "reinforce_is":
        # loss is linear in θ for fixed (stop-gradient) weights: loss(θ) = Σ grad·θ
        loss, _, _ = ref.policy_loss(theta64, old, roll, adv, mask, **kw)
        np.testing.assert_allclose(
            loss, float(np.sum(grad * np.where(mask > 0, theta64, 0))), rtol=1e-9, atol=1e-12
        )
        return
    h = 1e-6

    def f(t):
        # keep the correction fixed: it depends on old/rollout only (not θ)
        return ref.policy_loss(t, old, roll, adv, mask, **kw)[0]

    # the oracle rounds its inputs to float32; bypass that for the FD probe
    orig = ref._as_float
    ref._as_float = lambda x: np.asarray(x, dtype=np.float64)
    try:
        fd = np.zeros_like(theta64)
        for idx in np.ndindex(theta64.shape):
            tp, tm = theta64.copy(), theta64.copy()
            tp[idx] += h
            tm[idx] -= h
            fd[idx] = (f(tp) - f(tm)) / (2 * h)
        _, grad64, _ = ref.policy_loss(theta64, old, roll, adv, mask, **kw)
    finally:
        ref._as_float = orig
    np.testing.assert_allclose(grad64, fd, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("seed", [0, 1])
def test_masked_garbage_never_leaks(seed):
    """NaN / ±inf / 1e30 at masked positions change nothing (D3)."""
    rng = np.random.default_rng(seed)
    theta, old, roll, adv, mask = _random_batch(rng)
    garbage = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30], np.float32)
    dirty = [
        np.where(mask > 0, x, rng.choice(garbage, x.shape)).astype(np.float32)
        for x in (theta, old, roll, adv)
    ]
    corr = dict(
        use_tis=True,
        tis_level="sequence",
        tis_mode="mask",
        tis_lower_bound=0.1,
        tis_upper_bound=10.0,
        tis_batch_normalize=True,
        use_rs=True,
        rs_level="geometric",
        rs_veto_threshold=1e-4,
    )
    for red in ("sequence", "token"):
        clean_c = ref.correction(old, roll, mask, reduction=red, **corr)
        dirty_c = ref.correction(dirty[1], dirty[2], mask, reduction=red, **corr)
        np.testing.assert_array_equal(clean_c[0], dirty_c[0])
        np.testing.assert_array_equal(clean_c[1], dirty_c[1])
        assert clean_c[2] == dirty_c[2]
    for cfg in _LOSS_CONFIGS:
        clean = ref.policy_loss(theta, old, roll, adv, mask, **cfg)
        messy = ref.policy_loss(*dirty, mask, **cfg)
        assert clean[0] == messy[0]
        np.testing.assert_array_equal(clean[1], messy[1])
        assert clean[2] == messy[2]


def test_fractional_mask_equals_bool_for_zero_one():
    rng = np.random.default_rng(3)
    _, old, roll, _, mask = _random_batch(rng)
    kw = dict(
        use_tis=True,
        tis_mode="clip",
        tis_lower_bound=0.8,
        tis_upper_bound=1.25,
        tis_batch_normalize=True,
        use_rs=True,
        rs_level="geometric",
    )
    a = ref.correction(old, roll, mask, **kw)
    b = ref.correction(old, roll, mask.astype(bool), **kw)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert a[2] == b[2]


def test_batch_normalisation_invariant():
    """After normalisation the mean weight over m' is 1 (token and sequence level)."""
    rng = np.random.default_rng(4)
    _, old, roll, _, mask = _random_batch(rng, spread=0.6)
    for level in ("token", "sequence", "geometric"):
        w, m_out, met = ref.correction(
            old,
            roll,
            mask,
            use_tis=True,
            tis_level=level,
            tis_mode="truncate",
            tis_upper_bound=3.0,
            tis_batch_normalize=True,
        )
        red = "token" if level == "token" else "sequence"
        assert ref.reduce_metric(w, m_out, red) == pytest.approx(1.0)
        assert met["mis_is_ratio_mean_final"] == pytest.approx(
            ref.reduce_metric(w, m_out, "sequence")
        )


def test_all_rejected_gives_zero_loss_and_gradient():
    rng = np.random.default_rng(5)
    theta, old, roll, adv, mask = _random_batch(rng)
    roll = old - 1.0  # every ratio e ≈ 2.7 > upper bound 1.05 → all rejected
    for agg in ref.AGGREGATIONS:
        loss, grad, met = ref.policy_loss(
            theta,
            old,
            roll,
            adv,
            mask,
            algorithm="decoupled_ppo",
            aggregation=agg,
            correction=dict(
                use_tis=True,
                tis_mode="mask",
                tis_lower_bound=0.95,
                tis_upper_bound=1.05,
                tis_batch_normalize=True,
            ),
        )
        assert loss == 0.0 and not np.any(grad)
        assert met["mis_batch_norm_factor"] == 1.0
        assert met["mis_is_ratio_min_final"] == 0.0
