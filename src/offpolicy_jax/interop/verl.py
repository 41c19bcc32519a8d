"""verl as an input format: its ``algorithm.rollout_correction`` block and presets.

:func:`correction_kwargs` turns verl's keys and values (verl-project/verl,
``verl/trainer/ppo/rollout_corr_helper.py`` and ``RolloutCorrectionConfig``) into the
keyword arguments of a native :class:`~offpolicy_jax.CorrectionConfig`:

==============================  ===============================================
verl                            native
==============================  ===============================================
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
``rollout_token_veto_threshold``  ``rs_veto_threshold`` (older verl releases)
``bypass_mode``, ``loss_type``  loss settings: read by ``LossConfig.from_verl``
==============================  ===============================================

Every invalid value raises ``ValueError`` naming the verl key, where verl raises too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from offpolicy_jax._messages import close_match, shown
from offpolicy_jax.correction import criteria

VERL_KEYS: tuple[str, ...] = (
    "rollout_is",
    "rollout_is_threshold",
    "rollout_is_batch_normalize",
    "rollout_rs",
    "rollout_rs_threshold",
    "bypass_mode",
    "loss_type",
    "rollout_token_veto_threshold",
)
LOSS_ONLY_KEYS = ("bypass_mode", "loss_type")
IS_LEVELS = ("token", "sequence")
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
        if key not in VERL_KEYS:
            close = [c for c in [close_match(str(key), VERL_KEYS)] if c]
            hint = f"; did you mean {shown(close[0])}?" if close else ""
            raise ValueError(
                f"unknown verl {_OWNER} key {shown(key)}{hint} (known keys: {', '.join(VERL_KEYS)})"
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
    shared by all options or one per (deduplicated) option, comma-separated.
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
        criteria.check_criterion_name(name, rs_key)
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"{rs_key} must name at least one option, got {shown(options)}")
    if threshold is None:
        raise ValueError(
            f"{thr_key} must be explicitly provided when rollout_rs is enabled "
            f"(rollout_rs={shown(options)})"
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


def correction_kwargs(block: Mapping[str, Any]) -> dict[str, Any]:
    """Native ``CorrectionConfig`` keyword arguments for a verl ``rollout_correction`` block.

    Missing keys take verl's ``RolloutCorrectionConfig`` defaults, except that a missing
    ``rollout_is`` means no IS weight. ``bypass_mode`` and ``loss_type`` are loss settings
    and are ignored here.
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
    if rs is not None:
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
