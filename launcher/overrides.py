"""`--set a.b=c` overrides and YAML recipe files on top of a Recipe."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from launcher.recipe import Recipe
from launcher.recipes import get_recipe
from launcher.shapes import ModelShape, shape_from

_SHAPE_FIELDS = ("model", "target", "source")


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


def _coerce(current: Any, value: Any, where: str) -> Any:
    """Keep numbers numeric and booleans boolean, so a typo does not become a string."""
    if isinstance(current, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}.")
        return value
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(current, int) and not isinstance(value, int):
        raise ValueError(f"{where}: expected an integer, got {value!r}.")
    if isinstance(current, list) and not isinstance(value, list):
        raise ValueError(f"{where}: expected a list such as [1, 2], got {value!r}.")
    return value


def _set(node: Any, path: list[str], value: Any, where: str, depth: int = 0) -> Any:
    """A copy of `node` with path set to value; dataclasses (frozen or not) and dicts are walked."""
    key = path[depth]
    last = depth == len(path) - 1
    if isinstance(node, dict):
        child = node.get(key)
        new = dict(node)
        new[key] = value if last else _set(child, path, value, where, depth + 1)
        return new
    if not dataclasses.is_dataclass(node):
        raise ValueError(f"{where}: {'.'.join(path[:depth])} is not a section (it is {node!r}).")
    names = [f.name for f in dataclasses.fields(node)]
    if key not in names:
        section = ".".join(path[:depth]) or "the recipe"
        raise ValueError(f"{where}: no key {key!r} in {section}; valid keys: {', '.join(names)}.")
    current = getattr(node, key)
    if depth == 0 and key in _SHAPE_FIELDS:
        if last:
            return dataclasses.replace(node, **{key: shape_from(value, where)})
        if current is None:
            raise ValueError(f"{where}: the recipe has no {key} shape; set {key}=<shape name> first.")
    if last:
        if dataclasses.is_dataclass(current) and not isinstance(current, ModelShape):
            raise ValueError(f"{where}: {'.'.join(path)} is a section; set one of its keys.")
        if isinstance(current, ModelShape):
            return dataclasses.replace(node, **{key: shape_from(value, where)})
        return dataclasses.replace(node, **{key: _coerce(current, value, where)})
    return dataclasses.replace(node, **{key: _set(current, path, value, where, depth + 1)})


def apply_overrides(recipe: Recipe, overrides: list[str]) -> Recipe:
    """Apply `a.b=c` strings in order (later ones win); returns a new, validated recipe."""
    for text in overrides or []:
        path, value = parse_override(text)
        recipe = _set(recipe, path, value, f"--set {text}")
    recipe.validate()
    return recipe


def _flatten(node: Any, mapping: dict[str, Any], prefix: list[str]) -> list[tuple[list[str], Any]]:
    """Dotted (path, value) pairs from a nested mapping, stopping at shapes, dicts and lists."""
    pairs = []
    for key, value in mapping.items():
        path = prefix + [str(key)]
        child = getattr(node, str(key), None) if dataclasses.is_dataclass(node) else None
        walk = isinstance(value, dict) and dataclasses.is_dataclass(child) and not isinstance(child, ModelShape)
        pairs.extend(_flatten(child, value, path) if walk else [(path, value)])
    return pairs


def load_yaml_recipe(path: str | Path) -> Recipe:
    """A recipe from a YAML file: `base: REGISTERED_NAME[:DOMAIN]` (optional) plus sections to change."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"recipe file {path} does not exist.")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"recipe file {path} is not valid YAML ({err}).") from None
    if not isinstance(data, dict):
        raise ValueError(f"recipe file {path} must hold a mapping of recipe keys.")
    data = dict(data)
    base = data.pop("base", None)
    if base is not None:
        recipe = get_recipe(str(base))
    else:
        missing = [k for k in ("stage", "hardware", "precision") if k not in data]
        if missing:
            raise ValueError(f"recipe file {path}: without `base:` it must set {', '.join(missing)}.")
        recipe = Recipe(name=path.stem, stage=data.pop("stage"), hardware=data.pop("hardware"),
                        precision=str(data.pop("precision")))
    recipe = dataclasses.replace(recipe, name=str(data.pop("name", path.stem)))
    for keys, value in _flatten(recipe, data, []):
        recipe = _set(recipe, keys, value, f"{path}: {'.'.join(keys)}")
    recipe.validate()
    return recipe


def resolve_recipe(spec: str, overrides: list[str] | None = None) -> Recipe:
    """A registered name (NAME or NAME:DOMAIN) or a .yaml/.yml file, then the --set overrides."""
    if spec.endswith((".yaml", ".yml")) or Path(spec).is_file():
        recipe = load_yaml_recipe(spec)
    else:
        recipe = get_recipe(spec)
    return apply_overrides(recipe, overrides or [])
