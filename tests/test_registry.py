"""The surrogate registry: registration rules, LossConfig's flat keywords and round trips
(the guide's snippet runs in test_guides.py)."""

from __future__ import annotations

import dataclasses

import pytest

import offpolicy_jax as opj
from offpolicy_jax._src.losses import registry


@pytest.fixture
def scratch_registry():
    """Registrations made by a test are removed after it."""
    before = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(before)


def test_registration_rules(scratch_registry):
    @dataclasses.dataclass(frozen=True)
    class Clash:
        aggregation: float = 1.0

    @dataclasses.dataclass
    class Mutable:
        k: float = 1.0

    @dataclasses.dataclass(frozen=True)
    class NoDefault:
        k: float

    for params, message in ((Clash, "clashes"), (Mutable, "frozen"), (NoDefault, "default")):
        with pytest.raises(ValueError, match=message):
            opj.register_surrogate("bad", params=params)
    with pytest.raises(ValueError, match="already registered"):
        opj.register_surrogate("gspo")
    with pytest.raises(ValueError, match="did you mean 'cispo'"):
        opj.LossConfig(policy_loss="cipso")
    assert registry.names()[:2] == ("ppo_clip", "gspo")


def test_loss_config_reads_hyperparameters_flat_and_round_trips():
    cfg = opj.LossConfig(policy_loss="dppo_kl", clip_eps_high=0.3, aggregation="token_mean")
    assert (cfg.clip_eps, cfg.upper_clip_eps, cfg.dppo_ratio_cap) == (0.2, 0.3, 20.0)
    assert cfg.dual_clip_c is None  # another surrogate's hyperparameter
    assert opj.LossConfig.from_dict(cfg.to_dict()) == cfg
    assert opj.LossConfig.from_yaml(cfg.to_yaml()) == cfg
    # dataclasses.replace takes flat hyperparameters and another surrogate alike.
    assert dataclasses.replace(cfg, dppo_ratio_cap=5).dppo_ratio_cap == 5.0
    gspo = dataclasses.replace(cfg, policy_loss="gspo")
    assert gspo.params == opj.LossConfig(policy_loss="gspo", clip_eps_high=0.3).params
    with pytest.raises(ValueError, match="dual_clip_c"):
        dataclasses.replace(opj.LossConfig(dual_clip_c=3.0), policy_loss="gspo")
    # clip_eps is every config's keyword; positional arguments keep the spec's order.
    assert opj.LossConfig(policy_loss="gpg", clip_eps=0.1) == opj.LossConfig(policy_loss="gpg")
    assert opj.LossConfig("ppo", 0.1).clip_eps == 0.1
    with pytest.raises(ValueError, match="clip_eps"):
        opj.LossConfig(policy_loss="gpg", clip_eps=1.5)
    with pytest.raises(TypeError, match="did you mean 'tau_pos'"):
        opj.LossConfig(policy_loss="sapo", tau_pso=1.0)
    with pytest.raises(ValueError, match="to_dict"):
        opj.LossConfig(algorithm="decoupled_ppo", correction=opj.VanillaTIS()).to_dict()


@pytest.mark.heavy
def test_a_surrogate_sees_rollout_and_key_and_reports_its_own_metrics(scratch_registry):
    """The seam of the 2026 losses: ``x.rollout`` is π_rollout, ``x.key`` the call's key,
    and ``SurrogateTerms.metrics`` become metrics reduced like pg_clipfrac (per sequence,
    then over sequences by default) that pool exactly."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from offpolicy_jax import reduction

    @opj.register_surrogate("engine_gap_pg")
    def engine_gap_pg(x, p):
        assert x.rollout is not None
        gap = jnp.where(x.valid, x.denominator - x.rollout, 0.0)
        far = gap > 0.5
        drop = jnp.zeros_like(far) if x.key is None else jax.random.bernoulli(x.key, 0.5, far.shape)
        loss = jnp.where(far | drop, 0.0, -x.advantages * jnp.where(x.valid, x.logp, 0.0))
        return opj.SurrogateTerms(
            loss, metrics={"gap_far_fraction": reduction.count_where(far, x.mask)}
        )

    old = jnp.array([[-1.0, -1.0, -1.0, 9.0], [-2.0, -2.0, -2.0, -2.0]])
    rollout = old - jnp.array([[0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)
    cfg = opj.LossConfig(algorithm="ppo", policy_loss="engine_gap_pg", get_mismatch_metrics=True)
    loss, m = opj.policy_loss(old, old, rollout, jnp.ones(2), mask, cfg)
    np.testing.assert_allclose(float(m["gap_far_fraction"]), (1 / 3 + 2 / 4) / 2, rtol=1e-6)
    # sequence_mean of -A·logp over the kept tokens: (2/3 + 4/4) / 2
    np.testing.assert_allclose(float(loss), (2 / 3 + 4 / 4) / 2, rtol=1e-6)
    a, ma = opj.policy_loss_parts(old[:1], old[:1], rollout[:1], jnp.ones(1), mask[:1], cfg)
    b, mb = opj.policy_loss_parts(old[1:], old[1:], rollout[1:], jnp.ones(1), mask[1:], cfg)
    pooled = opj.finalize_metrics(opj.pool_metric_parts(ma, mb))
    np.testing.assert_allclose(float(pooled["gap_far_fraction"]), (1 / 3 + 2 / 4) / 2, rtol=1e-6)
    f = jax.jit(lambda k: opj.policy_loss(old, old, rollout, jnp.ones(2), mask, cfg, key=k)[0])
    assert float(f(jax.random.key(0))) == float(f(jax.random.key(0)))
    assert float(f(jax.random.key(0))) == float(
        opj.policy_loss(old, old, rollout, jnp.ones(2), mask, cfg, key=jax.random.PRNGKey(0))[0]
    )
    with pytest.raises(ValueError, match="key must be"):
        opj.policy_loss(old, old, rollout, jnp.ones(2), mask, cfg, key=jnp.zeros(3))

    @opj.register_surrogate("clashing_metrics")
    def clashing(x, p):
        return opj.SurrogateTerms(x.logp * 0, metrics={"ppo_kl": reduction.count(x.mask)})

    with pytest.raises(ValueError, match="ppo_kl"):
        opj.policy_loss(
            old,
            old,
            rollout,
            jnp.ones(2),
            mask,
            dataclasses.replace(cfg, policy_loss="clashing_metrics"),
        )
