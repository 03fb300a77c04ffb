"""Issue 39: the release's values as defaults, the project's old ones as named values (LeanModels/Osprey).

MiniMax-M2.5 trained and evaluated as examples/minimax-m25/{train,eval}.sh run it; Adam's beta2 as SpecForge's
AdamW; 512 held-out prompts per domain; 32 regeneration requests per server with --trust-remote-code.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from launcher.plan import make_plan
from launcher.render import render
from megatron_osprey.recipes import get_recipe, resolve_recipe
from megatron_osprey.recipes.distill import MINIMAX_EVAL_SUITES
from megatron_osprey.training.config import ADAM_BETA2_GPT, ADAM_BETA2_RELEASE, OptimizerConfig

MINIMAX = ("minimax_m25_osprey_distill_4gpu_b200_bf16", "minimax_m25_osprey_distill_8gpu_h100_bf16")


def _release_cosine(step: int, peak: float = 1e-4, total: int = 53_172, ratio: float = 0.04) -> float:
    """SpecForge's CosineAnnealingWarmupLR after warmup: int(ratio x total) warmup steps, cosine to 0 at `total`."""
    warmup = int(ratio * total)
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


@pytest.mark.parametrize("name", MINIMAX)
def test_minimax_recipes_train_as_the_release(name):
    recipe = get_recipe(name)
    cfg = recipe.distill
    # 70,897 samples / global batch 4 = 17,724 updates an epoch (the loader drops the partial batch) x 3 epochs.
    assert (cfg.training.global_batch_size, cfg.training.micro_batch_size) == (4, 1)
    assert (cfg.optimizer.lr_decay_iters, cfg.training.train_iters) == (3 * (70_897 // 4), 35_000) == (53_172, 35_000)
    assert cfg.optimizer.lr_warmup_iters == int(0.04 * 53_172) == 2_126
    assert (cfg.optimizer.lr, cfg.optimizer.min_lr, cfg.optimizer.lr_decay_style) == (1e-4, 0.0, "cosine")
    assert recipe.domain == "code" and recipe.eval_domains == list(MINIMAX_EVAL_SUITES)
    plan = make_plan(recipe, "distill").to_json()
    schedule = plan["schedule"]
    assert (schedule["warmup_iters"], schedule["decay_iters"], schedule["stop_iter"]) == (2_126, 53_172, 35_000)
    assert schedule["final_lr"] == pytest.approx(_release_cosine(35_000), rel=1e-12)
    assert 0.28 < schedule["final_lr_share_of_peak"] < 0.282  # "ends near 28% of the peak" (2.814e-5)
    assert plan["fits"]
    assert json.loads(json.dumps(plan))["eval_suites"]["global_mmlu"]["prompts"] == 84


def test_minimax_b200_is_the_release_layout_and_h100_is_refused_at_it():
    recipe = get_recipe(MINIMAX[0])
    par = recipe.distill.parallel
    assert recipe.resources["distill"].gpus_per_node == 4
    assert (par.tensor_model_parallel_size, par.expert_model_parallel_size) == (4, 4)
    # The BF16-dequantized target at the release's 4-GPU layout does not fit an H100: the H100 recipe uses 8.
    layout = [
        "resources.distill.gpus_per_node=4",
        "distill.parallel.tensor_model_parallel_size=4",
        "distill.parallel.expert_model_parallel_size=4",
    ]
    assert not make_plan(resolve_recipe(MINIMAX[1], layout), "distill").fits


def test_minimax_eval_sets_are_the_release_suites_with_the_commands_that_write_them():
    plan = make_plan(get_recipe(MINIMAX[0]), "evaluate").to_json()
    suites = plan["eval_suites"]
    # examples/minimax-m25/eval.sh: humaneval:64 math500:64 livecodebench:64 mtbench:64 commonsense_eval:64,
    # mgsm:64 global_mmlu:84 global_mmlu_native:84.
    assert {k: v["prompts"] for k, v in suites.items()} == {
        "humaneval": 64, "math500": 64, "livecodebench": 64, "mtbench": 64, "commonsense": 64, "mgsm": 64,
        "global_mmlu": 84, "global_mmlu_native": 84,
    }  # fmt: skip
    assert [k for k, v in suites.items() if v["offline"]] == ["humaneval"]
    assert suites["humaneval"]["command"] == (
        "osprey suite --suite humaneval --source package --limit 64 --output osprey_runs/data/suites/humaneval.jsonl"
    )
    from megatron_osprey.eval.suites import SUITES

    assert set(MINIMAX_EVAL_SUITES) <= set(SUITES)  # every one is a suite `osprey suite` builds


def test_a_suite_outside_the_eval_domains_is_refused():
    with pytest.raises(ValueError, match=r"eval_suites.aime = 8 must name one of its eval_domains"):
        resolve_recipe(MINIMAX[0], ["eval_suites={aime: 8}"])


def _server_line(script: str, marker: str) -> str:
    return next(line for line in script.splitlines() if marker in line)


def test_rendered_jobs_carry_the_release_serving_flags(tmp_path):
    name = MINIMAX[0]
    evaluate = render(get_recipe(name), name, "evaluate", str(tmp_path))
    line = _server_line(evaluate, "--max-running-requests")
    assert "--ep-size 4 --disable-custom-all-reduce" in line and "--trust-remote-code" in line
    assert re.search(r'--tp-size "\$TP"', line) and 'TP="${TP:-4}"' in evaluate
    regen = render(get_recipe(name), name, "regenerate", str(tmp_path))
    line = _server_line(regen, '--api-key "$OSPREY_SERVER_API_KEY"')
    # regenerate_data.sh passes --trust-remote-code and neither of the FP8 MoE eval flags.
    assert "--trust-remote-code" in line and "--ep-size" not in line and "--disable-custom" not in line
    qwen = "qwen3_8b_osprey_distill_2gpu_h100_bf16"
    line = _server_line(render(get_recipe(qwen), qwen, "evaluate", str(tmp_path)), "--max-running-requests")
    # examples/qwen3-8b/eval.sh serves with none of them.
    assert "--trust-remote-code" not in line and "--ep-size" not in line and "--disable-custom" not in line
    line = _server_line(render(get_recipe(qwen), qwen, "regenerate", str(tmp_path)), '--api-key "$OSPREY_SERVER')
    assert "--trust-remote-code" in line


@pytest.mark.parametrize(
    "name, servers",
    [("qwen3_8b_osprey_distill_2gpu_h100_bf16", 8), ("llama33_70b_osprey_distill_8gpu_h100_bf16", 2)]
    + [(name, 2) for name in MINIMAX],
)
def test_regeneration_keeps_32_requests_in_flight_per_server(name, servers):
    recipe = get_recipe(name)
    assert recipe.servers.servers == servers and recipe.regenerate.concurrency == 32 * servers


@pytest.mark.parametrize(
    "style, warmup, decay, steps",
    [("cosine", 2_126, 53_172, (0, 1, 1_000, 2_126, 2_127, 20_000, 35_000, 53_172, 60_000)), ("linear", 3, 20, (2, 9))],
)
def test_the_planned_learning_rate_is_megatron_cores(style, warmup, decay, steps):
    from megatron_osprey.training.scheduler import build_scheduler

    section = OptimizerConfig(
        lr=1e-4, min_lr=1e-6, lr_warmup_iters=warmup, lr_decay_iters=decay, lr_decay_style=style, weight_decay=0.0
    )
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-4)
    scheduler = build_scheduler(optimizer, section, train_iters=35_000)  # Megatron-Core's OptimizerParamScheduler
    done = 0
    for step in steps:
        if step > done:
            scheduler.step(increment=step - done)
        done = step
        # The same formula in float64 both sides: measured equal to the last bit; 1e-12 leaves room for summation.
        assert section.lr_at(35_000, step) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12, abs=1e-18)


