import os

# The sharding tests (test_sharding.py, test_hlo_communication.py) need 8 CPU
# devices, and JAX fixes the count when its CPU backend starts; this file is loaded
# before any test module, in the main process and in every xdist worker, so the
# setting lands first. Unsharded programs still run on device 0 only.
# `JAX_NUM_CPU_DEVICES=1 python -m pytest ...` runs the numeric tests on one device,
# where the CPU fusion takes its single-device paths; the multi-device modules below
# are then skipped (not failed).
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
MULTI_DEVICE_MODULES = frozenset(
    {"test_sharding.py", "test_sharding_losses.py", "test_hlo_communication.py"}
)

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Property tests trace and compile JAX programs: the first example of each test
# is slow, so deadlines would only measure compilation. Profiles, chosen with the
# HYPOTHESIS_PROFILE environment variable:
#   ci (the default; "default" is the same): few examples, derandomised, so that
#     every run (CI included) checks the same examples, fast;
#   explore: 200 new random examples per property;
#   thorough: the adversarial campaign's 5,000 random examples per property
#     (CAMPAIGN_EXAMPLES=N for N; 100 per JAX property of tests/test_campaign.py took
#     392 s of CPU, most of it compiling the bounded (config, dtype) pool once).
_CHECKS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]
settings.register_profile(
    "ci", deadline=None, max_examples=25, derandomize=True, suppress_health_check=_CHECKS
)
settings.register_profile("default", parent=settings.get_profile("ci"))
settings.register_profile(
    "explore", parent=settings.get_profile("ci"), derandomize=False, max_examples=200
)
settings.register_profile(
    "thorough",
    parent=settings.get_profile("ci"),
    derandomize=False,
    # CAMPAIGN_EXAMPLES=N runs a thorough subset (the rate, then, extrapolates).
    max_examples=int(os.environ.get("CAMPAIGN_EXAMPLES", "5000")),
    database=None,  # a thorough run reports its failures; it leaves no files behind
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def clear_jax_caches():
    """Drops compiled programs after a test that compiles many one-off programs.

    XLA:CPU keeps memory maps for every live executable; a process that compiles
    about a thousand of them can run out (see the conformance README).
    """
    yield
    jax.clear_caches()


# Test tiers. `pytest -m "not slow"` is the edit loop (a few minutes on 2 cores); CI runs
# everything. Whole modules that compile many multi-device or end-to-end programs are
# slow; of the shared reference packs, which compile one program per case, the fast tier
# keeps every CONFORMANCE_SAMPLE-th case (a spread over every kind of case), and the slow
# tier holds the rest: no case is dropped, only deferred to the full run.
SLOW_MODULES = frozenset(
    {
        "test_sharding.py",
        "test_sharding_rules.py",
        "test_sharding_losses.py",
        "test_hlo_communication.py",
        "test_multiprocess.py",
        "test_mesh_examples.py",
        "test_notebook.py",
    }
)
CONFORMANCE_SAMPLE = 8


def _mark_tiers(items) -> None:
    seen: dict[str, int] = {}
    for item in items:
        module = item.path.name
        if module in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        elif item.get_closest_marker("conformance") is not None:
            index = seen.get(module, 0)
            seen[module] = index + 1
            if index % CONFORMANCE_SAMPLE:
                item.add_marker(pytest.mark.slow)


def pytest_collection_modifyitems(config, items):
    _mark_tiers(items)
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
