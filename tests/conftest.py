import os

# The sharding tests (test_sharding.py, test_hlo_communication.py) need 8 CPU
# devices, and JAX fixes the count when its CPU backend starts; this file is loaded
# before any test module, in the main process and in every xdist worker, so the
# setting lands first. Unsharded programs still run on device 0 only.
# `JAX_NUM_CPU_DEVICES=1 python -m pytest ...` runs the numeric tests on one device,
# where the CPU fusion takes its single-device paths; the multi-device modules below
# are then skipped (not failed).
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
MULTI_DEVICE_MODULES = frozenset({"test_sharding.py", "test_hlo_communication.py"})

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Property tests trace and compile JAX programs: the first example of each test
# is slow, so deadlines would only measure compilation.
# The default profile is derandomised so that every run (CI included) checks the
# same examples; HYPOTHESIS_PROFILE=explore searches new ones with more examples.
settings.register_profile(
    "default",
    deadline=None,
    max_examples=25,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "explore", parent=settings.get_profile("default"), derandomize=False, max_examples=200
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def clear_jax_caches():
    """Drops compiled programs after a test that compiles many one-off programs.

    XLA:CPU keeps memory maps for every live executable; a process that compiles
    about a thousand of them can run out (see the conformance README).
    """
    yield
    jax.clear_caches()


def pytest_collection_modifyitems(config, items):
    count = jax.device_count()
    if count >= 8:
        return
    skip = pytest.mark.skip(
        reason=f"needs 8 devices, this run has {count} (JAX_NUM_CPU_DEVICES="
        f"{os.environ.get('JAX_NUM_CPU_DEVICES')}); run without it for the 8-device tier"
    )
    for item in items:
        if item.path.name in MULTI_DEVICE_MODULES:
            item.add_marker(skip)
