"""verl as an input format: its ``algorithm.rollout_correction`` block, actor and presets.

The readers behind :meth:`CorrectionConfig.from_verl
<offpolicy_jax.CorrectionConfig.from_verl>` and :meth:`LossConfig.from_verl
<offpolicy_jax.LossConfig.from_verl>`. They follow verl's ``RolloutCorrectionConfig``
(verl-project/verl ``verl/trainer/config/algorithm.py`` and
``verl/trainer/ppo/rollout_corr_helper.py``) of its main branch after v0.7.0, from
commit ``97eac90`` (2026-01-14) on, where ``rollout_rs`` names KL-estimator criteria
(:data:`VERL_VERSION`; the parity pack was computed at verl ``1dda039b9c``), and also
read the keys of its v0.6.1 and v0.7.0 releases (November 2025 to January 2026).
:func:`correction_kwargs` turns the keys into the keyword arguments of a native
:class:`~offpolicy_jax.CorrectionConfig`:

=============================== ===============================================
verl                            native
=============================== ===============================================
``rollout_is: null``            no IS weight: ``tis_mode="none"`` when a
                                ``rollout_rs`` is set, else ``use_tis=False``
                                (metrics only)
``rollout_is: token|sequence``  ``use_tis=True``, ``tis_level``
``rollout_is_threshold: U``     ``tis_mode="truncate"``, ``tis_upper_bound=U``
``rollout_is_threshold: "L_U"`` ``tis_mode="band"`` (weight 0 outside
                                ``[L, U]``, token kept in the denominator)
``rollout_is_batch_normalize``  ``tis_batch_normalize``
``rollout_rs: "a,b"``           ``rs_criteria=("a:<thr>", "b:<thr>")``
``rollout_rs_threshold``        one threshold for all criteria, or one each
``rollout_rs: binary_kl``       ``rs_criteria=("binary_kl:<φ>",)`` (KPop, verl
                                PR 6800; φ = 2.0 without a threshold)
``bypass_mode``, ``loss_type``  loss settings: read by ``LossConfig.from_verl``
=============================== ===============================================

The keys of verl v0.6.1 and v0.7.0, which later releases dropped:

====================================  =========================================
verl v0.6.1 / v0.7.0                  native
====================================  =========================================
``rollout_rs: token|sequence|``       ``use_rs=True``, ``rs_level`` (the ratio
``geometric``                         π_old / π_rollout at that level, kept
                                      inside ``[lower, upper]``)
``rollout_rs_threshold: U``           ``rs_upper_bound=U`` (with a level above)
``rollout_rs_threshold_lower: L``     ``rs_lower_bound=L`` (null: ``1 / U``)
``rollout_token_veto_threshold``      ``rs_veto_threshold``
``use_policy_gradient`` (v0.6.1)      ``loss_type``: true is ``"reinforce"``,
                                      false ``"ppo_clip"`` (its successor)
====================================  =========================================

Every invalid value raises ``ValueError`` naming the verl key, where verl raises too; an
unknown key's error names the verl release this reader follows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from offpolicy_jax._src.checks import check_bool, check_choice, check_number, reject_unknown_keys
from offpolicy_jax._src.config import _formats
from offpolicy_jax._src.config.correction import CorrectionConfig
from offpolicy_jax._src.config.loss import LossConfig
from offpolicy_jax._src.correction import criteria
from offpolicy_jax._src.losses import registry
from offpolicy_jax._src.messages import close_match, shown

__all__ = [
    "LEGACY_KEYS",
    "VERL_KEYS",
    "VERL_LEGACY_VERSIONS",
    "VERL_PRESETS",
    "VERL_VERSION",
    "correction_from_verl",
    "loss_from_verl",
]

VERL_VERSION = "verl main after v0.7.0 (RolloutCorrectionConfig of commit 97eac90, 2026-01-14, on)"
"""The verl release whose ``rollout_correction`` keys the readers follow."""
VERL_LEGACY_VERSIONS = "verl v0.6.1 and v0.7.0"
"""The earlier releases whose keys are read too (:data:`LEGACY_KEYS`)."""

VERL_KEYS: tuple[str, ...] = (
    "rollout_is",
    "rollout_is_threshold",
    "rollout_is_batch_normalize",
    "rollout_rs",
    "rollout_rs_threshold",
    "bypass_mode",
    "loss_type",
    "rollout_token_veto_threshold",
    "rollout_rs_threshold_lower",
    "use_policy_gradient",
)
LEGACY_KEYS: tuple[str, ...] = (
    "rollout_rs_threshold_lower",
    "rollout_token_veto_threshold",
    "use_policy_gradient",
)
"""Keys of :data:`VERL_LEGACY_VERSIONS` that later verl dropped, read all the same."""
IS_LEVELS = ("token", "sequence")
# verl v0.6.1 / v0.7.0's rollout_rs: one aggregation level of the ratio π_old / π_rollout.
LEGACY_RS_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
# Keys of verl v0.6.0's algorithm config, before the rollout_correction block existed.
_V060_KEYS = {
    "rollout_is_level": "rollout_is: <level>",
    "rollout_is_mode": "rollout_is_threshold ('U' truncates, 'L_U' is IcePop)",
    "rollout_is_threshold_lower": "rollout_is_threshold: 'L_U'",
    "rollout_is_veto_threshold": "rollout_token_veto_threshold",
}
_OWNER = "rollout_correction"

# verl's RolloutCorrectionConfig presets (verl/trainer/config/algorithm.py), with their
# default arguments: name -> the rollout_correction block they build.
_DEFAULTS = {
    "rollout_is": "sequence",
    "rollout_is_threshold": 2.0,
    "rollout_is_batch_normalize": False,
    "rollout_rs": None,
    "rollout_rs_threshold": None,
    "bypass_mode": False,
    "loss_type": "ppo_clip",
}


def _preset(**overrides: Any) -> dict[str, Any]:
    return {**_DEFAULTS, **overrides}


_GEO = "0.999_1.001"
VERL_PRESETS: dict[str, dict[str, Any]] = {
    "disabled": _preset(rollout_is=None),
    "decoupled_token_is": _preset(rollout_is="token"),
    "decoupled_seq_is": _preset(rollout_is="sequence"),
    "decoupled_token_icepop": _preset(rollout_is="token", rollout_is_threshold="0.5_5.0"),
    "decoupled_seq_is_rs": _preset(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"),
    # KPop (verl PR 6800, open): RolloutCorrectionConfig.decoupled_token_kpop(phi=2.0)
    "decoupled_token_kpop": _preset(
        rollout_is=None, rollout_rs="binary_kl", rollout_rs_threshold=2.0
    ),
    "decoupled_geo_rs": _preset(
        rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=_GEO
    ),
    "decoupled_geo_rs_seq_tis": _preset(rollout_rs="seq_mean_k1", rollout_rs_threshold=_GEO),
    "decoupled_geo_rs_token_tis": _preset(
        rollout_is="token", rollout_rs="seq_mean_k1", rollout_rs_threshold=_GEO
    ),
    "decoupled_k3_rs": _preset(
        rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01
    ),
    "decoupled_k3_rs_seq_tis": _preset(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "decoupled_k3_rs_token_tis": _preset(
        rollout_is="token", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01
    ),
    "bypass_ppo_clip": _preset(rollout_is=None, bypass_mode=True),
    "bypass_ppo_clip_geo_rs": _preset(
        rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=_GEO, bypass_mode=True
    ),
    "bypass_ppo_clip_k3_rs": _preset(
        rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01, bypass_mode=True
    ),
    "bypass_pg_is": _preset(bypass_mode=True, loss_type="reinforce"),
    "bypass_pg_token_icepop": _preset(
        rollout_is="token", rollout_is_threshold="0.5_5.0", bypass_mode=True, loss_type="reinforce"
    ),
    "bypass_pg_geo_rs": _preset(
        rollout_is=None,
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold=_GEO,
        bypass_mode=True,
        loss_type="reinforce",
    ),
    "bypass_pg_geo_rs_seq_tis": _preset(
        rollout_rs="seq_mean_k1", rollout_rs_threshold=_GEO, bypass_mode=True, loss_type="reinforce"
    ),
    "bypass_pg_geo_rs_token_tis": _preset(
        rollout_is="token",
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold=_GEO,
        bypass_mode=True,
        loss_type="reinforce",
    ),
}
"""verl's ``RolloutCorrectionConfig`` presets by name, as ``rollout_correction`` blocks."""


