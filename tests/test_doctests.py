"""The ``Examples:`` sections of the public functions run as doctests."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "offpolicy_jax._src.reduction.means",
    "offpolicy_jax._src.config.correction",
    "offpolicy_jax._src.correction.compute",
    "offpolicy_jax._src.correction.composed",
    "offpolicy_jax._src.losses.surrogate_values",
    "offpolicy_jax._src.losses.regularisers",
    "offpolicy_jax._src.losses.policy_loss",
    "offpolicy_jax._src.logprobs.sampling_support",
    "offpolicy_jax._src.losses.surrogates",
    "offpolicy_jax._src.vcpo",
    "offpolicy_jax._src.losses.oapl",
    "offpolicy_jax.integrations.optax",
]


@pytest.mark.heavy
@pytest.mark.parametrize("name", MODULES)
def test_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    assert result.attempted > 0, f"{name} has no examples"
