"""Mesh axes a call inside ``shard_map`` is split over: the ``axis_names`` argument."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """Mesh axis names over which a call inside ``shard_map`` is split.

    Attributes:
      batch: data-parallel axes: different devices hold different sequences.
      token: context-parallel axes: different devices hold different tokens of the
        same sequences (the last array axis is sharded).
    """

    batch: tuple[str, ...] = ()
    token: tuple[str, ...] = ()

    def __post_init__(self):
        for field in ("batch", "token"):
            value = getattr(self, field)
            if isinstance(value, str):
                value = (value,)
            value = tuple(value)
            if not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"MeshAxes.{field} must be axis-name strings, got {value!r}")
            object.__setattr__(self, field, value)
        overlap = set(self.batch) & set(self.token)
        if overlap:
            raise ValueError(f"mesh axes {sorted(overlap)} are named both as batch and token axes")


AxisNames = None | str | Sequence[str] | MeshAxes | Mapping[str, str | Sequence[str]]


def _names(value: str | Sequence[str]) -> tuple[str, ...]:
    # The same normalisation as MeshAxes.__post_init__, done before the call so that
    # the fields are typed as tuples.
    return (value,) if isinstance(value, str) else tuple(value)


def as_mesh_axes(axis_names: AxisNames) -> MeshAxes:
    """Normalises the ``axis_names`` argument of the public functions.

    ``None`` means unsharded; a string or a sequence of strings names data-parallel
    (batch) axes; a :class:`MeshAxes` or a mapping ``{"batch": ..., "token": ...}``
    also names context-parallel (token) axes.
    """
    if axis_names is None:
        return MeshAxes()
    if isinstance(axis_names, MeshAxes):
        return axis_names
    if isinstance(axis_names, str):
        return MeshAxes(batch=(axis_names,))
    if isinstance(axis_names, Mapping):
        unknown = set(axis_names) - {"batch", "token"}
        if unknown:
            raise ValueError(
                f"axis_names mapping has unknown keys {sorted(unknown)}; allowed: 'batch', 'token'"
            )
        return MeshAxes(
            batch=_names(axis_names.get("batch", ())), token=_names(axis_names.get("token", ()))
        )
    if isinstance(axis_names, Sequence):
        return MeshAxes(batch=tuple(axis_names))
    raise TypeError(
        "axis_names must be None, a mesh axis name, a sequence of names, a MeshAxes or a "
        f"mapping {{'batch': ..., 'token': ...}}; got {type(axis_names).__name__}"
    )