def _key(name: str) -> str:
    return f"{_OWNER}.{name}"


def _check_keys(block: Mapping[str, Any]) -> None:
    for key in block:
        if key in _V060_KEYS:
            raise ValueError(
                f"verl {_OWNER} key {shown(key)} is a key of verl v0.6.0's algorithm config, "
                f"which had no {_OWNER} block; this reader follows {VERL_VERSION} (and reads "
                f"the keys of {VERL_LEGACY_VERSIONS}): write {_V060_KEYS[key]} instead"
            )
        if key not in VERL_KEYS:
            close = [c for c in [close_match(str(key), VERL_KEYS)] if c]
            hint = f"; did you mean {shown(close[0])}?" if close else ""
            raise ValueError(
                f"unknown verl {_OWNER} key {shown(key)}{hint} (known keys: {', '.join(VERL_KEYS)}; "
                f"this reader follows {VERL_VERSION} and also reads the keys of "
                f"{VERL_LEGACY_VERSIONS})"
            )


def parse_is_threshold(threshold: Any) -> tuple[float | None, float]:
    """verl's ``rollout_is_threshold``: ``U`` (TIS) or ``"L_U"`` (IcePop) -> ``(L, U)``."""
    key = _key("rollout_is_threshold")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, str)):
        raise ValueError(
            f"{key} must be a number or a 'lower_upper' string, got {shown(threshold)}"
        )
    text = str(threshold).strip()
    if not text:
        raise ValueError(f"{key} must not be an empty string")
    lower: float | None = None
    if text.count("_") > 1:  # float() would read "2_0" in "0.5_2_0" as 20.0
        raise ValueError(
            f"{key}: malformed threshold {shown(threshold)}: 'upper' or 'lower_upper' (one "
            "'_', no digit separators)"
        )
    try:
        if "_" in text:
            lower_text, upper_text = text.split("_", 1)
            lower, upper = float(lower_text), float(upper_text)
        else:
            upper = float(text)
    except ValueError:
        raise ValueError(f"{key}: malformed threshold {shown(threshold)}") from None
    if not all(map(lambda x: x is None or abs(x) != float("inf") and x == x, (lower, upper))):
        raise ValueError(f"{key}: bounds must be finite, got {shown(threshold)}")
    if upper <= 0:
        raise ValueError(f"{key} upper bound must be positive, got {upper}")
    if lower is not None:
        if lower <= 0:
            raise ValueError(f"{key} lower bound must be positive, got {lower}")
        if lower > upper:
            raise ValueError(f"{key} lower bound must be <= upper bound, got {shown(threshold)}")
    return lower, upper


