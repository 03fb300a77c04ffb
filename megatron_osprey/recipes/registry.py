"""The one recipe registry: named functions returning a Recipe, Megatron-Bridge style
(target_method_stage_gpus_hardware_precision), YAML recipe files on top of them, and `--set` overrides.

A recipe holds the very configs its stages run (recipe.py); `resolve_recipe` is the one way to get one, for
`osprey` and for a job's `--recipe` alike.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from pathlib import Path
from typing import Any, Callable

import yaml

from megatron_osprey.config.overrides import apply_overrides, parse_override, with_override
from megatron_osprey.recipes import backbone, cpu, distill
from megatron_osprey.recipes.recipe import STAGES, Recipe, check_domain_name


def _registered(name: str, build: Callable[..., Recipe], doc: str) -> Callable[..., Recipe]:
    """`build` as a named recipe function: its recipe carries the name and is validated."""

    @functools.wraps(build)
    def recipe_fn(*args, **kwargs) -> Recipe:
        recipe = build(*args, **kwargs)
        recipe.name = name
        recipe.validate()
        return recipe

    recipe_fn.__name__ = recipe_fn.__qualname__ = name
    recipe_fn.__doc__ = doc
    return recipe_fn


def _pretrain_recipes() -> dict[str, Callable[..., Recipe]]:
    out = {}
    for steps, label in ((backbone.PAPER_STEPS_FULL, "55k"), (backbone.PAPER_STEPS_BUDGET, "10k")):
        for hardware, precisions in (("h100", ("bf16", "fp8")), ("b200", ("bf16", "mxfp8"))):
            for precision in precisions:
                name = f"qwen3_4b_backbone_pretrain_{label}_64gpu_{hardware}_{precision}"
                doc = f"Backbone pretraining, {steps:,} steps, 64 x {hardware.upper()}, {precision.upper()}."
                out[name] = _registered(
                    name, functools.partial(backbone.backbone_pretrain, steps, hardware, precision), doc
                )
    for label, steps in (("55k", backbone.PAPER_STEPS_FULL), ("10k", backbone.PAPER_STEPS_BUDGET)):
        for hardware in ("h100", "b200"):
            name = f"layerskip_llama32_1b_backbone_pretrain_{label}_64gpu_{hardware}_bf16"
            doc = f"The release's LayerSkip-Llama 4-layer backbone, {steps:,} steps, 64 x {hardware.upper()}, BF16."
            build = functools.partial(backbone.backbone_pretrain, steps, hardware, "bf16", "layerskip_llama32_1b")
            out[name] = _registered(name, build, doc)
    for hardware in ("h100", "b200"):

        def monolingual(domain: str | None = None, _h=hardware) -> Recipe:
            return backbone.backbone_monolingual_pretrain(_h, "bf16", domain)

        name = f"qwen3_4b_backbone_monolingual_pretrain_10k_64gpu_{hardware}_bf16"
        doc = f"Backbone Stage 2 on a monolingual corpus (NAME:LANGUAGE, paths.pretrain_text), 64 x {hardware.upper()}."
        out[name] = _registered(name, monolingual, doc)
    return out


def _distill_recipes() -> dict[str, Callable[..., Recipe]]:
    out = {}
    methods = (("osprey", 1, "Osprey drafter"), ("eagle3", 1, "EAGLE-3 baseline (1 layer)"))
    methods += (("eagle3_2layer", 2, "EAGLE-3 baseline (2 layers, parameter-matched)"),)
    for (target, hardware), layout in distill.LAYOUTS.items():
        gpus = layout.gpus * layout.nodes
        for method, layers, what in methods:
            name = f"{target}_{method}_distill_{gpus}gpu_{hardware}_bf16"
            base = "eagle3" if method.startswith("eagle3") else "osprey"

            def build(domain: str | None = None, _t=target, _m=base, _h=hardware, _l=layers) -> Recipe:
                return distill.target_recipe(_t, _m, _h, domain, eagle3_layers=_l)

            doc = f"{what} for {target}, {gpus} x {hardware.upper()} (target TP {layout.tp}, EP {layout.ep})."
            out[name] = _registered(name, build, doc)

    for (target, hardware), layout in distill.LAYOUTS.items():
        gpus = layout.gpus * layout.nodes
        name = f"{target}_osprey_opd_distill_{gpus}gpu_{hardware}_bf16"

        def build_opd(domain: str | None = None, _t=target, _h=hardware) -> Recipe:
            return distill.opd_recipe(_t, _h, domain)

        how = "the authors' online loop, rolling out with " + (
            "the HF target whole on each GPU"
            if distill.opd_target_backend(target, hardware) == "hf"
            else "the Megatron-Core target at the distillation's layout"
        )
        doc = f"Osprey + Draft-OPD for {target} ({how}, from paths.sft), {gpus} x "
        out[name] = _registered(name, build_opd, doc + f"{hardware.upper()}.")
        offline = f"{target}_osprey_opd_offline_distill_{gpus}gpu_{hardware}_bf16"

        def build_offline(domain: str | None = None, _t=target, _h=hardware) -> Recipe:
            return distill.opd_recipe(_t, _h, domain, form="offline")

        doc = f"Osprey + Draft-OPD's offline form for {target} (one rollout + on-policy round), {gpus} x "
        out[offline] = _registered(offline, build_offline, doc + f"{hardware.upper()}.")

    def eagle3_ttt7(domain: str | None = None) -> Recipe:
        recipe = distill.target_recipe("qwen3_8b", "eagle3", "h100", domain)
        recipe.distill.ttt.ttt_steps = 7
        return recipe

    name = "qwen3_8b_eagle3_ttt7_distill_2gpu_h100_bf16"
    out[name] = _registered(
        name, eagle3_ttt7, "EAGLE-3 at its own paper's TTT depth 7 (the matched comparison uses 5)."
    )
    return out


def _cpu_recipes() -> dict[str, Callable[..., Recipe]]:
    table = {
        "tiny_cpu_backbone_pretrain_2proc_fp32": (cpu.tiny_backbone_pretrain, "Stage 2 at toy scale, 2 gloo ranks."),
        "tiny_cpu_osprey_distill_2proc_fp32": (
            lambda domain=None: cpu.tiny_distill(domain or "chat", tp=2),
            "Stage 3+4 at toy scale: the toy target at TP 2 on 2 gloo ranks.",
        ),
        "tiny_cpu_eagle3_distill_2proc_fp32": (
            lambda domain=None: cpu.tiny_distill(domain or "chat", tp=2, baseline="eagle3"),
            "The EAGLE-3 baseline at toy scale (1 layer, TTT 5, a 256-token draft vocabulary).",
        ),
        "tiny_cpu_osprey_distill_1proc_fp32": (
            lambda domain=None: cpu.tiny_distill(domain or "chat", tp=1),
            "Stage 4 at toy scale in one process: 128 tokens, 100 steps at lr 3e-3.",
        ),
        "smollm2_cpu_smoke": (cpu.smollm2_smoke, "Every stage on SmolLM2-135M-Instruct at smoke size (CPU, gloo)."),
        "smollm2_cpu_opd_smoke": (cpu.smollm2_opd_smoke, "Draft-OPD from the smoke chain's drafter (CPU, gloo)."),
    }
    for language in cpu.MONOLINGUAL_LANGUAGES:
        table[f"smollm2_cpu_monolingual_{language}_pretrain"] = (
            functools.partial(cpu.smollm2_monolingual_pretrain, language),
            f"Stage 2 of SmolLM2's first 2 layers on the {language} chatterbot text (CPU, gloo).",
        )
    return {name: _registered(name, build, doc) for name, (build, doc) in table.items()}


RECIPES: types.MappingProxyType[str, Callable[..., Recipe]] = types.MappingProxyType(
    {**_pretrain_recipes(), **_distill_recipes(), **_cpu_recipes()}
)


def takes_domain(name: str) -> bool:
    """Whether the named recipe takes a training domain (NAME:DOMAIN)."""
    return "domain" in inspect.signature(RECIPES[name]).parameters


def get_recipe(spec: str) -> Recipe:
    """A registered recipe by NAME, or NAME:DOMAIN for the per-domain recipes (a domain is any name)."""
    name, _, domain = spec.partition(":")
    if name not in RECIPES:
        close = [n for n in RECIPES if name and (name in n or n.startswith(name.split("_")[0]))][:5]
        hint = f" Close names: {', '.join(close)}." if close else " `osprey recipes` lists them."
        raise ValueError(f"recipe {name!r} is unknown (neither a registered recipe nor a .yaml file).{hint}")
    if domain:
        if not takes_domain(name):
            raise ValueError(f"recipe {name} takes no domain; drop ':{domain}'.")
        check_domain_name(domain, f"recipe {name}: domain")
        return RECIPES[name](domain)
    return RECIPES[name]()


def _flatten(node: Any, mapping: dict, prefix: list[str]) -> list[tuple[list[str], Any]]:
    """Dotted (path, value) pairs from a nested mapping, walking into the recipe's dataclass sections."""
    pairs = []
    for key, value in mapping.items():
        path = prefix + [str(key)]
        child = getattr(node, str(key), None) if dataclasses.is_dataclass(node) else None
        walk = isinstance(value, dict) and dataclasses.is_dataclass(child)
        pairs.extend(_flatten(child, value, path) if walk else [(path, value)])
    return pairs


