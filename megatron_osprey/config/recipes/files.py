"""YAML recipe files and `--set a.b=c` overrides (config/overrides.py, the one implementation) on a Recipe."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from megatron_osprey.config.overrides import apply_overrides as apply_to
from megatron_osprey.config.overrides import with_override
from megatron_osprey.config.recipes.recipe import Recipe
from megatron_osprey.config.recipes.registry import get_recipe
from megatron_osprey.config.recipes.shapes import ModelShape, shape_from

_SHAPE_FIELDS = ("model", "target", "source")


def _shape_fields(node: Any, key: str, value: Any, where: str) -> Any:
    """A model shape is set by name (or a mapping of its numbers), even where the recipe has none yet."""
    if isinstance(getattr(node, key), ModelShape) or isinstance(node, Recipe) and key in _SHAPE_FIELDS:
        return shape_from(value, where)
    return NotImplemented


def apply_recipe_overrides(recipe: Recipe, overrides: list[str] | None) -> Recipe:
    """Apply `a.b=c` strings in order (later ones win); returns a new, validated recipe."""
    recipe = apply_to(recipe, overrides, _shape_fields)
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
        recipe = Recipe(
            name=path.stem, stage=data.pop("stage"), hardware=data.pop("hardware"), precision=str(data.pop("precision"))
        )
    recipe = dataclasses.replace(recipe, name=str(data.pop("name", path.stem)))
    for keys, value in _flatten(recipe, data, []):
        recipe = with_override(recipe, keys, value, f"{path}: {'.'.join(keys)}", _shape_fields)
    recipe.validate()
    return recipe


def resolve_recipe(spec: str, overrides: list[str] | None = None) -> Recipe:
    """A registered name (NAME or NAME:DOMAIN) or a .yaml/.yml file, then the --set overrides."""
    if spec.endswith((".yaml", ".yml")) or Path(spec).is_file():
        recipe = load_yaml_recipe(spec)
    else:
        recipe = get_recipe(spec)
    return apply_recipe_overrides(recipe, overrides or [])
