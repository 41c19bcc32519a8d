"""Rejection rules of the field (docs/semantics.md §8): their specs and per-token formulas.

Every function here is pure and takes plain arrays and numbers; the pipeline stages
that apply them live in :mod:`offpolicy_jax._src.correction.rules`.

* **KL-estimator criteria** (verl ``rollout_rs``): with ``λ_t = clip(δ_t, −S, S)``,
  ``δ_t = log π_old − log π_rollout``,

  - ``k1 = −λ``              (log of π_rollout / π_old: verl's sign convention),
  - ``k2 = ½ λ²``,
  - ``k3 = e^λ − 1 − λ``,

  tested per token (``token_k*``) or on the per-sequence sum, mean or max
  (``seq_sum_k*``, ``seq_mean_k*``, ``seq_max_k2``, ``seq_max_k3``). A ``k1`` criterion
  keeps ``lo ≤ exp(stat) ≤ hi`` (bounds on the ratio π_rollout / π_old, or its product /
  geometric mean; a single value ``hi`` means ``[1/hi, hi]``); ``k2`` / ``k3`` keep
  ``stat ≤ hi``. A token stays only if every criterion keeps it.
* **KPop** (verl ``rollout_rs: binary_kl``): per token ``max(D_B(o‖b), D_B(b‖o))``, the
  binary KL of the sampled token between π_old and π_rollout in both directions
  (:func:`offpolicy_jax._src.correction.binary_kl.bidirectional_binary_kl`); keeps ``stat ≤ φ``
  (default φ = 2.0, :data:`BINARY_KL_DEFAULT_THRESHOLD`).
* **Sequence log-prob error** (NeMo-RL ``seq_logprob_error_threshold``): a sequence is
  dropped when ``mean_t exp(|δ_t|) > threshold``.
* **M2PO** (Zheng et al., 2025, "Prosperity before Collapse: How Far Can Off-Policy RL
  Reach with Stale Data on LLMs?", arXiv:2510.01161): drop the tokens with the largest
  ``δ²`` until the batch mean of ``δ²`` over the kept tokens is ``≤ τ``.
* **OPSM** (DeepSeek-AI, 2025, "DeepSeek-V3.2", off-policy sequence masking): in the
  loss, drop a sequence whose advantage is negative and whose mean
  ``log(π_rollout / π_θ)`` exceeds ``δ``.
* **AReaL's grid** (inclusionAI/AReaL ``RejectionSamplingConfig``): a ratio,
  ``k1``/``k2``/``k3`` (:func:`areal_statistic`) or KPop's binary-KL statistic
  (:func:`areal_binary_kl`) per token or aggregated per
  sequence (``sum``/``mean``/``max``), bounded by ``[lower, upper]``, masks the tokens
  out of bounds or clamps their weight.
* Probability metrics: NeMo-RL's ``token_mult_prob_error`` (``exp(|δ|)``) and
  Jensen–Shannon estimate, and the effective sample size of the weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from offpolicy_jax._src.correction.binary_kl import bidirectional_binary_kl
from offpolicy_jax._src.messages import close_match, shown

LOG_RATIO_CLAMP = 20.0  # S, as ratios.LOG_RATIO_CLAMP (verl's SAFETY_BOUND)

ESTIMATORS = ("k1", "k2", "k3")
KL_CRITERIA: tuple[str, ...] = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
"""verl's eleven ``rollout_rs`` options (``seq_max_k1`` does not exist: ``max(−λ)`` of a
ratio bound in both directions is not a trust region)."""

BINARY_KL = "binary_kl"
BINARY_KL_DEFAULT_THRESHOLD = 2.0
"""KPop's φ in verl (``rollout_rs: binary_kl`` without a ``rollout_rs_threshold``)."""
RS_CRITERIA: tuple[str, ...] = (*KL_CRITERIA, BINARY_KL)
"""Every built-in ``rollout_rs`` option: the KL criteria and KPop's ``binary_kl`` (keep a
token iff ``max(D_B(o‖b), D_B(b‖o)) ≤ φ``, :mod:`offpolicy_jax._src.correction.binary_kl`)."""


