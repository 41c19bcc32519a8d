"""End-to-end demo: a small RL run that shows the training–inference mismatch and its
correction (``offpolicy-jax demo``). Uses Flax NNX, optax and matplotlib; the core library
never imports this package."""

from offpolicy_jax.demo.experiment import PRESETS, DemoConfig, History, run
from offpolicy_jax.demo.report import format_table, plot, summarize
from offpolicy_jax.demo.train import ALGORITHMS, Mismatch, TrainConfig

__all__ = [
    "ALGORITHMS",
    "DemoConfig",
    "History",
    "Mismatch",
    "PRESETS",
    "TrainConfig",
    "format_table",
    "plot",
    "run",
    "summarize",
]
