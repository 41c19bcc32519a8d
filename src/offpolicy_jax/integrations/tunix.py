"""tunix integration: rollout correction inside tunix's GRPO and PPO learners.

`tunix <https://github.com/google/tunix>`_ (``google-tunix``) computes a policy loss as
``fn(model, train_example, algo_config, pad_id, eos_id)``, registered by name with
``tunix.rl.function_registry.register_policy_loss_fn``. Importing this module
registers :func:`offpolicy_policy_loss` under :data:`POLICY_LOSS_NAME`
(``"offpolicy_jax"``): it computes the policy's per-token log-probs θ, takes π_old
from ``train_example.old_per_token_logps`` (``None``, tunix's on-policy case, means
``sg(θ)``, as tunix's ``grpo`` loss reads it), π_rollout from the sampler's
log-probs, and returns ``opj.policy_loss`` with any :class:`~offpolicy_jax.LossConfig`
as tunix's ``(loss, aux)``, the metrics flat in ``aux`` under ``opj/<key>``.

What tunix 0.1.7 lacks, as small pieces:

* :class:`OffPolicyGRPOConfig`, a ``GRPOConfig`` that tunix's validation accepts with
  ``policy_loss_fn="offpolicy_jax"`` and that carries the correction (or a whole
  ``LossConfig``) and the options below; tunix's own fields (``epsilon``,
  ``epsilon_c``, ``loss_agg_mode``, ``beta``, ``kl_loss_mode``, ``loss_algo``) map
  to the ``LossConfig`` (:func:`loss_config_from_tunix`).
* :class:`OffPolicyTrainExample` and :func:`with_rollout_logps`: the rollout engine's
  per-token log-probs (``RolloutOutput.logprobs``, with
  ``RolloutConfig(return_logprobs=True)``) checked against the completion tokens and
  right-padded like ``completion_ids``, in a ``TrainExample`` field.
* :class:`OffPolicyGRPOLearner`: tunix's ``GRPOLearner`` that puts them there;
  :class:`OffPolicyPPOConfig`, :class:`OffPolicyPPOLearner` and
  :class:`OffPolicyPPOTrainExample` do the same for tunix's PPO.
* ``logps_from_hidden=True``: θ's log-probs from the last hidden states and the
  unembedding with :func:`~offpolicy_jax.token_logprobs_from_hidden`, so the
  ``[B, T, V]`` logits of tunix's log-prob pass are never built.
* :class:`StepMetricsHook`: a tunix training hook (``with_training_hooks``, tunix's
  public extension point) that hands each train step's logged ``opj/`` metrics to a
  callback, keyed by what the config produces (:func:`metric_keys`).

tunix 0.1.7 has no public hook for adding a field to its train examples: the learners
override one private method of tunix's (``_generate_and_compute_advantage``; see
:class:`OffPolicyGRPOLearner`), and nothing else of tunix's is patched.

See docs/guide/tunix.md.
"""

# tunix is an optional extra: where it is not installed its imports are unresolved.
# pyright: reportMissingImports=false

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from tunix.rl import common as tunix_common
from tunix.rl import function_registry
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.ppo import ppo_learner
from tunix.sft import hooks as tunix_hooks
from tunix.sft import metrics_logger as tunix_metrics_logger

import offpolicy_jax as opj

__all__ = [
    "METRIC_PREFIX",
    "POLICY_LOSS_NAME",
    "OffPolicyGRPOConfig",
    "OffPolicyGRPOLearner",
    "OffPolicyPPOConfig",
    "OffPolicyPPOLearner",
    "OffPolicyPPOTrainExample",
    "OffPolicyTrainExample",
    "StepMetricsHook",
    "hidden_states_and_unembedding",
    "loss_config_from_tunix",
    "metric_aggregators",
    "metric_keys",
    "offpolicy_policy_loss",
    "policy_token_logps",
    "with_rollout_logps",
]

POLICY_LOSS_NAME = "offpolicy_jax"
METRIC_PREFIX = "opj/"

# tunix's loss_agg_mode -> LossConfig.aggregation. tunix's
# "sequence-mean-token-sum-norm" divides the token sum by the non-empty rows (its
# default norm), which is sequence_sum; "sequence-mean-token-scale" divides each
# sequence sum by the padded length T, which is sequence_sum_norm's default.
TUNIX_AGGREGATIONS: dict[str, str] = {
    "token-mean": "token_mean",
    "sequence-mean-token-mean": "sequence_mean",
    "seq-mean-token-sum": "sequence_sum",
    "sequence-mean-token-sum-norm": "sequence_sum",
    "sequence-mean-token-scale": "sequence_sum_norm",
}
# tunix's kl_loss_mode -> LossConfig.kl_estimator (docs/semantics.md §5.2).
TUNIX_KL_ESTIMATORS: dict[str, str] = {"kl": "k1", "mse_kl": "k2", "low_var_kl": "k3"}
TUNIX_SURROGATES: dict[str, str] = {"grpo": "ppo_clip", "gspo-token": "gspo_token"}


# --------------------------------------------------------------------------- configs


def _lookup(table: Mapping[str, str], key: str, value: Any) -> str:
    if value not in table:
        raise ValueError(f"{key} must be one of {sorted(table)} here, got {value!r}")
    return table[value]


