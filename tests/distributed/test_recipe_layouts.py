"""Every GPU distill recipe's drafter family built under its recipe's parallel layout (EP included), scaled to 2
gloo ranks, takes one TTT step at tiny size equal to the same drafter's at DP=2 (torchrun)."""

import pytest

from megatron_osprey.recipes import RECIPES, get_recipe
from tests.distributed.launch import run_torchrun

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    return run_torchrun("check_recipe_layouts.py", tmp_path_factory.mktemp("recipe_layouts"), timeout=500)


def test_every_gpu_distill_recipe_is_covered(figures):
    covered = {name for entry in figures.values() for name in entry["recipes"]}
    expected = {n for n in RECIPES if get_recipe(n).distill is not None and get_recipe(n).hardware != "cpu"}
    assert covered == expected
    # Qwen3-8B's DP layout, Llama-3.3-70B's TP and MiniMax-M2.5's TP + EP + SP, for every drafter family
    assert {key.split("_tp")[1] for key in figures} == {"1_ep1", "2_ep1", "2_ep2_sp"}
    assert {key.split("_tp")[0] for key in figures} == {"osprey2_fused", "eagle31_fused", "eagle32_fused"}


def test_one_step_under_each_recipe_layout_equals_dp2(figures):
    for key, entry in figures.items():
        print(key, entry["loss_diff"], entry["metric_diff"], entry["fc_grad_diff"])
        assert entry["loss"] > 0 and entry["fc_grad_norm"] > 0.1, key
        # float32, measured: losses equal, metrics (sums of per-row terms over TP) to 4.8e-7, fusion_fc
        # gradients (norm 0.1-0.4) to 1.0e-8
        assert entry["loss_diff"] < 1e-6 and entry["metric_diff"] < 2e-6, (key, entry)
        assert entry["fc_grad_diff"] < 5e-8, (key, entry)
