"""Named recipes: the reader behind :meth:`CorrectionConfig.preset
<offpolicy_jax.CorrectionConfig.preset>`.

A name is a configuration shipped with the package (``offpolicy_jax/configs/*.yaml``;
``"mis"`` is the reference ``mis.yaml``) or one of verl's ``RolloutCorrectionConfig``
presets (:data:`offpolicy_jax.interop.verl.VERL_PRESETS`, their correction part).
"""

from __future__ import annotations

from importlib import resources

from offpolicy_jax._src.config import _formats
from offpolicy_jax._src.config.correction import CorrectionConfig
from offpolicy_jax._src.messages import close_match, shown
from offpolicy_jax.interop import verl

__all__ = ["correction_preset", "shipped"]


def shipped() -> list[str]:
    """The names of the configurations shipped with the package, sorted."""
    return sorted(
        p.name[: -len(".yaml")]
        for p in resources.files("offpolicy_jax").joinpath("configs").iterdir()
        if p.name.endswith(".yaml")
    )


@_formats.register("CorrectionConfig.preset")
def correction_preset(cls: type[CorrectionConfig], name: str) -> CorrectionConfig:
    """``cls`` (a :class:`CorrectionConfig`) from a preset name; ``ValueError`` with a
    did-you-mean hint for an unknown one."""
    names = shipped()
    if name in names:
        # As YAML text: a packaged resource need not be a file on disk (e.g. a zip).
        shipped_file = resources.files("offpolicy_jax") / "configs" / f"{name}.yaml"
        return cls.from_yaml(shipped_file.read_text())
    if name in verl.VERL_PRESETS:
        return cls.from_verl(verl.preset_block(name))
    known = names + sorted(verl.VERL_PRESETS)
    close = [c for c in [close_match(str(name), known)] if c]
    hint = f" (did you mean {shown(close[0])}?)" if close else ""
    raise ValueError(f"preset must be one of {known}, got {shown(name)}{hint}")