def test_a_warmup_fraction_is_of_the_schedule_length():
    # Megatron-LM's and the release's: the fraction of --lr-decay-iters when a cosine is longer than the run.
    section = OptimizerConfig(lr_warmup_fraction=0.04, lr_decay_iters=53_172)
    assert section.warmup_iters(35_000) == round(0.04 * 53_172) == 2_127
    assert OptimizerConfig(lr_warmup_fraction=0.04).warmup_iters(97_500) == 3_900


def test_distillation_uses_the_release_adam_betas_and_095_stays_a_flag_value():
    from megatron_osprey.stages.distill import DistillConfig, config_from_args
    from megatron_osprey.stages.pretrain import PretrainConfig

    assert (ADAM_BETA2_RELEASE, ADAM_BETA2_GPT) == (0.999, 0.95)
    assert DistillConfig().optimizer.adam_beta2 == 0.999 and DistillConfig().optimizer.adam_beta1 == 0.9
    assert PretrainConfig().optimizer.adam_beta2 == 0.95  # Stage 2 keeps the GPT-pretraining value
    for name in ("qwen3_8b_osprey_distill_2gpu_h100_bf16", "tiny_cpu_osprey_distill_1proc_fp32", "smollm2_cpu_smoke"):
        assert get_recipe(name).distill.optimizer.adam_beta2 == 0.999
    assert make_plan(get_recipe("qwen3_8b_osprey_distill_2gpu_h100_bf16"), "distill").budget.endswith("(0.9, 0.999)")
    cfg, _ = config_from_args(["--adam-beta2", "0.95"])
    assert cfg.optimizer.adam_beta2 == 0.95