def parse_rs(options: Any, threshold: Any) -> tuple[str, ...]:
    """verl's ``rollout_rs`` / ``rollout_rs_threshold`` -> native ``rs_criteria`` specs.

    Options are comma-separated and deduplicated in order; the threshold is one entry
    shared by all options or one per (deduplicated) option, comma-separated. KPop's
    ``binary_kl`` takes one upper bound φ on ``max(D_B(o‖b), D_B(b‖o))``; a
    ``rollout_rs: binary_kl`` without a threshold uses φ = 2.0.
    """
    rs_key, thr_key = _key("rollout_rs"), _key("rollout_rs_threshold")
    if not isinstance(options, str):
        raise ValueError(
            f"{rs_key} must be a string (comma-separated options) or null, got {shown(options)}"
        )
    names: list[str] = []
    for part in options.split(","):
        name = part.strip()
        if not name:
            continue
        if name in LEGACY_RS_LEVELS:
            raise ValueError(
                f"{rs_key}: {shown(name)} is a level of {VERL_LEGACY_VERSIONS}'s rollout_rs, "
                f"which takes one level alone (rollout_rs: {name}); a list names the criteria "
                f"of {VERL_VERSION}, e.g. 'token_k1,seq_max_k2', got {shown(options)}"
            )
        criteria.check_criterion_name(name, rs_key)
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"{rs_key} must name at least one option, got {shown(options)}")
    if threshold is None:
        if all(name == criteria.BINARY_KL for name in names):
            threshold = criteria.BINARY_KL_DEFAULT_THRESHOLD  # KPop's φ (verl PR 6800)
        else:
            raise ValueError(
                f"{thr_key} must be explicitly provided when rollout_rs is enabled "
                f"(rollout_rs={shown(options)}; only 'binary_kl' alone defaults, to "
                f"{criteria.BINARY_KL_DEFAULT_THRESHOLD!r})"
            )
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, str)):
        raise ValueError(f"{thr_key} must be a number or a string, got {shown(threshold)}")
    if isinstance(threshold, str):
        specs = [part.strip() for part in threshold.split(",") if part.strip()]
    else:
        specs = [str(threshold)]
    if not specs:
        raise ValueError(f"{thr_key} must contain at least one threshold, got {shown(threshold)}")
    if len(specs) not in (1, len(names)):
        raise ValueError(
            f"{thr_key} expects either one threshold shared by all options or exactly "
            f"{len(names)} thresholds to match rollout_rs={shown(options)}, got {shown(threshold)}"
        )
    if len(specs) == 1:
        specs = specs * len(names)
    return tuple(
        criteria.parse_threshold(name, spec, thr_key).spec
        for name, spec in zip(names, specs, strict=True)
    )


