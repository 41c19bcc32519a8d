"""The implementation of offpolicy_jax: not a public API.

What is public is what ``offpolicy_jax`` and its modules export (``__all__``);
names here may change without notice.
"""
