"""`--set a.b=c` overrides and YAML recipe files on top of a Recipe."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from launcher.recipe import Recipe
from launcher.recipes import get_recipe
from launcher.shapes import ModelShape, shape_from
from megatron_osprey.config.overrides import parse_override, with_override

_SHAPE_FIELDS = ("model", "target", "source")


def _shape_fields(current: Any, value: Any, where: str) -> Any:
    """A model shape is set by name (or a mapping of its numbers); other fields coerce as usual."""
    if isinstance(current, ModelShape):
        return shape_from(value, where)
    return NotImplemented


def _set(recipe: Recipe, path: list[str], value: Any, where: str) -> Recipe:
    """A copy of recipe with path set; the top-level shape fields take a shape name even when unset."""
    if len(path) == 1 and path[0] in _SHAPE_FIELDS:
        return dataclasses.replace(recipe, **{path[0]: shape_from(value, where)})
    if path[0] in _SHAPE_FIELDS and getattr(recipe, path[0]) is None:
        raise ValueError(f"{where}: the recipe has no {path[0]} shape; set {path[0]}=<shape name> first.")
    return with_override(recipe, path, value, where, _shape_fields)


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
