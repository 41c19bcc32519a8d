"""The tunix integration (offpolicy_jax.integrations.tunix) against tunix itself.

Runs only where google-tunix is installed (the ``[tunix]`` extra, .ci/tunix.sh); the
main suite skips it. A one-layer Qwen3 from tunix's model zoo, randomly initialised
with tunix's own ``dummy_model_creator``, is the policy.
"""

import dataclasses
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tunix")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.models import dummy_model_creator  # noqa: E402
from tunix.models.qwen3 import model as qwen3  # noqa: E402
from tunix.rl import algo_core, algorithm_config, common, function_registry  # noqa: E402
from tunix.rl import utils as rl_utils  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402

import offpolicy_jax as opj  # noqa: E402
from offpolicy_jax.integrations import tunix as otx  # noqa: E402

PAD, EOS = 0, 1
TEMPERATURE = 0.9
REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model():
    config = qwen3.ModelConfig(
        num_layers=1,
        vocab_size=64,
        embed_dim=32,
        hidden_dim=64,
        num_heads=2,
        head_dim=16,
        num_kv_heads=1,
        rope_theta=10_000,
        norm_eps=1e-6,
        use_tied_embedding=True,
    )
    return dummy_model_creator.create_dummy_model(qwen3.Qwen3, config, scale=0.5)


def _theta(model, example):
    graphdef, state = nnx.split(model)
    return common.compute_per_token_logps(
        graphdef,
        state,
        example.prompt_ids,
        example.completion_ids,
        PAD,
        EOS,
        segment_ids=example.segment_ids,
        segment_positions=example.segment_positions,
        temperature=TEMPERATURE,
        stop_gradient=False,
    )


@pytest.fixture(scope="module")
def example(model):
    """Ragged completions (one of length 1), left-padded prompts, π_old ≠ θ (clipping
    active), π_rollout ≠ π_old (one catastrophic token), garbage in the padding."""
    rng = np.random.default_rng(0)
    batch, prompt_len, length = 4, 3, 6
    prompt = rng.integers(2, 64, (batch, prompt_len))
    prompt[0, 0] = PAD
    completion = rng.integers(2, 64, (batch, length))
    for row, n in enumerate((6, 3, 1, 5)):
        completion[row, n:] = PAD
    base = grpo_learner.TrainExample(
        prompt_ids=jnp.asarray(prompt),
        prompt_mask=jnp.asarray(prompt != PAD),
        completion_ids=jnp.asarray(completion),
        completion_mask=jnp.asarray(completion != PAD),
        advantages=jnp.asarray(rng.standard_normal(batch), jnp.float32),
        ref_per_token_logps=None,
        old_per_token_logps=None,
    )
    theta = _theta(model, base)
    noise = jnp.asarray(rng.standard_normal((2, batch, length)), jnp.float32)
    old = theta + 0.3 * noise[0]
    rollout = (old + 0.2 * noise[1]).at[1, 0].add(12.0)
    rollout = jnp.where(base.completion_mask, rollout, jnp.nan)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    fields.update(old_per_token_logps=old, rollout_per_token_logps=rollout)
    return otx.OffPolicyTrainExample(**fields)


def _packed(example):
    """tunix's own packer (rl_utils.pack_sequences) on ``example``, rollout log-probs
    packed alongside (the packer does not carry that field)."""
    packed = next(iter(rl_utils.pack_sequences(iter([[example]]), 40, pad_id=PAD)))[0]
    pieces = []
    for row in range(example.completion_ids.shape[0]):
        n_prompt = int(np.sum(np.asarray(example.prompt_mask[row])))
        n = int(np.sum(np.asarray(example.completion_mask[row])))
        pieces += [
            np.zeros(n_prompt, np.float32),
            np.asarray(example.rollout_per_token_logps[row, :n]),
        ]
    flat = np.concatenate(pieces)
    rollout = np.zeros(packed.completion_ids.shape, np.float32)
    rollout[0, : flat.size] = flat
    fields = {f.name: getattr(packed, f.name) for f in dataclasses.fields(packed)}
    fields["rollout_per_token_logps"] = jnp.asarray(rollout)
    return otx.OffPolicyTrainExample(**fields)


def _config(cls, epsilon_c=None, **kwargs):
    config = cls(**kwargs)
    config.temperature = TEMPERATURE  # as GRPOLearner sets it from the rollout config
    if epsilon_c is not None:  # not a GRPOConfig field; tunix's grpo loss reads it if set
        config.epsilon_c = epsilon_c
    return config


