"""What a trained GPT backbone starts from and its numerics (torch-free: recipes and `osprey plan` read it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_osprey.base.hardware import (
    FP8_RECIPE_CAPABILITY,
    cuda_capability,
    cuda_version,
    fp8_recipe_refusal,
    transformer_engine_usable,
)
from megatron_osprey.config.flags import STORE_TRUE, Flag

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = tuple(FP8_RECIPE_CAPABILITY)
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")
# Stage 1: the first N blocks (the paper), or Minitron layer importance (nvidia-modelopt, GPU).
PRUNE_STRATEGIES = ("first", "importance")


@dataclasses.dataclass
class BackboneConfig:
    """Where the architecture and the initial weights come from, and the numerics."""

    backbone: str | None = None  # Stage 1 (or a pretrained backbone) output: run_config.yaml + megatron/ + hf/
    hf_model: str | None = None  # or a HF model directory (all its layers)
    transformer_impl: str = "auto"
    bf16: bool = False
    fp8_format: str | None = None
    fp8_recipe: str = "delayed"

    def validate(self) -> None:
        """Exactly one weight source, with what it must hold; FP8 only where it can run."""
        validate_source(self)
        validate_numerics(self)


def validate_source(model: BackboneConfig) -> None:
    """Exactly one of --backbone / --hf-model, and it has what it must."""
    if bool(model.backbone) == bool(model.hf_model):
        raise ValueError("pass exactly one of --backbone DIR (Stage 1 output) or --hf-model DIR.")
    if model.backbone:
        root = Path(model.backbone)
        for need in ("run_config.yaml", "megatron"):
            if not (root / need).exists():
                raise FileNotFoundError(
                    f"--backbone {root}: no {need} there (expected the output of the prune stage, "
                    f"tools/prune_backbone.py)."
                )
    elif not (Path(model.hf_model) / "config.json").is_file():
        raise FileNotFoundError(f"--hf-model {model.hf_model}: no config.json there (expected a HF model directory).")


def validate_numerics(model: BackboneConfig) -> None:
    """FP8 needs Transformer Engine on CUDA, and a GPU with the recipe's GEMMs; say so before building anything."""
    if model.fp8_format is None:
        return
    if model.fp8_format not in FP8_FORMATS:
        raise ValueError(f"--fp8-format must be one of {FP8_FORMATS}, got {model.fp8_format!r}.")
    if model.fp8_recipe not in FP8_RECIPES:
        raise ValueError(f"--fp8-recipe must be one of {FP8_RECIPES}, got {model.fp8_recipe!r}.")
    if not transformer_engine_usable():
        raise RuntimeError(
            "--fp8-format needs CUDA and Transformer Engine (pip install -e '.[gpu]' on a GPU machine); "
            "drop it to train in float32/bf16 on this machine."
        )
    if model.transformer_impl == "local":
        raise ValueError("--fp8-format needs --transformer-impl transformer_engine (or auto).")
    capability = cuda_capability()
    refusal = (
        fp8_recipe_refusal(model.fp8_recipe, capability, "this GPU", cuda_version()) if capability is not None else None
    )
    if refusal:
        raise ValueError(refusal)


BACKBONE_FLAGS = [
    Flag("--backbone", "backbone", {"help": "Stage 1 output directory (run_config.yaml, megatron/, hf/)"}),
    Flag("--hf-model", "hf_model", {"help": "a HF model directory to start from instead"}),
    Flag("--transformer-impl", "transformer_impl", {"choices": list(TRANSFORMER_IMPLS)}),
    Flag("--bf16", "bf16", STORE_TRUE),
    Flag("--fp8-format", "fp8_format", {"choices": list(FP8_FORMATS)}),
    Flag("--fp8-recipe", "fp8_recipe", {"choices": list(FP8_RECIPES)}),
]