def parse_legacy_rs(level: str, block: Mapping[str, Any]) -> dict[str, Any]:
    """verl v0.6.1 / v0.7.0's ``rollout_rs: <level>`` with ``rollout_rs_threshold`` (the
    upper ratio bound, required as verl requires it) and ``rollout_rs_threshold_lower``
    (null: ``1 / upper``) -> native ``use_rs`` keywords; verl keeps a token (sequence)
    iff ``lower <= ratio <= upper``, as ``use_rs`` does."""
    upper_key, lower_key = _key("rollout_rs_threshold"), _key("rollout_rs_threshold_lower")
    if block.get("rollout_rs_threshold") is None:
        raise ValueError(
            f"{upper_key} must be explicitly provided when rollout_rs is enabled "
            f"(rollout_rs={shown(level)})"
        )
    upper = check_number(
        _OWNER, "rollout_rs_threshold", block["rollout_rs_threshold"], optional=False
    )
    lower = check_number(
        _OWNER, "rollout_rs_threshold_lower", block.get("rollout_rs_threshold_lower"), optional=True
    )
    assert upper is not None  # optional=False never returns None
    if upper <= 0:
        raise ValueError(f"{upper_key} must be positive, got {shown(upper)}")
    if lower is not None and lower <= 0:
        raise ValueError(f"{lower_key} must be positive, got {shown(lower)}")
    resolved = 1.0 / upper if lower is None else lower
    if not resolved < upper:
        source = lower_key if lower is not None else f"1 / {upper_key}"
        raise ValueError(
            f"{lower_key}: the lower ratio bound must be < the upper, got {source} = "
            f"{shown(resolved)} >= {upper_key} = {shown(upper)} (every token would be rejected)"
        )
    return {"use_rs": True, "rs_level": level, "rs_lower_bound": resolved, "rs_upper_bound": upper}