def _loss_and_grads(loss_fn, model, example, config):
    def loss(m):
        return loss_fn(m, example, config, PAD, EOS)

    (value, aux), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return value, aux, grads


def _assert_rel(actual, expected, rtol):
    actual_leaves, expected_leaves = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert len(actual_leaves) == len(expected_leaves)
    for a, e in zip(actual_leaves, expected_leaves, strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        scale = max(np.max(np.abs(e)), 1e-30)
        assert np.max(np.abs(a - e)) <= rtol * scale, (np.max(np.abs(a - e)), scale)


# --------------------------------------------------------------------------- correction off


@pytest.mark.parametrize(
    ("agg_mode", "correction"),
    [
        ("sequence-mean-token-mean", None),
        ("token-mean", opj.CorrectionConfig(use_tis=False)),
        ("seq-mean-token-sum", None),
        ("sequence-mean-token-scale", None),
    ],
)
def test_correction_off_equals_tunix_grpo(model, example, agg_mode, correction):
    """CorrectionConfig disabled (or none), same clips, β = 0: tunix's own ``grpo``."""
    common_kwargs = dict(beta=0.0, epsilon=0.2, epsilon_c=3.0, loss_agg_mode=agg_mode)
    tunix_config = _config(grpo_learner.GRPOConfig, **common_kwargs)
    ours = _config(otx.OffPolicyGRPOConfig, correction=correction, **common_kwargs)
    tunix_loss, tunix_aux, tunix_grads = _loss_and_grads(
        algo_core.grpo_loss_fn, model, example, tunix_config
    )
    loss, aux, grads = _loss_and_grads(otx.offpolicy_policy_loss, model, example, ours)
    assert float(tunix_aux["pg_clipfrac"]) > 0  # the clip is exercised
    _assert_rel(loss, tunix_loss, 1e-6)
    _assert_rel(grads, tunix_grads, 1e-6)


def test_correction_off_on_policy_equals_tunix_grpo(model, example):
    """tunix's num_iterations == 1 case: old_per_token_logps None means sg(θ)."""
    on_policy = example.replace(old_per_token_logps=None)
    tunix_config = _config(grpo_learner.GRPOConfig, beta=0.0)
    ours = _config(otx.OffPolicyGRPOConfig)
    expected = _loss_and_grads(algo_core.grpo_loss_fn, model, on_policy, tunix_config)
    actual = _loss_and_grads(otx.offpolicy_policy_loss, model, on_policy, ours)
    _assert_rel(actual[0], expected[0], 1e-6)
    _assert_rel(actual[2], expected[2], 1e-6)


def test_correction_off_packed_equals_tunix_grpo(model, example):
    """Rows packed by tunix's packer: token-mean (tunix's per-row modes average packed
    rows, ours the sequences; docs/guide/tunix.md)."""
    packed = _packed(example)
    tunix_config = _config(grpo_learner.GRPOConfig, beta=0.0, loss_agg_mode="token-mean")
    ours = _config(otx.OffPolicyGRPOConfig, loss_agg_mode="token-mean", max_segments_per_row=4)
    tunix_loss, _, tunix_grads = _loss_and_grads(
        algo_core.grpo_loss_fn, model, packed, tunix_config
    )
    loss, aux, grads = _loss_and_grads(otx.offpolicy_policy_loss, model, packed, ours)
    _assert_rel(loss, tunix_loss, 1e-6)
    _assert_rel(grads, tunix_grads, 1e-6)
    assert float(aux["opj/segment_overflow_fraction"]) == 0.0


def _ppo_example(example):
    from tunix.rl.ppo import ppo_learner

    fields = {f.name: getattr(example, f.name) for f in dataclasses.fields(example)}
    fields.pop("rollout_per_token_logps")
    shape = example.completion_ids.shape  # GAE advantages are per token
    fields["advantages"] = example.advantages[:, None] * jnp.linspace(0.5, 1.5, shape[1])
    plain = ppo_learner.TrainExample(**fields)
    tokens, logps = _rollout_output(example)
    return otx.with_rollout_logps(plain, logps, tokens)


def test_correction_off_equals_tunix_ppo(model, example):
    """tunix's ``ppo`` loss (token-mean, temperature 1, dual clip, entropy bonus)."""
    from tunix.rl.ppo import ppo_learner

    ppo_example = _ppo_example(example)
    assert isinstance(ppo_example, otx.OffPolicyPPOTrainExample)
    kwargs = dict(epsilon=0.2, epsilon_high=0.28, epsilon_c=3.0, entropy_coef=0.01)
    tunix_config = ppo_learner.PPOConfig(**kwargs)
    ours = otx.OffPolicyPPOConfig(correction=opj.CorrectionConfig(use_tis=False), **kwargs)
    tunix_loss, tunix_aux, tunix_grads = _loss_and_grads(
        algo_core.ppo_policy_loss_fn, model, ppo_example, tunix_config
    )
    loss, aux, grads = _loss_and_grads(otx.offpolicy_policy_loss, model, ppo_example, ours)
    assert float(tunix_aux["pg_clipfrac"]) > 0
    _assert_rel(loss, tunix_loss, 1e-6)
    _assert_rel(grads, tunix_grads, 1e-6)
    assert "opj/mis_k3_kl" in aux and "opj/entropy" in aux


# --------------------------------------------------------------------------- correction on


def _reference(model, example, loss_config, num_segments=None):
    """opj.policy_loss on the same per-token arrays, θ from tunix's log-prob pass."""

    def loss(m):
        value, metrics = opj.policy_loss(
            _theta(m, example),
            example.old_per_token_logps,
            example.rollout_per_token_logps,
            example.advantages,
            example.completion_mask,
            loss_config,
            segment_ids=example.segment_ids,
            num_segments=num_segments,
        )
        return value, metrics

    (value, metrics), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return value, metrics, grads


LOSS_CONFIGS = {
    "mis": dict(correction=opj.CorrectionConfig.preset("mis")),
    "verl_geo_rs": dict(
        loss_config=opj.LossConfig.from_verl(
            {"rollout_is": "token", "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.5_2.0"},
            {"loss_agg_mode": "token-mean"},
        )
    ),
    "gspo": dict(
        loss_config=opj.LossConfig(
            algorithm="decoupled_ppo",
            policy_loss="gspo",
            correction=opj.CorrectionConfig(use_tis=True, tis_level="geometric", use_rs=True),
        )
    ),
    "cispo": dict(
        loss_config=opj.LossConfig(
            algorithm="bypass_ppo", policy_loss="cispo", clip_eps_high=0.3, aggregation="token_mean"
        )
    ),
}


@pytest.mark.parametrize("name", sorted(LOSS_CONFIGS))
def test_correction_equals_policy_loss(model, example, name):
    config = _config(otx.OffPolicyGRPOConfig, **LOSS_CONFIGS[name])
    loss, aux, grads = _loss_and_grads(otx.offpolicy_policy_loss, model, example, config)
    ref_loss, metrics, ref_grads = _reference(model, example, config.offpolicy_loss_config)
    _assert_rel(loss, ref_loss, 1e-6)
    _assert_rel(grads, ref_grads, 1e-6)
    for key, value in metrics.items():
        np.testing.assert_allclose(aux["opj/" + key], value, rtol=1e-6, atol=1e-7)
    assert set(otx.metric_keys(config.offpolicy_loss_config)) <= set(aux)


def test_correction_packed_equals_policy_loss(model, example):
    packed = _packed(example)
    config = _config(
        otx.OffPolicyGRPOConfig,
        correction=opj.CorrectionConfig.preset("mis"),
        max_segments_per_row=4,
    )
    loss, aux, grads = _loss_and_grads(otx.offpolicy_policy_loss, model, packed, config)
    ref_loss, _, ref_grads = _reference(model, packed, config.offpolicy_loss_config, 4)
    _assert_rel(loss, ref_loss, 1e-6)
    _assert_rel(grads, ref_grads, 1e-6)
    assert float(aux["opj/segment_overflow_fraction"]) == 0.0
    assert set(otx.metric_keys(config.offpolicy_loss_config, packed=True)) <= set(aux)


def test_too_few_segments_is_never_silent(model, example):
    """max_segments_per_row below the packer's count: the library refuses concrete ids;
    inside tunix's jitted step (traced ids) the dropped share is a metric."""
    packed = _packed(example)
    config = _config(
        otx.OffPolicyGRPOConfig,
        correction=opj.CorrectionConfig.preset("mis"),
        max_segments_per_row=3,
    )
    with pytest.raises(ValueError, match="num_segments"):
        otx.offpolicy_policy_loss(model, packed, config, PAD, EOS)
    graphdef, state = nnx.split(model)

    @jax.jit
    def aux_of(state, packed):
        return otx.offpolicy_policy_loss(nnx.merge(graphdef, state), packed, config, PAD, EOS)[1]

    aux = aux_of(state, packed)
    assert float(aux["opj/segment_overflow_fraction"]) == pytest.approx(5 / 15)


def test_logps_from_hidden_matches_logits_path(model, example):
    kwargs = dict(correction=opj.CorrectionConfig.preset("mis"))
    logits_path = _config(otx.OffPolicyGRPOConfig, **kwargs)
    hidden_path = _config(
        otx.OffPolicyGRPOConfig, logps_from_hidden=True, hidden_chunk_size=5, **kwargs
    )
    expected = _loss_and_grads(otx.offpolicy_policy_loss, model, example, logits_path)
    actual = _loss_and_grads(otx.offpolicy_policy_loss, model, example, hidden_path)
    _assert_rel(actual[0], expected[0], 1e-5)
    _assert_rel(actual[2], expected[2], 1e-5)


def test_logps_from_hidden_packed(model, example):
    packed = _packed(example)
    theta = _theta(model, packed)
    logp, _ = otx.policy_token_logps(
        model, packed, pad_id=PAD, eos_id=EOS, temperature=TEMPERATURE, from_hidden=True
    )
    mask = np.asarray(packed.completion_mask) > 0
    np.testing.assert_allclose(
        np.asarray(logp)[mask], np.asarray(theta)[mask], rtol=1e-5, atol=1e-5
    )


# --------------------------------------------------------------------------- bad wiring


def _plain(example):
    fields = {
        f.name: getattr(example, f.name) for f in dataclasses.fields(grpo_learner.TrainExample)
    }
    return grpo_learner.TrainExample(**fields)


def test_missing_rollout_logps_is_an_error(model, example):
    config = _config(otx.OffPolicyGRPOConfig, correction=opj.CorrectionConfig.preset("mis"))
    with pytest.raises(ValueError, match="needs the rollout engine's log-probs"):
        otx.offpolicy_policy_loss(model, _plain(example), config, PAD, EOS)
    # The registry resolves the name tunix's learner looks up.
    assert function_registry.get_policy_loss_fn(otx.POLICY_LOSS_NAME) is otx.offpolicy_policy_loss


@pytest.mark.parametrize("length", [5, 7])
def test_wrong_length_rollout_logps_is_an_error(model, example, length):
    config = _config(otx.OffPolicyGRPOConfig, correction=opj.CorrectionConfig.preset("mis"))
    bad = example.replace(rollout_per_token_logps=jnp.zeros((4, length)))
    with pytest.raises(ValueError, match="rollout_per_token_logps has shape"):
        otx.offpolicy_policy_loss(model, bad, config, PAD, EOS)


def _rollout_output(example):
    ids, mask = np.asarray(example.completion_ids), np.asarray(example.completion_mask)
    tokens = [ids[row, : mask[row].sum()] for row in range(ids.shape[0])]
    logps = [
        np.asarray(example.rollout_per_token_logps[row, : t.size]) for row, t in enumerate(tokens)
    ]
    return tokens, logps


def test_with_rollout_logps_aligns_and_pads(example):
    tokens, logps = _rollout_output(example)
    built = otx.with_rollout_logps(_plain(example), logps, tokens)
    mask = np.asarray(example.completion_mask)
    np.testing.assert_array_equal(
        np.asarray(built.rollout_per_token_logps)[mask],
        np.asarray(example.rollout_per_token_logps)[mask],
    )
    assert np.all(np.asarray(built.rollout_per_token_logps)[~mask] == 0.0)


def test_with_rollout_logps_rejects_bad_wiring(example):
    tokens, logps = _rollout_output(example)
    plain = _plain(example)
    with pytest.raises(ValueError, match="return_logprobs=True"):
        otx.with_rollout_logps(plain, None, tokens)
    with pytest.raises(ValueError, match="misaligned in row 1"):  # one log-prob too many
        otx.with_rollout_logps(plain, [*logps[:1], np.append(logps[1], -1.0), *logps[2:]], tokens)
    with pytest.raises(ValueError, match="misaligned in row 0"):  # shifted by one token
        otx.with_rollout_logps(plain, [logps[0][1:], *logps[1:]], [tokens[0][1:], *tokens[1:]])
    with pytest.raises(ValueError, match="3 sequences"):
        otx.with_rollout_logps(plain, logps[:3], tokens[:3])


def test_nan_rollout_logp_at_valid_token_rejects_its_sequence(model, example):
    """A NaN at a valid token rejects its sequence (docs/semantics.md §0), counted."""
    config = _config(otx.OffPolicyGRPOConfig, correction=opj.CorrectionConfig.preset("mis"))
    bad = example.replace(
        rollout_per_token_logps=example.rollout_per_token_logps.at[3, 2].set(jnp.nan)
    )
    loss, aux, grads = _loss_and_grads(otx.offpolicy_policy_loss, model, bad, config)
    assert np.isfinite(float(loss))
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    assert float(aux["opj/mis_nonfinite_seq_fraction"]) == pytest.approx(0.25)
    without = example.replace(completion_mask=example.completion_mask.at[3].set(False))
    expected = _loss_and_grads(otx.offpolicy_policy_loss, model, without, config)
    _assert_rel(loss, expected[0], 1e-6)


def test_sampler_is_weights_and_missing_segments_are_errors(model, example):
    config = _config(otx.OffPolicyGRPOConfig, correction=opj.CorrectionConfig.preset("mis"))
    doubled = example.replace(sampler_is_weights=jnp.ones((4, 6)))
    with pytest.raises(ValueError, match="sampler_is_weights"):
        otx.offpolicy_policy_loss(model, doubled, config, PAD, EOS)
    with pytest.raises(ValueError, match="max_segments_per_row"):
        otx.offpolicy_policy_loss(model, _packed(example), config, PAD, EOS)
    with pytest.raises(TypeError, match="OffPolicyGRPOConfig"):
        otx.offpolicy_policy_loss(model, example, _config(grpo_learner.GRPOConfig), PAD, EOS)


# --------------------------------------------------------------------------- configs


def test_config_passes_tunix_validation_and_checks_its_own():
    with pytest.raises(ValueError, match="policy_loss_fn"):
        algorithm_config.AlgorithmConfig(policy_loss_fn=otx.POLICY_LOSS_NAME)
    config = otx.OffPolicyGRPOConfig(correction=opj.CorrectionConfig.preset("mis"))
    assert config.policy_loss_fn == otx.POLICY_LOSS_NAME
    assert config.offpolicy_loss_config.algorithm == "decoupled_ppo"
    with pytest.raises(ValueError, match="num_generations"):
        otx.OffPolicyGRPOConfig(num_generations=1)
    with pytest.raises(ValueError, match="kl_coef"):
        otx.OffPolicyGRPOConfig(beta=0.04, loss_config=opj.LossConfig())
    with pytest.raises(ValueError, match="not both"):
        otx.OffPolicyGRPOConfig(loss_config=opj.LossConfig(), correction=opj.VanillaTIS())
    with pytest.raises(ValueError, match="loss_agg_mode"):
        otx.OffPolicyGRPOConfig(loss_agg_mode="token-sum")
    with pytest.raises(ValueError, match="max_segments_per_row"):
        otx.OffPolicyGRPOConfig(max_segments_per_row=0)


def test_loss_config_from_tunix_maps_the_fields():
    tunix_config = grpo_learner.GRPOConfig(beta=0.04, epsilon=0.25, kl_loss_mode="low_var_kl")
    tunix_config.epsilon_c = 3.0
    config = otx.loss_config_from_tunix(tunix_config, opj.VanillaTIS())
    assert (config.clip_eps, config.clip_eps_high, config.dual_clip_c) == (0.25, 0.25, 3.0)
    assert (config.kl_coef, config.kl_estimator, config.policy_loss) == (0.04, "k3", "ppo_clip")
    assert (config.algorithm, config.aggregation) == ("decoupled_ppo", "sequence_mean")
    gspo = otx.loss_config_from_tunix(grpo_learner.GRPOConfig(loss_algo="gspo-token"))
    assert (gspo.algorithm, gspo.policy_loss, gspo.kl_estimator) == ("ppo", "gspo_token", "k1")


# --------------------------------------------------------------------------- the learner


class _ByteTokenizer:
    def encode(self, text, **kwargs):
        return [b % 61 + 3 for b in text.encode()]

    def decode(self, ids, **kwargs):
        return "".join(chr(97 + int(i) % 26) for i in ids)

    def bos_id(self):
        return 2

    def eos_id(self):
        return EOS

    def pad_id(self):
        return PAD


def _learner(model, *, return_logprobs=True, packing=None, **config):
    import optax
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.rollout import base_rollout

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
    cluster = rl_cluster_lib.RLCluster(
        actor=model,
        tokenizer=_ByteTokenizer(),
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh=dict.fromkeys(roles, mesh),
            rollout_engine="vanilla",
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.sgd(0.0),
                eval_every_n_steps=1000,
                max_steps=1,
                pbar_description=None,
                max_seq_token_per_tpu=packing,
                rollout_micro_batch_size=2,  # train() derives these; set for a direct call
                compute_logps_micro_batch_size=2,
            ),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=5,
                max_prompt_length=4,
                kv_cache_size=16,
                temperature=TEMPERATURE,
                top_p=1.0,
                top_k=None,
                return_logprobs=return_logprobs,
            ),
        ),
    )
    algo_config = otx.OffPolicyGRPOConfig(num_generations=2, **config)
    return otx.OffPolicyGRPOLearner(
        cluster, algo_config, lambda prompts, completions, **kw: [0.0] * len(prompts)
    )