def test_the_data_stage_holds_out_512_prompts_per_domain_and_64_stays_a_flag_value():
    from megatron_osprey.data.user_data import EARLIER_EVAL_SIZE, PAPER_EVAL_SIZE, UserDataConfig
    from megatron_osprey.stages.cli import parse_config
    from megatron_osprey.stages.data import FLAGS, DataConfig

    def parsed(*argv: str) -> int:
        return parse_config(list(argv), "data", DataConfig, FLAGS, "")[0].eval_size

    assert UserDataConfig().eval_size == PAPER_EVAL_SIZE == 512
    assert parsed("--input", "a=b.jsonl") == 512
    assert parsed("--input", "a=b.jsonl", "--eval-size", "64") == EARLIER_EVAL_SIZE == 64


def test_the_commonsense_suite_is_the_first_user_turn_of_a_held_out_conversations_file(tmp_path):
    from megatron_osprey.eval.suites import suite_conversations

    source = tmp_path / "commonsense_eval_512.jsonl"
    rows = [
        {"id": f"cs{i}", "conversations": [{"role": "system", "content": ""}, {"role": "user", "content": f"Q{i}?"}]}
        for i in range(100)
    ]
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    sets = suite_conversations("commonsense", source, limit=64)
    assert len(sets) == 64 and sets[3].id == "commonsense/cs3"
    assert list(sets[3].messages) == [{"role": "user", "content": "Q3?"}]
    source.write_text(json.dumps({"id": "x", "conversations": [{"role": "assistant", "content": "A"}]}) + "\n")
    with pytest.raises(ValueError, match="commonsense: a row has no user message"):
        suite_conversations("commonsense", source)


