"""The per-token objective of ``policy_loss``: the configured surrogate, weighted.

:func:`surrogate_columns` turns ``LossConfig.policy_loss`` into the per-token loss
``ℓ'`` (IS weights applied) and the per-token metric columns that the loss's one
per-sequence pass sums; :func:`regulariser_terms` gives the KL-to-reference and entropy
terms. Surrogates that need a per-sequence quantity first (GSPO's sequence ratio, GMPO's
geometric means) take it from one extra per-sequence pass through the layout, so packed
sequences (several per row) work unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from offpolicy_jax import policy_losses as pl
from offpolicy_jax import reduction as _reduce
from offpolicy_jax.config import LossConfig
from offpolicy_jax.reduction import Column, Rows

PG_METRICS: tuple[str, ...] = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")


class SurrogateOutput(NamedTuple):
    """``ℓ'`` ``[..., T]`` and the surrogate's metric columns (summed over ``m'``)."""

    loss: jax.Array
    columns: dict[str, Column]


def surrogate_columns(
    config: LossConfig,
    theta: jax.Array,
    denominator: jax.Array,
    advantages: jax.Array,
    valid: jax.Array,
    final_mask: jax.Array,
    weights: jax.Array | None,
    layout: Rows,
) -> SurrogateOutput:
    """The configured surrogate (not ``ppo_clip``, which ``policy_loss`` runs itself).

    Args:
      config: the loss config (its ``policy_loss`` and hyperparameters).
      theta: ``[..., T]`` log π_θ.
      denominator: ``[..., T]`` log π_d (π_old, or π_rollout in bypass mode).
      advantages: ``[..., T]``, 0 where not ``valid``.
      valid: ``[..., T]`` bool: the original mask.
      final_mask: ``[..., T]`` float ``m'`` after the correction's rejection.
      weights: ``[..., T]`` stop-gradient IS weights (meaningful where ``m' > 0``) or None.
      layout: the per-sequence seam (rows, or packed segments).

    Returns:
      :class:`SurrogateOutput`.
    """
    name = config.policy_loss
    kept = final_mask > 0
    eps, eps_high = config.clip_eps, config.upper_clip_eps
    sg = jax.lax.stop_gradient
    x = pl.safe_log_ratio(theta, denominator, valid)
    columns: dict[str, Column] = {"ppo_kl": _reduce.total(-sg(x), final_mask)}

    def weighted(per_token):
        return per_token if weights is None else jnp.where(kept, weights, 0.0) * per_token

    if name in ("gspo", "gspo_token"):
        sums = layout.reduce({"x": _reduce.total(x, final_mask), "n": _reduce.count(final_mask)})
        seq_log_ratio = layout.broadcast(sums["x"] / jnp.maximum(sums["n"], 1.0))
        terms = pl.gspo(
            theta,
            seq_log_ratio,
            advantages,
            valid,
            clip_eps=eps,
            clip_eps_high=eps_high,
            token_level=name == "gspo_token",
        )
        loss = weighted(terms.loss)
    elif name == "gmpo":
        terms = pl.gmpo_token_log_ratio(
            theta, denominator, advantages, valid, clip_eps=eps, clip_eps_high=eps_high
        )
        seq_columns = {
            "x": _reduce.total(terms.loss, final_mask),
            "adv": _reduce.total(advantages, final_mask),
            "n": _reduce.count(final_mask),
        }
        if weights is not None:
            seq_columns["log_w"] = _reduce.total(pl.gmpo_log_weight(weights), final_mask)
        sums = layout.reduce(seq_columns)
        n = jnp.maximum(sums["n"], 1.0)
        per_seq = pl.gmpo_sequence_loss(
            sums["x"] / n, sums["adv"] / n, None if weights is None else sums["log_w"] / n
        )
        # Every token carries its sequence's loss: any aggregation then averages L_i
        # (sequence_mean / row_mean: each sequence once; token_mean: by length).
        loss = jnp.broadcast_to(layout.broadcast(per_seq), theta.shape)
    elif name == "cispo":
        terms = pl.cispo(
            theta, denominator, advantages, valid, clip_eps=eps, clip_eps_high=eps_high
        )
        loss = weighted(terms.loss)
    elif name == "sapo":
        terms = pl.sapo(
            theta,
            denominator,
            advantages,
            valid,
            tau_pos=config.sapo_tau_pos,
            tau_neg=config.sapo_tau_neg,
        )
        loss = weighted(terms.loss)
    elif name == "gpg":
        terms = pl.gpg(theta, advantages, valid)
        loss = weighted(terms.loss)
    elif name in ("dppo_tv", "dppo_kl"):
        terms = pl.dppo(
            theta,
            denominator,
            advantages,
            valid,
            divergence=name[-2:],
            clip_eps=eps,
            clip_eps_high=eps_high,
            ratio_cap=config.dppo_cap,
        )
        loss = weighted(terms.loss)
    elif name == "dro":
        terms = pl.dro(theta, denominator, advantages, valid, beta=config.dro_penalty)
        loss = weighted(terms.loss)
    else:
        raise ValueError(f"unknown policy_loss {name!r}")
    if terms.clipped is not None:
        columns["pg_clipfrac"] = _reduce.count_where(terms.clipped, final_mask)
    if terms.clipped_lower is not None:
        columns["pg_clipfrac_lower"] = _reduce.count_where(terms.clipped_lower, final_mask)
    return SurrogateOutput(loss, columns)


def regulariser_terms(
    config: LossConfig,
    theta: jax.Array,
    denominator: jax.Array | None,
    valid: jax.Array,
    ref_logp: jax.Array | None,
    entropy: jax.Array | None,
) -> dict[str, jax.Array]:
    """Per-token ``kl_loss`` (KL-to-reference estimate) and ``entropy`` where given.

    The loss adds ``kl_coef · kl − entropy_coef · H`` per token; both are reported as
    metrics aggregated like the policy term whenever their input is passed.
    """
    out = {}
    if ref_logp is not None:
        if config.kl_off_policy:
            if denominator is None:
                raise ValueError(
                    "kl_off_policy weights the KL estimate by π_θ / π_old and needs old_logp; "
                    "pass old_logp or set kl_off_policy=False"
                )
            out["kl_loss"] = pl.off_policy_kl_estimate(
                theta, ref_logp, denominator, valid, estimator=config.kl_estimator
            )
        else:
            out["kl_loss"] = pl.kl_estimate(theta, ref_logp, valid, estimator=config.kl_estimator)
    if entropy is not None:
        out["entropy"] = jnp.where(valid & jnp.isfinite(entropy), entropy, 0.0)
    return out
