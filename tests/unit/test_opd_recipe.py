"""The Draft-OPD recipes: one rollout + on-policy round after the Osprey recipe's SFT distillation, wired to it."""

from __future__ import annotations

import math

import pytest

from launcher.plan import make_plan
from megatron_osprey.recipes import RECIPES, get_recipe
from megatron_osprey.recipes.distill import LAYOUTS, OPD_EPOCHS, OPD_STEPS, PIPELINE_OPD

OPD = [name for name in RECIPES if "_opd_" in name]


def test_every_target_and_gpu_has_an_opd_recipe_and_a_cpu_smoke():
    assert len(OPD) == len(LAYOUTS) + 1 and "smollm2_cpu_opd_smoke" in OPD


@pytest.mark.parametrize("name", [n for n in OPD if n.startswith(("qwen3", "llama", "minimax"))])
def test_an_opd_recipe_rolls_out_the_sft_drafter_and_trains_on_its_rounds(name):
    recipe = get_recipe(name)
    sft = get_recipe(name.replace("_osprey_opd_distill_", "_osprey_distill_") + f":{recipe.domain}")
    assert recipe.chain == PIPELINE_OPD
    # paths.sft is where the Osprey recipe of the same target, GPUs and domain writes under the same root
    assert recipe.path("sft") == f"{sft.path('run_dir')}/distill"
    assert recipe.path("conversations") == f"{sft.path('run_dir')}/regenerate/conversations.jsonl"
    rollout, distill = recipe.config("rollout", "RUN"), recipe.config("distill", "RUN")
    assert rollout.drafter == distill.drafter.drafter_init == recipe.path("sft")
    assert rollout.data_path == recipe.path("conversations") and rollout.output == "RUN/rollout"
    assert distill.data.mode == "on-policy" and distill.data.hidden_states == "RUN/rollout"
    assert distill.drafter.baseline is None and distill.ttt.ttt_steps == rollout.steps == OPD_STEPS
    assert distill.optimizer.lr == pytest.approx(sft.distill.optimizer.lr / 10)
    batch = distill.training.global_batch_size
    assert distill.training.train_iters == math.ceil(OPD_EPOCHS * rollout.limit / batch)
    assert rollout.temperature == sft.regenerate.sampling.temperature == 1.0
    assert rollout.max_new_tokens == sft.regenerate.sampling.max_tokens
    # a target that fits one GPU rolls out with HF (one replica per GPU); the others at the distillation's layout
    if sft.distill.parallel.tensor_model_parallel_size == 1:
        assert rollout.target_backend == "hf" and rollout.parallel.tensor_model_parallel_size == 1
    else:
        assert rollout.target_backend == "megatron" and rollout.parallel == sft.distill.parallel
    assert recipe.stage_resources("rollout").gpus_per_node == sft.stage_resources("distill").gpus_per_node
    plan = make_plan(recipe, "distill", "RUN")
    assert plan.train_iters == distill.training.train_iters


@pytest.mark.parametrize("name", OPD)
def test_osprey_plan_sizes_the_rollout_on_its_layout(name):
    """`osprey plan RECIPE --stage rollout`: the target's layout checked and its memory per GPU within the GPU's."""
    recipe = get_recipe(name)
    plan = make_plan(recipe, "rollout", "RUN")
    rollout = recipe.config("rollout", "RUN")
    assert plan.data_parallel_size == plan.world_size // rollout.parallel.tensor_model_parallel_size
    assert any("target weights" == term for term, _ in plan.memory)
    if plan.gpu_memory_gib is not None:
        assert sum(size for _, size in plan.memory) / 2**30 < plan.gpu_memory_gib