def correction_kwargs(block: Mapping[str, Any]) -> dict[str, Any]:
    """Native ``CorrectionConfig`` keyword arguments for a verl ``rollout_correction`` block.

    Missing keys take verl's ``RolloutCorrectionConfig`` defaults, except that a missing
    ``rollout_is`` means no IS weight. ``bypass_mode``, ``loss_type`` and
    ``use_policy_gradient`` are loss settings and are ignored here. A ``rollout_rs``
    that is one level (``token``, ``sequence``, ``geometric``) is read as in
    :data:`VERL_LEGACY_VERSIONS`: rejection sampling on the ratio at that level.
    """
    if not isinstance(block, Mapping):
        raise ValueError(
            f"CorrectionConfig.from_verl expects verl's {_OWNER} mapping, got {type(block).__name__}"
        )
    _check_keys(block)
    level = block.get("rollout_is")
    if "rollout_is_threshold" in block and block["rollout_is_threshold"] is None:
        level = None  # verl computes IS weights only when both are set
    rs = block.get("rollout_rs")
    veto = block.get("rollout_token_veto_threshold")
    out: dict[str, Any] = {}
    if level is not None:
        if level not in IS_LEVELS:
            hint = ""
            if isinstance(level, str):
                close = [c for c in [close_match(level, IS_LEVELS)] if c]
                hint = f" (did you mean {shown(close[0])}?)" if close else ""
            raise ValueError(
                f"{_key('rollout_is')}: invalid value {shown(level)}{hint}; must be one of "
                f"{list(IS_LEVELS)} or null"
            )
        lower, upper = parse_is_threshold(block.get("rollout_is_threshold", 2.0))
        normalize = block.get("rollout_is_batch_normalize", False)
        if not isinstance(normalize, bool):
            raise ValueError(
                f"{_key('rollout_is_batch_normalize')} must be true or false, got {shown(normalize)}"
            )
        out.update(
            use_tis=True,
            tis_level=level,
            tis_mode="truncate" if lower is None else "band",
            tis_upper_bound=upper,
            tis_batch_normalize=normalize,
        )
        if lower is not None:
            out["tis_lower_bound"] = lower
    if isinstance(rs, str) and rs.strip() in LEGACY_RS_LEVELS:
        out.update(parse_legacy_rs(rs.strip(), block))
        if level is None:
            out.update(use_tis=True, tis_mode="none")
    elif rs is not None:
        if block.get("rollout_rs_threshold_lower") is not None:
            raise ValueError(
                f"{_key('rollout_rs_threshold_lower')} is a key of {VERL_LEGACY_VERSIONS}, "
                f"where rollout_rs was one level ('token', 'sequence', 'geometric'); the "
                f"criteria of rollout_rs={shown(rs)} ({VERL_VERSION}) take their lower bound "
                "in rollout_rs_threshold, as 'lower_upper' (e.g. '0.5_2.0')"
            )
        out["rs_criteria"] = parse_rs(rs, block.get("rollout_rs_threshold"))
        if level is None:
            out.update(use_tis=True, tis_mode="none")
    if veto is not None:
        out["rs_veto_threshold"] = veto
        if level is None and rs is None:
            out.update(use_tis=True, tis_mode="none")
    return out


def preset_block(name: str) -> dict[str, Any]:
    """The ``rollout_correction`` block of verl's preset ``name`` (a copy)."""
    if name not in VERL_PRESETS:
        close = [c for c in [close_match(str(name), tuple(VERL_PRESETS))] if c]
        hint = f" (did you mean {shown(close[0])}?)" if close else ""
        raise ValueError(f"unknown verl preset {shown(name)}{hint}; known: {sorted(VERL_PRESETS)}")
    return dict(VERL_PRESETS[name])


@_formats.register("CorrectionConfig.from_verl")
def correction_from_verl(
    cls: type[CorrectionConfig], rollout_correction: Mapping[str, Any]
) -> CorrectionConfig:
    """``cls`` (a :class:`CorrectionConfig`) from verl's ``rollout_correction`` block."""
    return cls(**correction_kwargs(rollout_correction))


def _loss_type(rc: Mapping[str, Any]) -> str:
    """``loss_type``, or its predecessor ``use_policy_gradient`` (verl v0.6.1: true is
    ``"reinforce"``, false ``"ppo_clip"``); both given must agree."""
    loss_type = rc.get("loss_type", "ppo_clip")
    check_choice("rollout_correction", "loss_type", loss_type, ("ppo_clip", "reinforce"))
    legacy = rc.get("use_policy_gradient")
    if legacy is None:
        return loss_type
    legacy_type = (
        "reinforce"
        if check_bool("rollout_correction", "use_policy_gradient", legacy)
        else "ppo_clip"
    )
    if "loss_type" in rc and loss_type != legacy_type:
        raise ValueError(
            f"rollout_correction.use_policy_gradient={shown(legacy)} (verl v0.6.1's key, "
            f"replaced by loss_type: true is 'reinforce', false 'ppo_clip') contradicts "
            f"rollout_correction.loss_type={shown(loss_type)}; give one of them"
        )
    return legacy_type