def _kl_settings(algo_config: Any) -> tuple[float, str]:
    """(kl_coef, kl_estimator) of the loss: GRPO's ``beta`` with its ``kl_loss_mode``;
    tunix's PPO loss reads a ``kl_coef`` attribute (k1) instead (its ``beta`` is a
    reward penalty, not a loss term)."""
    if isinstance(algo_config, ppo_learner.PPOConfig):
        return float(getattr(algo_config, "kl_coef", 0.0) or 0.0), "k1"
    beta = float(getattr(algo_config, "beta", 0.0) or 0.0)
    mode = getattr(algo_config, "kl_loss_mode", "kl")
    return beta, _lookup(TUNIX_KL_ESTIMATORS, "kl_loss_mode", mode) if beta else "k3"


def loss_config_from_tunix(algo_config: Any, correction: Any = None) -> opj.LossConfig:
    """The :class:`~offpolicy_jax.LossConfig` of a tunix algorithm config's own fields.

    ``epsilon`` → ``clip_eps`` (``epsilon_low`` if set), ``epsilon_high`` (if the config
    has it) → ``clip_eps_high``, ``epsilon_c`` → ``dual_clip_c``, ``loss_agg_mode`` →
    ``aggregation`` (:data:`TUNIX_AGGREGATIONS`; tunix's PPO loss, which has none, is
    ``token-mean``), ``loss_algo`` → ``policy_loss`` (``"grpo"`` → ``ppo_clip``,
    ``"gspo-token"`` → ``gspo_token``), ``entropy_coef`` → ``entropy_coef``, and the KL
    term: GRPO's ``beta`` → ``kl_coef`` with ``kl_loss_mode`` → ``kl_estimator``
    (``kl``/``mse_kl``/``low_var_kl`` → ``k1``/``k2``/``k3``); for PPO a ``kl_coef``
    attribute (k1), as tunix's ``ppo`` loss reads it. With ``correction=None``, or a
    ``CorrectionConfig`` with ``use_tis=False`` (the mismatch metrics only), the
    algorithm is ``"ppo"``: tunix's own ``grpo`` / ``ppo`` loss (to float32 rounding);
    with a correction that weights (a :class:`~offpolicy_jax.CorrectionConfig` with
    ``use_tis=True``, a :class:`~offpolicy_jax.VanillaTIS` or a callable) it is
    ``"decoupled_ppo"``: ``w(π_old/π_rollout) · ℓ(θ; π_old)``.

    Args:
      algo_config: a tunix ``GRPOConfig`` or ``PPOConfig`` (or any object with those
        attributes).
      correction: the correction, or None.

    Returns:
      A validated ``LossConfig``; a ``ValueError`` names a field tunix sets to a value
      with no counterpart.
    """
    epsilon = float(algo_config.epsilon)
    low = getattr(algo_config, "epsilon_low", None) or epsilon
    high = getattr(algo_config, "epsilon_high", None) or epsilon
    kl_coef, kl_estimator = _kl_settings(algo_config)
    metrics_only = isinstance(correction, opj.CorrectionConfig) and not correction.use_tis
    return opj.LossConfig(
        algorithm="ppo" if correction is None or metrics_only else "decoupled_ppo",
        clip_eps=low,
        clip_eps_high=high,
        dual_clip_c=getattr(algo_config, "epsilon_c", None),
        correction=correction,
        aggregation=_lookup(
            TUNIX_AGGREGATIONS,
            "loss_agg_mode",
            getattr(algo_config, "loss_agg_mode", "token-mean"),
        ),
        policy_loss=_lookup(
            TUNIX_SURROGATES, "loss_algo", getattr(algo_config, "loss_algo", "grpo")
        ),
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        entropy_coef=float(getattr(algo_config, "entropy_coef", 0.0) or 0.0),
    )


