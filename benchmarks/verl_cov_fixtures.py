"""The verl-parity fixtures of ``clip_cov`` / ``kl_cov``: ``tests/fixtures/verl_cov/``.

Two steps, in two environments (verl's code is never copied into this repository):

1. ``python -m benchmarks.verl_cov_fixtures inputs`` (this project's environment): the
   parity batches (ragged rows, an empty row, a one-token row, finite garbage where
   masked: verl's masked means multiply by the mask) and, for ``clip_cov``, the tokens
   this library draws with the case's key.
2. ``python benchmarks/verl_cov_fixtures.py verl --verl-root DIR`` (an environment with
   torch, numpy and omegaconf; ``DIR`` holds verl's source, e.g.
   ``git -C verl archive HEAD verl | tar -x -C DIR``): runs verl's own
   ``compute_policy_loss_clip_cov`` / ``compute_policy_loss_kl_cov`` on each batch and
   stores its loss, the gradient w.r.t. ``log_prob`` and its metrics. verl's module is
   loaded from ``DIR`` with stubs for the imports these two functions do not use.
   ``torch.randperm`` is replaced so that clip_cov's random choice is the set step 1
   recorded (the run checks that it is a subset of verl's candidates and that verl
   zeroes exactly that many tokens).

``tests/test_verl_cov.py`` compares this library's loss and gradient with them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys
import types

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
OUT = HERE.parent / "tests" / "fixtures" / "verl_cov"
B, T = 8, 64
LENGTHS = (64, 0, 1, 37, 50, 12, 64, 29)

# name -> (verl actor config, key seed, batch seed)
CASES: dict[str, tuple[dict, int, int]] = {
    "clip_cov_token_mean": (
        {
            "loss_mode": "clip_cov",
            "policy_loss": {"clip_cov_ratio": 0.1, "clip_cov_lb": 0.2, "clip_cov_ub": 2.0},
        },
        0,
        1,
    ),
    "clip_cov_seq_mean_token_mean_asymmetric": (
        {
            "loss_mode": "clip_cov",
            "loss_agg_mode": "seq-mean-token-mean",
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.28,
            "policy_loss": {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.1, "clip_cov_ub": 1.5},
        },
        1,
        2,
    ),
    "clip_cov_seq_mean_token_sum_defaults_band": (
        {
            "loss_mode": "clip_cov",
            "loss_agg_mode": "seq-mean-token-sum",
            "policy_loss": {"clip_cov_ratio": 0.05},
        },
        2,
        3,
    ),
    # k = int(0.5 n) exceeds the candidates of the narrow band: all of them are taken.
    "clip_cov_seq_mean_token_sum_norm_k_over_candidates": (
        {
            "loss_mode": "clip_cov",
            "loss_agg_mode": "seq-mean-token-sum-norm",
            "policy_loss": {"clip_cov_ratio": 0.5, "clip_cov_lb": 0.5, "clip_cov_ub": 0.8},
        },
        3,
        4,
    ),
    "kl_cov_token_mean": (
        {"loss_mode": "kl_cov", "policy_loss": {"kl_cov_ratio": 0.05, "ppo_kl_coef": 0.1}},
        0,
        5,
    ),
    "kl_cov_seq_mean_token_mean": (
        {
            "loss_mode": "kl_cov",
            "loss_agg_mode": "seq-mean-token-mean",
            "policy_loss": {"kl_cov_ratio": 0.2, "ppo_kl_coef": 1.0},
        },
        0,
        6,
    ),
    "kl_cov_seq_mean_token_sum": (
        {
            "loss_mode": "kl_cov",
            "loss_agg_mode": "seq-mean-token-sum",
            "policy_loss": {"kl_cov_ratio": 0.1},
        },
        0,
        7,
    ),
    "kl_cov_seq_mean_token_sum_norm": (
        {
            "loss_mode": "kl_cov",
            "loss_agg_mode": "seq-mean-token-sum-norm",
            "policy_loss": {"kl_cov_ratio": 0.15, "ppo_kl_coef": 0.5},
        },
        0,
        8,
    ),
}
MARGIN = 1e-3  # no covariance this close to a band edge or to the top-k cut


def make_batch(seed: int) -> dict[str, np.ndarray]:
    """A ragged [8, 64] batch; finite garbage where masked; some ratios past the clip."""
    rng = np.random.default_rng(seed)
    mask = np.arange(T)[None, :] < np.asarray(LENGTHS)[:, None]
    old = rng.normal(-1.3, 0.7, (B, T))
    logp = old + rng.normal(0.0, 0.2, (B, T))
    adv = np.repeat(rng.normal(0.0, 1.0, (B, 1)), T, axis=1) + rng.normal(0.0, 0.3, (B, T))
    for arr, garbage in ((old, 7.0), (logp, -3.0), (adv, 11.0)):
        arr[~mask] = garbage * rng.random(int((~mask).sum()))
    f32 = np.float32
    return dict(
        log_prob=logp.astype(f32),
        old_log_prob=old.astype(f32),
        advantages=adv.astype(f32),
        response_mask=mask.astype(f32),
    )


def _covariance(batch: dict[str, np.ndarray]) -> np.ndarray:
    valid = batch["response_mask"] > 0
    a = batch["advantages"].astype(np.float64)
    t = batch["log_prob"].astype(np.float64)
    cov = (a - a[valid].mean()) * (t - t[valid].mean())
    return np.where(valid, cov, np.nan)


def _margin(actor: dict, batch: dict[str, np.ndarray]) -> float:
    """How far (float64) the covariances are from deciding a selection differently."""
    cov = _covariance(batch)
    policy = actor["policy_loss"]
    if actor["loss_mode"] == "clip_cov":
        lb, ub = policy.get("clip_cov_lb", 1.0), policy.get("clip_cov_ub", 5.0)
        gap = np.nanmin(np.minimum(np.abs(cov - lb), np.abs(cov - ub)))
    else:
        values = np.sort(cov[np.isfinite(cov)])[::-1]
        k = max(1, int(len(values) * policy["kl_cov_ratio"]))
        gap = values[k - 1] - values[k]
    return float(gap)


def batch_for(actor: dict, seed: int) -> tuple[dict[str, np.ndarray], int]:
    """The first batch of seeds ``seed, seed + 1000, ...`` where float32 rounding of the
    means cannot decide a selection (no covariance within ``MARGIN`` of an edge)."""
    for attempt in range(100):
        batch = make_batch(seed + 1000 * attempt)
        if _margin(actor, batch) >= MARGIN:
            return batch, seed + 1000 * attempt
    raise SystemExit(f"no batch with margin {MARGIN} for {actor}")


def make_inputs() -> list[dict]:
    """Step 1: the batches and this library's clip_cov choice (JAX environment)."""
    import jax

    import offpolicy_jax as opj
    from offpolicy_jax._src.losses import covariance as cov
    from offpolicy_jax._src.losses import policy_losses as pl
    from offpolicy_jax._src.losses import registry
    from offpolicy_jax.reduction import Rows

    OUT.mkdir(parents=True, exist_ok=True)
    manifest = []
    for name, (actor, key_seed, seed) in CASES.items():
        batch, seed = batch_for(actor, seed)
        config = opj.LossConfig.from_verl({}, actor)
        valid = batch["response_mask"] > 0
        x = registry.SurrogateInput(
            batch["log_prob"],
            pl.safe_log_ratio(batch["log_prob"], batch["old_log_prob"], valid),
            batch["old_log_prob"],
            np.where(valid, batch["advantages"], 0.0),
            valid,
            batch["response_mask"],
            None,
            Rows(),
            None,
            jax.random.key(key_seed),
        )
        if config.policy_loss == "clip_cov":
            selected = registry.lookup("clip_cov").fn(x, config.params).clipped
        else:
            members, c, n = cov.covariance(x)
            selected = cov.select_top(c, members, n, config.kl_cov_ratio, Rows().axes)
        np.savez_compressed(OUT / f"{name}.npz", **batch, selected=np.asarray(selected))
        manifest.append(
            {"name": name, "file": f"{name}.npz", "actor": actor, "key": key_seed, "seed": seed}
        )
    return manifest


