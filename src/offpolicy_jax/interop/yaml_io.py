"""YAML as an input format: the configs' ``from_yaml`` / ``to_yaml``.

Read with ``yaml.safe_load`` semantics (a :class:`yaml.SafeLoader`), with a key given
twice in one mapping refused, and every failure a ``ValueError`` (or
``FileNotFoundError`` / ``IsADirectoryError`` for a path) that says what is wrong.
Registered as the readers behind :meth:`CorrectionConfig.from_yaml
<offpolicy_jax.CorrectionConfig.from_yaml>`, :meth:`LossConfig.from_yaml
<offpolicy_jax.LossConfig.from_yaml>` and their ``to_yaml``.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import yaml

from offpolicy_jax._src.config import _formats
from offpolicy_jax._src.messages import shown

__all__ = ["dump", "load_mapping"]


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (``safe_load``
    keeps the last silently: a config that says two things means one of them)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)  # pyright: ignore[reportArgumentType]
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: construct_mapping reports it
                    continue
                if first is not key_node:
                    raise ValueError(
                        f"duplicate YAML key {shown(key)} (line {first.start_mark.line + 1} and "
                        f"line {key_node.start_mark.line + 1}); give each key once"
                    )
        return super().construct_mapping(node, deep=deep)


def _parse_yaml(text: str, owner: str, origin: str) -> Any:
    """``yaml.safe_load`` with duplicate keys refused and every failure a ``ValueError``."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except ValueError as err:
        raise ValueError(f"{owner} YAML {origin}: {err}") from None
    except RecursionError:
        raise ValueError(f"{owner} YAML {origin} is nested too deeply to be a config") from None
    except yaml.YAMLError as err:
        reason = " ".join(str(err).split())
        raise ValueError(f"{owner} YAML {origin} is not valid YAML: {shown(reason)}") from None


def _read_yaml_file(path: pathlib.Path, owner: str) -> str:
    if path.is_dir():
        raise IsADirectoryError(f"{owner} YAML path is a directory, not a file: {shown(str(path))}")
    if not path.is_file():
        raise FileNotFoundError(f"{owner} YAML file not found: {shown(str(path))}")
    return path.read_text()


def load_mapping(source: str | os.PathLike[str], owner: str) -> dict[str, Any]:
    """Reads a YAML mapping from a path or from YAML text (``yaml.safe_load``, with
    duplicate keys refused)."""
    if isinstance(source, os.PathLike):
        text = _read_yaml_file(pathlib.Path(source), owner)
        origin = os.fspath(source)
    elif isinstance(source, str):
        looks_like_text = "\n" in source or ":" in source.split("/")[-1] or "{" in source
        if not looks_like_text or os.path.isfile(source):
            text, origin = _read_yaml_file(pathlib.Path(source), owner), source
        else:
            text, origin = source, "<yaml text>"
    else:
        raise TypeError(
            f"{owner}.from_yaml expects a path or YAML text, got {type(source).__name__}"
        )
    data = _parse_yaml(text, owner, shown(origin) if origin != "<yaml text>" else origin)
    if not isinstance(data, dict):
        raise ValueError(
            f"{owner} YAML {origin} must be a mapping of keys to values, got {type(data).__name__}"
        )
    return data


_formats.register("yaml.load_mapping")(load_mapping)


@_formats.register("yaml.dump")
def dump(data: dict[str, Any]) -> str:
    """A config's mapping as YAML text (``yaml.safe_dump``, keys in field order)."""
    return yaml.safe_dump(data, sort_keys=False)