def load_yaml_recipe(path: str | Path) -> Recipe:
    """A recipe from a YAML file: `base: REGISTERED_NAME[:DOMAIN]` plus the keys to change (any depth)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"recipe file {path} does not exist.")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"recipe file {path} is not valid YAML ({err}).") from None
    if not isinstance(data, dict) or "base" not in data:
        raise ValueError(f"recipe file {path} must be a mapping with `base: REGISTERED_NAME[:DOMAIN]`.")
    data = dict(data)
    recipe = get_recipe(str(data.pop("base")))
    recipe.name = str(data.pop("name", path.stem))
    for keys, value in _flatten(recipe, data, []):
        recipe = with_override(recipe, keys, value, f"{path}: {'.'.join(keys)}")
    recipe.validate()
    return recipe


def is_recipe_file(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml"))


def resolve_recipe(spec: str, overrides: list[str] | None = None) -> Recipe:
    """A registered name (NAME or NAME:DOMAIN) or a .yaml file, then recipe-level `--set` overrides."""
    recipe = load_yaml_recipe(spec) if is_recipe_file(spec) else get_recipe(spec)
    recipe = apply_overrides(recipe, overrides or [])
    recipe.validate()
    return recipe


def split_overrides(overrides: list[str], stage_config: Any) -> tuple[list[str], list[str]]:
    """(recipe-level, stage-level) `--set` keys: a key whose first part is a field of the stage's config is the
    stage's (`training.lr=2e-4`); any other is the recipe's (`paths.target=DIR`, `distill.training.lr=2e-4`)."""
    stage_fields = {f.name for f in dataclasses.fields(stage_config)}
    recipe_level, stage_level = [], []
    for text in overrides:
        first = parse_override(text)[0][0]
        (stage_level if first in stage_fields else recipe_level).append(text)
    return recipe_level, stage_level


def stage_resolver(spec: str, stage: str, overrides: list[str], run_dir: str | None):
    """The stages' `--recipe` hook: (the stage's config from the recipe, the overrides left for the stage)."""
    if stage not in STAGES:
        raise ValueError(f"stage {stage!r} is not one of {', '.join(STAGES)}.")
    probe = getattr(get_recipe(spec) if not is_recipe_file(spec) else load_yaml_recipe(spec), stage)
    if probe is None:
        recipe = resolve_recipe(spec, [])
        recipe.config(stage)  # raises: the recipe has no such stage, naming those it has
    recipe_level, stage_level = split_overrides(overrides, probe)
    recipe = resolve_recipe(spec, recipe_level)
    return recipe.config(stage, run_dir), stage_level
