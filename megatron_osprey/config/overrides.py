"""`--set section.key=value` overrides on a tree of dataclasses and dicts: the one implementation.

The stage entry points apply them to their config (PretrainConfig, DistillConfig)
and the `osprey` launcher to its Recipe (megatron_osprey/recipes). Values are read as YAML, then checked
against the field they replace so that a typo does not silently become a string.
Dataclasses are replaced, never mutated, so frozen ones work too.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import PurePath
from typing import Any, Callable

import yaml

# convert(node, key, value, where) -> the value to store in node.key, or NotImplemented to coerce as
# usual; lets a caller give fields of its own types (a recipe's model shapes) their own reading.
Convert = Callable[[Any, str, Any, str], Any]


def parse_value(raw: str) -> Any:
    """A --set value read as YAML, with 1e-4-style numbers kept numeric (YAML 1.1 reads them as strings)."""
    value = yaml.safe_load(raw) if raw.strip() else None
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") and value[0] in "+-.0123456789" else value
        except ValueError:
            return value
    return value


def parse_override(text: str) -> tuple[list[str], Any]:
    """'training.lr=1e-4' -> (['training', 'lr'], 0.0001)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set {text!r}: expected section.key=value (e.g. training.lr=1e-4).")
    return key.strip().split("."), parse_value(raw)


def _declared_types(node: Any, key: str) -> tuple[type, ...] | None:
    """The plain types a dataclass field is declared with (int | None -> (int, NoneType)), if readable."""
    try:
        hint = typing.get_type_hints(type(node))[key]
    except Exception:  # noqa: BLE001 - an unresolvable annotation: fall back to the current value's type
        return None
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    plain = tuple(typing.get_origin(a) or a for a in args)
    return plain if all(isinstance(a, type) for a in plain) else None


def coerce(current: Any, value: Any, where: str, declared: tuple[type, ...] | None = None) -> Any:
    """Keep numbers numeric and booleans boolean, so a typo does not become a string."""
    if declared is None:
        declared = (type(current),) if current is not None else None
    if declared is None or value is None and type(None) in declared:
        return value
    if bool in declared and isinstance(value, bool):
        return value
    if float in declared and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if int in declared and isinstance(value, int) and not isinstance(value, bool):
        return value
    if (list in declared or tuple in declared) and isinstance(value, list):
        return value if list in declared else tuple(value)
    if any(isinstance(value, t) for t in declared if t not in (bool, int, float, list, tuple)):
        return value
    if str in declared or any(issubclass(t, PurePath) for t in declared):
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    names = {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        list: "a list such as [1, 2]",
        tuple: "a list such as [1, 2]",
        type(None): "null",
    }
    wanted = " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in declared))
    raise ValueError(f"{where}: expected {wanted}, got {value!r}.")


def with_override(
    node: Any, path: list[str], value: Any, where: str, convert: Convert | None = None, depth: int = 0
) -> Any:
    """A copy of node with path set to value; dataclasses (frozen or not) and dicts are walked."""
    key = path[depth]
    last = depth == len(path) - 1
    if isinstance(node, dict):
        new = dict(node)
        new[key] = value if last else with_override(node.get(key), path, value, where, convert, depth + 1)
        return new
    if not dataclasses.is_dataclass(node):
        raise ValueError(f"{where}: {'.'.join(path[:depth])} is not a section (it is {node!r}).")
    names = [f.name for f in dataclasses.fields(node)]
    if key not in names:
        section = ".".join(path[:depth]) or "the top level"
        raise ValueError(f"{where}: no key {key!r} in {section}; valid keys: {', '.join(names)}.")
    current = getattr(node, key)
    converted = convert(node, key, value, where) if convert is not None and last else NotImplemented
    if converted is not NotImplemented:
        new_value = converted
    elif last:
        if dataclasses.is_dataclass(current):
            raise ValueError(f"{where}: {'.'.join(path)} is a section; set one of its keys.")
        new_value = coerce(current, value, where, _declared_types(node, key))
    else:
        new_value = with_override(current, path, value, where, convert, depth + 1)
    return dataclasses.replace(node, **{key: new_value})


def apply_overrides(config: Any, overrides: list[str] | None, convert: Convert | None = None) -> Any:
    """Apply `section.key=value` strings in order (later ones win); returns the new config."""
    for text in overrides or []:
        path, value = parse_override(text)
        config = with_override(config, path, value, f"--set {text}", convert)
    return config
