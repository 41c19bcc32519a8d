import gc
import os
import re
import shutil

# Two device layouts, two runs (README's test commands):
#
# * One CPU device (the default here, unless JAX_NUM_CPU_DEVICES is set): every module
#   except the multi-device ones below, which are skipped with a pointer to the second run.
#   Compiling is most of the suite's time, and a one-device program compiles faster
#   than one that jit may split over eight devices.
# * `JAX_NUM_CPU_DEVICES=8 python -m pytest -m "multi_device or partition_safe"`: the
#   sharded, HLO-communication and mesh modules and the tests marked `multi_device`
#   (which need 8 devices), plus the fast tier of the PARTITION_SAFE_MODULES: unsharded
#   programs on a multi-device backend, where jit may still split them (what users of
#   multi-device hosts run).
#
# JAX fixes the device count when its CPU backend starts; this file is loaded before any
# test module, in the main process and in every xdist worker, so the setting lands first.
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "1")
# XLA's lowest backend optimisation level for every program the suite compiles, and for
# the processes it starts (they inherit the variable): the level governs LLVM's
# optimisation and machine-code generation for each fused kernel, about a third of a
# program's compile time, and compiling is most of the suite's time. The library traces
# the same programs and XLA runs the same HLO passes at every level; only the machine
# code differs: at XLA's default level LLVM fuses more multiply-adds into FMA
# instructions, so its numbers differ from these by float32 rounding, as TPU's and GPU's
# do (tests/test_compile_level.py bounds the difference). An XLA_FLAGS that names a level
# keeps it.
SUITE_XLA_FLAGS = "--xla_backend_optimization_level=0"
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SUITE_XLA_FLAGS}".strip()
MULTI_DEVICE_MODULES = frozenset(
    {
        "test_sharding.py",
        "test_sharding_losses.py",
        "test_sharding_rules.py",
        "test_sharding_areal_minpro.py",
        "test_hlo_communication.py",
        "test_mesh_examples.py",
    }
)
PARTITION_SAFE_MODULES = frozenset(
    {
        "test_seq_reduce.py",
        "test_primitives.py",
        "test_pipeline_defects.py",
        "test_correction.py",
        "test_losses.py",
        "test_packing.py",
        "test_conformance.py",
    }
)
EIGHT_DEVICE_RUN = (
    'JAX_NUM_CPU_DEVICES=8 python -m pytest -n 2 -m "multi_device or partition_safe" tests'
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
# The fast tier's cap (4. below): loaded by pytest_configure for a `-m "not slow"` run
# under the ci profile. Properties with their own count take
# `@settings(max_examples=strategies.examples(n))`, which this profile caps too.
settings.register_profile("fast", parent=settings.get_profile("ci"), max_examples=3)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# JAX's persistent compilation cache: a program compiled once is read back from disk
# the next time any run (or the other xdist worker, or a later module after the caches
# are dropped) compiles it, instead of being compiled again. Most of the suite's time is
# compiling, so a re-run of the fast tier, the edit loop, is much faster; a run on a
# clean clone starts cold and fills it. Every program is kept (compile time >= 0 s: the
# op-by-op programs of eager calls are most of them). JAX keys an entry by the program,
# the compile options, the devices and the jax/jaxlib versions, so a changed library or
# device count compiles anew. JAX_COMPILATION_CACHE_DIR overrides the folder (empty:
# no cache); a folder over COMPILATION_CACHE_MAX_BYTES is emptied when a run starts.
COMPILATION_CACHE = os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache")
COMPILATION_CACHE_MAX_BYTES = 2 << 30
_cache_dir = os.environ.get("JAX_COMPILATION_CACHE_DIR", COMPILATION_CACHE)
if _cache_dir:
    jax.config.update("jax_compilation_cache_dir", _cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _bound_compilation_cache() -> None:
    """Empties the cache folder when it has grown past its bound (the main process only,
    before any worker starts)."""
    if not _cache_dir or not os.path.isdir(_cache_dir):
        return
    with os.scandir(_cache_dir) as entries:
        size = sum(entry.stat().st_size for entry in entries if entry.is_file())
    if size > COMPILATION_CACHE_MAX_BYTES:
        shutil.rmtree(_cache_dir, ignore_errors=True)


@pytest.fixture
def clear_jax_caches():
    """Drops compiled programs after a test that compiles many one-off programs.

    XLA:CPU keeps memory maps for every live executable; a process that compiles
    about a thousand of them can run out (see the conformance README).
    """
    yield
    jax.clear_caches()


# Test tiers. `pytest -m "not slow"` is the edit loop (under 3 minutes with `-n 2` on 2
# idle cores); CI runs everything. No check is ever dropped: each rule below only defers
# cases to the full run, and keeps in the fast tier a representative of each behaviour.
#
# 1. SLOW_MODULES: whole modules that compile many multi-device or end-to-end programs
#    (sharding, HLO communication, multi-process, mesh examples, notebook). The fast tier
#    still runs one device's numerics; `@pytest.mark.slow` in a module marks single
#    end-to-end runs (demo presets, benchmark command, long hypothesis properties).
# 2. Reference packs (tests marked `conformance` and parametrized over `case`): each case
#    compiles its own program (~1.5 s of CPU each, ~1,500 cases; a run compiles 16
#    consecutive selected cases of one shape together, tests/grouped_cases.py). The fast
#    tier keeps the first case of each category (the case name's first word: grid, edge,
#    new, err, misyaml, metrics, loss; for the verl packs the word after `verl_<kind>__`:
#    is, rs, preset, bypass, decoupled, ...) of each test function, plus every
#    CONFORMANCE_STRIDE-th case for a spread over the pack's grid (a prime, so that the
#    sample does not lock onto one value of a grid factor the way a stride of 8 kept only
#    `veto-none_bn-0` cases). Every case runs in the full suite.
# 3. Products of parametrizations (a test function with at least COVER_MIN cases): the
#    fast tier keeps, in collection order, each case that brings a parameter value not yet
#    run by that function (so every surrogate, every aggregation, every algorithm, every
#    dtype ... still runs once); the combinations of values run in the full suite. A
#    one-parameter list keeps every case (each value is new), so only the cross products
#    of values shrink.
# 4. Hypothesis properties: a run selected with exactly `-m "not slow"` under the ci
#    profile draws at most 3 examples per property (the first ones of the same
#    derandomised sequence: the "fast" profile); any other run (CI's full suite,
#    `-m slow`, a single file, the
#    explore/thorough profiles) keeps each property's own count. Most of a property's cost
#    is compiling one program per drawn config, so this is where its time goes.
SLOW_MODULES = frozenset(
    {
        "test_sharding.py",
        "test_sharding_rules.py",
        "test_sharding_losses.py",
        "test_hlo_communication.py",
        "test_multiprocess.py",
        "test_mesh_examples.py",
        "test_notebook.py",
        # End-to-end runs of user-facing text (~23 s and ~8 s of CPU); the library calls
        # they make are each covered by the numeric modules and the doctests.
        "test_readme.py",
        "test_examples.py",
    }
)
# 5. `@pytest.mark.heavy` functions and cases: those whose fast-tier cases took over
#    ~2.5 s of CPU (measured with `--durations=0` on the 2-core VM: about 140 functions:
#    pooling, packed == padded, vmap == loop, jit == eager, finite-difference gradients,
#    the demo's engines, diagnose's end-to-end reports), and all but a spread of the
#    settings whose composed path is checked against its config (`test_composing.py`).
#    They run in the whole suite; each behaviour keeps a cheaper case in the fast tier.
CONFORMANCE_STRIDE = 97
COVER_MIN = 6


def _case_category(case_id: str) -> str:
    return re.sub(r"^verl_[a-z_]+?__", "", case_id).split("_")[0]


def _mark_tiers(items) -> None:
    slow = pytest.mark.slow
    conformance_seen: dict[tuple, int] = {}
    categories: set[tuple] = set()
    groups: dict[tuple, list] = {}
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(slow)
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is None:
            continue
        function = (item.path.name, item.originalname)
        if item.get_closest_marker("conformance") is not None and "case" in callspec.params:
            index = conformance_seen.get(function, 0)
            conformance_seen[function] = index + 1
            category = (function, _case_category(callspec.id))
            if category not in categories:
                categories.add(category)
            elif index % CONFORMANCE_STRIDE:
                item.add_marker(slow)
        else:
            groups.setdefault(function, []).append(item)
    for cases in groups.values():
        if len(cases) < COVER_MIN:
            continue
        covered: set[tuple[str, str]] = set()
        for item in cases:
            values = {(name, repr(value)) for name, value in item.callspec.params.items()}
            if values <= covered:
                item.add_marker(slow)
            covered |= values


def _markexpr(config) -> str:
    return " ".join(config.option.markexpr.split())


def _fast_run(config) -> bool:
    return _markexpr(config) == "not slow"


def _eight_device_run(config) -> bool:
    return _markexpr(config) == "multi_device or partition_safe"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"multi_device: needs 8 CPU devices; runs in `{EIGHT_DEVICE_RUN}`"
    )
    config.addinivalue_line(
        "markers",
        "partition_safe: unsharded numerics run again on 8 devices (programs jit may "
        "split); added by tests/conftest.py",
    )
    config.addinivalue_line(
        "markers",
        "heavy: over ~5 s of CPU in the fast tier; deferred to the whole suite (rule 5)",
    )
    if not hasattr(config, "workerinput"):  # the main process, not an xdist worker
        _bound_compilation_cache()
    # Before any test module is imported: their @settings decorators read the profile.
    # The 8-device run repeats fast-tier cases with its example cap.
    fast_profile = _fast_run(config) or _eight_device_run(config)
    if fast_profile and os.environ.get("HYPOTHESIS_PROFILE", "ci") in ("ci", "default"):
        settings.load_profile("fast")


# Python's full (generation-2) collections walk every live object: in a worker that is
# pytest's items, Hypothesis, and JAX's traces and caches, and tracing allocates enough to
# trigger one every few seconds (about 0.2 s each, 5% of a worker's time in
# `tests/test_conformance.py`, `test_policy_losses.py` and `test_packing.py`). Objects
# that outlive collection are frozen out of those walks, and a full collection waits for
# 100 collections of the younger generation instead of 10: under a third of the full
# collections' time, the same peak memory (docs/development.md).
GC_THRESHOLDS = (700, 10, 100)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


# Every compiled XLA:CPU program holds a few memory maps until it is freed, and JAX's
# caches keep every program a module-level `jax.jit` ever compiled. A worker of the whole
# suite compiles tens of thousands of programs: past the kernel's map limit
# (vm.max_map_count, 65,530 by default on Linux) the next compile's mmap fails and
# XLA:CPU dies with a segmentation fault (the worker "crashed", at whichever test was
# compiling then). Caches are dropped when a worker leaves a test module (programs are
# rarely shared between modules) and, within a long module, whenever the process holds
# more than MAP_BUDGET maps (counted every MAP_CHECK_EVERY tests: reading the map list
# costs milliseconds).
MAP_BUDGET = 16_384
MAP_CHECK_EVERY = 25
_tests_since_map_check = 0


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as maps:
            return maps.read().count(b"\n")
    except OSError:  # not Linux: no such limit to guard
        return 0


def _should_drop_caches(item, nextitem) -> bool:
    global _tests_since_map_check
    if nextitem is None or nextitem.path != item.path:
        return True
    _tests_since_map_check += 1
    if _tests_since_map_check < MAP_CHECK_EVERY:
        return False
    _tests_since_map_check = 0
    return _memory_maps() > MAP_BUDGET


def pytest_runtest_teardown(item, nextitem):
    if _should_drop_caches(item, nextitem):
        jax.clear_caches()


def _needs_eight_devices(item) -> bool:
    return (
        item.path.name in MULTI_DEVICE_MODULES
        or item.get_closest_marker("multi_device") is not None
    )


def pytest_collection_modifyitems(config, items):
    _mark_tiers(items)
    for item in items:
        if item.get_closest_marker("heavy") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
        if _needs_eight_devices(item):
            item.add_marker(pytest.mark.multi_device)
        elif item.path.name in PARTITION_SAFE_MODULES and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.partition_safe)
    count = jax.device_count()
    if count >= 8:
        return
    skip = pytest.mark.skip(
        reason=f"needs 8 devices, this run has {count} (JAX_NUM_CPU_DEVICES="
        f"{os.environ.get('JAX_NUM_CPU_DEVICES')}); the second test command runs it: "
        f"{EIGHT_DEVICE_RUN}"
    )
    for item in items:
        if _needs_eight_devices(item):
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown without it
def pytest_xdist_make_scheduler(config, log):
    """``-n N``: ``--dist load``, each chunk of grouped reference cases kept on one worker,
    which compiles the chunk's cases together (tests/grouped_cases.py)."""
    if config.getvalue("dist") != "load":
        return None
    from grouped_cases import ChunkScheduling

    return ChunkScheduling(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # A test that skips itself for want of devices but is not marked `multi_device` would
    # run in neither device layout: fail it, naming the marker that puts it in the second.
    outcome = yield
    report = outcome.get_result()
    if report.skipped and call.excinfo is not None and not _needs_eight_devices(item):
        reason = str(call.excinfo.value).lower()
        if "devices" in reason and "needs" in reason:
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid} skipped itself ({reason}) but is not marked "
                "@pytest.mark.multi_device, so no run of the suite would run it"
            )