@_formats.register("LossConfig.from_verl")
def loss_from_verl(
    cls: type[LossConfig],
    rollout_correction: Mapping[str, Any] | None,
    actor: Mapping[str, Any] | None,
) -> LossConfig:
    """``cls`` (a :class:`LossConfig`) from verl's ``rollout_correction`` block and actor
    settings; the mapping is described in :meth:`LossConfig.from_verl
    <offpolicy_jax.LossConfig.from_verl>`."""
    rc = _verl_mapping("rollout_correction", rollout_correction)
    actor = _verl_mapping("actor", actor)
    reject_unknown_keys("verl actor", actor, _VERL_ACTOR_KEYS)
    policy = _verl_mapping("actor.policy_loss", actor.get("policy_loss"))
    reject_unknown_keys("verl actor.policy_loss", policy, _VERL_POLICY_LOSS_KEYS)

    bypass = check_bool("rollout_correction", "bypass_mode", rc.get("bypass_mode", False))
    loss_type = _loss_type(rc)
    loss_mode = actor.get("loss_mode", policy.get("loss_mode", "vanilla"))
    if "loss_mode" in actor and "loss_mode" in policy and policy["loss_mode"] != loss_mode:
        raise ValueError(
            f"actor.loss_mode {shown(loss_mode)} contradicts actor.policy_loss.loss_mode "
            f"{shown(policy['loss_mode'])}"
        )
    check_choice("actor", "loss_mode", loss_mode, tuple(_VERL_LOSS_MODES))
    agg_mode = actor.get("loss_agg_mode", "token-mean")
    check_choice("actor", "loss_agg_mode", agg_mode, tuple(_VERL_AGGREGATIONS))

    fields: dict[str, Any] = {}
    clip_ratio = check_number("actor", "clip_ratio", actor.get("clip_ratio", 0.2), optional=False)
    low = check_number("actor", "clip_ratio_low", actor.get("clip_ratio_low"), optional=True)
    high = check_number("actor", "clip_ratio_high", actor.get("clip_ratio_high"), optional=True)
    low = clip_ratio if low is None else low
    high = clip_ratio if high is None else high
    # verl's ActorConfig default; vanilla's dual clip and DPPO's ratio cap both read it.
    clip_c = check_number("actor", "clip_ratio_c", actor.get("clip_ratio_c", 3.0), optional=False)
    assert clip_c is not None  # optional=False never returns None

    if bypass:
        # verl's apply_bypass_mode swaps loss_mode for its own "bypass_mode" loss.
        surrogate = "gpg" if loss_type == "reinforce" else "ppo_clip"
        aggregation = _VERL_AGGREGATIONS[agg_mode]
    else:
        surrogate = _VERL_LOSS_MODES[loss_mode]
        aggregation = _VERL_FORCED_AGGREGATIONS.get(loss_mode, _VERL_AGGREGATIONS[agg_mode])
    # verl's value of each native hyperparameter (clip_ratio_c is both vanilla's dual
    # clip and DPPO's ratio cap): the surrogate takes those its registered params have.
    verl_values = {
        "clip_eps": low,
        "clip_eps_high": high,
        "dual_clip_c": clip_c,
        "dppo_ratio_cap": clip_c,
        "tau_pos": actor.get("tau_pos"),
        "tau_neg": actor.get("tau_neg"),
        "dro_beta": actor.get("dro_beta"),
        **_verl_cov_values(policy),
    }
    takes = registry.lookup(surrogate).param_names
    if "dual_clip_c" in takes and clip_c <= 1:
        raise ValueError(
            f"actor.clip_ratio_c must be > 1 (verl's dual-clip constant), got {shown(clip_c)}"
        )
    fields.update(policy_loss=surrogate, aggregation=aggregation)
    fields.update({key: v for key, v in verl_values.items() if key in takes})
    if aggregation == "sequence_sum_norm" and actor.get("loss_scale_factor") is not None:
        fields["loss_scale_factor"] = actor["loss_scale_factor"]

    if check_bool("actor", "use_kl_loss", actor.get("use_kl_loss", False)):
        kl_type = actor.get("kl_loss_type", "low_var_kl")
        check_choice("actor", "kl_loss_type", kl_type, tuple(_VERL_KL_TYPES))
        fields["kl_coef"] = actor.get("kl_loss_coef", 0.001)
        fields["kl_estimator"] = _VERL_KL_TYPES[kl_type]
    fields["entropy_coef"] = actor.get("entropy_coeff", 0.0)

    correction_keys = dict(rc)
    if bypass and loss_type == "ppo_clip":
        correction_keys["rollout_is"] = None  # verl computes, then ignores, the weights
    correction = CorrectionConfig(**correction_kwargs(correction_keys))
    reweights = correction.use_tis
    if not bypass:
        algorithm = "decoupled_ppo" if reweights else "ppo"
    elif loss_type == "reinforce" and reweights:
        algorithm, fields["policy_loss"] = "reinforce_is", "ppo_clip"
    else:
        algorithm = "bypass_ppo"
    return cls(algorithm=algorithm, correction=correction, **fields)


