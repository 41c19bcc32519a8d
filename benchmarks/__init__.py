"""Benchmarks of offpolicy-jax: ``python -m benchmarks.run`` (see README.md, "Performance")."""