# --------------------------------------------------------------------------- verl's side


def _load_core_algos(root: pathlib.Path):
    """verl's ``core_algos`` from ``root``, with stubs for the imports it needs elsewhere."""
    import torch

    def stub(name, **attrs):
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        module.__path__ = []  # a package, so that submodules import
        sys.modules[name] = module
        return module

    class _Anything:  # verl's config classes, only named in isinstance checks here
        def __init__(self, *args, **kwargs):
            pass

    stub("verl")
    stub("verl.trainer", __path__=[])
    stub("verl.trainer.ppo")
    stub("verl.trainer.config", AlgoConfig=type("AlgoConfig", (_Anything,), {}))
    stub("verl.workers")
    stub("verl.workers.config", ActorConfig=type("ActorConfig", (_Anything,), {}))
    stub("verl.utils", as_torch_index=None, group_mean_std=None)
    stub("verl.utils.import_utils", deprecated=lambda *a, **k: lambda f: f)
    stub("verl.utils.device", get_device_name=lambda: "cpu", get_torch_device=lambda: torch.cpu)
    stub("tensordict", TensorDict=_Anything)
    stub("transformers", PreTrainedTokenizer=_Anything)
    modules = {}
    for dotted in ("verl.utils.torch_functional", "verl.trainer.ppo.core_algos"):
        path = root / (dotted.replace(".", "/") + ".py")
        spec = importlib.util.spec_from_file_location(dotted, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[dotted] = module
        spec.loader.exec_module(module)
        modules[dotted] = module
    sys.modules["verl.utils"].torch_functional = modules["verl.utils.torch_functional"]
    return modules["verl.trainer.ppo.core_algos"]


def _verl_config(actor: dict):
    policy = {
        "clip_cov_ratio": 0.0002,
        "clip_cov_lb": 1.0,
        "clip_cov_ub": 5.0,
        "kl_cov_ratio": 0.0002,
        "ppo_kl_coef": 0.1,
        **actor.get("policy_loss", {}),
    }
    return types.SimpleNamespace(
        clip_ratio=actor.get("clip_ratio", 0.2),
        clip_ratio_low=actor.get("clip_ratio_low"),
        clip_ratio_high=actor.get("clip_ratio_high"),
        policy_loss=types.SimpleNamespace(**policy),
        global_batch_info={},
    )


def _forced_randperm(torch, chosen: np.ndarray, seen: dict):
    """``torch.randperm`` whose first entries are the positions of ``chosen`` (flat token
    indices) in the candidate list ``torch.nonzero`` last returned (recorded in ``seen``)."""
    nonzero, randperm = torch.nonzero, torch.randperm

    def recording_nonzero(*args, **kwargs):
        out = nonzero(*args, **kwargs)
        seen["nonzero"] = out
        return out

    def forced(n, *args, **kwargs):
        rows, cols = seen["nonzero"].numpy().T
        flat = list(rows * T + cols)
        assert len(flat) == n
        missing = [int(i) for i in chosen if i not in flat]
        assert not missing, f"chosen tokens {missing} are not among verl's candidates"
        first = [flat.index(int(i)) for i in chosen]
        rest = [p for p in range(n) if p not in first]
        return torch.tensor(first + rest, dtype=torch.long)

    return recording_nonzero, forced, (nonzero, randperm)


def run_verl(root: pathlib.Path) -> None:
    """Step 2: verl's loss, gradient and metrics on every batch (torch environment)."""
    import torch

    core = _load_core_algos(root)
    manifest = json.loads((OUT / "manifest.json").read_text())
    for case in manifest["cases"]:
        path = OUT / case["file"]
        with np.load(path) as data:
            arrays = {k: data[k] for k in data.files}
        actor = case["actor"]
        tensors = {
            k: torch.tensor(arrays[k]) for k in ("old_log_prob", "advantages", "response_mask")
        }
        log_prob = torch.tensor(arrays["log_prob"], requires_grad=True)
        mode = actor["loss_mode"]
        fn = core.get_policy_loss_fn(mode)
        seen: dict = {}
        patched = None
        if mode == "clip_cov":
            chosen = np.flatnonzero(arrays["selected"].reshape(-1))
            nonzero, randperm, patched = _forced_randperm(torch, chosen, seen)
            torch.nonzero, torch.randperm = nonzero, randperm
        try:
            loss, metrics = fn(
                old_log_prob=tensors["old_log_prob"],
                log_prob=log_prob,
                advantages=tensors["advantages"],
                response_mask=tensors["response_mask"],
                loss_agg_mode=actor.get("loss_agg_mode", "token-mean"),
                config=_verl_config(actor),
            )
        finally:
            if patched is not None:
                torch.nonzero, torch.randperm = patched
        loss.backward()
        assert log_prob.grad is not None
        if mode == "clip_cov":
            n_valid = float(arrays["response_mask"].sum())
            zeroed = round(metrics["actor/pg_clipfrac"] * n_valid)
            assert zeroed == int(arrays["selected"].sum()), (zeroed, int(arrays["selected"].sum()))
            case["candidates"] = int(seen["nonzero"].shape[0])
        case["selected"] = int(arrays["selected"].sum())
        case["verl_metrics"] = {k: float(v) for k, v in metrics.items()}
        arrays.update(
            verl_loss=np.float32(loss.detach().numpy()),
            verl_grad=log_prob.grad.numpy().astype(np.float32),
        )
        np.savez_compressed(path, **arrays)
        print(f"{case['name']}: loss {loss.item():.6f}, selected {case['selected']}")
    manifest["torch"] = torch.__version__
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("inputs", "verl"))
    parser.add_argument("--verl-root", type=pathlib.Path, help="a directory holding verl/")
    parser.add_argument("--verl-commit", default="", help="recorded in the manifest")
    args = parser.parse_args(argv)
    if args.step == "inputs":
        manifest = {
            "about": "verl parity of clip_cov / kl_cov: benchmarks/verl_cov_fixtures.py",
            "verl_commit": args.verl_commit,
            "cases": make_inputs(),
        }
        (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        return 0
    if args.verl_root is None or not (args.verl_root / "verl").is_dir():
        parser.error("verl needs --verl-root DIR, a directory that holds verl/")
    run_verl(args.verl_root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