def test_learner_carries_the_samplers_logps(model):
    """tunix's sampler -> OffPolicyGRPOLearner -> TrainExample: at every valid token the
    carried log-prob is the sampler's log-prob of *that* token (the same fp32 weights,
    so it matches the trainer's teacher-forced pass to rounding: any shift would not)."""
    learner = _learner(model, correction=opj.CorrectionConfig.preset("mis"), trainer_old_logps=True)
    prompts = np.array(["ab", "ab", "cde", "cde"])
    example = learner._generate_and_compute_advantage({"prompts": prompts})
    assert isinstance(example, otx.OffPolicyTrainExample)
    # Up to the first masked position of each row: a sampled pad id (this random model
    # draws them) is a hole in tunix's completion_mask, and the trainer's pass then
    # attends around it while the sampler attended to it, a genuine mismatch.
    mask = np.cumprod(np.asarray(example.completion_mask) > 0, axis=1).astype(bool)
    assert mask.sum() >= 8
    theta = np.asarray(_theta(model, example))
    carried = np.asarray(example.rollout_per_token_logps)
    np.testing.assert_allclose(carried[mask], theta[mask], atol=2e-4)
    np.testing.assert_allclose(
        np.asarray(example.old_per_token_logps)[mask], theta[mask], atol=2e-5
    )
    assert set(otx.metric_keys(learner.algo_config.offpolicy_loss_config)) <= set(
        learner.rl_cluster.actor_trainer.rl_metrics_to_log
    )


