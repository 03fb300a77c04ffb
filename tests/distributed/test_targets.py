"""Targets (Llama, Qwen3, Qwen3-MoE, MiniMax-M2) at TP=2+SP, PP=2 and EP=2 against HF, and extraction, under torchrun + gloo."""

import pytest

from tests.distributed.launch import run_torchrun

pytestmark = pytest.mark.distributed

FAMILIES = ["llama", "qwen3", "qwen3_moe", "minimax_m2"]
MOE = ["qwen3_moe", "minimax_m2"]


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    return run_torchrun("check_targets.py", tmp_path_factory.mktemp("targets"), timeout=400)


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_hooks_are_hf_output_hidden_states(figures, family):
    assert figures[f"{family}_hf_hooks_match_output_hidden_states"] is True


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["tp2_sp", "pp2"])
def test_every_layer_output_equals_hf(figures, family, layout):
    assert figures[f"{family}_{layout}_max_abs"] < 1e-4
    # Under PP the stage owning a layer sent it to the writer: all 6 arrive.
    assert figures[f"{family}_{layout}_layers_seen"] == list(range(6))


@pytest.mark.parametrize("family", MOE)
def test_expert_parallel_states_and_logits_equal_hf(figures, family):
    assert figures[f"{family}_ep2_max_abs"] < 1e-4
    assert figures[f"{family}_ep2_logits_max_abs"] < 1e-4
    assert figures[f"{family}_ep2_local_experts"] == 4  # 8 experts over 2 EP ranks


@pytest.mark.parametrize("family,layout,writers", [("minimax_m2", "ep2", 2), ("qwen3", "pp2", 1)])
def test_extracted_store_equals_hf_in_bf16(figures, family, layout, writers):
    assert figures[f"extract_{family}_{layout}_num_samples"] == 7
    assert figures[f"extract_{family}_{layout}_writers"] == writers
    # One bf16 rounding step apart at most (values are O(1)); a wrong layer is off by O(1).
    assert figures[f"extract_{family}_{layout}_max_abs"] < 4e-3
