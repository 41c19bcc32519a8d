"""Benchmarks of offpolicy-jax: ``python -m benchmarks.run`` (see docs/benchmarks.md)."""