class Criterion(NamedTuple):
    """One parsed KL-estimator criterion.

    Attributes:
      name: e.g. ``"seq_max_k2"``.
      aggregate: ``"token"``, ``"seq_sum"``, ``"seq_mean"`` or ``"seq_max"``; ``"rule"``
        for a registered rule (:data:`RULES`), whose threshold is ``upper`` / ``hi``.
      estimator: ``"k1"``, ``"k2"``, ``"k3"``, or ``"binary_kl"`` (KPop's statistic).
      lower: bound on the statistic (``log lo`` for k1), None for one-sided k2/k3.
      upper: bound on the statistic (``log hi`` for k1).
      lo: the written lower bound (k1: on the ratio), or None.
      hi: the written upper bound.
    """

    name: str
    aggregate: str
    estimator: str
    lower: float | None
    upper: float
    lo: float | None
    hi: float

    @property
    def spec(self) -> str:
        """The canonical ``"name:threshold"`` string of the native config."""
        bound = f"{self.lo!r}_{self.hi!r}" if self.lo is not None else repr(self.hi)
        return f"{self.name}:{bound}"


def _hint(value: str, allowed: tuple[str, ...]) -> str:
    close = [c for c in [close_match(value, allowed)] if c]
    return f" (did you mean {shown(close[0])}?)" if close else ""


RULES: dict[str, Callable[[float], object]] = {}
"""Rejection rules registered by name (:func:`offpolicy_jax._src.correction.rules.register_rule`): name ->
``factory(threshold)`` returning the rule's pipeline stage. ``rs_criteria`` entries
``"name:threshold"`` take these names beside :data:`KL_CRITERIA`."""


def check_criterion_name(name: object, key: str) -> str:
    """``name`` if it is one of :data:`RS_CRITERIA` or a registered rule (:data:`RULES`),
    else ``ValueError`` naming ``key``."""
    if isinstance(name, str) and (name in RS_CRITERIA or name in RULES):
        return name
    allowed = (*RS_CRITERIA, *RULES)
    hint = _hint(name, allowed) if isinstance(name, str) else ""
    raise ValueError(
        f"{key}: unknown rejection criterion {shown(name)}{hint}; must be one of {list(allowed)}"
    )


def _number(text: str, key: str, what: str) -> float:
    if "_" in text:  # float() reads "2_0" as 20.0; in a threshold "_" separates bounds
        raise ValueError(
            f"{key}: malformed threshold {shown(what)}: a threshold is 'upper' or "
            "'lower_upper' (one '_', no digit separators)"
        )
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: malformed threshold {shown(what)} (not a number)") from None
    if not math.isfinite(value):
        raise ValueError(f"{key}: threshold {shown(what)} must be finite")
    return value


def parse_threshold(name: str, threshold: object, key: str) -> Criterion:
    """Parses one criterion's threshold, verl's syntax: ``hi`` or ``"lo_hi"`` (k1 only).

    ``binary_kl`` (KPop) is a per-token criterion with one upper bound φ > 0 on the
    bidirectional binary KL (estimator ``"binary_kl"``, aggregate ``"token"``).

    Args:
      name: a :data:`RS_CRITERIA` name (already checked).
      threshold: a number or a string: ``"2.0"``, ``"0.5_2.0"``.
      key: the config key named in errors.

    Returns:
      the :class:`Criterion`; ``ValueError`` naming ``key`` for a malformed or
      non-positive threshold, ``lo > hi``, or ``lo_hi`` on a k2/k3 criterion.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, str)):
        raise ValueError(
            f"{key}: threshold of {shown(name)} must be a number or string, got {shown(threshold)}"
        )
    text = str(threshold).strip()
    aggregate, estimator = name.rsplit("_", 1)
    if name == BINARY_KL:
        aggregate, estimator = "token", BINARY_KL
    if estimator == "k1":
        if "_" in text:
            lo_text, hi_text = text.split("_", 1)
            lo, hi = _number(lo_text, key, text), _number(hi_text, key, text)
        else:
            hi = _number(text, key, text)
            lo = 1.0 / hi if hi > 0 else hi
        if lo <= 0 or hi <= 0:
            raise ValueError(
                f"{key}: thresholds of {shown(name)} must be positive, got {shown(text)}"
            )
        if lo > hi:
            raise ValueError(
                f"{key}: thresholds of {shown(name)} must be lower <= upper, got {shown(text)}"
            )
        return Criterion(name, aggregate, estimator, math.log(lo), math.log(hi), lo, hi)
    if "_" in text:
        raise ValueError(
            f"{key}: {shown(name)} takes a single upper bound without '_' (it is >= 0), got {shown(text)}"
        )
    hi = _number(text, key, text)
    if hi <= 0:
        raise ValueError(f"{key}: threshold of {shown(name)} must be positive, got {shown(text)}")
    return Criterion(name, aggregate, estimator, None, hi, None, hi)


def parse_spec(spec: object, key: str) -> Criterion:
    """Parses a native ``rs_criteria`` entry ``"name:threshold"`` (e.g. ``"seq_max_k2:2.5"``)."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(
            f"{key}: each entry must be a string 'criterion:threshold' such as "
            f"'seq_max_k2:2.5' or 'token_k1:0.5_2.0', got {shown(spec)}"
        )
    name, threshold = (part.strip() for part in spec.split(":", 1))
    name = check_criterion_name(name, key)
    if name in RULES:  # a registered rule: one finite threshold, the rule's own meaning
        value = _number(threshold, key, threshold)
        return Criterion(name, "rule", "", None, value, None, value)
    return parse_threshold(name, threshold, key)


