"""The loss config: :class:`LossConfig`, the settings of :func:`~offpolicy_jax.policy_loss`.

Validated when built, like the correction configs: a surrogate's name and
hyperparameters through the registry (:mod:`offpolicy_jax._src.losses.registry`), the
correction, aggregation and regularisers here. Its readers of other systems' formats
(verl, miles' flags, YAML) live in :mod:`offpolicy_jax.interop`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, overload

from offpolicy_jax._src.checks import (
    check_bool,
    check_choice,
    reject_unknown_keys,
)
from offpolicy_jax._src.config import _formats
from offpolicy_jax._src.config.correction import Correction, CorrectionConfig, VanillaTIS
from offpolicy_jax._src.losses import registry
from offpolicy_jax._src.losses.algorithms import ALGORITHMS as ALGORITHM_SPECS
from offpolicy_jax._src.losses.plan import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    METRIC_REDUCTIONS,
    PROX_LOGP_METHODS,
    check_aggregation,
    check_coefficient,
    check_opsm_delta,
    check_prox_logp_method,
)
from offpolicy_jax._src.messages import shown

__all__ = [
    "AGGREGATIONS",
    "ALGORITHMS",
    "KL_ESTIMATORS",
    "METRIC_REDUCTIONS",
    "PROX_LOGP_METHODS",
    "LossConfig",
]

ALGORITHMS: tuple[str, ...] = tuple(ALGORITHM_SPECS)

_T = TypeVar("_T")


class _Hyperparameter(Generic[_T]):
    """A surrogate hyperparameter of :class:`LossConfig`, read flat from its ``params``.

    A descriptor rather than a field: the value lives in ``params`` (the surrogate's
    own validated dataclass); this gives it a name and a type a checker can see.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> _Hyperparameter[_T]: ...
    @overload
    def __get__(self, obj: LossConfig, objtype: type | None = None) -> _T: ...
    def __get__(self, obj: LossConfig | None, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return obj._surrogate_attribute(self._name)


# The spec's order of LossConfig's arguments, which may be given positionally.
_LOSS_POSITIONAL: tuple[str, ...] = (
    "algorithm",
    "clip_eps",
    "clip_eps_high",
    "dual_clip_c",
    "correction",
    "aggregation",
    "rejected_in_denominator",
    "get_mismatch_metrics",
    "metric_reduction",
)


@dataclasses.dataclass(frozen=True, init=False)
class LossConfig:
    """Settings of :func:`~offpolicy_jax.policy_loss` (docs/semantics.md §5).

    Built from keywords, ``LossConfig(algorithm="decoupled_ppo", correction=cfg,
    policy_loss="gspo", clip_eps=3e-4)``: the fields below, plus the hyperparameters of
    the surrogate ``policy_loss`` names (its registered params, see
    :func:`~offpolicy_jax.register_surrogate` and the table in
    :mod:`offpolicy_jax._src.losses.builtins`), which it holds as ``params`` and reads flat
    (``cfg.clip_eps``). A hyperparameter left out or ``None`` takes the surrogate's
    default; one of another surrogate raises ``ValueError``. ``clip_eps`` is accepted
    whatever the surrogate (validated, and ignored by one without a clip range).

    Attributes:
      algorithm: ``"ppo"`` (old log-probs as the ratio denominator), ``"bypass_ppo"``
        (rollout log-probs as the denominator; ``old_logp`` may be None),
        ``"decoupled_ppo"`` (3-policy PPO: IS weights π_old/π_rollout multiply the
        clipped loss) or ``"reinforce_is"`` (``−sg(w)·A·log π_θ``, no clipping); see
        :mod:`offpolicy_jax._src.losses.algorithms`.
      correction: a :class:`CorrectionConfig`, a :class:`VanillaTIS`, a callable
        with the signature of ``compute_correction`` minus ``config``
        (``fn(old_logp, rollout_logp, mask, *, reduction, axis_names)``), or None.
      aggregation: how per-token losses become one number, over the final mask ``m'``
        (``m''`` = the denominator mask, see ``rejected_in_denominator``):
        ``"sequence_mean"`` (mean over non-empty sequences of ``Σ_t ℓ'/Σ_t m''``),
        ``"token_mean"`` (``Σ ℓ' / Σ m''``), ``"sequence_sum"`` (mean over non-empty
        sequences of ``Σ_t ℓ'``), ``"sequence_sum_norm"`` (``sequence_sum`` divided by
        ``loss_scale_factor``, by default the padded length ``T`` of the token axis),
        ``"token_sum"`` (``Σ ℓ'``, no normalisation) and ``"row_mean"`` (mean over every
        sequence slot of the batch, empty or rejected ones included, of
        ``Σ_t ℓ'/Σ_t m''``). verl's ``loss_agg_mode`` names map one to one:
        ``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-mean``,
        ``seq-mean-token-sum-norm``, ``token-sum``; ``row_mean`` is how verl averages
        GMPO (``torch.mean`` over the rows).
      rejected_in_denominator: keep rejected tokens in the loss denominator (the
        reference's behaviour); False = they leave it (D5).
      get_mismatch_metrics: add the §4 mismatch metrics without changing the loss.
      metric_reduction: ``"sequence"`` or ``"token"`` reduction of the metrics.
      policy_loss: the registered surrogate, orthogonal to ``algorithm`` (which decides
        the ratio denominator ``d`` and the IS weights): ``"ppo_clip"`` (default, the
        clipped PPO surrogate: ``clip_eps``, ``clip_eps_high``, ``dual_clip_c``),
        ``"gspo"``, ``"gspo_token"``, ``"cispo"``, ``"gmpo"``, ``"sapo"``, ``"gpg"``,
        ``"dppo_tv"``, ``"dppo_kl"`` (TRL's ``divergence_type`` ``"topk_tv"`` /
        ``"topk_kl"`` with ``divergence_topk`` take the trust region over the engine's
        top-k ids, passed as ``topk=``), ``"dro"``, prime-rl's ``"prime_dppo"``, ``"ipo"``
        and ``"kpop"``, INTELLECT-2's ``"two_sided_clip"``, TRL's ``"vespo"`` and ``"luspo"``
        or any registered name; formulas and papers in :mod:`offpolicy_jax._src.losses.policy_losses`.
        ``reinforce_is`` has its own term and takes only the default.
      params: the surrogate's hyperparameters (an instance of its registered params
        class); built from the flat keywords, or given whole.
      opsm_delta: DeepSeek-V3.2 off-policy sequence masking (docs/semantics.md §8): drop
        a sequence whose mean advantage is negative and whose mean
        ``log π_rollout − log π_θ`` over its tokens exceeds ``δ > 0``; None disables it.
      loss_scale_factor: the divisor of ``"sequence_sum_norm"`` (None = the padded
        length ``T``; a constant keeps the loss scale independent of padding).
      kl_coef: coefficient of the KL-to-reference term (needs ``ref_logp``); 0 = off.
      kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (low variance) per-token estimator
        of ``KL(π_θ ‖ π_ref)``.
      kl_off_policy: weight the estimator by ``π_θ/π_d`` (DeepSeek-V3.2's unbiased
        estimate for samples drawn from ``π_d``).
      entropy_coef: coefficient of the entropy bonus ``−c·H`` (needs ``entropy``); 0 = off.
      positive_example_nll_weight: VAPO's ``μ`` (NeMo-RL's key): adds ``μ·(−log π_θ)``
        on the tokens of sequences with ``reward > 0`` (needs ``rewards``), aggregated
        like the policy term; 0 = off.
      prox_logp_method: where decoupled PPO's proximal policy π_old comes from (AReaL's
        key, docs/guide/async.md): ``"recompute"`` (default: ``old_logp``, a forward
        pass), ``"loglinear"`` / ``"linear"`` (approximated from ``rollout_logp``,
        ``sg(logp)`` and the token ``versions``, so ``old_logp`` may be None) or
        ``"metrics"`` (``old_logp``, plus ``prox_*`` metrics of both approximations'
        errors). Anything but ``"recompute"`` needs ``algorithm="decoupled_ppo"`` and
        ``versions`` / ``current_version``.
    """

    algorithm: str = "ppo"
    correction: Correction = None
    aggregation: str = "sequence_mean"
    rejected_in_denominator: bool = False
    get_mismatch_metrics: bool = False
    metric_reduction: Literal["sequence", "token"] = "sequence"
    policy_loss: str = "ppo_clip"
    params: Any = None
    opsm_delta: float | None = None
    loss_scale_factor: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_off_policy: bool = False
    entropy_coef: float = 0.0
    prox_logp_method: str = "recompute"
    positive_example_nll_weight: float = 0.0

    def __init__(self, *args: Any, **settings: Any) -> None:
        if len(args) > len(_LOSS_POSITIONAL):
            raise TypeError(
                f"LossConfig takes at most {len(_LOSS_POSITIONAL)} positional arguments "
                f"({', '.join(_LOSS_POSITIONAL)}), got {len(args)}"
            )
        for key, value in zip(_LOSS_POSITIONAL, args, strict=False):
            if key in settings:
                raise TypeError(f"LossConfig got multiple values for argument {key!r}")
            settings[key] = value
        for field in dataclasses.fields(self):
            object.__setattr__(self, field.name, settings.pop(field.name, field.default))
        self._validate(settings)

    # The built-in surrogates' hyperparameters, read flat and typed for checkers (a
    # hyperparameter of another registered surrogate than ``policy_loss`` reads None).
    clip_eps = _Hyperparameter[float | None]()
    clip_eps_high = _Hyperparameter[float | None]()
    dual_clip_c = _Hyperparameter[float | None]()
    dppo_ratio_cap = _Hyperparameter[float | None]()
    divergence_type = _Hyperparameter[str | None]()
    divergence_topk = _Hyperparameter[int | None]()
    tau_pos = _Hyperparameter[float | None]()
    tau_neg = _Hyperparameter[float | None]()
    dro_beta = _Hyperparameter[float | None]()
    adv_tau = _Hyperparameter[float | None]()
    kl_tau = _Hyperparameter[float | None]()
    dppo_mask_low = _Hyperparameter[float | None]()
    dppo_mask_high = _Hyperparameter[float | None]()
    ipo_threshold = _Hyperparameter[float | None]()
    kpop_threshold = _Hyperparameter[float | None]()
    clamp_log_prob_coef = _Hyperparameter[float | None]()
    vespo_k_pos = _Hyperparameter[float | None]()
    vespo_lambda_pos = _Hyperparameter[float | None]()
    vespo_k_neg = _Hyperparameter[float | None]()
    vespo_lambda_neg = _Hyperparameter[float | None]()
    clip_cov_ratio = _Hyperparameter[float | None]()
    clip_cov_lb = _Hyperparameter[float | None]()
    clip_cov_ub = _Hyperparameter[float | None]()
    kl_cov_ratio = _Hyperparameter[float | None]()
    ppo_kl_coef = _Hyperparameter[float | None]()
    beta2 = _Hyperparameter[float | None]()
    # The clip range's resolved upper ε (``clip_eps_high`` or ``clip_eps``).
    upper_clip_eps = _Hyperparameter[float]()

    def _surrogate_attribute(self, name: str) -> Any:
        """``params.<name>``; None for a hyperparameter of another registered surrogate."""
        params = self.__dict__.get("params")
        if params is not None and not name.startswith("_") and hasattr(params, name):
            return getattr(params, name)
        if params is not None and name in registry.hyperparameter_owners():
            return None
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    if not TYPE_CHECKING:
        # A user-registered surrogate's hyperparameters read flat too (``cfg.scale``);
        # hidden from type checkers, which then flag a misspelt attribute. Typed code
        # reads them as ``cfg.params.scale``.
        def __getattr__(self, name: str) -> Any:
            return self._surrogate_attribute(name)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The keywords the constructor and :meth:`from_dict` accept: the fields
        (``params`` aside) and every registered surrogate's hyperparameters."""
        own = tuple(f.name for f in dataclasses.fields(cls) if f.name != "params")
        extra = sorted(set(registry.hyperparameter_owners()) | set(registry.UNIVERSAL_KEYS))
        return own + tuple(k for k in extra if k not in own)

    def _validate(self, hyperparameters: Mapping[str, Any]) -> None:
        owner = "LossConfig"
        set_ = lambda key, value: object.__setattr__(self, key, value)  # noqa: E731 (frozen)
        set_("algorithm", check_choice(owner, "algorithm", self.algorithm, ALGORITHMS))
        # The aggregation settings are the core's (the objectives validate them alike).
        aggregation = check_aggregation(
            owner,
            aggregation=self.aggregation,
            loss_scale_factor=self.loss_scale_factor,
            rejected_in_denominator=self.rejected_in_denominator,
            metric_reduction=self.metric_reduction,
        )
        for key, value in aggregation._asdict().items():
            set_(key, value)
        for key in ("get_mismatch_metrics", "kl_off_policy"):
            set_(key, check_bool(owner, key, getattr(self, key)))
        set_("opsm_delta", check_opsm_delta(owner, self.opsm_delta))
        set_("kl_estimator", check_choice(owner, "kl_estimator", self.kl_estimator, KL_ESTIMATORS))
        for key in ("kl_coef", "entropy_coef", "positive_example_nll_weight"):
            nonnegative = key != "entropy_coef"
            set_(key, check_coefficient(owner, key, getattr(self, key), nonnegative=nonnegative))
        self._check_surrogate(hyperparameters)
        self._check_correction()
        self._check_proximal()

    def _check_proximal(self) -> None:
        """``prox_logp_method``: AReaL's values; an approximation is decoupled PPO's."""
        method = check_prox_logp_method("LossConfig", self.prox_logp_method, self.algorithm)
        object.__setattr__(self, "prox_logp_method", method)

    @property
    def approximates_old(self) -> bool:
        """π_old is approximated (``old_logp`` is not needed)."""
        return self.prox_logp_method in ("loglinear", "linear")

    def _check_surrogate(self, hyperparameters: Mapping[str, Any]) -> None:
        """The surrogate's name (did-you-mean) and its hyperparameters, via the registry."""
        entry = registry.lookup(self.policy_loss)
        object.__setattr__(
            self, "params", registry.build_params(entry.name, hyperparameters, self.params)
        )
        if self.algorithm == "reinforce_is" and entry.name != "ppo_clip":
            raise ValueError(
                f"LossConfig.policy_loss: algorithm 'reinforce_is' has its own per-token term "
                f"−sg(w)·A·log π_θ, so policy_loss {shown(entry.name)} does not apply; use 'gpg' "
                "with 'bypass_ppo' or 'decoupled_ppo', or leave policy_loss at 'ppo_clip'"
            )

    def _check_correction(self) -> None:
        correction = self.correction
        if isinstance(correction, Mapping):
            raise ValueError(
                "LossConfig.correction must be a CorrectionConfig, VanillaTIS or callable, got a "
                "mapping; build it with CorrectionConfig.from_dict(...)"
            )
        if correction is not None and not (
            isinstance(correction, (CorrectionConfig, VanillaTIS)) or callable(correction)
        ):
            raise ValueError(
                "LossConfig.correction must be a CorrectionConfig, VanillaTIS, callable or None, "
                f"got {type(correction).__name__}"
            )
        algo = ALGORITHM_SPECS[self.algorithm]
        if algo.weighted and not self.reweights:
            what = "None" if correction is None else "a CorrectionConfig with use_tis: false"
            raise ValueError(
                f"LossConfig.correction: algorithm {shown(algo.name)} needs importance weights "
                f"(a CorrectionConfig with use_tis: true, a VanillaTIS or a callable), got {what}"
            )
        # bypass_ppo takes a rejection-only correction (tis_mode "none", weights 1): its
        # mask, decided on sg(π_θ)/π_rollout, is verl's bypass PPO-clip with rollout_rs.
        allowed = algo.rejection_only and self.rejects_only
        if not algo.weighted and self.reweights and not allowed:
            raise ValueError(
                f"LossConfig.correction: algorithm {shown(algo.name)} does not apply importance "
                f"weights, but the correction enables them; use "
                f"algorithm={shown(algo.weighted_variant)}, or a "
                "CorrectionConfig with use_tis: false for mismatch metrics only"
            )

    @property
    def reweights(self) -> bool:
        """Whether the correction produces importance weights (not metrics only)."""
        correction = self.correction
        if correction is None:
            return False
        if isinstance(correction, CorrectionConfig):
            return correction.use_tis
        return True  # VanillaTIS or a user callable

    @property
    def rejects_only(self) -> bool:
        """A CorrectionConfig that rejects tokens but leaves every weight at 1."""
        correction = self.correction
        return (
            isinstance(correction, CorrectionConfig)
            and correction.use_tis
            and getattr(correction, "tis_mode", None) == "none"
        )

    @property
    def wants_mismatch_metrics(self) -> bool:
        """§4 metrics: asked for, or part of a (possibly metrics-only) CorrectionConfig."""
        return self.get_mismatch_metrics or isinstance(self.correction, CorrectionConfig)

    @classmethod
    def from_flags(
        cls,
        use_rollout_logprobs: bool = False,
        use_tis: bool = False,
        custom_config_path: str | os.PathLike[str] | None = None,
        *,
        tis_clip: float = 2.0,
        tis_clip_low: float = 0.0,
        **other_fields: Any,
    ) -> LossConfig:
        """Maps the reference's command-line flags (miles' and slime's) to a :class:`LossConfig`;
        the reader is :mod:`offpolicy_jax.interop.flags`.

        ==========================  ===========  ==========================
        ``use_rollout_logprobs``    ``use_tis``  algorithm
        ==========================  ===========  ==========================
        False                       False        ``ppo``
        True                        False        ``bypass_ppo``
        False                       True         ``decoupled_ppo``
        True                        True         ``reinforce_is`` (D9)
        ==========================  ===========  ==========================

        With ``use_tis`` the correction is the YAML at ``custom_config_path`` (the
        reference ``mis.yaml``) or, without one, the built-in
        ``VanillaTIS(tis_clip_low, tis_clip)``. Without ``use_tis`` a YAML may only
        ask for metrics (``use_tis: false``), which turns on ``get_mismatch_metrics``.
        A YAML that contradicts the flags raises ``ValueError``.
        """
        return _formats.reader("LossConfig.from_flags")(
            cls,
            use_rollout_logprobs,
            use_tis,
            custom_config_path,
            tis_clip=tis_clip,
            tis_clip_low=tis_clip_low,
            **other_fields,
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LossConfig:
        """Builds a config from a mapping of field names, rejecting unknown keys with a
        did-you-mean hint (``correction`` may be a mapping of ``CorrectionConfig`` keys)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"LossConfig.from_dict expects a mapping, got {type(data).__name__}")
        reject_unknown_keys("LossConfig", data, cls.keys())
        fields = dict(data)
        if isinstance(fields.get("correction"), Mapping):
            fields["correction"] = CorrectionConfig.from_dict(fields["correction"])
        return cls(**fields)

    @classmethod
    def from_yaml(cls, source: str | os.PathLike[str]) -> LossConfig:
        """Builds a config from a YAML file path or YAML text (see :meth:`from_dict`)."""
        return cls.from_dict(_formats.reader("yaml.load_mapping")(source, "LossConfig"))

    def to_dict(self) -> dict[str, Any]:
        """The config as flat keys (the surrogate's hyperparameters beside the fields),
        the inverse of :meth:`from_dict`. A ``VanillaTIS`` or callable correction has no
        mapping form: ``ValueError``."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data.update(dataclasses.asdict(data.pop("params")))
        if isinstance(self.correction, CorrectionConfig):
            data["correction"] = self.correction.to_dict()
        elif self.correction is not None:
            raise ValueError(
                f"LossConfig.to_dict: correction {type(self.correction).__name__} has no "
                "mapping form; only a CorrectionConfig (or None) does"
            )
        return data

    def to_yaml(self) -> str:
        """The config as YAML text, the inverse of :meth:`from_yaml`."""
        return _formats.reader("yaml.dump")(self.to_dict())

    @classmethod
    def from_verl(
        cls, rollout_correction: Mapping[str, Any] | None, actor: Mapping[str, Any] | None
    ) -> LossConfig:
        """Maps verl's ``algorithm.rollout_correction`` block and actor settings to a config.

        verl is an input format here: the result reproduces verl's loss and gradient.

        * Mode (``rollout_correction``): ``bypass_mode: false`` (decoupled, the default) uses
          π_old as the ratio denominator and the correction's IS weights and rejection
          (``decoupled_ppo``; plain ``ppo`` when the correction neither reweights nor
          rejects). ``bypass_mode: true`` sets π_old := π_rollout and, like verl, replaces
          ``loss_mode`` by ``loss_type``: ``"ppo_clip"`` (default) → ``bypass_ppo`` with the
          rejection mask but *without* IS weights (verl ignores ``rollout_is`` there: the
          PPO ratio already is π_θ/π_rollout); ``"reinforce"`` → ``reinforce_is`` (IS weights
          from sg(π_θ)/π_rollout), or ``bypass_ppo`` with ``gpg`` when ``rollout_is`` is off.
          The ``rollout_is*`` / ``rollout_rs*`` keys go to :meth:`CorrectionConfig.from_verl`.
        * Surrogate (``actor.loss_mode``, also read from ``actor.policy_loss.loss_mode``):
          ``vanilla`` → ``ppo_clip`` with dual clip ``c = clip_ratio_c`` (verl always
          applies it; default 3.0), ``gspo`` → ``gspo_token`` (verl implements the token
          form), ``cispo``, ``geo_mean`` → ``gmpo``, ``sapo``, ``gpg``, ``dppo_tv``,
          ``dppo_kl`` (``clip_ratio_c`` → ``dppo_ratio_cap``), ``dro``, ``clip_cov``,
          ``kl_cov``. ``clip_ratio_low`` / ``clip_ratio_high`` (default ``clip_ratio``,
          0.2) → ``clip_eps`` / ``clip_eps_high``; ``tau_pos``, ``tau_neg``, ``dro_beta``
          as named; ``actor.policy_loss``'s ``clip_cov_ratio``, ``clip_cov_lb``,
          ``clip_cov_ub``, ``kl_cov_ratio`` and ``ppo_kl_coef`` (default 0.1 as verl's
          config; an explicit null is 1.0, the fallback of verl's function) as named.
          ``clip_cov`` draws its tokens with ``policy_loss(..., key=...)``.
        * Aggregation (``actor.loss_agg_mode``, default ``token-mean``): ``token-mean`` →
          ``token_mean``, ``seq-mean-token-sum`` → ``sequence_sum``, ``seq-mean-token-mean``
          → ``sequence_mean``, ``seq-mean-token-sum-norm`` → ``sequence_sum_norm``
          (``loss_scale_factor``, default the padded length ``T``), ``token-sum`` →
          ``token_sum``. verl's ``gspo`` and ``sapo`` always use ``seq-mean-token-mean``
          and ``geo_mean`` the plain mean over rows, whatever ``loss_agg_mode`` says; so do
          the configs built here. Rejected tokens leave the denominator (verl replaces the
          response mask), as in this library's default.
        * Regularisers: ``use_kl_loss`` with ``kl_loss_coef`` (default 0.001) and
          ``kl_loss_type`` (``kl``/``k1``, ``mse``/``k2``, ``low_var_kl``/``k3``; default
          ``low_var_kl``) → ``kl_coef``, ``kl_estimator``; ``entropy_coeff`` →
          ``entropy_coef``. Difference: verl aggregates these two with ``loss_agg_mode``
          even where it forces the policy term's aggregation (gspo, sapo, geo_mean); here
          they share the policy term's aggregation.

        The ``rollout_correction`` keys of verl v0.6.1 / v0.7.0 are read too
        (``use_policy_gradient: true`` is ``loss_type: reinforce``; see
        :meth:`CorrectionConfig.from_verl`). Other keys of verl's ``ActorConfig`` (batch sizes, optimiser, engine, ...) are
        accepted and ignored; a key verl does not have raises ``ValueError`` naming it,
        with a did-you-mean hint.

        Args:
          rollout_correction: verl's ``algorithm.rollout_correction`` mapping, or None.
          actor: verl's ``actor_rollout_ref.actor`` mapping (or its loss keys), or None.

        Returns:
          A validated :class:`LossConfig`.
        """
        return _formats.reader("LossConfig.from_verl")(cls, rollout_correction, actor)
