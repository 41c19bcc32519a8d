"""``python -m offpolicy_jax``: the ``offpolicy-jax`` command line."""

import sys

from offpolicy_jax.cli import main

sys.exit(main())