# --------------------------------------------------------------------------- verl's loss names

# --------------------------------------------------------------------------- verl names

_VERL_LOSS_MODES: dict[str, str] = {
    "vanilla": "ppo_clip",
    "gspo": "gspo_token",
    "cispo": "cispo",
    "geo_mean": "gmpo",
    "sapo": "sapo",
    "gpg": "gpg",
    "dppo_tv": "dppo_tv",
    "dppo_kl": "dppo_kl",
    "dro": "dro",
    "clip_cov": "clip_cov",
    "kl_cov": "kl_cov",
}
_VERL_AGGREGATIONS: dict[str, str] = {
    "token-mean": "token_mean",
    "seq-mean-token-sum": "sequence_sum",
    "seq-mean-token-mean": "sequence_mean",
    "seq-mean-token-sum-norm": "sequence_sum_norm",
    "token-sum": "token_sum",
}
# verl's gspo / sapo call agg_loss with "seq-mean-token-mean" and geo_mean takes
# torch.mean over the rows, ignoring loss_agg_mode.
_VERL_FORCED_AGGREGATIONS: dict[str, str] = {
    "gspo": "sequence_mean",
    "sapo": "sequence_mean",
    "geo_mean": "row_mean",
}
_VERL_KL_TYPES: dict[str, str] = {
    "kl": "k1",
    "k1": "k1",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "k3",
    "k3": "k3",
}
_VERL_LOSS_KEYS: tuple[str, ...] = (
    "loss_mode",
    "loss_agg_mode",
    "clip_ratio",
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "tau_pos",
    "tau_neg",
    "dro_beta",
    "loss_scale_factor",
    "entropy_coeff",
    "use_kl_loss",
    "kl_loss_coef",
    "kl_loss_type",
    "policy_loss",
)
# The rest of verl's (FSDP / Megatron / VeOmni) ActorConfig: accepted, no effect on the loss.
_VERL_ACTOR_OTHER_KEYS: tuple[str, ...] = (
    "_target_",
    "strategy",
    "ppo_mini_batch_size",
    "ppo_micro_batch_size",
    "ppo_micro_batch_size_per_gpu",
    "ppo_infer_micro_batch_size_per_gpu",
    "use_dynamic_bsz",
    "ppo_max_token_len_per_gpu",
    "ppo_infer_max_token_len_per_gpu",
    "freeze_vision_tower",
    "calculate_entropy",
    "use_prefix_grouper",
    "use_torch_compile",
    "ppo_epochs",
    "shuffle",
    "data_loader_seed",
    "checkpoint",
    "optim",
    "use_fused_kernels",
    "profiler",
    "engine",
    "rollout_n",
    "model_config",
    "router_replay",
    "global_batch_info",
    "grad_clip",
    "ulysses_sequence_parallel_size",
    "entropy_from_logits_with_chunking",
    "entropy_checkpointing",
    "fsdp_config",
    "use_remove_padding",
    "use_rollout_log_probs",
    "calculate_sum_pi_squared",
    "sum_pi_squared_checkpointing",
    "load_weight",
    "megatron",
    "profile",
    "veomni",
)
_VERL_ACTOR_KEYS = _VERL_LOSS_KEYS + _VERL_ACTOR_OTHER_KEYS
_VERL_POLICY_LOSS_KEYS: tuple[str, ...] = (
    "_target_",
    "loss_mode",
    "clip_cov_ratio",
    "clip_cov_lb",
    "clip_cov_ub",
    "kl_cov_ratio",
    "ppo_kl_coef",
    "rollout_correction",
)


def _verl_cov_values(policy: Mapping[str, Any]) -> dict[str, Any]:
    """Clip-Cov / KL-Cov's keys of verl's ``actor.policy_loss`` (absent: the defaults of
    verl's config, which are this library's; ``ppo_kl_coef: null`` is 1.0, the fallback
    of verl's ``compute_policy_loss_kl_cov``, the others' null their config defaults)."""
    keys = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")
    values = {key: policy.get(key) for key in keys}
    if "ppo_kl_coef" in policy and policy["ppo_kl_coef"] is None:
        values["ppo_kl_coef"] = 1.0
    return values


def _verl_mapping(name: str, value: Any) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"verl {name} must be a mapping, got {type(value).__name__}")
    return value
