"""Reference cases compiled in groups: one XLA program for several cases of one shape.

Each case of the reference packs (and of the surrogate oracles of
``test_policy_losses.py`` / ``test_trl_losses.py``, parametrized over configs on one
batch) has its own static config, hence its own program, and compiling is most of a
case's time. Sixteen cases of one input signature traced into one
jitted program give the same arrays bit for bit and compile in about half the time of
sixteen programs (per-program overhead; about 10% less than two programs of eight). The cases stay separate test items
with their own ids, outcomes and ``-k`` selection:

* a *chunk* is GROUP_SIZE consecutive selected cases of one test function in
  GROUPED_FUNCTIONS (the same split in the xdist controller and in every worker, from the
  run's ordered node ids);
* under ``pytest -n`` the scheduler below (``--dist load``, whose batches of consecutive
  tests are extended to the end of a chunk) runs a chunk on one worker;
* the first case of a chunk that a test runs computes the results of the chunk's cases of
  its input signature in one program; the others read theirs. A group that fails to trace
  or compile falls back to one program per case, so a bad case reports its own error.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax

GROUP_SIZE = 16
GROUPED_FUNCTIONS = frozenset(
    {
        "test_conformance.py::test_correction_case",
        "test_conformance.py::test_loss_case",
        "test_conformance_verl.py::test_verl_correction_case",
        "test_conformance_verl_loss.py::test_verl_loss_case",
        "test_policy_losses.py::test_policy_loss_matches_the_oracles",
        "test_trl_losses.py::test_policy_loss_matches_the_oracles",
    }
)


def _function_of(nodeid: str) -> str | None:
    function = nodeid.split("[", 1)[0].rsplit("/", 1)[-1]
    return function if function in GROUPED_FUNCTIONS else None


def chunk_keys(nodeids: Sequence[str]) -> dict[str, str]:
    """Node id -> chunk name, for the grouped functions' cases among ``nodeids``."""
    seen: dict[str, int] = {}
    keys = {}
    for nodeid in nodeids:
        function = _function_of(nodeid)
        if function is None:
            continue
        index = seen.get(function, 0)
        seen[function] = index + 1
        keys[nodeid] = f"{function}#chunk{index // GROUP_SIZE}"
    return keys


try:
    from xdist.scheduler import LoadScheduling
except ImportError:  # pytest-xdist absent: the cases run one by one in one process
    LoadScheduling = object  # type: ignore[assignment,misc]


class ChunkScheduling(LoadScheduling):  # type: ignore[valid-type,misc]
    """``--dist load`` whose batches of consecutive tests never end inside a chunk.

    xdist hands each worker runs of consecutive tests, shorter as the run nears its end; a
    chunk split between two workers would be compiled by both.
    """

    def _send_tests(self, node, num):
        if not hasattr(self, "_chunks"):
            self._chunks = chunk_keys(self.collection)
        pending, collection = self.pending, self.collection
        while 0 < num < len(pending):
            chunk = self._chunks.get(collection[pending[num - 1]])
            if chunk is None or chunk != self._chunks.get(collection[pending[num]]):
                break
            num += 1
        super()._send_tests(node, num)


_RESULTS: dict[str, Any] = {}  # computed, not yet read
_DONE: set[str] = set()  # computed (read or not): never computed again
_CHUNKS: dict[int, dict[str, str]] = {}  # id(session) -> chunk_keys of its items


def result(
    item: Any,
    prepare: Callable[[dict], tuple[Hashable, Any] | None],
    run_group: Callable[[list[tuple[Hashable, Any]]], list[Any]],
) -> Any:
    """This case's outputs, computed with the other cases of its chunk and signature.

    Args:
      item: the running test item (``request.node``); its parameters are passed on.
      prepare: the item's parameters (``{name: value}``) -> ``(static config, args)``, or
        None for a case that does not run as a group member (one expected to raise).
      run_group: ``[(config, args), ...]`` of one input signature -> their outputs, from
        one jitted program.
    """
    if item.nodeid not in _RESULTS:
        members = [i for i in _chunk_items(item) if i.nodeid not in _DONE]
        mine = prepare(item.callspec.params)
        assert mine is not None, f"{item.nodeid} does not run as a group member"
        group = [(item, mine)]
        for other in members:
            prepared = None if other is item else prepare(other.callspec.params)
            if prepared is not None and _signature(prepared) == _signature(mine):
                group.append((other, prepared))
        try:
            outputs = run_group([prepared for _, prepared in group])
        except Exception:  # one case's error is that case's to report
            group, outputs = group[:1], run_group([mine])
        _RESULTS.update((i.nodeid, out) for (i, _), out in zip(group, outputs, strict=True))
        _DONE.update(i.nodeid for i, _ in group)
    return _RESULTS.pop(item.nodeid)


def _chunk_items(item: Any) -> list[Any]:
    items = item.session.items
    keys = _CHUNKS.get(id(item.session))
    if keys is None:
        keys = _CHUNKS[id(item.session)] = chunk_keys([i.nodeid for i in items])
    key = keys.get(item.nodeid)
    return [i for i in items if key is not None and keys.get(i.nodeid) == key]


def _signature(prepared: tuple[Hashable, Any]) -> Any:
    leaves, treedef = jax.tree.flatten(prepared[1])
    return treedef, tuple((leaf.shape, str(leaf.dtype)) for leaf in leaves)
