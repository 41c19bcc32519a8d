"""The demo's KPop and top-k rows: the engine's top-k ids and log-probs, the trainer's
log-probs on them (each against a float64 NumPy computation from the logits), the rows
training a few steps with finite metrics, and the MoE sweep's ``--rows`` / ``--table``."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

pytest.importorskip("flax")

from offpolicy_jax.demo import engine, moe_sweep, task, train
from offpolicy_jax.demo.experiment import DemoConfig, run


def _log_softmax64(logits) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _topk64(logq: np.ndarray, tok: np.ndarray, k: int) -> np.ndarray:
    """TRL's support: the k largest ids, the sampled one in the k-th place if missing."""
    ids = np.argsort(-logq, axis=-1, kind="stable")[..., :k].copy()
    missing = ~(ids == tok[..., None]).any(-1)
    ids[missing, k - 1] = tok[missing]
    return ids


def _routed(d_model=16, prompt_len=3):
    cfg = train.TrainConfig(d_model=d_model, prompt_len=prompt_len, n_experts=4, top_k=1)
    graphdef, state = train.init_state(cfg, train.Mismatch("router", 30), [0])
    return cfg, graphdef, jax.tree.map(lambda x: x[0], state["params"])


def test_topk_support_keeps_the_sampled_token():
    rng = np.random.default_rng(0)
    logq = _log_softmax64(rng.normal(size=(6, 5, task.VOCAB)) * 3).astype(np.float32)
    tok = rng.integers(0, task.VOCAB, size=(6, 5)).astype(np.int32)
    ids, lp = map(np.asarray, engine.topk_support(logq, tok, 3))
    want = _topk64(logq.astype(np.float64), tok, 3)
    missing = ~(np.argsort(-logq, -1)[..., :3] == tok[..., None]).any(-1)
    assert missing.any() and (~missing).any()  # both cases occur
    np.testing.assert_array_equal(ids, want)
    np.testing.assert_array_equal(lp, np.take_along_axis(logq, want, -1))
    assert (ids == tok[..., None]).any(-1).all()


@pytest.mark.parametrize("k", [3, task.VOCAB])
@pytest.mark.heavy
def test_engine_topk_equals_numpy_from_the_logits(k):
    """``generate_topk``'s ids and log-probs are the top-k of log_softmax of the engine's
    logits at each sampled position (float64 NumPy), its responses those of generate."""
    cfg, graphdef, params = _routed()
    n = cfg.prompt_len
    prompts = task.sample_prompts(jax.random.key(1), 32, n)
    numerics = engine.Numerics()
    key = jax.random.key(2)
    sample = jax.jit(engine.generate_topk, static_argnums=(0, 4, 5))(
        graphdef, params, prompts, key, numerics, k
    )
    responses, rollout_logp = engine.generate(graphdef, params, prompts, key, numerics)
    np.testing.assert_array_equal(sample.responses, responses)
    np.testing.assert_array_equal(sample.rollout_logp, rollout_logp)
    assert sample.topk_ids.shape == (32, n, k) and sample.topk_ids.dtype == np.int32
    # The engine's logits at the positions that sampled the response (causal: the full
    # sequence gives the same logits as the step that sampled each token).
    tokens = task.join(prompts, sample.responses)
    from flax import nnx

    logits = np.asarray(nnx.merge(graphdef, params)(tokens))[:, n : 2 * n]
    logq = _log_softmax64(logits)
    want = _topk64(logq, np.asarray(sample.responses), k)
    np.testing.assert_array_equal(sample.topk_ids, want)
    np.testing.assert_allclose(
        sample.topk_logp, np.take_along_axis(logq, want, -1), rtol=0, atol=2e-6
    )


@pytest.mark.heavy
def test_trainer_topk_logprobs_equal_numpy_and_are_masked():
    cfg, graphdef, params = _routed()
    n = cfg.prompt_len
    rng = np.random.default_rng(3)
    tokens = task.join(
        task.sample_prompts(jax.random.key(4), 8, n), task.sample_prompts(jax.random.key(5), 8, n)
    )
    ids = rng.integers(0, task.VOCAB, size=(8, n, 4)).astype(np.int32)
    mask = np.ones((8, n), np.float32)
    mask[0, 1:] = 0.0
    ids[0, 1:] = 99  # padding: never read
    logp, topk, own = train.token_logp_topk(graphdef, params, tokens, n, ids, mask=mask)
    from flax import nnx

    logits = np.asarray(nnx.merge(graphdef, params)(tokens))[:, n : 2 * n]
    logq = _log_softmax64(logits)
    keep = mask > 0
    got = np.asarray(topk)
    want = np.take_along_axis(logq, np.where(ids < task.VOCAB, ids, 0), -1)
    np.testing.assert_allclose(got[keep], want[keep], rtol=0, atol=2e-6)
    assert (got[~keep] == 0).all()
    sampled = np.take_along_axis(logq, np.asarray(tokens)[:, n + 1 :, None], -1)[..., 0]
    np.testing.assert_allclose(logp, sampled, rtol=0, atol=2e-6)
    assert own is None  # no routing given: no routes asked for