def test_learner_rejects_wiring_that_drops_the_logps(model):
    mis = opj.CorrectionConfig.preset("mis")
    with pytest.raises(ValueError, match="return_logprobs=True"):
        _learner(model, return_logprobs=False, correction=mis)
    with pytest.raises(ValueError, match="sequence packing"):
        _learner(model, packing=64, correction=mis)
    with pytest.raises(TypeError, match="OffPolicyGRPOConfig"):
        otx.OffPolicyGRPOLearner(None, grpo_learner.GRPOConfig(), [])


# --------------------------------------------------------------------------- the example


def test_example_runs_end_to_end():
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "tunix_grpo.py"), "--steps", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "mis_k3_kl" in result.stdout and "loss" in result.stdout


def test_metric_aggregators_pool_each_kind_by_its_rule():
    """tunix combines a step's micro-batch scalars per key: the maxima by max, the minima
    by min (a mean of maxima would understate the batch's), the means by mean."""
    lc = opj.LossConfig(
        algorithm="decoupled_ppo",
        correction=opj.CorrectionConfig(use_tis=True, rs_criteria=("token_k1:2.0",)),
    )
    agg = otx.metric_aggregators(lc)
    assert set(agg) == set(otx.metric_keys(lc))
    assert agg["opj/mis_rs_token_k1_max"] is np.max
    assert agg["opj/mis_is_ratio_min_before_bound"] is np.min
    assert agg["opj/mis_k3_kl"] is np.mean and agg["pg_clipfrac"] is np.mean
