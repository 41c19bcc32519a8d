"""The config layer: its import structure, its build-time checks, and the verl releases
its reader follows.

* The configs sit below ``interop`` and above the core: no module of the package is in
  an import cycle (``importlib`` calls with a literal name count as imports), no module
  of ``offpolicy_jax.config`` imports ``offpolicy_jax.interop``, and each module of the
  two packages imports on its own in a fresh interpreter.
* ``use_rs`` (or the veto) without ``use_tis`` is metrics only, as in miles, and says
  so; an explicit ``tis_lower_bound >= tis_upper_bound`` raises in every mode.
* verl's keys of its v0.6.1 / v0.7.0 releases are read with their meaning, and the
  errors name the release the reader follows.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import pytest

import offpolicy_jax as opj

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "offpolicy_jax"
CORE = PACKAGE / "_src"


# --------------------------------------------------------------------------- imports


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(name: str, known: dict[str, pathlib.Path]) -> str | None:
    """The package module ``name`` loads (its longest known prefix)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """Every package module ``path`` imports, wherever the import sits (function-level
    imports and ``importlib.import_module("literal")`` calls included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from a import b``: the module a.b if there is one, else the module a.
            names = [
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in known
                else node.module
                for alias in node.names
            ]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        for name in names:
            if name.startswith("offpolicy_jax"):
                target = _resolve(name, known)
                if target is not None:
                    found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(path, known) - {name} for name, path in known.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_cycle():
    graph = _graph()
    assert "offpolicy_jax._src.config.loss" in graph and "offpolicy_jax.interop.verl" in graph
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_config_never_imports_interop():
    graph = _graph()
    config = [
        m
        for m in graph
        if m == "offpolicy_jax._src.config" or m.startswith("offpolicy_jax._src.config.")
    ]
    assert len(config) >= 4
    up = {m: sorted(t for t in graph[m] if t.startswith("offpolicy_jax.interop")) for m in config}
    assert all(not targets for targets in up.values()), up


def test_the_core_imports_only_the_core():
    """Behind the wall, modules import one another, never the public facades above them
    (``offpolicy_jax.config`` re-exports ``offpolicy_jax._src.config``), interop or a
    client: the core is usable, and importable, on its own."""
    graph = _graph()
    core = [m for m in graph if m.startswith("offpolicy_jax._src")]
    assert len(core) > 30
    up = {m: sorted(t for t in graph[m] if not t.startswith("offpolicy_jax._src")) for m in core}
    assert all(not targets for targets in up.values()), {m: t for m, t in up.items() if t}


def test_interop_imports_config():
    graph = _graph()
    assert "offpolicy_jax._src.config.correction" in graph["offpolicy_jax.interop.verl"]


def test_no_import_machinery_in_config_interop_or_the_registry():
    for path in [*(CORE / "config").glob("*.py"), *(PACKAGE / "interop").glob("*.py")]:
        text = path.read_text()
        assert "import_module" not in text and "__import__" not in text, path
    assert "importlib" not in (CORE / "losses" / "registry.py").read_text()


def test_the_registry_names_loss_configs_fields():
    from offpolicy_jax._src.losses import registry

    assert set(registry._RESERVED) == {f.name for f in dataclasses.fields(opj.LossConfig)}


# Imports one module with the top-level package's __init__ skipped, so that it is the
# first module of the package loaded: an import cycle through it fails, and what it
# drags in is visible.
_ALONE = """
import importlib, importlib.util, sys, types
spec = importlib.util.find_spec("offpolicy_jax")
package = types.ModuleType("offpolicy_jax")
package.__path__ = list(spec.submodule_search_locations)
sys.modules["offpolicy_jax"] = package
importlib.import_module({name!r})
print(sorted(m for m in sys.modules if m.startswith("offpolicy_jax.interop")))
"""


def _layer_modules() -> list[str]:
    return sorted(
        m for m in _modules() if m.startswith(("offpolicy_jax.config", "offpolicy_jax.interop"))
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", _layer_modules())
def test_each_layer_module_imports_alone(name):
    run = subprocess.run(
        [sys.executable, "-c", _ALONE.format(name=name)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    loaded = run.stdout.strip().splitlines()[-1]
    if name.startswith("offpolicy_jax.config"):
        assert loaded == "[]", f"{name} imports {loaded}"


# --------------------------------------------------------------------------- use_rs, bounds


def _batch(seed: int = 0, shape=(6, 9)):
    rng = np.random.default_rng(seed)
    rollout = rng.uniform(-3.0, -0.1, shape)
    old = rollout + rng.normal(0.0, 0.6, shape)
    mask = np.ones(shape, dtype=bool)
    mask[:, -2:] = False
    mask[0, 3:] = False
    return old.astype(np.float32), rollout.astype(np.float32), mask


def test_use_rs_without_use_tis_warns_and_is_metrics_only():
    with pytest.warns(UserWarning, match=r"use_rs rejects nothing because use_tis is false"):
        cfg = opj.CorrectionConfig(use_rs=True, rs_lower_bound=0.9, rs_upper_bound=1.1)
    old, rollout, mask = _batch()
    # Ratios well outside [0.9, 1.1] exist: use_tis would reject them.
    assert np.any(np.abs(old - rollout)[mask] > 0.2)
    res = opj.compute_correction(old, rollout, mask, cfg)
    np.testing.assert_array_equal(np.asarray(res.mask), mask.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(res.weights), mask.astype(np.float32))


def test_veto_without_use_tis_warns():
    with pytest.warns(UserWarning, match=r"use_rs and rs_veto_threshold reject nothing"):
        opj.CorrectionConfig.from_dict({"use_rs": True, "rs_veto_threshold": 1e-4})
    with pytest.warns(UserWarning, match=r"rs_veto_threshold rejects nothing"):
        opj.CorrectionConfig(rs_veto_threshold=1e-4)


def test_rejection_with_use_tis_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opj.CorrectionConfig.preset("mis")
        opj.CorrectionConfig(use_tis=True, tis_mode="none", use_rs=True)
        opj.CorrectionConfig()


@pytest.mark.parametrize("mode", ["truncate", "none"])
@pytest.mark.parametrize("lower", [3.0, 2.0])
def test_truncate_lower_at_or_above_upper_raises(mode, lower):
    with pytest.raises(ValueError, match=r"tis_lower_bound must be < tis_upper_bound") as info:
        opj.CorrectionConfig(
            use_tis=True, tis_mode=mode, tis_lower_bound=lower, tis_upper_bound=2.0
        )
    assert "leave it null" in str(info.value)


def test_truncate_lower_above_upper_raises_from_yaml():
    with pytest.raises(ValueError, match=r"tis_lower_bound"):
        opj.CorrectionConfig.from_yaml(
            "use_tis: true\ntis_lower_bound: 3.0\ntis_upper_bound: 2.0\n"
        )


def test_truncate_lower_below_upper_still_builds():
    cfg = opj.CorrectionConfig(use_tis=True, tis_lower_bound=0.5, tis_upper_bound=2.0)
    assert (cfg.tis_mode, cfg.lower_bound) == ("truncate", 0.5)
    # band keeps allowing lower == upper (a one-point band).
    assert (
        opj.CorrectionConfig(use_tis=True, tis_mode="band", tis_lower_bound=2.0).tis_mode == "band"
    )


# --------------------------------------------------------------------------- verl releases


def test_unknown_verl_key_names_the_release_followed():
    with pytest.raises(ValueError, match=r"unknown verl rollout_correction key") as info:
        opj.CorrectionConfig.from_verl({"rollout_is": "token", "rollout_fancy": 1})
    message = str(info.value)
    assert "v0.7.0" in message and "97eac90" in message and "v0.6.1" in message


def test_verl_v060_key_names_its_replacement():
    with pytest.raises(ValueError, match=r"v0\.6\.0") as info:
        opj.CorrectionConfig.from_verl({"rollout_is_level": "token"})
    assert "rollout_is: <level>" in str(info.value)


def _verl_legacy_keep(old, rollout, mask, level, lower, upper):
    """verl v0.7.0's compute_rollout_rejection_mask in float64: the ratio
    π_old / π_rollout at ``level`` (safety-clamped at ±20 in log space), kept iff
    ``lower <= ratio <= upper``."""
    delta = np.where(mask, old.astype(np.float64) - rollout.astype(np.float64), 0.0)
    count = mask.sum(-1, keepdims=True)
    if level == "token":
        log_ratio = delta
    elif level == "sequence":
        log_ratio = np.broadcast_to(delta.sum(-1, keepdims=True), delta.shape)
    else:
        log_ratio = np.broadcast_to(
            delta.sum(-1, keepdims=True) / np.maximum(count, 1), delta.shape
        )
    ratio = np.exp(np.clip(log_ratio, -20.0, 20.0))
    return mask & (ratio >= lower) & (ratio <= upper)


@pytest.mark.parametrize(
    "level, threshold, lower",
    [("token", 1.5, None), ("token", 1.5, 0.8), ("sequence", 4.0, 0.3), ("geometric", 1.2, 0.9)],
)
def test_verl_legacy_rollout_rs_level_is_read(level, threshold, lower):
    block = {"rollout_is": None, "rollout_rs": level, "rollout_rs_threshold": threshold}
    if lower is not None:
        block["rollout_rs_threshold_lower"] = lower
    cfg = opj.CorrectionConfig.from_verl(block)
    assert (cfg.use_tis, cfg.tis_mode, cfg.use_rs, cfg.rs_level) == (True, "none", True, level)
    old, rollout, mask = _batch(seed=3)
    expected = _verl_legacy_keep(
        old, rollout, mask, level, 1.0 / threshold if lower is None else lower, threshold
    )
    assert 0 < expected.sum() < mask.sum()  # some kept, some rejected
    res = opj.compute_correction(old, rollout, mask, cfg)
    np.testing.assert_array_equal(np.asarray(res.mask) > 0, expected)
    np.testing.assert_array_equal(np.asarray(res.weights), expected.astype(np.float32))


def test_verl_legacy_rollout_rs_with_is_weights_and_veto():
    cfg = opj.CorrectionConfig.from_verl(
        {
            "rollout_is": "token",
            "rollout_is_threshold": 2.0,
            "rollout_rs": "geometric",
            "rollout_rs_threshold": 1.001,
            "rollout_rs_threshold_lower": 0.999,
            "rollout_token_veto_threshold": 1e-4,
        }
    )
    assert (cfg.tis_mode, cfg.tis_upper_bound) == ("truncate", 2.0)
    assert (cfg.rs_level, cfg.rs_lower_bound, cfg.rs_upper_bound) == ("geometric", 0.999, 1.001)
    assert cfg.rs_veto_threshold == 1e-4


@pytest.mark.parametrize(
    "block, match",
    [
        ({"rollout_rs": "token"}, r"rollout_rs_threshold must be explicitly provided"),
        (
            {"rollout_rs": "token", "rollout_rs_threshold": 2.0, "rollout_rs_threshold_lower": 3.0},
            r"rollout_rs_threshold_lower: the lower ratio bound must be < the upper",
        ),
        (
            {"rollout_rs": "geometric", "rollout_rs_threshold": 0.5},
            r"1 / rollout_correction.rollout_rs_threshold",
        ),
        ({"rollout_rs": "token", "rollout_rs_threshold": -1.0}, r"must be positive"),
        (
            {
                "rollout_rs": "seq_mean_k3",
                "rollout_rs_threshold": 0.01,
                "rollout_rs_threshold_lower": 0.5,
            },
            r"rollout_rs_threshold_lower is a key of verl v0\.6\.1 and v0\.7\.0.*'lower_upper'",
        ),
        (
            {"rollout_rs": "token,seq_max_k2", "rollout_rs_threshold": 2.0},
            r"'token' is a level of verl v0\.6\.1 and v0\.7\.0's rollout_rs",
        ),
    ],
)
def test_verl_legacy_rs_errors_explain(block, match):
    with pytest.raises(ValueError, match=match):
        opj.CorrectionConfig.from_verl(block)


@pytest.mark.parametrize("flag, loss_type", [(True, "reinforce"), (False, "ppo_clip")])
def test_verl_use_policy_gradient_is_loss_type(flag, loss_type):
    base = {"rollout_is": "token", "rollout_is_threshold": 2.0, "bypass_mode": True}
    legacy = opj.LossConfig.from_verl({**base, "use_policy_gradient": flag}, {})
    current = opj.LossConfig.from_verl({**base, "loss_type": loss_type}, {})
    assert legacy == current
    assert legacy.algorithm == ("reinforce_is" if flag else "bypass_ppo")
    both = opj.LossConfig.from_verl(
        {**base, "use_policy_gradient": flag, "loss_type": loss_type}, {}
    )
    assert both == current


def test_verl_use_policy_gradient_contradicting_loss_type_raises():
    block = {"bypass_mode": True, "use_policy_gradient": True, "loss_type": "ppo_clip"}
    with pytest.raises(ValueError, match=r"use_policy_gradient=True .* contradicts .*loss_type"):
        opj.LossConfig.from_verl(block, {})
    with pytest.raises(ValueError, match=r"use_policy_gradient must be true or false"):
        opj.LossConfig.from_verl({"use_policy_gradient": "yes"}, {})


def test_verl_v070_default_block_builds():
    # verl v0.7.0's RolloutCorrectionConfig with its defaults, as its YAML dumps it.
    block = {
        "rollout_is": "sequence",
        "rollout_is_threshold": 2.0,
        "rollout_rs": None,
        "rollout_rs_threshold": None,
        "rollout_rs_threshold_lower": None,
        "rollout_token_veto_threshold": None,
        "bypass_mode": False,
        "loss_type": "ppo_clip",
        "rollout_is_batch_normalize": False,
    }
    cfg = opj.LossConfig.from_verl(block, {})
    assert cfg.algorithm == "decoupled_ppo"
    assert isinstance(cfg.correction, opj.CorrectionConfig)
    assert (cfg.correction.tis_level, cfg.correction.use_rs) == ("sequence", False)


# --------------------------------------------------------------------------- the loss plan


def test_private_loss_functions_receive_the_plan_not_the_config():
    tree = ast.parse((CORE / "losses" / "policy_loss.py").read_text())
    takes_config = sorted(
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and node.name.startswith("_")
        and any(
            arg.annotation is not None and "LossConfig" in ast.unparse(arg.annotation)
            for arg in node.args.args + node.args.kwonlyargs
        )
    )
    assert takes_config == ["_terms"]  # the one that resolves it
    built = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("CorrectionConfig")
    ]
    assert built == [], f"a CorrectionConfig is built in the loss pipeline at lines {built}"


def test_a_loss_config_is_resolved_once_per_trace(monkeypatch):
    import jax

    from offpolicy_jax._src.config import plan
    from offpolicy_jax._src.losses import policy_loss as module

    calls = []

    def counting(config):
        calls.append(config)
        return plan.resolve(config)

    monkeypatch.setattr(module, "resolve", counting)
    old, rollout, mask = _batch(seed=5)
    logp = old + np.float32(0.05)
    adv = np.linspace(-1.0, 1.0, old.shape[0], dtype=np.float32)
    cfg = opj.LossConfig(
        algorithm="decoupled_ppo",
        correction=opj.CorrectionConfig.preset("mis"),
        get_mismatch_metrics=True,
        policy_loss="gspo",
        clip_eps=3e-4,
    )
    step = jax.jit(
        jax.value_and_grad(lambda lp: opj.policy_loss(lp, old, rollout, adv, mask, cfg)[0])
    )
    first = step(logp)
    second = step(logp + np.float32(0.01))
    assert len(calls) == 1 and calls[0] is cfg
    assert np.isfinite(float(first[0])) and np.isfinite(float(second[0]))


@pytest.mark.parametrize(
    "config, mismatch",
    [
        (opj.LossConfig(algorithm="ppo"), None),
        (opj.LossConfig(algorithm="ppo", get_mismatch_metrics=True), opj.CorrectionConfig()),
        (
            opj.LossConfig(correction=opj.CorrectionConfig(probability_metrics=True)),
            opj.CorrectionConfig(probability_metrics=True),
        ),
        (opj.LossConfig(algorithm="decoupled_ppo", correction=opj.VanillaTIS()), None),
        (
            opj.LossConfig(
                algorithm="decoupled_ppo",
                correction=opj.VanillaTIS(),
                get_mismatch_metrics=True,
            ),
            opj.CorrectionConfig(),
        ),
        (
            opj.LossConfig(
                algorithm="decoupled_ppo",
                correction=opj.CorrectionConfig.preset("mis"),
                get_mismatch_metrics=True,
            ),
            None,  # the correction reports them itself
        ),
    ],
)
def test_the_plan_resolves_the_metrics_only_correction(config, mismatch):
    from offpolicy_jax._src.config.plan import resolve

    plan = resolve(config)
    assert plan.mismatch_metrics == mismatch
    assert plan.algorithm.name == config.algorithm
    assert plan.reweights == config.reweights
    assert (plan.policy_loss, plan.params) == (config.policy_loss, config.params)
    with pytest.raises(TypeError, match=r"config must be a LossConfig, got dict"):
        resolve({"algorithm": "ppo"})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "config",
    [
        opj.LossConfig(algorithm="ppo"),
        opj.LossConfig(algorithm="ppo", get_mismatch_metrics=True),
        opj.LossConfig(algorithm="ppo", correction=opj.CorrectionConfig()),
        opj.LossConfig(algorithm="bypass_ppo"),
        opj.LossConfig(
            algorithm="bypass_ppo",
            correction=opj.CorrectionConfig(use_tis=True, tis_mode="none", use_rs=True),
        ),
        opj.LossConfig(algorithm="decoupled_ppo", correction=opj.VanillaTIS()),
        opj.LossConfig(algorithm="decoupled_ppo", correction=opj.CorrectionConfig.preset("mis")),
        opj.LossConfig(algorithm="reinforce_is", correction=opj.CorrectionConfig.preset("mis")),
        opj.LossConfig(
            algorithm="decoupled_ppo",
            correction=opj.VanillaTIS(),
            prox_logp_method="loglinear",
        ),
    ],
    ids=lambda c: f"{c.algorithm}-{type(c.correction).__name__}-{c.get_mismatch_metrics}",
)
def test_the_plan_derives_what_the_loss_reads_of_the_config(config):
    from offpolicy_jax._src.config.plan import resolve
    from offpolicy_jax._src.losses.algorithms import ALGORITHMS

    plan = resolve(config)
    wants_rollout = config.correction is not None or config.get_mismatch_metrics
    assert plan.reports_ois == wants_rollout
    assert plan.needs_rollout == (ALGORITHMS[config.algorithm].needs_rollout or wants_rollout)
    assert plan.approximates_old == config.approximates_old
    assert (plan.aggregation, plan.metric_reduction) == (
        config.aggregation,
        config.metric_reduction,
    )


def test_the_config_and_the_objectives_validate_the_aggregation_alike():
    from offpolicy_jax._src.losses.plan import check_aggregation

    settings = check_aggregation(
        "X",
        aggregation="sequence_sum_norm",
        loss_scale_factor="16",  # a numeric string reads as its number, as in YAML
        rejected_in_denominator=True,
        metric_reduction="token",
    )
    assert settings == ("sequence_sum_norm", 16.0, True, "token")
    config = opj.LossConfig(
        aggregation="sequence_sum_norm",
        loss_scale_factor="16",
        rejected_in_denominator=True,
        metric_reduction="token",
    )
    assert (
        config.aggregation,
        config.loss_scale_factor,
        config.rejected_in_denominator,
        config.metric_reduction,
    ) == tuple(settings)
    for bad, match in [
        ({"aggregation": "token_meen"}, r"LossConfig\.aggregation must be one of"),
        ({"loss_scale_factor": 2.0}, r"LossConfig\.loss_scale_factor only applies"),
        ({"loss_scale_factor": -1.0, "aggregation": "sequence_sum_norm"}, r"must be > 0"),
        ({"loss_scale_factor": 1e-46, "aggregation": "sequence_sum_norm"}, "loss_scale_factor"),
        ({"metric_reduction": "row"}, r"LossConfig\.metric_reduction must be one of"),
    ]:
        with pytest.raises(ValueError, match=match):
            opj.LossConfig(**bad)