def test_new_rows_are_library_configs():
    kpop = train.row("decoupled_ppo+kpop").loss
    assert kpop.correction.rs_criteria == (f"binary_kl:{train.KPOP_PHI}",)
    assert train.row("decoupled_ppo+kpop2").loss.correction.rs_criteria == ("binary_kl:2.0",)
    topk = train.row("bypass_ppo+topk_tv").loss
    assert (topk.algorithm, topk.policy_loss, topk.divergence_type) == (
        "bypass_ppo",
        "dppo_tv",
        "topk_tv",
    )
    assert train.topk_of(topk) == train.DEMO_TOPK == min(20, task.VOCAB)
    assert train.topk_of(kpop) == 0


@pytest.mark.heavy
def test_top_k_sizes_must_agree_and_fit_the_vocabulary():
    cfg, graphdef, _ = _routed()
    mismatch = train.Mismatch("router", 30)
    five = train.row("bypass_ppo+topk_tv/divergence_topk=5")
    with pytest.raises(ValueError, match="different top-k sizes"):
        train.make_train_step(graphdef, cfg, [train.row("bypass_ppo+topk_tv"), five], mismatch)
    big = train.row(f"bypass_ppo+topk_tv/divergence_topk={task.VOCAB + 1}")
    with pytest.raises(ValueError, match="vocabulary"):
        train.make_train_step(graphdef, cfg, [big], mismatch)


@pytest.mark.heavy
def test_new_rows_train_a_few_steps_finite():
    """KPop at both φ and DPPO's top-k TV row train 3 steps of a routed policy under the
    router mismatch; every demo metric is finite and the top-k metrics are there."""
    rows = ("ppo", "decoupled_ppo+kpop", "decoupled_ppo+kpop2", "bypass_ppo+topk_tv")
    config = DemoConfig(
        steps=3,
        seeds=1,
        algorithms=rows,
        mismatch=train.Mismatch("router", 30),
        train=train.TrainConfig(
            d_model=16, n_experts=4, prompts_per_step=4, group_size=4, eval_prompts=8
        ),
        chunk=3,
    )
    history = run(config)
    for name in rows:
        m = history.metrics[name]
        for key in (*train.STEP_METRICS, "topk_tv", "binary_kl", "binary_kl_above_phi"):
            if key != "staleness_mean":
                assert np.isfinite(m[key]).all(), (name, key)
        assert np.isfinite(m["loss/pg_loss"]).all(), name
        assert 0.0 <= m["topk_tv"].min() and m["topk_tv"].max() <= 1.0
    assert np.isfinite(history.metrics["bypass_ppo+topk_tv"]["loss/mis_topk_tv"]).all()


def _line(index, rows, steps=4):
    out = {
        "collapsed": 0,
        "final": [1.0],
        "peak": [1.0],
        "max_is_weight": 1.0,
        "max_grad_norm": 1.0,
        "peak_k3": 0.0,
        "mean_k3": 0.0,
        "route_flips": 0.1,
        "log_ratio_above_1": 0.0,
    }
    return {
        "index": index,
        "mismatch": "router",
        "severity": 30,
        "lr": 0.01,
        "clip": 0.0,
        "steps": steps,
        "seeds": 1,
        "horizons": {str(h): {r: dict(out) for r in rows} for h in (steps // 2, steps)},
    }


def test_sweep_table_merges_runs_of_a_setting(tmp_path, capsys):
    """``--table`` joins the rows of several runs of one setting, in ROWS order; a line
    without the rejected-tokens column prints a dash there."""
    path = tmp_path / "sweep.jsonl"
    lines = [
        _line(0, ["ppo", "decoupled_ppo+tis2"]),
        _line(1, ["ppo"]),
        _line(0, ["decoupled_ppo+kpop"]),
    ]
    lines[2]["horizons"]["4"]["decoupled_ppo+kpop"]["rejected"] = 0.025
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    merged = moe_sweep.merge(lines)
    assert [x["index"] for x in merged] == [0, 1]
    assert list(merged[0]["horizons"]["4"]) == ["ppo", "decoupled_ppo+tis2", "decoupled_ppo+kpop"]
    moe_sweep.main(["--table", str(path)])
    out = capsys.readouterr().out
    collapsed, full = out.split("\n\n")
    assert collapsed.splitlines()[2].count("0 · 0") == 3
    assert "| – |" in collapsed.splitlines()[3]  # setting 1 never ran those rows
    assert full.count("`decoupled_ppo+kpop`") == 1 and "| 2.50% |" in full


def test_sweep_rows_flag_picks_the_rows():
    config = moe_sweep.setting("router", 30, 1e-2, 0.0, 10, 1, ("decoupled_ppo+kpop",))
    assert config.algorithms == ("decoupled_ppo+kpop",)
    assert set(moe_sweep.ROWS) >= {"decoupled_ppo+kpop", "bypass_ppo+topk_tv"}
