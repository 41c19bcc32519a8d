"""Packed reductions, and the fused CPU engine's windowed path for contiguous segments.

The exact compare-and-reduce for any ids, and, where the caller promises contiguous
segments (``contiguous=True``, checked by ``contiguous_rows``), the windowed two-level
path of :mod:`offpolicy_jax.reduction.fused_cpu`: per-segment sums / mins / maxes over
windows of ``W`` tokens, the windows that hold two sequences gathered and split in two
slots (even and odd ids), scattered into the segments. The windowed path runs only on
the fused path where no device may share the token axis, so every test here traces
under a one-device mesh (the test process has 8 CPU devices); under
``OFFPOLICY_JAX_REDUCTION=plain`` the same tests check the plain path. The oracle is
NumPy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from offpolicy_jax import reduction as _reduce
from offpolicy_jax.reduction import MeshAxes
from offpolicy_jax.reduction import fused_cpu as _windows

_segments = _reduce

OPS = ("sum", "min", "max")


@pytest.fixture
def one_device():
    mesh = jax.make_mesh(
        (1,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices("cpu")[:1]
    )
    with jax.set_mesh(mesh):
        yield


def _contiguous_row(rng, length, k, window, kind):
    """One row of ids: runs of one id (the usual packed layout) or something else."""
    row = np.zeros(length, np.int64)
    if kind == "padding":
        return row
    if kind == "random":
        return rng.integers(-1, k + 2, length)
    pos = rng.integers(0, 2 * window) if kind == "leading_padding" else 0
    # "ordered": the layout of pack_sequences, tunix and MaxText (ids 1, 2, 3, ... in
    # order, each sequence longer than a window)
    order = np.arange(1, k + 1) if kind == "ordered" else rng.permutation(np.arange(1, k + 1))
    for seg in order:
        if kind == "ordered":
            size = int(rng.integers(window, 3 * window))
        elif kind == "short":
            size = int(rng.integers(1, 4))
        elif kind == "edges":  # every boundary on a window edge
            size = window * int(rng.integers(1, 3))
        else:
            size = int(rng.integers(1, 3 * window))
        if pos >= length:
            break
        row[pos : pos + size] = seg
        pos += size
        if kind == "gaps":
            pos += int(rng.integers(0, 3))
    if kind == "garbage_tail":  # out-of-range ids after the segments are padding
        row[pos:] = rng.choice([0, -3, k + 1], size=max(length - pos, 0))
    return row


def _ids(rng, rows, length, k, window, kind):
    return np.stack([_contiguous_row(rng, length, k, window, kind) for _ in range(rows)]).astype(
        np.int32
    )


def _expected(op, value, population, ids, k):
    out = []
    for seg in range(1, k + 1):
        inside = (population > 0) & (ids == seg)
        if op == "sum":
            out.append(np.where(inside, value * population, 0.0).sum(-1))
        else:
            fill = np.inf if op == "min" else -np.inf
            x = np.where(inside, value, fill)
            out.append(x.min(-1, initial=fill) if op == "min" else x.max(-1, initial=fill))
    return np.stack(out, -1)


def _columns(values, population):
    return {f"c{i}": _reduce.Column(OPS[i % 3], values[i], population) for i in range(len(values))}


def _data(rng, ids, n, k):
    shape = ids.shape
    population = np.where(rng.random(shape) < 0.8, rng.choice([1.0, 0.5, 2.0], shape), 0.0)
    # 0 on padding, as every population of the library (segment_reduce's contract)
    population = np.where((ids >= 1) & (ids <= k), population, 0.0)
    population = population.astype(np.float32)
    values = rng.normal(size=(n, *shape)).astype(np.float32)
    values[:, (population == 0) | (ids < 1)] = np.nan  # garbage never reaches a result
    return values, population


def _check(got, values, population, ids, k):
    for i in range(len(values)):
        want = _expected(OPS[i % 3], values[i], population, ids, k)
        np.testing.assert_allclose(got[f"c{i}"], want, rtol=1e-5, atol=1e-5, err_msg=f"c{i}")


KINDS = [
    "ordered",
    "contiguous",
    "short",
    "edges",
    "gaps",
    "leading_padding",
    "garbage_tail",
    "padding",
]


def _windowable(ids, window, k):
    """NumPy oracle of the check: no window holds two even or two odd ids, and no
    sequence of a row ends in two windows that hold two ids (the windows across a
    boundary are listed by the id on the left of it)."""
    ids = np.where((ids >= 1) & (ids <= k), ids, 0)
    n = ids.shape[-1] // window
    for row in ids.reshape(-1, ids.shape[-1]):
        ends = []
        for w in row[: n * window].reshape(n, window):
            inside = w[w > 0]
            present = set(inside.tolist())
            if len({i for i in present if i % 2}) > 1 or len({i for i in present if not i % 2}) > 1:
                return False
            if len(present) == 2:
                ends.append(int(inside[0]))
        if len(ends) != len(set(ends)):
            return False
    return True


_SIZES = [(515, 8)] + [
    pytest.param(length, k, marks=pytest.mark.slow)
    for length in (64, 100, 131, 515)
    for k in (1, 3, 8)
    if (length, k) != (515, 8)
]


_FAST_KINDS = ("ordered", "short", "garbage_tail", "random")


# Module-level and keyed by the static arguments: the kinds of ids of one size share
# their three programs (a jit of a fresh closure per test compiled them again).
@functools.partial(jax.jit, static_argnames=("k", "contiguous"))
def _segment_reduce(values, population, ids, *, k, contiguous):
    return _segments.segment_reduce(
        _columns(values, population), ids, k, MeshAxes(), contiguous=contiguous
    )


_contiguous_rows = jax.jit(_segments.contiguous_rows, static_argnums=1)


@pytest.mark.heavy
@pytest.mark.parametrize(("length", "k"), _SIZES)
@pytest.mark.parametrize(
    "kind",
    [
        kind if kind in _FAST_KINDS else pytest.param(kind, marks=pytest.mark.slow)
        for kind in (*KINDS, "random")
    ],
)
def test_windowed_matches_numpy(one_device, length, k, kind):
    rng = np.random.default_rng(length * 31 + k * 7 + len(kind))
    window = _windows._window_size(length)
    ids = _ids(rng, 5, length, k, window, kind)
    values, population = _data(rng, ids, 7, k)  # 3 sums, 2 mins, 2 maxes in two loops
    assert _windows.use_windows(jnp.asarray(values[0]), k)

    exact = _segment_reduce(values, population, ids, k=k, contiguous=False)
    _check(exact, values, population, ids, k)
    ok = bool(_contiguous_rows(ids, k))
    assert ok == _windowable(ids, window, k)
    if kind in ("ordered", "edges", "padding"):
        assert ok  # the packed layouts of the field never fall back
    if ok:
        windowed = _segment_reduce(values, population, ids, k=k, contiguous=True)
        _check(windowed, values, population, ids, k)


@pytest.mark.heavy
def test_the_promise_is_static_and_compiles_once(one_device):
    rng = np.random.default_rng(3)
    ids = _ids(rng, 2, 256, 4, 16, "ordered")
    x = rng.normal(size=ids.shape).astype(np.float32)
    inside = (ids > 0).astype(np.float32)  # populations are 0 on padding (the contract)
    for contiguous in (False, True):
        layout = _segments.layout(MeshAxes(), ids, 4, ids.shape, contiguous)
        assert layout.contiguous is contiguous

        def fn(x, ids, contiguous=contiguous):
            layout = _segments.layout(MeshAxes(), ids, 4, ids.shape, contiguous)
            return layout.reduce({"s": _reduce.total(x, inside)})["s"]

        compiled = jax.jit(fn).lower(x, ids).compile()
        assert "conditional" not in compiled.as_text()
        np.testing.assert_allclose(
            compiled(x, ids), _expected("sum", x, inside, ids, 4), rtol=1e-5, atol=1e-6
        )
    with pytest.raises(TypeError, match="contiguous_segments"):
        _segments.layout(MeshAxes(), ids, 4, ids.shape, 1)


@pytest.mark.heavy
@pytest.mark.parametrize("contiguous", [False, True])
def test_windowed_gradient_is_the_gather(one_device, contiguous):
    rng = np.random.default_rng(5)
    k, length = 6, 300
    ids = _ids(rng, 3, length, k, _windows._window_size(length), "ordered")
    x = rng.normal(size=ids.shape).astype(np.float32)
    inside = (ids >= 1) & (ids <= k)
    # 0 on padding, as every population of the library (segment_reduce's contract)
    population = ((rng.random(ids.shape) < 0.8) & inside).astype(np.float32)
    cot = rng.normal(size=(3, k)).astype(np.float32)

    def sums(x):
        columns = {"s": _reduce.total(x, population), "m": _reduce.Column("max", x, population)}
        out = _segments.segment_reduce(columns, ids, k, MeshAxes(), contiguous=contiguous)
        return out["s"]

    np.testing.assert_allclose(
        jax.jit(sums)(x), _expected("sum", x, population, ids, k), rtol=1e-5, atol=1e-5
    )
    grad = jax.jit(jax.grad(lambda x: jnp.sum(sums(x) * cot)))(x)
    gathered = np.take_along_axis(np.concatenate([np.zeros((3, 1)), cot], -1), ids, -1)
    np.testing.assert_allclose(grad, np.where(inside, gathered, 0) * population, rtol=1e-6)
    tangent = rng.normal(size=ids.shape).astype(np.float32)
    _, jvp = jax.jvp(sums, (x,), (tangent,))
    np.testing.assert_allclose(
        jvp, _expected("sum", tangent, population, ids, k), rtol=1e-5, atol=1e-5
    )
    hlo = jax.jit(jax.grad(lambda x: jnp.sum(sums(x) * cot))).lower(x).compile().as_text()
    assert f"{k},{length}]" not in hlo.replace(" ", "")


@pytest.mark.heavy
@pytest.mark.parametrize("length", [515, pytest.param(131, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["ordered", "edges", "garbage", "padding"])
def test_windowed_broadcast_matches_the_gather(one_device, length, kind):
    """The layout's way back (``[..., K] -> [..., T]``) on the windowed path: two
    per-window lookups and two selects per token, 0 / False on padding, with the
    tail after the last window; its transpose is the per-segment sum."""
    rng = np.random.default_rng(length + len(kind))
    k = 5
    ids = _ids(rng, 3, length, k, _windows._window_size(length), kind.replace("garbage", "ordered"))
    if kind == "garbage":  # out-of-range ids are padding too
        ids = np.where(ids == 0, rng.choice([0, -3, k + 1], ids.shape), ids).astype(np.int32)
    assert _windowable(ids, _windows._window_size(length), k)
    inside = (ids >= 1) & (ids <= k)
    layout = _segments.Packed(MeshAxes(), jnp.asarray(ids), k, True)
    values = rng.normal(size=(3, k)).astype(np.float32)
    gathered = np.take_along_axis(
        np.concatenate([np.zeros((3, 1)), values], -1), np.where(inside, ids, 0), -1
    )
    got = jax.jit(layout.broadcast)(values)
    np.testing.assert_array_equal(got, np.where(inside, gathered, 0.0).astype(np.float32))
    flags = rng.random((3, k)) < 0.5
    got_flags = jax.jit(layout.broadcast)(flags)
    assert got_flags.dtype == jnp.bool_
    want_flags = np.take_along_axis(
        np.concatenate([np.zeros((3, 1), bool), flags], -1), np.where(inside, ids, 0), -1
    )
    np.testing.assert_array_equal(got_flags, want_flags & inside)
    cot = rng.normal(size=ids.shape).astype(np.float32)
    grad = jax.jit(jax.grad(lambda v: jnp.sum(layout.broadcast(v) * cot)))(values)
    want = _expected("sum", cot, inside.astype(np.float32), ids, k)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)


def test_packed_reduction_under_vmap(one_device):
    """Mapped rows of contiguous and of scattered ids: each exact, without a branch."""
    rng = np.random.default_rng(11)
    k, length = 4, 400
    window = _windows._window_size(length)
    ids = np.stack(
        [_ids(rng, 2, length, k, window, "contiguous"), _ids(rng, 2, length, k, window, "random")]
    )
    values, population = _data(rng, ids, 3, k)

    def one(values, population, ids):
        return _segments.segment_reduce(_columns(values, population), ids, k, MeshAxes())

    batched = jax.jit(jax.vmap(one, in_axes=(1, 0, 0)))
    _check(batched(values, population, ids), values, population, ids, k)
    assert "conditional" not in batched.lower(values, population, ids).compile().as_text()


def test_small_or_multi_device_programs_compare(one_device):
    # too short for two windows: the compare-and-reduce, no cond
    ids = np.array([[1, 1, 2, 2, 0]], np.int32)
    x = np.arange(5, dtype=np.float32)[None]
    fn = jax.jit(
        lambda x: _segments.segment_reduce(
            {"s": _reduce.total(x, jnp.ones_like(x))}, ids, 2, MeshAxes()
        )
    )
    np.testing.assert_allclose(fn(x)["s"], [[1.0, 5.0]])
    assert "conditional" not in fn.lower(x).compile().as_text()


def _unpacked(ids, k, *arrays):
    """The sequences of packed rows laid out one per row (padded with zeros)."""
    seqs = [
        np.flatnonzero(ids[r] == seg)
        for r in range(ids.shape[0])
        for seg in range(1, k + 1)
        if (ids[r] == seg).any()
    ]
    rows = [r for r in range(ids.shape[0]) for seg in range(1, k + 1) if (ids[r] == seg).any()]
    width = max(len(s) for s in seqs)
    out = []
    for a in arrays:
        b = np.zeros((len(seqs), width), a.dtype)
        for i, (r, s) in enumerate(zip(rows, seqs, strict=True)):
            b[i, : len(s)] = a[r, s]
        out.append(b)
    return out, rows, seqs


@pytest.mark.heavy
@pytest.mark.parametrize(
    "kind",
    ["ordered", *(pytest.param(kind, marks=pytest.mark.slow) for kind in ("contiguous", "random"))],
)
def test_public_calls_take_either_path_exactly(one_device, kind):
    """policy_loss (value and gradient) and compute_correction on long packed rows equal
    the same sequences one per row: on the exact path, and with the promise of
    contiguous segments where the ids keep it."""
    import offpolicy_jax as opj

    rng = np.random.default_rng(17)
    k, length = 5, 320
    ids = _ids(rng, 3, length, k, _windows._window_size(length), kind)
    ids[:, :2] = np.where(ids[:, :2] > 0, ids[:, :2], 1)  # no row without a sequence
    shape = ids.shape
    logp = rng.normal(-2.0, 0.5, shape).astype(np.float32)
    old = (logp + rng.normal(0, 0.05, shape)).astype(np.float32)
    rollout = (old + rng.normal(0, 0.4, shape)).astype(np.float32)
    adv = rng.normal(size=shape).astype(np.float32)
    mask = rng.random(shape) < 0.85
    config = opj.LossConfig(
        algorithm="decoupled_ppo",
        correction=opj.CorrectionConfig.preset("mis"),
        get_mismatch_metrics=True,
    )
    expected_ok = _windowable(ids, _windows._window_size(length), k)
    assert bool(_segments.contiguous_rows(jnp.asarray(ids), k)) == expected_ok
    if kind == "ordered":
        assert expected_ok

    def packed(lp, segment_ids):
        return opj.policy_loss(
            lp,
            old,
            rollout,
            adv,
            mask,
            config,
            segment_ids=segment_ids,
            num_segments=k,
            contiguous_segments=expected_ok,
        )

    compiled = jax.jit(jax.value_and_grad(packed, has_aux=True)).lower(logp, ids).compile()
    (loss, metrics), grad = compiled(logp, ids)
    assert "conditional" not in compiled.as_text()
    (lp2, old2, ro2, adv2, mask2), rows, seqs = _unpacked(ids, k, logp, old, rollout, adv, mask)

    def padded(lp):
        return opj.policy_loss(lp, old2, ro2, adv2, mask2, config)

    (loss2, metrics2), grad2 = jax.jit(jax.value_and_grad(padded, has_aux=True))(lp2)
    np.testing.assert_allclose(loss, loss2, rtol=2e-5, atol=1e-7)
    assert metrics.keys() == metrics2.keys()
    for key in metrics:
        np.testing.assert_allclose(metrics[key], metrics2[key], rtol=2e-5, atol=1e-6, err_msg=key)
    for i, (r, s) in enumerate(zip(rows, seqs, strict=True)):
        np.testing.assert_allclose(np.asarray(grad)[r, s], grad2[i, : len(s)], rtol=1e-5, atol=1e-8)
    # Called eagerly, ids above k raise (issue 30); they are padding, as 0 is, and the
    # jitted loss above read them traced (as padding).
    result = opj.compute_correction(
        old,
        rollout,
        mask,
        config.correction,
        segment_ids=np.where(ids > k, 0, ids),
        num_segments=k,
        contiguous_segments=expected_ok,
    )
    result2 = opj.compute_correction(old2, ro2, mask2, config.correction)
    for i, (r, s) in enumerate(zip(rows, seqs, strict=True)):
        np.testing.assert_allclose(
            np.asarray(result.weights)[r, s], result2.weights[i, : len(s)], rtol=1e-5
        )
        np.testing.assert_array_equal(np.asarray(result.mask)[r, s], result2.mask[i, : len(s)])
    for key in result.metrics:
        np.testing.assert_allclose(
            result.metrics[key], result2.metrics[key], rtol=2e-5, atol=1e-6, err_msg=key
        )
