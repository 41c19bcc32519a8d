"""miles' (and slime's) command-line flags as an input format.

The reader behind :meth:`LossConfig.from_flags <offpolicy_jax.LossConfig.from_flags>`:
``--use-rollout-logprobs``, ``--use-tis``, ``--custom-config-path`` (the reference
``mis.yaml``) and ``--tis-clip`` / ``--tis-clip-low`` (the built-in truncated IS).
"""

from __future__ import annotations

import os
from typing import Any

from offpolicy_jax._src.checks import check_bool
from offpolicy_jax._src.config import _formats
from offpolicy_jax._src.config.correction import Correction, CorrectionConfig, VanillaTIS
from offpolicy_jax._src.config.loss import LossConfig
from offpolicy_jax._src.messages import shown

__all__ = ["loss_from_flags"]


@_formats.register("LossConfig.from_flags")
def loss_from_flags(
    cls: type[LossConfig],
    use_rollout_logprobs: bool = False,
    use_tis: bool = False,
    custom_config_path: str | os.PathLike[str] | None = None,
    *,
    tis_clip: float = 2.0,
    tis_clip_low: float = 0.0,
    **other_fields: Any,
) -> LossConfig:
    """``cls`` (a :class:`LossConfig`) from the flags; the table is in its docstring."""
    use_rollout_logprobs = check_bool("from_flags", "use_rollout_logprobs", use_rollout_logprobs)
    use_tis = check_bool("from_flags", "use_tis", use_tis)
    if "algorithm" in other_fields or "correction" in other_fields:
        raise ValueError(
            "from_flags derives 'algorithm' and 'correction' from the flags; "
            "pass them to LossConfig(...) directly instead"
        )
    algorithm = {
        (False, False): "ppo",
        (True, False): "bypass_ppo",
        (False, True): "decoupled_ppo",
        (True, True): "reinforce_is",
    }[(use_rollout_logprobs, use_tis)]
    correction: Correction = None
    if custom_config_path is not None:
        correction = CorrectionConfig.from_yaml(custom_config_path)
        if correction.use_tis != use_tis:
            raise ValueError(
                f"use_tis={use_tis} contradicts use_tis: {str(correction.use_tis).lower()} "
                f"in {shown(os.fspath(custom_config_path))}: "
                + (
                    "the flag enables importance sampling but the YAML only asks for metrics"
                    if use_tis
                    else "the YAML enables importance sampling but the flag is off"
                )
            )
        if not use_tis:
            other_fields.setdefault("get_mismatch_metrics", True)
    elif use_tis:
        correction = VanillaTIS(clip_low=tis_clip_low, clip=tis_clip)
    return cls(algorithm=algorithm, correction=correction, **other_fields)
