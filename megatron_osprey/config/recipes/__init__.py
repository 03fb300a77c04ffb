"""The one recipe registry: named functions returning a Recipe (a stage config plus a launch section).

Read by the `osprey` launcher and by the entry points' `--recipe`; see registry.py for the names.
"""

from megatron_osprey.config.recipes.files import apply_recipe_overrides, load_yaml_recipe, resolve_recipe
from megatron_osprey.config.recipes.recipe import Recipe
from megatron_osprey.config.recipes.registry import RECIPES, get_recipe, stage_config, takes_domain

__all__ = [
    "RECIPES",
    "Recipe",
    "apply_recipe_overrides",
    "get_recipe",
    "load_yaml_recipe",
    "resolve_recipe",
    "stage_config",
    "takes_domain",
]