@dataclasses.dataclass(kw_only=True)
class _OffPolicyOptions:
    """The settings :class:`OffPolicyGRPOConfig` and :class:`OffPolicyPPOConfig` add
    (documented there)."""

    policy_loss_fn: str = POLICY_LOSS_NAME
    correction: Any = None
    loss_config: opj.LossConfig | None = None
    logps_from_hidden: bool = False
    hidden_chunk_size: int = 512
    vocab_chunk_size: int | None = None
    max_segments_per_row: int | None = None
    trainer_old_logps: bool = False

    def _validate_with(self, tunix_post_init: Callable[[Any], None]) -> None:
        """tunix's validation with the loss name it knows, then the fields added here."""
        requested = self.policy_loss_fn
        self.policy_loss_fn = self._replaces  # the name tunix's validation knows
        try:
            tunix_post_init(self)
        finally:
            self.policy_loss_fn = requested
        if self.loss_config is not None and not isinstance(self.loss_config, opj.LossConfig):
            raise TypeError(
                f"loss_config must be an offpolicy_jax.LossConfig, got {type(self.loss_config)}"
            )
        for key in ("hidden_chunk_size", "vocab_chunk_size", "max_segments_per_row"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        self.offpolicy_loss_config  # noqa: B018 (builds and validates it now)

    _replaces = "grpo"

    @property
    def offpolicy_loss_config(self) -> opj.LossConfig:
        """The ``LossConfig`` the loss applies (rebuilt from the fields on each read)."""
        if self.loss_config is None:
            return loss_config_from_tunix(self, self.correction)
        if self.correction is not None:
            raise ValueError("give either loss_config or correction, not both")
        kl_coef, _ = _kl_settings(self)
        if self.loss_config.kl_coef != kl_coef:
            raise ValueError(
                f"loss_config.kl_coef ({self.loss_config.kl_coef}) must equal tunix's KL "
                f"coefficient ({kl_coef}; GRPO: beta): tunix computes the reference "
                "log-probs only when it is not 0"
            )
        return self.loss_config


@dataclasses.dataclass(kw_only=True)
class OffPolicyGRPOConfig(_OffPolicyOptions, grpo_learner.GRPOConfig):
    """tunix's ``GRPOConfig`` with the offpolicy-jax loss and its settings.

    tunix validates ``policy_loss_fn`` against its built-in names; this config runs
    tunix's validation with the name its loss replaces (``"grpo"``) and then checks its
    own fields. Everything else (``num_generations``, ``num_iterations``, ``epsilon``,
    ``loss_agg_mode``, ...) means what it means in tunix.

    Attributes:
      policy_loss_fn: the registered loss, :data:`POLICY_LOSS_NAME`.
      beta: tunix's KL coefficient; it also decides whether tunix computes the
        reference log-probs, so an explicit ``loss_config`` must have
        ``kl_coef == beta``. Default 0 (tunix's default is 0.04).
      correction: the rollout correction (a :class:`~offpolicy_jax.CorrectionConfig`,
        e.g. ``CorrectionConfig.preset("mis")``, a :class:`~offpolicy_jax.VanillaTIS`,
        or None for plain GRPO). The loss is then :func:`loss_config_from_tunix` of
        this config.
      loss_config: a whole :class:`~offpolicy_jax.LossConfig` instead (any algorithm,
        surrogate, aggregation, e.g. ``LossConfig.from_verl(...)``); exclusive with
        ``correction``.
      logps_from_hidden: compute θ's log-probs from the last hidden states and the
        unembedding (:func:`policy_token_logps`), never building ``[B, T, V]`` logits.
      hidden_chunk_size: tokens per chunk of that computation.
      vocab_chunk_size: vocabulary columns per chunk (None: the whole vocabulary).
      max_segments_per_row: for packed ``TrainExample``\\ s (``segment_ids``): the
        static most sequences a row holds, ``num_segments`` of
        :func:`~offpolicy_jax.policy_loss`; a token of a higher id is padding (refused
        for concrete ids; under jit its share is the ``opj/segment_overflow_fraction``
        metric).
      trainer_old_logps: the learner recomputes π_old with the trainer's weights at
        sampling time (``rl_cluster.get_actor_per_token_logps``) instead of tunix's
        choice (GRPO: ``None`` → ``sg(θ)`` when ``num_iterations == 1``, else the
        rollout model's recomputation).
    """

    beta: float = 0.0

    def __post_init__(self):
        self._validate_with(grpo_learner.GRPOConfig.__post_init__)


@dataclasses.dataclass(kw_only=True)
class OffPolicyPPOConfig(_OffPolicyOptions, ppo_learner.PPOConfig):
    """tunix's ``PPOConfig`` with the offpolicy-jax loss; the fields of
    :class:`OffPolicyGRPOConfig` (``correction``, ``loss_config``,
    ``logps_from_hidden``, ...). tunix's PPO loss has no temperature and aggregates
    with ``token-mean``; :class:`OffPolicyPPOLearner` sets ``temperature`` from the
    rollout config, so that θ is scored as the sampler scored π_rollout."""

    _replaces = "ppo"

    def __post_init__(self):
        self._validate_with(ppo_learner.PPOConfig.__post_init__)


def _resolve(algo_config: Any) -> opj.LossConfig:
    loss_config = getattr(algo_config, "offpolicy_loss_config", None)
    if not isinstance(loss_config, opj.LossConfig):
        raise TypeError(
            f"policy_loss_fn={POLICY_LOSS_NAME!r} needs an OffPolicyGRPOConfig (or an algo "
            "config whose `offpolicy_loss_config` is an offpolicy_jax.LossConfig); got "
            f"{type(algo_config).__name__}"
        )
    return loss_config


def _needs_rollout_logps(loss_config: opj.LossConfig) -> bool:
    return (
        loss_config.algorithm != "ppo"
        or loss_config.correction is not None
        or loss_config.get_mismatch_metrics
    )


# --------------------------------------------------------------------------- examples


@struct.dataclass(frozen=True)
class OffPolicyTrainExample(grpo_learner.TrainExample):
    """tunix's GRPO ``TrainExample`` with the rollout engine's per-token log-probs.

    ``rollout_per_token_logps``: float32 ``[B, T]``, aligned with ``completion_ids``
    (position t is log π_rollout of ``completion_ids[:, t]``), 0 where
    ``completion_mask`` is 0. tunix's sequence packing
    (``max_seq_token_per_tpu``) does not carry this field: pack with it in place, or
    build packed examples yourself (``segment_ids``, ``segment_positions``).
    """

    rollout_per_token_logps: jax.Array | None = None


@struct.dataclass(frozen=True)
class OffPolicyPPOTrainExample(ppo_learner.TrainExample):
    """tunix's PPO ``TrainExample`` (``returns``, ``old_values``) with
    ``rollout_per_token_logps`` as in :class:`OffPolicyTrainExample`."""

    rollout_per_token_logps: jax.Array | None = None


def _carrier(example: Any) -> type:
    """The example class with a rollout field for ``example``'s class."""
    if isinstance(example, ppo_learner.TrainExample):
        return OffPolicyPPOTrainExample
    return OffPolicyTrainExample


def with_rollout_logps(
    example: Any, logprobs: Any, tokens: Any, *, pad_value: float = 0.0
) -> OffPolicyTrainExample:
    """Puts the sampler's log-probs into ``example``, aligned with its completions.

    The rollout engines return, per sequence, the completion tokens and one log-prob
    per token (``RolloutOutput.tokens`` / ``.logprobs``); tunix's GRPO learner
    right-pads the tokens to ``completion_ids`` ``[B, T]``. Each row is checked: its
    log-probs count equals its token count, the tokens are ``completion_ids[i, :n]``,
    and ``n <= T``; the log-probs are then right-padded with ``pad_value`` to
    ``[B, T]``. Non-finite log-probs are kept as they are: the loss rejects their
    sequence (``opj/mis_nonfinite_seq_fraction``, docs/semantics.md §0).

    Args:
      example: a tunix ``TrainExample`` (any subclass).
      logprobs: ``RolloutOutput.logprobs``: B sequences of floats, or None.
      tokens: ``RolloutOutput.tokens``: B integer sequences.
      pad_value: the value after each completion (masked; never read).

    Returns:
      An :class:`OffPolicyTrainExample` (:class:`OffPolicyPPOTrainExample` for a PPO
      example) with ``example``'s fields and ``rollout_per_token_logps``.

    Raises:
      ValueError: log-probs missing, or a count, length or token that does not match.
    """
    if logprobs is None:
        raise ValueError(
            "the rollout engine returned no log-probs: set RolloutConfig(return_logprobs=True)"
        )
    completion_ids = np.asarray(example.completion_ids)
    batch, length = completion_ids.shape
    if len(logprobs) != batch or len(tokens) != batch:
        raise ValueError(
            f"rollout log-probs / tokens for {len(logprobs)} / {len(tokens)} sequences, "
            f"but the example has {batch} rows"
        )
    padded = np.full((batch, length), pad_value, np.float32)
    for row, (row_logps, row_tokens) in enumerate(zip(logprobs, tokens, strict=True)):
        row_logps = np.asarray(row_logps, np.float32).reshape(-1)
        row_tokens = np.asarray(row_tokens).reshape(-1)
        if row_logps.shape != row_tokens.shape or row_tokens.size > length:
            raise ValueError(
                f"rollout log-probs misaligned in row {row}: {row_logps.size} log-probs for "
                f"{row_tokens.size} completion tokens (completion_ids has T = {length})"
            )
        if not np.array_equal(completion_ids[row, : row_tokens.size], row_tokens):
            raise ValueError(
                f"rollout log-probs misaligned in row {row}: the sampled tokens are not "
                "completion_ids[row, :n] (right-padded completions expected)"
            )
        padded[row, : row_tokens.size] = row_logps
    carrier = _carrier(example)
    fields = {f.name: getattr(example, f.name) for f in dataclasses.fields(example)}
    known = {f.name for f in dataclasses.fields(carrier)}
    extra = sorted(k for k, v in fields.items() if k not in known and v is not None)
    if extra:
        raise ValueError(f"{carrier.__name__} has no field for {extra} of {type(example)}")
    fields = {k: v for k, v in fields.items() if k in known}
    fields["rollout_per_token_logps"] = jnp.asarray(padded)
    return carrier(**fields)


# --------------------------------------------------------------------------- θ's log-probs


def _unembedding(model: Any) -> jax.Array:
    """The ``[D, V]`` output projection of tunix's Qwen2/Qwen3/Gemma3-style models."""
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcap", None) is not None:
        raise NotImplementedError(
            "logps_from_hidden: this model soft-caps its logits (final_logit_softcap), "
            "which token_logprobs_from_hidden does not apply; use logps_from_hidden=False"
        )
    tied = getattr(config, "use_tied_embedding", True)
    lm_head = getattr(model, "lm_head", None)
    if not tied and lm_head is not None:
        return lm_head.w[...]
    table = getattr(getattr(model, "embedder", None), "input_embedding", None)
    if table is None:
        raise TypeError(
            f"logps_from_hidden: cannot find the unembedding of {type(model).__name__} "
            "(expected embedder.input_embedding [V, D] or lm_head.w [D, V])"
        )
    return table[...].T


def hidden_states_and_unembedding(
    model: Any, input_tokens: jax.Array, **model_kwargs: Any
) -> tuple[jax.Array, jax.Array]:
    """The last hidden states ``[B, L, D]`` and the unembedding ``[D, V]`` of a model.

    For tunix's model families whose ``__call__`` takes ``output_hidden_states`` and
    sows the final-norm hidden states (Qwen2, Qwen3, Gemma3; Gemma 1/2 soft-cap their
    logits and are refused). The model's own logits are computed and discarded: under
    ``jit`` XLA removes that dead ``[B, L, V]`` matmul (the memory benchmark checks it).

    Args:
      model: a tunix ``nnx.Module`` language model (not modified: a merged copy runs).
      input_tokens: ``[B, L]`` token ids.
      **model_kwargs: the model's other arguments (positions, cache, attention_mask,
        segment_ids).

    Returns:
      ``(hidden, unembedding)``.
    """
    graphdef, state = nnx.split(model)
    copy = cast(Any, nnx.merge(graphdef, state))
    try:
        copy(input_tokens, output_hidden_states=True, **model_kwargs)
    except TypeError as error:
        raise TypeError(
            f"logps_from_hidden: {type(model).__name__} does not take output_hidden_states"
        ) from error
    sown = cast(Any, nnx.pop(copy, nnx.Intermediate))
    if "all_hidden_states" not in sown:
        raise TypeError(f"logps_from_hidden: {type(model).__name__} sows no all_hidden_states")
    hidden = sown["all_hidden_states"].get_value()[-1]
    return hidden, _unembedding(model)


def _model_inputs(model: Any, example: Any, pad_id: int, eos_id: int):
    """tunix's own model inputs (``tunix.rl.common.compute_per_token_logps``)."""
    segment_ids = getattr(example, "segment_ids", None)
    tokens, positions, attn_mask, input_seg_ids = tunix_common.process_ids(
        example.prompt_ids,
        example.completion_ids,
        pad_id,
        eos_id,
        segment_ids,
        getattr(example, "segment_positions", None),
    )
    kwargs: dict[str, Any] = {"positions": positions, "cache": None, "attention_mask": attn_mask}
    params = inspect.signature(model.__call__).parameters
    if "segment_ids" in params or any(p.kind == p.VAR_KEYWORD for p in params.values()):
        seg = segment_ids if segment_ids is not None else input_seg_ids
        if seg is not None:
            kwargs["segment_ids"] = seg
    return tokens, kwargs


def policy_token_logps(
    model: Any,
    example: Any,
    *,
    pad_id: int,
    eos_id: int,
    temperature: float = 1.0,
    from_hidden: bool = False,
    return_entropy: bool = False,
    chunk_size: int = 512,
    vocab_chunk_size: int | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """θ's per-token log-probs of ``example``'s completions, ``[B, T]`` float32.

    ``from_hidden=False`` is tunix's own pass
    (``tunix.rl.common.compute_per_token_logps``: the model's ``[B, T, V]`` logits,
    scaled by ``1/temperature``, a log-softmax). ``from_hidden=True`` gives the same
    values (float32 rounding) with
    :func:`~offpolicy_jax.token_logprobs_from_hidden` on the last hidden states and
    the unembedding (:func:`hidden_states_and_unembedding`), ``chunk_size`` tokens at
    a time, never building the logits. Unpacked, position t scores
    ``completion_ids[:, t]``; packed (``segment_ids``), position t scores the t-th
    token of the packed row and position 0 is 0, as in tunix.

    Returns:
      ``(logp, entropy)``; ``entropy`` (per token, of the tempered distribution) is
      None unless ``return_entropy``.
    """
    packed = getattr(example, "segment_ids", None) is not None
    if not from_hidden:
        graphdef, state = nnx.split(model)
        logp, logits = tunix_common.compute_per_token_logps(
            graphdef,
            state,
            prompt_tokens=example.prompt_ids,
            completion_tokens=example.completion_ids,
            pad_id=pad_id,
            eos_id=eos_id,
            stop_gradient=False,
            return_logits=True,
            segment_ids=getattr(example, "segment_ids", None),
            segment_positions=getattr(example, "segment_positions", None),
            temperature=temperature,
        )
        entropy = None
        if return_entropy:
            log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
            entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
        return logp.astype(jnp.float32), entropy
    tokens, kwargs = _model_inputs(model, example, pad_id, eos_id)
    hidden, unembedding = hidden_states_and_unembedding(model, tokens, **kwargs)
    keep = tokens.shape[1] - 1 if packed else example.completion_ids.shape[1]
    out = opj.token_logprobs_from_hidden(
        hidden[:, -keep - 1 : -1],
        unembedding,
        tokens[:, -keep:],
        temperature=1.0 if temperature in (0.0, 1.0) else temperature,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        return_entropy=return_entropy,
    )
    logp, entropy = cast(tuple[jax.Array, jax.Array], out) if return_entropy else (out, None)
    logp = cast(jax.Array, logp)
    if packed:  # tunix scores token t from position t - 1 and puts 0 first
        logp = jnp.pad(logp, ((0, 0), (1, 0)))
        entropy = None if entropy is None else jnp.pad(entropy, ((0, 0), (1, 0)))
    return logp, entropy


# --------------------------------------------------------------------------- the loss


def _per_token(name: str, value: Any, shape: tuple[int, ...]) -> jax.Array:
    dtype = jnp.result_type(value)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"train_example.{name} must be a float array, got dtype {dtype}")
    value = jnp.asarray(value)
    if value.shape != shape:
        raise ValueError(
            f"train_example.{name} has shape {value.shape} but completion_ids has {shape}: "
            "one value per completion token, aligned with completion_ids"
        )
    return value.astype(jnp.float32)


def _rollout_logps(example: Any, loss_config: opj.LossConfig, shape) -> jax.Array | None:
    value = getattr(example, "rollout_per_token_logps", None)
    if value is None:
        if _needs_rollout_logps(loss_config):
            raise ValueError(
                "this LossConfig needs the rollout engine's log-probs, but "
                f"train_example ({type(example).__name__}) has no rollout_per_token_logps: "
                "train with OffPolicyGRPOLearner and RolloutConfig(return_logprobs=True), or "
                "build the example with with_rollout_logps (tunix's sequence packing drops "
                "the field)"
            )
        return None
    return _per_token("rollout_per_token_logps", value, shape)


def _num_segments(example: Any, algo_config: Any) -> int | None:
    if getattr(example, "segment_ids", None) is None:
        return None
    num_segments = getattr(algo_config, "max_segments_per_row", None)
    if num_segments is None:
        raise ValueError(
            "packed TrainExample (segment_ids): set max_segments_per_row in the config, the "
            "static most sequences one packed row holds"
        )
    return num_segments


def _aux(metrics: Mapping[str, jax.Array], example: Any, num_segments: int | None):
    """tunix's aux dict: our metrics under ``opj/``, plus the keys tunix's learner logs."""
    aux = {METRIC_PREFIX + key: value for key, value in metrics.items()}
    aux["pg_clipfrac"] = metrics.get("pg_clipfrac", jnp.float32(0.0))
    aux["kl"] = metrics.get("kl_loss", jnp.float32(0.0))
    if num_segments is not None:
        ids = jnp.asarray(example.segment_ids)
        member = jnp.asarray(example.completion_mask) > 0
        overflow = member & ((ids < 1) | (ids > num_segments))
        count = jnp.maximum(jnp.sum(member), 1)
        aux[METRIC_PREFIX + "segment_overflow_fraction"] = jnp.sum(overflow) / count
    return aux


def offpolicy_policy_loss(
    model: Any, train_example: Any, algo_config: Any, pad_id: int, eos_id: int, **kwargs: Any
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """tunix policy loss: :func:`~offpolicy_jax.policy_loss` on tunix's ``TrainExample``.

    θ = the model's log-probs of the completions (:func:`policy_token_logps`, at
    ``algo_config.temperature``); π_old = ``train_example.old_per_token_logps``, or
    ``sg(θ)`` when it is None (tunix's on-policy case, as its ``grpo`` loss);
    π_rollout = ``train_example.rollout_per_token_logps``
    (:class:`OffPolicyTrainExample`); advantages, mask, reference log-probs and, for
    packed rows, ``segment_ids`` as tunix sets them. The ``LossConfig`` is
    ``algo_config.offpolicy_loss_config`` (:class:`OffPolicyGRPOConfig`,
    :class:`OffPolicyPPOConfig`).

    Args:
      model: the policy, an ``nnx.Module`` (differentiated).
      train_example: a tunix ``TrainExample``.
      algo_config: an :class:`OffPolicyGRPOConfig` or :class:`OffPolicyPPOConfig`.
      pad_id, eos_id: the tokenizer's ids.
      **kwargs: ignored (tunix's signature).

    Returns:
      ``(loss, aux)``: the float32 loss and a flat dict of float32 scalars, the
      library's metrics as ``opj/<key>`` plus ``pg_clipfrac`` and ``kl`` (the names
      tunix's GRPO learner logs; ``kl`` is ``opj/kl_loss``, or 0 without a KL term).

    Raises:
      TypeError: at trace time, a config without a ``LossConfig`` or log-probs that
        are not floats.
      ValueError: at trace time, other bad wiring: missing or misshapen rollout/old
        log-probs, ``segment_ids`` without ``max_segments_per_row``, or tunix's
        ``sampler_is_weights`` (a second, precomputed correction).
    """
    del kwargs
    loss_config = _resolve(algo_config)
    if getattr(train_example, "sampler_is_weights", None) is not None:
        raise ValueError(
            "train_example.sampler_is_weights is set: tunix's own token-TIS would correct a "
            "second time; leave it None and configure the correction in the LossConfig"
        )
    shape = tuple(train_example.completion_ids.shape)
    if getattr(train_example, "segment_ids", None) is not None:
        shape = (shape[0], train_example.prompt_ids.shape[1] + shape[1])
    num_segments = _num_segments(train_example, algo_config)
    logp, entropy = policy_token_logps(
        model,
        train_example,
        pad_id=pad_id,
        eos_id=eos_id,
        temperature=getattr(algo_config, "temperature", 1.0),
        from_hidden=getattr(algo_config, "logps_from_hidden", False),
        return_entropy=loss_config.entropy_coef != 0,
        chunk_size=getattr(algo_config, "hidden_chunk_size", 512),
        vocab_chunk_size=getattr(algo_config, "vocab_chunk_size", None),
    )
    old = train_example.old_per_token_logps
    old = (
        jax.lax.stop_gradient(logp)
        if old is None
        else _per_token("old_per_token_logps", old, shape)
    )
    ref = train_example.ref_per_token_logps
    loss, metrics = opj.policy_loss(
        logp,
        old,
        _rollout_logps(train_example, loss_config, shape),
        jnp.asarray(train_example.advantages, jnp.float32),
        train_example.completion_mask,
        loss_config,
        segment_ids=getattr(train_example, "segment_ids", None),
        num_segments=num_segments,
        ref_logp=None if ref is None else _per_token("ref_per_token_logps", ref, shape),
        entropy=entropy,
    )
    return loss, _aux(metrics, train_example, num_segments)


# Registered by a call, not as a decorator: the module keeps the function itself (what
# tunix's registry returns is tunix's business).
function_registry.register_policy_loss_fn(POLICY_LOSS_NAME)(offpolicy_policy_loss)


def _abstract_call(loss_config: opj.LossConfig, packed: bool, parts: bool) -> Any:
    """``jax.eval_shape`` of the loss on a tiny abstract batch: tunix's aux dict, or
    (``parts``) the metric parts of ``policy_loss_parts`` (their types say how they pool)."""
    shape = (2, 4)
    # Abstract inputs (eval_shape arguments): nothing is computed or checked on values.
    zeros = jax.ShapeDtypeStruct(shape, jnp.float32)
    ints = jax.ShapeDtypeStruct(shape, jnp.int32)
    mask = jax.ShapeDtypeStruct(shape, jnp.bool_)

    def run(zeros, ints, mask):
        example = cast(Any, grpo_learner.TrainExample)(
            prompt_ids=ints[:, :0],
            prompt_mask=mask[:, :0],
            completion_ids=ints,
            completion_mask=mask,
            advantages=zeros,
            ref_per_token_logps=zeros,
            old_per_token_logps=zeros,
            segment_ids=ints if packed else None,
        )
        loss_fn: Any = opj.policy_loss_parts if parts else opj.policy_loss
        loss, metrics = loss_fn(
            zeros,
            zeros,
            zeros if _needs_rollout_logps(loss_config) else None,
            zeros if packed else zeros[:, 0],
            mask,
            loss_config,
            segment_ids=example.segment_ids,
            num_segments=1 if packed else None,
            ref_logp=zeros if loss_config.kl_coef > 0 else None,
            entropy=zeros if loss_config.entropy_coef != 0 else None,
        )
        return metrics if parts else _aux(metrics, example, 1 if packed else None)

    return jax.eval_shape(run, zeros, ints, mask)


def metric_keys(loss_config: opj.LossConfig, *, packed: bool = False) -> tuple[str, ...]:
    """The ``aux`` keys :func:`offpolicy_policy_loss` returns for ``loss_config``.

    They depend only on the config, packing and which optional inputs the example has,
    never on data: these are the keys of an example with rollout log-probs only where
    the config needs them and reference log-probs only where ``kl_coef > 0`` (the
    :class:`OffPolicyGRPOLearner` logs them; an example with more inputs has more
    keys). Found with ``jax.eval_shape`` on a tiny batch.
    """
    return tuple(sorted(_abstract_call(loss_config, packed, parts=False)))


def metric_aggregators(
    loss_config: opj.LossConfig, *, packed: bool = False
) -> dict[str, Callable[..., Any]]:
    """How tunix combines each :func:`metric_keys` value over micro-batches and steps.

    tunix logs one finished scalar per micro-batch, which cannot pool exactly as
    :func:`offpolicy_jax.pool_metric_parts` pools the parts; what it can do is pool each
    kind by its rule: ``np.max`` for a batch maximum (``mis_staleness_max``, a rule's
    ``P_max``), ``np.min`` for a batch minimum, ``np.mean`` for every mean and share.
    """
    kinds = {
        METRIC_PREFIX + key: getattr(part, "kind", None)
        for key, part in _abstract_call(loss_config, packed, parts=True).items()
    }
    pick: dict[str | None, Callable[..., Any]] = {"max": np.max, "min": np.min}
    return {
        key: pick.get(kinds.get(key), np.mean) for key in metric_keys(loss_config, packed=packed)
    }


class StepMetricsHook(tunix_hooks.TrainingHooks):
    """Hands each train step's metrics to ``callback(step, metrics)``.

    A tunix ``TrainingHooks`` for the public ``PeftTrainer.with_training_hooks`` (of
    ``learner.rl_cluster.actor_trainer``; it replaces any hooks set before): after a
    train step's metrics are logged, ``metrics`` holds ``"loss"`` and the latest value
    of each of ``keys`` the trainer logged, e.g. ``metric_keys(loss_config)``. A key
    the config does not produce is left out, never a ``KeyError``: the same hook
    serves every correction. tunix writes a step's metrics when the next step ends
    (the last one when the trainer closes), so the callback runs one step behind.

    Args:
      keys: the metric names to report (``opj/<key>``, ``pg_clipfrac``, ``kl``, ...).
      callback: called as ``callback(step, {name: float})``.
    """

    def __init__(self, keys: Any, callback: Callable[[int, dict[str, float]], None]):
        self.keys = tuple(keys)
        self.callback = callback

    def on_train_step_end(self, train_ctx: Any, train_step: int, train_loss: Any) -> None:
        logger = train_ctx.metrics_logger
        prefix = train_ctx.metrics_prefix
        mode = tunix_metrics_logger.Mode.TRAIN
        values: dict[str, float] = {}
        if train_loss is not None:
            values["loss"] = float(np.asarray(train_loss))
        for key in self.keys:
            if logger.metric_exists(prefix, key, mode):
                values[key] = float(logger.get_metric_history(prefix, key, mode)[-1])
        self.callback(int(train_step), values)

    def on_train_start(self, train_ctx: Any) -> None:
        del train_ctx

    def on_train_end(self, train_ctx: Any) -> None:
        del train_ctx

    def on_train_step_start(self, train_ctx: Any) -> None:
        del train_ctx

    def on_eval_step_start(self, train_ctx: Any) -> None:
        del train_ctx

    def on_eval_step_end(self, train_ctx: Any, eval_loss: Any) -> None:
        del train_ctx, eval_loss


# --------------------------------------------------------------------------- the learner


def _capture_outputs(rl_cluster: Any, store: threading.local) -> None:
    """Wraps ``rl_cluster.generate`` to keep each thread's latest ``RolloutOutput``."""
    generate: Callable[..., Any] = rl_cluster.generate

    def generate_and_keep(*args: Any, **kwargs: Any) -> Any:
        output = generate(*args, **kwargs)
        store.output = output
        return output

    rl_cluster.generate = generate_and_keep


class _CarriesRolloutLogps:
    """What :class:`OffPolicyGRPOLearner` and :class:`OffPolicyPPOLearner` add to
    tunix's learners (a mixin before the tunix class)."""

    algo_config: Any
    rl_cluster: Any

    def _wire(self, rl_cluster: Any, algo_config: Any) -> None:
        """Checks, keeps the rollout outputs, and logs every ``opj/`` metric."""
        loss_config = algo_config.offpolicy_loss_config
        self._needs_rollout = _needs_rollout_logps(loss_config)
        if self._needs_rollout:
            for mode in (rl_cluster_lib.Mode.TRAIN, rl_cluster_lib.Mode.EVAL):
                if not rl_cluster.get_rollout_config(mode).return_logprobs:
                    raise ValueError(
                        f"the correction needs the sampler's log-probs: set "
                        f"RolloutConfig(return_logprobs=True) (mode {mode})"
                    )
            if rl_cluster.cluster_config.training_config.max_seq_token_per_tpu is not None:
                raise ValueError(
                    "tunix's sequence packing (max_seq_token_per_tpu) drops the rollout "
                    "log-probs; the correction cannot run with it"
                )
        self._rollouts = threading.local()
        _capture_outputs(rl_cluster, self._rollouts)
        rl_cluster.actor_trainer.with_rl_metrics_to_log(metric_aggregators(loss_config))

    # tunix 0.1.7 builds its TrainExample inside this private method and offers no
    # public hook to add a field: the one override of a private tunix method here (the
    # tests run the learner end to end against tunix, so a rename there fails loudly).
    def _generate_and_compute_advantage(
        self, training_input: Any, mode: Any = rl_cluster_lib.Mode.TRAIN
    ) -> Any:
        self._rollouts.output = None
        example = super()._generate_and_compute_advantage(training_input, mode)  # pyright: ignore[reportAttributeAccessIssue]
        if self.algo_config.trainer_old_logps:
            old = self.rl_cluster.get_actor_per_token_logps(
                prompt_tokens=example.prompt_ids,
                completion_tokens=example.completion_ids,
                pad_id=self.rl_cluster.rollout.pad_id(),
                eos_id=self.rl_cluster.rollout.eos_id(),
                temperature=self.rl_cluster.get_rollout_config(mode).temperature,
            )
            example = cast(Any, example).replace(old_per_token_logps=old)
        output = self._rollouts.output
        if output is None and self._needs_rollout:
            raise RuntimeError("no RolloutOutput was seen: rl_cluster.generate was not called")
        if output is None or (output.logprobs is None and not self._needs_rollout):
            return example
        return with_rollout_logps(example, output.logprobs, output.tokens)


class OffPolicyGRPOLearner(_CarriesRolloutLogps, grpo_learner.GRPOLearner):
    """tunix's ``GRPOLearner`` whose train examples carry the sampler's log-probs.

    Each batch's ``RolloutOutput`` (kept per thread by a thin wrapper around
    ``rl_cluster.generate``, set on this learner's cluster object) goes through
    :func:`with_rollout_logps`, called from an override of tunix's private
    ``_generate_and_compute_advantage`` (tunix 0.1.7 has no public hook to extend its
    train examples), into an
    :class:`OffPolicyTrainExample`; the registered loss then applies the correction of
    ``algo_config`` (an :class:`OffPolicyGRPOConfig`), and the learner logs every
    ``opj/`` metric. Checked when built: the rollout configs return log-probs when the
    loss needs them, and tunix's sequence packing (which would drop them) is off.
    """

    def __init__(
        self, rl_cluster: Any, algo_config: OffPolicyGRPOConfig, reward_fns: Any, **kwargs
    ):
        if not isinstance(algo_config, OffPolicyGRPOConfig):
            raise TypeError(f"algo_config must be an OffPolicyGRPOConfig, got {type(algo_config)}")
        super().__init__(rl_cluster, algo_config, reward_fns, **kwargs)  # pyright: ignore[reportCallIssue]
        self._wire(rl_cluster, algo_config)


class OffPolicyPPOLearner(_CarriesRolloutLogps, ppo_learner.PPOLearner):
    """tunix's ``PPOLearner`` (actor and critic) with the sampler's log-probs carried
    into its train examples (:class:`OffPolicyPPOTrainExample`), as
    :class:`OffPolicyGRPOLearner` does; ``algo_config`` is an
    :class:`OffPolicyPPOConfig`. It also sets ``algo_config.temperature`` from the
    rollout config (tunix's PPO loss scores θ at temperature 1)."""

    def __init__(self, rl_cluster: Any, ppo_config: OffPolicyPPOConfig, **kwargs):
        if not isinstance(ppo_config, OffPolicyPPOConfig):
            raise TypeError(f"ppo_config must be an OffPolicyPPOConfig, got {type(ppo_config)}")
        super().__init__(rl_cluster, ppo_config, **kwargs)  # pyright: ignore[reportCallIssue]
        cast(Any, ppo_config).temperature = rl_cluster.get_rollout_config(
            rl_cluster_lib.Mode.TRAIN
        ).temperature
        self._wire(rl_cluster, ppo_config)