def test_the_perfectblend_split_is_the_release_shuffle(tmp_path):
    import random

    from megatron_osprey.data.conversations import validate_row
    from megatron_osprey.data.user_data import UserDataConfig, split_domains

    rows = [
        validate_row(
            {
                "id": f"r{i}",
                "conversations": [{"role": "user", "content": f"P{i}"}, {"role": "assistant", "content": "A"}],
            },
            "row",
        )
        for i in range(50)
    ]
    # The README's words, with the global random module: number the records, seed 42, shuffle.
    numbers = list(range(50))
    random.seed(42)
    random.shuffle(numbers)
    split = split_domains({"perfectblend": rows}, eval_size=5, seed=42, max_train=20, rule="shuffle")["perfectblend"]
    assert [c.id for c in split.train] == [f"r{i}" for i in numbers[:20]]
    assert [c.id for c in split.eval] == [f"r{i}" for i in numbers[20:25]]
    assert [c.id for c in split_domains({"d": rows}, 5, 0, max_train=20)["d"].eval] != [c.id for c in split.eval]
    with pytest.raises(ValueError, match="--split-rule shuffle takes the first --max-train"):
        UserDataConfig(inputs=["a=b"], target="t", output="o", split_rule="shuffle").validate()
    with pytest.raises(ValueError, match="has 50 rows; --split-rule shuffle takes --max-train 48"):
        split_domains({"perfectblend": rows}, eval_size=5, seed=42, max_train=48, rule="shuffle")


def test_the_llama_recipe_carries_the_perfectblend_rule():
    recipe = get_recipe("llama33_70b_osprey_distill_8gpu_h100_bf16")
    rule = make_plan(recipe, "distill").to_json()["data_rule"]
    assert recipe.domain == "perfectblend"
    assert (rule["split_rule"], rule["seed"], rule["max_train"], rule["eval_size"]) == ("shuffle", 42, 100_000, 512)
    assert rule["command"].endswith("--split-rule shuffle --seed 42 --eval-size 512 --max-train 100000")


def test_the_layerskip_backbone_preset_keeps_4_of_16_llama_layers():
    from launcher.plan import backbone_arch

    recipe = get_recipe("layerskip_llama32_1b_backbone_pretrain_10k_64gpu_h100_bf16")
    assert recipe.source == "layerskip_llama32_1b" and recipe.prune.num_layers == 4
    arch = backbone_arch(recipe)
    assert (arch.num_layers, arch.hidden_size, arch.vocab_size, arch.tie_word_embeddings) == (4, 2048, 128_256, True)
    # A distill recipe whose source is the LayerSkip model plans its 4-layer drafter.
    osprey = resolve_recipe("qwen3_8b_osprey_distill_2gpu_h100_bf16", ["source=layerskip_llama32_1b"])
    assert backbone_arch(osprey).num_layers == 4


def test_mt_bench_rows_carry_both_turns_and_the_one_turn_form_is_a_flag_value(tmp_path):
    from megatron_osprey.data.conversations import read_conversations
    from megatron_osprey.eval.suites import MT_BENCH_SYSTEM_PROMPT, suite_conversations, write_suite

    source = tmp_path / "question.jsonl"
    source.write_text(json.dumps({"question_id": 81, "turns": ["Write a poem.", "Now shorter."]}) + "\n")
    (row,) = suite_conversations("mtbench", source)
    assert list(row.messages) == [
        {"role": "system", "content": MT_BENCH_SYSTEM_PROMPT},
        {"role": "user", "content": "Write a poem."},
    ]
    assert row.extra["next_turns"] == ["Now shorter."]
    (one,) = suite_conversations("mtbench", source, first_turn_only=True)  # the earlier form, a flag value
    assert list(one.messages) == [{"role": "user", "content": "Write a poem."}] and "next_turns" not in one.extra
    write_suite("mtbench", source, tmp_path / "two.jsonl")
    write_suite("mtbench", source, tmp_path / "one.jsonl", first_turn_only=True)
    (two,) = read_conversations(tmp_path / "two.jsonl")
    (one,) = read_conversations(tmp_path / "one.jsonl")
    assert two.extra["next_turns"] == ["Now shorter."] and "next_turns" not in one.extra
    source.write_text(json.dumps({"question_id": 82, "turns": ["Only one."]}) + "\n")
    with pytest.raises(ValueError, match="mtbench: a row has no two turns of text"):
        suite_conversations("mtbench", source)
