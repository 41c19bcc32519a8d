"""The ``Examples:`` sections of the public functions run as doctests."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "offpolicy_jax.reduction.means",
    "offpolicy_jax.config.correction",
    "offpolicy_jax.correction.compute",
    "offpolicy_jax.correction.composed",
    "offpolicy_jax.losses.surrogate_values",
    "offpolicy_jax.losses.policy_loss",
    "offpolicy_jax.logprobs.sampling_support",
    "offpolicy_jax.losses.surrogates",
    "offpolicy_jax.vcpo",
    "offpolicy_jax.losses.oapl",
    "offpolicy_jax.integrations.optax",
]


@pytest.mark.heavy
@pytest.mark.parametrize("name", MODULES)
def test_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    assert result.attempted > 0, f"{name} has no examples"
