import jax
import pytest
from hypothesis import HealthCheck, settings

# Property tests trace and compile JAX programs: the first example of each test
# is slow, so deadlines would only measure compilation.
settings.register_profile(
    "default",
    deadline=None,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("ci", parent=settings.get_profile("default"), max_examples=25, derandomize=True)
settings.load_profile("default")


@pytest.fixture
def clear_jax_caches():
    """Drops compiled programs after a test that compiles many one-off programs.

    XLA:CPU keeps memory maps for every live executable; a process that compiles
    about a thousand of them can run out (see the conformance README).
    """
    yield
    jax.clear_caches()
