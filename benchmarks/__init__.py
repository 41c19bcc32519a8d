"""Benchmarks of offpolicy-jax: ``python -m benchmarks.run`` (see docs/benchmarks.md).

Compile times here are cold compiles. A persistent XLA compilation cache (a user's
``JAX_COMPILATION_CACHE_DIR``) would hand programs back from disk and time the disk
instead, so it is off for every benchmark.
"""

import jax

jax.config.update("jax_enable_compilation_cache", False)
