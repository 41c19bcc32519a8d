"""Input formats of other systems: configurations and packed rows.

This package sits above the configs (:mod:`offpolicy_jax._src.config`): it turns foreign
formats into configs and layouts, and registers the readers behind the configs'
classmethods (``from_verl``, ``from_areal``, ``from_yaml`` / ``to_yaml``, ``preset``,
``from_flags``), so the configs never import it.

``verl`` (verl's ``rollout_correction`` block, actor settings and presets), ``areal``
(AReaL's ``rejection_sampling`` block), ``flags`` (miles' command-line flags),
``yaml_io`` (YAML text and files), ``presets`` (the named recipes) and ``packing``
(:func:`~offpolicy_jax.pack_sequences`, host-side NumPy).
"""

from offpolicy_jax.interop import areal, flags, packing, presets, verl, yaml_io

__all__ = ["areal", "flags", "packing", "presets", "verl", "yaml_io"]
