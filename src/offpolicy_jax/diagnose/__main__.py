"""``python -m offpolicy_jax.diagnose ARGS``: ``offpolicy-jax diagnose ARGS``."""

import sys

from offpolicy_jax.cli import main

sys.exit(main(["diagnose", *sys.argv[1:]]))