# --------------------------------------------------------------------------- formulas


def kl_statistic(delta: jax.Array, estimator: str) -> jax.Array:
    """Per-token ``k1 = −λ``, ``k2 = ½λ²`` or ``k3 = e^λ − 1 − λ``, ``λ = clip(δ, −S, S)``.

    Args:
      delta: ``[..., T]`` log-ratio ``log π_old − log π_rollout`` (finite where valid).
      estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
      ``[..., T]`` float32 statistic (garbage where ``delta`` is).
    """
    lam = jnp.clip(delta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return -lam
    if estimator == "k2":
        return 0.5 * lam * lam
    if estimator == "k3":
        return jnp.exp(lam) - 1.0 - lam
    raise ValueError(f"unknown KL estimator {shown(estimator)}; must be one of {list(ESTIMATORS)}")


def areal_statistic(delta: jax.Array, metric: str) -> jax.Array:
    """AReaL's per-token divergence statistic of its rejection grid, unclamped.

    inclusionAI/AReaL ``apply_rejection_sampling`` (``areal/utils/functional/
    functional.py``) with ``δ = log π_old − log π_rollout`` (its ``proximal_logprobs −
    old_logprobs``) and ``KLEstimator._compute_approx_kl(..., apply_clamp=False)``
    (``areal/utils/data.py``):

    * ``ratio = e^δ`` (the importance ratio),
    * ``kl_k1 = δ``,
    * ``kl_k2 = ½ δ²``,
    * ``kl_k3 = e^{−δ} − 1 + δ`` (AReaL's code negates the log-ratio before ``e^x − 1 −
      x``; its docstring's ``r − log r − 1`` is the other direction).

    No ``±S`` clamp (AReaL applies none): ``ratio`` and ``kl_k3`` are ``inf`` past
    float32's range, which every finite upper bound rejects, as AReaL's does.

    Args:
      delta: ``[..., T]`` float32 log-ratio (finite where valid).
      metric: ``"ratio"``, ``"kl_k1"``, ``"kl_k2"`` or ``"kl_k3"``.

    Returns:
      ``[..., T]`` float32 statistic (garbage where ``delta`` is).
    """
    if metric == "ratio":
        return jnp.exp(delta)
    if metric == "kl_k1":
        return delta
    if metric == "kl_k2":
        return delta * delta / 2.0
    if metric == "kl_k3":
        log_ratio = -delta  # AReaL's order of operations, for the same rounding
        return jnp.exp(log_ratio) - 1.0 - log_ratio
    raise ValueError(
        f"unknown AReaL metric {shown(metric)}; must be 'ratio', 'kl_k1', 'kl_k2' or 'kl_k3'"
    )


AREAL_BINARY_KL_EPS = 1e-8
"""ε of AReaL's ``compute_binary_kl_divergence``: both probabilities clamped to ``[ε, 1 − ε]``."""


def areal_binary_kl(old: jax.Array, rollout: jax.Array) -> tuple[jax.Array, jax.Array]:
    """AReaL's KPop statistic (``metric: binary_kl``) and where AReaL's value is NaN.

    inclusionAI/AReaL ``apply_rejection_sampling`` (commit ``13353cc6``):
    ``max(D_B(o‖b), D_B(b‖o))`` of ``compute_binary_kl_divergence``, which clamps
    ``p = e^logp`` to ``[1e-8, 1 − 1e-8]``. In float32 ``1 − 1e-8`` rounds to 1, so a
    probability that rounds to 1 (``logp ≳ −3e-8``, a near-certain token) gives
    ``0·log 0 = NaN`` there, and NaN fails every bound test: AReaL rejects such a token
    (and, aggregated, its sequence). This returns the statistic finite
    (:func:`~offpolicy_jax._src.correction.binary_kl.bidirectional_binary_kl` with ``ε =
    1e-8``) and that set of tokens as a flag, so the decision is AReaL's and no NaN
    reaches a metric.

    Args:
      old: ``[..., T]`` log π_old (AReaL's ``proximal_logprobs``).
      rollout: ``[..., T]`` log π_rollout (AReaL's ``old_logprobs``).

    Returns:
      ``(stat, undefined)``: float32 ``≥ 0`` and bool, ``[..., T]`` (garbage where an
      input is not a log-probability).
    """
    old, rollout = old.astype(jnp.float32), rollout.astype(jnp.float32)
    stat = bidirectional_binary_kl(old, rollout, eps=AREAL_BINARY_KL_EPS)
    undefined = (jnp.exp(old) >= 1.0) | (jnp.exp(rollout) >= 1.0)
    return stat, undefined


MULT_PROB_LOG_CAP = 50.0
"""``|δ|`` is capped here before ``exp`` (e^50 ≈ 5e21: a sum of many stays finite)."""


def mult_prob_error(delta: jax.Array) -> jax.Array:
    """NeMo-RL's multiplicative probability error per token, ``exp(min(|δ_t|, 50)) ≥ 1``.

    Its masked token mean is ``token_mult_prob_error``; its per-sequence mean is the
    statistic of the sequence log-prob error rule (``seq_mult_prob_error``). The cap
    only matters for ``|δ| > 50``, where every sensible threshold rejects anyway.
    """
    return jnp.exp(jnp.minimum(jnp.abs(delta), MULT_PROB_LOG_CAP))


def js_divergence(old_logp: jax.Array, rollout_logp: jax.Array) -> jax.Array:
    """NeMo-RL's per-token Jensen–Shannon estimate between π_old and π_rollout.

    With ``log M = log(½ e^o + ½ e^b)`` and ``k3(x) = e^x − x − 1`` (the k3 estimate of
    KL from one sample): ``JS_t = ½ k3(o − log M) + ½ k3(b − log M)``, which simplifies
    to ``log cosh(δ/2)`` with ``δ = o − b`` (``≥ 0``, 0 iff ``o = b``); see
    :func:`probability_errors` for how it is computed.
    """
    return probability_errors(old_logp - rollout_logp)[1]


def probability_errors(delta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(exp|δ|, log cosh(δ/2))``: :func:`mult_prob_error` and :func:`js_divergence`
    of one ``δ`` per token.

    With ``y = |δ|/2`` (``|δ|`` capped at :data:`MULT_PROB_LOG_CAP`): ``exp|δ| = e^{2y}``
    and, written for accuracy near ``δ = 0`` (where ``log((e^{2y} + 1)/2) − y``
    cancels), ``log cosh y = log1p(2 sinh²(y/2))`` with ``sinh z = u (u + 2) / (2 (u +
    1))``, ``u = expm1(z)``: every term positive, a few ulp everywhere.
    """
    y = 0.5 * jnp.minimum(jnp.abs(delta), MULT_PROB_LOG_CAP)
    mult = jnp.exp(2.0 * y)
    u = jnp.expm1(0.5 * y)
    sinh = u * (u + 2.0) / (2.0 * (u + 1.0))
    return mult, jnp.log1p(2.0 * sinh * sinh)


def effective_sample_size(sum_w: jax.Array, sum_w2: jax.Array, n: jax.Array) -> jax.Array:
    """``ESS = (Σ w)² / (n · Σ w²)`` in ``[0, 1]``; 0 when nothing is kept.

    verl's ``rollout_is_eff_sample_size`` (``1 / mean((w / mean w)²)``) is the same
    quantity. Sums run over the kept tokens.

    Taken as ``(Σ w / n) · (Σ w / Σ w²)``, the weighted mean weight times the inverse
    of the ``w``-weighted one: no sum is squared, so float mask weights of any scale
    (each sum scales by it) give a finite value where ``(Σ w)²`` would overflow.
    """
    ok = (n > 0) & (sum_w2 > 0)
    mean_w = sum_w / jnp.where(ok, n, 1.0)
    inverse = sum_w / jnp.where(ok, sum_w2, 1.0)
    return jnp.where(ok, mean_w * inverse, 0.0)


def opsm_keep(mean_log_ratio: jax.Array, mean_advantage: jax.Array, delta: float) -> jax.Array:
    """DeepSeek-V3.2 off-policy sequence masking, per sequence.

    Drops a sequence iff ``Ā < 0`` and ``mean_t log(π_rollout / π_θ) > δ``.

    Args:
      mean_log_ratio: ``[...]`` per-sequence mean of ``log π_rollout − sg(log π_θ)``.
      mean_advantage: ``[...]`` per-sequence mean advantage.
      delta: the threshold ``δ > 0``.

    Returns:
      ``[...]`` bool, True where the sequence stays; no gradient flows through it.
    """
    drop = (mean_advantage < 0) & (mean_log_ratio > delta)
    return jax.lax.stop_gradient(~drop)


def m2po_cutoff(
    values: jax.Array,
    valid: jax.Array,
    tau: float,
    psum: Callable[[jax.Array], jax.Array] = lambda x: x,
    pmax: Callable[[jax.Array], jax.Array] = lambda x: x,
) -> jax.Array:
    """M2PO's cut-off: the largest ``c`` with ``mean{v ≤ c} ≤ τ`` over the valid tokens.

    Dropping the tokens with the largest ``v = δ²`` one at a time until the mean of the
    rest is ``≤ τ`` keeps exactly ``{v ≤ c}`` for this ``c`` (ties at the cut leave
    together, so the rule does not depend on the tokens' order). ``g(c) = Σ (v − τ)·[v ≤ c]``
    is non-decreasing for ``c ≥ τ`` and ``g(c) ≤ 0`` is the condition, so a bisection
    finds ``c``: on the bit patterns of non-negative float32 (monotone as integers), 32
    steps, each one global sum (``psum``) of a scalar: exact under sharding, no sort.

    Args:
      values: ``[..., T]`` float32 ``v ≥ 0`` (anything where not ``valid``).
      valid: ``[..., T]`` bool, the tokens that take part.
      tau: the second-moment budget ``τ > 0``.
      psum / pmax: global sum / max over the devices the batch is split across
        (identity when unsharded).

    Returns:
      float32 scalar ``c``: keep the valid tokens with ``v ≤ c`` (``+inf``: keep all).
    """
    v = jnp.where(valid, values, 0.0).astype(jnp.float32)

    def excess(cut):  # g(cut) = Σ (v − τ) [v ≤ cut]
        inside = valid & (v <= cut)
        return psum(jnp.sum(jnp.where(inside, v - tau, 0.0)))

    vmax = pmax(jnp.max(jnp.where(valid, v, 0.0), initial=0.0))
    keep_all = excess(vmax) <= 0
    bits = jax.lax.bitcast_convert_type

    def step(_, lo_hi):
        lo, hi = lo_hi  # g(from_bits(lo)) <= 0 < g(from_bits(hi))
        mid = lo + (hi - lo) // 2
        ok = excess(bits(mid, jnp.float32)) <= 0
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    # g(0) = −τ·#{v = 0} <= 0 always, so bit pattern 0 is a valid start.
    lo0 = jnp.zeros((), jnp.int32)
    hi0 = bits(vmax, jnp.int32)
    lo, _ = jax.lax.fori_loop(0, 32, step, (lo0, hi0))
    return jnp.where(keep_all, jnp.inf, bits(lo, jnp.float32))
