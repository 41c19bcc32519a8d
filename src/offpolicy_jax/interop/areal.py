"""AReaL as an input format: its ``actor.rejection_sampling`` block.

The reader behind :meth:`CorrectionConfig.from_areal
<offpolicy_jax.CorrectionConfig.from_areal>` (inclusionAI/AReaL
``areal/api/cli_args.py``, ``RejectionSamplingConfig``, read at commit ``4aef98d8``):
the block becomes :class:`~offpolicy_jax.RejectionSamplingConfig`, AReaL's IS weight
and its mask or clamp, with ``use_tis: true`` and ``tis_mode: none``; ``None`` (AReaL's
"no filtering", no IS weight either) is a metrics-only config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from offpolicy_jax._src.config import _formats
from offpolicy_jax._src.config.correction import CorrectionConfig
from offpolicy_jax._src.config.rejection import RejectionSamplingConfig

__all__ = ["correction_from_areal"]


@_formats.register("CorrectionConfig.from_areal")
def correction_from_areal(
    cls: type[CorrectionConfig], rejection_sampling: Mapping[str, Any] | None
) -> CorrectionConfig:
    """``cls`` (a :class:`CorrectionConfig`) from AReaL's ``actor.rejection_sampling``."""
    if rejection_sampling is None:
        return cls()
    block = RejectionSamplingConfig.from_dict(rejection_sampling)
    return cls(use_tis=True, tis_mode="none", rejection_sampling=block)
