"""Recipes: a target x stage chain x hardware x precision, as the very configs its stages run plus a launch section.

`resolve_recipe(NAME[:DOMAIN] | FILE.yaml, overrides)` gives a Recipe; `Recipe.config(stage, run_dir)` the config the
stage runs; `run_stage(stage, argv)` runs a stage with `--recipe` resolved here: the job door
(`python -m megatron_osprey STAGE`, megatron_osprey/__main__.py) and the tools/*.py scripts call it.
"""

from __future__ import annotations

import importlib

from megatron_osprey.recipes.recipe import STAGES, Recipe
from megatron_osprey.recipes.registry import (
    RECIPES,
    get_recipe,
    load_yaml_recipe,
    resolve_recipe,
    stage_resolver,
    takes_domain,
)


def run_stage(stage: str, argv: list[str]) -> int:
    """Run `megatron_osprey.stages.<stage>`'s main on `argv` (the entry point passes its command line) with
    `--recipe` resolved by this registry; its exit code."""
    module = importlib.import_module(f"megatron_osprey.stages.{stage}")
    return module.main(list(argv), recipes=stage_resolver)


__all__ = [
    "RECIPES",
    "STAGES",
    "Recipe",
    "get_recipe",
    "load_yaml_recipe",
    "resolve_recipe",
    "run_stage",
    "stage_resolver",
    "takes_domain",
]
