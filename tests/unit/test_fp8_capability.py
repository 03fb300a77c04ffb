"""An FP8 recipe the GPU has no GEMMs for is refused by `osprey plan` (from the recipe's GPU type) and at start
(from torch.cuda.get_device_capability, mocked here), both from the one table in megatron_osprey.base.hardware."""

from __future__ import annotations

import copy

import pytest
import torch

from launcher.cli import main
from launcher.plan import LayoutError, make_plan
from megatron_osprey.base.hardware import GPU_CAPABILITY, fp8_recipe_refusal, fp8_recipe_runs
from megatron_osprey.models.backbone import config as backbone_config
from megatron_osprey.models.backbone.config import BackboneConfig, validate_numerics
from megatron_osprey.recipes import RECIPES, get_recipe

H100_FP8 = "qwen3_4b_backbone_pretrain_10k_64gpu_h100_fp8"
B200_MXFP8 = "qwen3_4b_backbone_pretrain_10k_64gpu_b200_mxfp8"


@pytest.mark.parametrize(
    "fp8_recipe, runs_on, refused_on",
    [
        ("delayed", [(8, 9), (9, 0), (10, 0)], [(8, 0), (8, 6)]),
        ("tensorwise", [(8, 9), (9, 0), (10, 0)], [(8, 0)]),
        ("blockwise", [(9, 0), (10, 0)], [(8, 9)]),
        ("mxfp8", [(10, 0), (10, 3)], [(8, 9), (9, 0), (12, 0)]),
    ],
)
def test_capability_table(fp8_recipe, runs_on, refused_on):
    for capability in runs_on:
        assert fp8_recipe_runs(fp8_recipe, capability) and fp8_recipe_refusal(fp8_recipe, capability, "x") is None
    for capability in refused_on:
        refusal = fp8_recipe_refusal(fp8_recipe, capability, "this GPU")
        assert not fp8_recipe_runs(fp8_recipe, capability)
        assert (
            f"--fp8-recipe {fp8_recipe} needs" in refusal and f"this GPU is {capability[0]}.{capability[1]}" in refusal
        )


def test_plan_refuses_mxfp8_on_h100_and_plans_blockwise_on_b200_naming_its_cuda(capsys):
    assert main(["plan", H100_FP8, "--set", "pretrain.model.fp8_recipe=mxfp8"]) == 2
    err = capsys.readouterr().err
    assert f"recipe {H100_FP8} (pretrain.model.fp8_recipe)" in err
    assert "--fp8-recipe mxfp8 needs" in err and "its hardware H100 is" in err
    recipe = copy.deepcopy(get_recipe(B200_MXFP8))
    recipe.pretrain.model.fp8_recipe = "blockwise"  # TE 2.11: block scaling from compute capability 9.0 on
    checks = make_plan(recipe, "pretrain").checks
    assert any(c.startswith("FP8 recipe blockwise runs on B200") and "CUDA 12.9+" in c for c in checks)


def test_make_plan_refuses_without_recipe_validation():
    recipe = copy.deepcopy(get_recipe(H100_FP8))
    recipe.pretrain.model.fp8_recipe = "mxfp8"  # set after validation: the plan checks on its own
    with pytest.raises(LayoutError, match="--fp8-recipe mxfp8 needs .*its hardware H100 is 9.0"):
        make_plan(recipe, "pretrain")


def test_every_shipped_fp8_recipe_plans_on_its_gpu_type():
    planned = set()
    for name in RECIPES:
        recipe = get_recipe(name)
        for stage in recipe.chain:
            model = getattr(recipe.config(stage), "model", None)
            if getattr(model, "fp8_format", None) is None:
                continue
            plan = make_plan(recipe, stage)
            capability = GPU_CAPABILITY[recipe.hardware]
            assert fp8_recipe_runs(model.fp8_recipe, capability), name
            assert any(c.startswith(f"FP8 recipe {model.fp8_recipe} runs on") for c in plan.checks), name
            planned.add((recipe.hardware, model.fp8_recipe))
    assert planned == {("h100", "delayed"), ("b200", "mxfp8")}


@pytest.fixture
def gpu_with_te(monkeypatch):
    """A CUDA machine with Transformer Engine whose compute capability the test sets."""
    capability = {"value": (9, 0)}
    monkeypatch.setattr(backbone_config, "transformer_engine_usable", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    return capability


@pytest.mark.parametrize(
    "capability, fp8_recipe, refused",
    [((9, 0), "mxfp8", True), ((10, 0), "mxfp8", False), ((10, 0), "blockwise", False), ((9, 0), "blockwise", False)],
)
def test_start_refuses_from_the_device_capability(gpu_with_te, capability, fp8_recipe, refused, monkeypatch):
    gpu_with_te["value"] = capability
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    model = BackboneConfig(hf_model="unused", transformer_impl="transformer_engine", fp8_format="e4m3")
    model.fp8_recipe = fp8_recipe
    if refused:
        with pytest.raises(ValueError, match=f"--fp8-recipe {fp8_recipe} needs .*this GPU is {capability[0]}"):
            validate_numerics(model)
    else:
        validate_numerics(model)


@pytest.mark.parametrize("cuda, refused", [("12.8", True), ("12.9", False), ("13.0", False)])
def test_start_refuses_blockwise_below_cuda_12_9(gpu_with_te, monkeypatch, cuda, refused):
    """TE 2.11's check_fp8_block_scaling_support: compute capability 9.0 or higher and CUDA 12.9 or newer."""
    monkeypatch.setattr(torch.version, "cuda", cuda)
    model = BackboneConfig(hf_model="unused", transformer_impl="transformer_engine", fp8_format="e4m3")
    model.fp8_recipe = "blockwise"
    if refused:
        with pytest.raises(ValueError, match=f"--fp8-recipe blockwise needs CUDA 12.9 or newer.*CUDA {cuda}"):
            validate_numerics(model)
    else:
        validate_numerics(model)
