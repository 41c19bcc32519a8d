"""Input formats of other systems: verl's configuration and packed rows.

``verl`` (verl's ``rollout_correction`` block and presets, read by ``from_verl``) and
``packing`` (:func:`~offpolicy_jax.pack_sequences`, host-side NumPy).
"""
