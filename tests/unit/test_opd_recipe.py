"""The Draft-OPD recipes after the Osprey recipe's SFT distillation, wired to it: the authors' online loop (the
default of every target: the HF target whole per GPU where it fits one, else the Megatron-Core target at the
distillation's layout) and the offline form (one rollout + on-policy round)."""

from __future__ import annotations

import math

import pytest

from launcher.plan import make_plan
from megatron_osprey.recipes import RECIPES, get_recipe
from megatron_osprey.recipes.distill import (
    LAYOUTS,
    OPD_EPOCHS,
    OPD_PROMPT_SHARE,
    OPD_STEPS,
    PIPELINE_OPD,
    PIPELINE_OPD_ONLINE,
)

OPD = [name for name in RECIPES if "_opd_" in name]
TARGETS = [n for n in OPD if n.startswith(("qwen3", "llama", "minimax"))]
OFFLINE = [n for n in TARGETS if get_recipe(n).chain == PIPELINE_OPD]
ONLINE = [n for n in TARGETS if get_recipe(n).chain == PIPELINE_OPD_ONLINE]


def _sft(name: str, domain: str):
    base = name.replace("_osprey_opd_offline_distill_", "_osprey_distill_").replace(
        "_osprey_opd_distill_", "_osprey_distill_"
    )
    return get_recipe(f"{base}:{domain}")


def test_every_target_and_gpu_has_both_opd_forms_and_a_cpu_smoke():
    assert len(OPD) == 2 * len(LAYOUTS) + 1 and "smollm2_cpu_opd_smoke" in OPD
    # the default is the authors' online loop for every target; the offline form is the named *_opd_offline_* one
    assert sorted(ONLINE) == sorted(n for n in TARGETS if "_osprey_opd_distill_" in n)
    assert sorted(OFFLINE) == sorted(n for n in TARGETS if "_osprey_opd_offline_distill_" in n)
    assert len(ONLINE) == len(OFFLINE) > 2


@pytest.mark.parametrize("name", ONLINE)
def test_the_online_opd_recipe_is_the_authors_loop(name):
    """bingyang-lei/Draft-OPD's run_qwen_eagle3.sh: LR 1e-4, lr_warmup_steps_ratio 0.015, cosine, TTT length 7,
    8 epochs, one update per 10 x 24 greedy rollouts of the current drafter, the target's full distribution."""
    recipe = get_recipe(name)
    sft = _sft(name, recipe.domain)
    distill = recipe.config("distill", "RUN")
    assert recipe.rollout is None and "rollout" not in recipe.chain
    assert distill.data.mode == "on-policy" and distill.data.opd_form == "online"
    assert distill.data.hidden_states is None and distill.data.opd_round_updates == 1
    assert distill.data.data_path == [recipe.path("conversations")]
    assert recipe.path("conversations") == f"{sft.path('run_dir')}/regenerate/conversations.jsonl"
    assert distill.drafter.drafter_init == recipe.path("sft") == f"{sft.path('run_dir')}/distill"
    assert distill.optimizer.lr == 1e-4 and distill.optimizer.lr_warmup_fraction == 0.015
    assert distill.optimizer.lr_decay_style == "cosine" and distill.ttt.ttt_steps == 7
    assert distill.training.global_batch_size == 240 and distill.data.opd_max_new_tokens == 4096 - 512 - 1
    prompts = LAYOUTS[(recipe.target, recipe.hardware)].examples // OPD_PROMPT_SHARE
    assert distill.data.opd_limit == prompts
    assert distill.training.train_iters == math.ceil(8 * prompts / 240)
    plan = make_plan(recipe, "distill", "RUN")
    assert plan.train_iters == distill.training.train_iters
    assert distill.parallel == sft.distill.parallel
    # the HF target whole on each GPU where it fits one (TP 1), else the Megatron-Core target at the SFT's layout
    sharded = sft.distill.parallel.tensor_model_parallel_size > 1
    assert distill.data.opd_target_backend == ("megatron" if sharded else "hf")
    rollout_weights = dict(plan.memory)["target weights"]
    sft_weights = dict(make_plan(sft, "distill", "RUN").memory)["target weights"]
    assert rollout_weights == sft_weights if sharded else rollout_weights >= sft_weights
    assert plan.fits


@pytest.mark.parametrize("name", OFFLINE)
def test_an_offline_opd_recipe_rolls_out_the_sft_drafter_and_trains_on_its_rounds(name):
    recipe = get_recipe(name)
    sft = _sft(name, recipe.domain)
    assert recipe.chain == PIPELINE_OPD
    # paths.sft is where the Osprey recipe of the same target, GPUs and domain writes under the same root
    assert recipe.path("sft") == f"{sft.path('run_dir')}/distill"
    assert recipe.path("conversations") == f"{sft.path('run_dir')}/regenerate/conversations.jsonl"
    rollout, distill = recipe.config("rollout", "RUN"), recipe.config("distill", "RUN")
    assert rollout.drafter == distill.drafter.drafter_init == recipe.path("sft")
    assert rollout.data_path == recipe.path("conversations") and rollout.output == "RUN/rollout"
    assert distill.data.mode == "on-policy" and distill.data.opd_form == "offline"
    assert distill.data.hidden_states == "RUN/rollout"
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


@pytest.mark.parametrize("name", OFFLINE + ["smollm2_cpu_opd_smoke"])
def test_osprey_plan_sizes_the_rollout_on_its_layout(name):
    """`osprey plan RECIPE --stage rollout`: the target's layout checked and its memory per GPU within the GPU's."""
    recipe = get_recipe(name)
    plan = make_plan(recipe, "rollout", "RUN")
    rollout = recipe.config("rollout", "RUN")
    assert plan.data_parallel_size == plan.world_size // rollout.parallel.tensor_model_parallel_size
    assert any("target weights" == term for term, _ in plan.memory)
    if plan.gpu_memory_gib is not None:
        assert sum(size for _, size in plan.memory) / 2**30 < plan.gpu_memory_gib
