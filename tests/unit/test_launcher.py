"""The `osprey` launcher: recipes, overrides, entry-point argv, plan numbers and refusals."""

from __future__ import annotations

import math
import re

import pytest

from launcher import cli
from launcher.commands import entry_args, local_argv
from launcher.plan import LayoutError, make_plan, osprey_drafter_parameters
from megatron_osprey.config.args import config_from_args
from megatron_osprey.config.distill_args import distill_config_from_args
from megatron_osprey.config.recipes import RECIPES, get_recipe, resolve_recipe, stage_config, takes_domain
from megatron_osprey.config.recipes.shapes import LLAMA33_70B, MINIMAX_M25, QWEN3_4B_2LAYER, QWEN3_8B

GIB = 1 << 30


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_every_recipe_plans_and_its_name_states_its_gpus_hardware_and_precision():
    for name in RECIPES:
        recipe = get_recipe(name)
        assert recipe.name == name
        count = re.search(r"_(\d+)(gpu|proc)_", name)
        assert count and int(count.group(1)) == recipe.layout.world_size, name
        assert name.endswith(f"_{recipe.hardware}_{recipe.precision}") or recipe.hardware == "cpu", name
        stages = [recipe.stage] + (["extract"] if recipe.target is not None else [])
        for stage in stages:
            if recipe.drafter.target_fp8_format and stage in ("distill", "extract"):
                with pytest.raises(LayoutError, match="FP8 target forward .* not implemented"):
                    make_plan(recipe, stage)
                continue
            plan = make_plan(recipe, stage)
            assert plan.world_size == recipe.layout.world_size
            if recipe.hardware != "cpu":
                assert plan.memory_bytes < plan.gpu_memory_gib * GIB


def test_shapes_reproduce_the_published_parameter_counts():
    assert abs(QWEN3_4B_2LAYER.num_parameters() / 1e6 - 591) < 1  # the paper's ~591M backbone
    assert abs(QWEN3_8B.num_parameters() / 1e9 - 8.19) < 0.01
    assert abs(LLAMA33_70B.num_parameters() / 1e9 - 70.55) < 0.01
    assert abs(MINIMAX_M25.num_parameters() / 1e9 - 228.7) < 0.1  # ~229B


def test_distill_recipes_carry_the_paper_settings():
    qwen = get_recipe("qwen3_8b_osprey_distill_2gpu_h100_bf16:math")
    argv = entry_args(qwen, "distill")
    cfg = distill_config_from_args(argv[2:])  # what the job runs
    assert qwen.drafter.domain == cfg.data.domain == "math" and qwen.layout.world_size == 2
    iters = math.ceil(3 * 65_000 / 2)  # the paper: global batch 2, 97,500 updates
    assert cfg.training.num_train_iters() == iters and cfg.warmup_iters() == round(0.04 * iters)
    assert (cfg.optimizer.lr, cfg.optimizer.clip_grad, cfg.training.seq_length) == (1e-4, 1.0, 4096)
    assert cfg.ttt.ttt_steps == 5 and cfg.drafter.drafter_init.endswith("drafter_init/qwen3_8b")
    assert cfg.data.data_path[0].endswith("qwen3_8b/math.jsonl")
    assert _flag(argv, "--load") == _flag(argv, "--save")

    eagle = entry_args(get_recipe("qwen3_8b_eagle3_2layer_distill_2gpu_h100_bf16"), "distill")
    assert (_flag(eagle, "--baseline"), _flag(eagle, "--eagle3-num-layers")) == ("eagle3", "2")
    assert distill_config_from_args(eagle[2:]).ttt.ttt_steps == 5  # the default, so no flag
    assert distill_config_from_args(eagle[2:]).drafter.draft_vocab_size == 32_000
    assert "--drafter-init" not in eagle

    llama = entry_args(get_recipe("llama33_70b_osprey_distill_8gpu_h100_fp8"), "distill")
    assert _flag(llama, "--target-tensor-model-parallel-size") == "4"
    # One job, one TP group: the drafter runs at the target's TP size.
    assert _flag(llama, "--tensor-model-parallel-size") == "4"

    minimax = get_recipe("minimax_m25_osprey_distill_4gpu_b200_mxfp8")
    argv = entry_args(minimax, "distill")
    assert minimax.layout.world_size == 4
    adapt = entry_args(minimax, "adapt")  # Osprey's aux taps are fixed when adapting
    assert adapt[adapt.index("--aux-layer-ids") + 1 : adapt.index("--aux-layer-ids") + 4] == ["1", "30", "58"]
    assert (
        _flag(argv, "--target-tensor-model-parallel-size"),
        _flag(argv, "--target-expert-model-parallel-size"),
        _flag(argv, "--target-expert-tensor-parallel-size"),
    ) == ("4", "4", "1")
    assert _flag(argv, "--tensor-model-parallel-size") == "4" and "--sequence-parallel" in argv
    extract = entry_args(minimax, "extract")
    assert _flag(extract, "--expert-model-parallel-size") == "4" and "--sequence-parallel" in extract


def test_backbone_recipes_pretrain_with_fp8_where_it_applies():
    h100 = entry_args(get_recipe("qwen3_4b_backbone_pretrain_55k_64gpu_h100_fp8"), "pretrain")
    b200 = entry_args(get_recipe("qwen3_4b_backbone_pretrain_10k_64gpu_b200_mxfp8"), "pretrain")
    bf16 = entry_args(get_recipe("qwen3_4b_backbone_pretrain_10k_64gpu_h100_bf16"), "pretrain")
    assert h100[:2] == ["-m", "megatron_osprey.stages.pretrain"] and _flag(h100, "--train-iters") == "55000"
    h100_cfg = config_from_args(h100[2:])
    assert (h100_cfg.model.fp8_format, h100_cfg.model.fp8_recipe) == ("hybrid", "delayed")
    assert (_flag(b200, "--fp8-recipe"), _flag(b200, "--train-iters")) == ("mxfp8", "10000")
    assert "--fp8-format" not in bf16 and "--bf16" in bf16
    assert _flag(bf16, "--load") == _flag(bf16, "--save")
    prefixes = config_from_args(bf16[2:]).data.data_path
    assert len(prefixes) == 16 and prefixes[3].endswith("fineweb_00003_text_document")


def test_local_commands_use_torchrun_for_distributed_stages_and_python_otherwise():
    recipe = get_recipe("qwen3_8b_osprey_distill_2gpu_h100_bf16")
    argv = local_argv(recipe, "distill", ["--foo", "1"], python="PY", torchrun="TR")
    assert argv[:5] == ["TR", "--standalone", "--nproc-per-node=2", "-m", "megatron_osprey.stages.distill"]
    assert argv[-2:] == ["--foo", "1"]
    assert local_argv(recipe, "export", python="PY")[:3] == ["PY", "-m", "megatron_osprey.stages.export"]
    assert local_argv(recipe, "extract", python="PY", torchrun="TR")[3:5] == ["-m", "megatron_osprey.stages.extract"]
    assert local_argv(get_recipe("tiny_cpu_demo_1proc_fp32"), "demo", python="PY") == [
        "PY",
        "-m",
        "megatron_osprey.demo",
        "--output",
        "demo_out",
    ]
    prune = local_argv(get_recipe("qwen3_4b_backbone_pretrain_10k_64gpu_h100_bf16"), "prune", python="PY")
    assert _flag(prune, "--num-layers") == "2"
    with pytest.raises(ValueError, match="spans 8 nodes.*osprey submit"):
        local_argv(get_recipe("qwen3_4b_backbone_pretrain_10k_64gpu_h100_bf16"), "pretrain")
    with pytest.raises(ValueError, match="data.regenerate_server_urls"):
        local_argv(recipe, "regenerate")
    urls = resolve_recipe(recipe.name, ["data.regenerate_server_urls=[http://a:1, http://b:2]"])
    regen = local_argv(urls, "regenerate", python="PY")
    assert [regen[i + 1] for i, a in enumerate(regen) if a == "--server-url"] == ["http://a:1", "http://b:2"]


def test_overrides_are_typed_and_unknown_keys_are_named():
    recipe = resolve_recipe(
        "qwen3_8b_osprey_distill_2gpu_h100_bf16:code",
        [
            "training.lr=2e-4",
            "layout.gpus_per_node=4",
            "target=llama33_70b",
            "target.num_layers=40",
            "paths.root=/scratch/me",
        ],
    )
    assert recipe.training.lr == 2e-4 and recipe.layout.gpus_per_node == 4
    assert recipe.target.name == "llama33_70b" and recipe.target.num_layers == 40
    assert recipe.resolved_paths()["save"] == "/scratch/me/checkpoints/qwen3_8b_osprey_distill_2gpu_h100_bf16_code"
    assert LLAMA33_70B.num_layers == 80  # the shared shape constant is untouched
    with pytest.raises(ValueError, match="no key 'lrr' in training; valid keys: .*lr"):
        resolve_recipe("tiny_cpu_demo_1proc_fp32", ["training.lrr=1"])
    with pytest.raises(ValueError, match="expected an integer"):
        resolve_recipe("tiny_cpu_demo_1proc_fp32", ["layout.nodes=two"])
    with pytest.raises(ValueError, match="takes no domain"):
        get_recipe("qwen3_4b_backbone_pretrain_10k_64gpu_h100_bf16:code")
    assert takes_domain("minimax_m25_eagle3_distill_4gpu_b200_bf16")


def test_yaml_recipe_file_with_base_and_overrides(tmp_path):
    path = tmp_path / "my_run.yaml"
    path.write_text(
        "base: llama33_70b_osprey_distill_8gpu_h100_bf16:code\n"
        "layout: {nodes: 2}\n"
        "training: {global_batch_size: 32}\n"
        "drafter: {aux_layer_ids: [2, 39, 76]}\n"
    )
    recipe = resolve_recipe(str(path), ["training.micro_batch_size=2"])
    assert recipe.name == "my_run" and recipe.layout.world_size == 16
    assert recipe.training.global_batch_size == 32 and recipe.training.micro_batch_size == 2
    assert recipe.drafter.aux_layer_ids == [2, 39, 76] and recipe.drafter.domain == "code"
    plan = make_plan(recipe)
    # 16 ranks over the shared TP group of drafter and target (the target's TP 4): DP 4.
    assert plan.data_parallel_size == 4 and plan.iterations == math.ceil(3 * 65_000 / 32)

    bare = tmp_path / "bare.yaml"
    bare.write_text(
        "stage: pretrain\nhardware: h100\nprecision: bf16\nmodel: qwen3_4b_2layer\n"
        "layout: {gpus_per_node: 8}\ntraining: {global_batch_size: 64, train_iters: 100}\n"
    )
    assert make_plan(resolve_recipe(str(bare))).tokens == 100 * 64 * 4096
    bad = tmp_path / "bad.yaml"
    bad.write_text("hardware: h100\n")
    with pytest.raises(ValueError, match="without `base:` it must set stage, precision"):
        resolve_recipe(str(bad))


def test_plan_numbers_for_the_backbone_recipe(capsys):
    recipe = get_recipe("qwen3_4b_backbone_pretrain_10k_64gpu_h100_bf16")
    plan = make_plan(recipe)
    params = QWEN3_4B_2LAYER.num_parameters()
    memory = dict(plan.memory)
    assert (plan.world_size, plan.data_parallel_size) == (64, 64)
    assert plan.tokens == 10_000 * 256 * 4096
    assert memory["weights"] == params * 2 and memory["grads"] == params * 4
    assert memory["optimizer/64"] == params * 12 // 64  # the distributed optimizer shards over DP
    assert memory["activations"] == 34 * 4096 * 4 * 2560 * 2 * (10 + 24) // 34  # 2 layers, micro-batch 4
    assert memory["logits"] == 4096 * 4 * 151_936 * 6
    assert dict(plan.disk)[next(k for k, _ in plan.disk if k.startswith("checkpoint"))] == params * 14

    assert cli.main(["plan", recipe.name]) == 0
    out = capsys.readouterr().out
    assert "8 node(s) x 8 GPU(s) per node = 64 ranks" in out
    assert "10,485,760,000 tokens" in out
    assert f"= {plan.memory_bytes / GIB:.2f} GiB of 79.6 GiB" in out


def test_plan_sizes_the_frozen_target_and_the_hidden_state_store():
    recipe = get_recipe("qwen3_8b_osprey_distill_2gpu_h100_bf16")
    plan = make_plan(recipe)
    memory = dict(plan.memory)
    assert memory["weights"] == osprey_drafter_parameters(QWEN3_4B_2LAYER, QWEN3_8B, None) * 2
    # Qwen3-8B at TP 1: every weight on one GPU in bf16 (untied head).
    assert memory["target weights"] == QWEN3_8B.num_parameters() * 2
    disk = [b for k, b in plan.disk if k.startswith("hidden states")]
    assert disk[0] == 65_000 * 4096 * 4 * 4096 * 2  # 32 KiB per token at Ht=4096
    assert disk[1] == int(disk[0] * 0.45)
    # The target is built in BF16 whatever the recipe says: an FP8 target claim is refused, not planned at 1 byte.
    with pytest.raises(LayoutError, match=r"drafter.target_fp8_format=hybrid\), which is not implemented"):
        make_plan(get_recipe("qwen3_8b_osprey_distill_2gpu_h100_fp8"))
    bf16 = resolve_recipe("qwen3_8b_osprey_distill_2gpu_h100_fp8", ["drafter.target_fp8_format=null"])
    assert dict(make_plan(bf16).memory)["target weights"] == QWEN3_8B.num_parameters() * 2
    with pytest.raises(ValueError, match="MXFP8 needs Blackwell"):
        resolve_recipe("qwen3_8b_osprey_distill_2gpu_b200_mxfp8", ["hardware=h100"])


def test_plan_uses_distillations_shared_tensor_parallel_size_and_an_fp32_target_head():
    # distill runs drafter and target on one TP group (the larger size): Llama-70B TP 4 on 8 GPUs is DP 2,
    # MiniMax TP 8 on 8 GPUs is DP 1 (and sequence parallel, as the command adds it).
    llama = make_plan(get_recipe("llama33_70b_osprey_distill_8gpu_h100_bf16"))
    assert llama.data_parallel_size == 2
    assert "--tensor-model-parallel-size 4" in " ".join(
        entry_args(get_recipe("llama33_70b_osprey_distill_8gpu_h100_bf16"), "distill")
    )
    minimax = resolve_recipe("minimax_m25_osprey_distill_8gpu_h100_fp8", ["drafter.target_fp8_format=null"])
    assert make_plan(minimax).data_parallel_size == 1
    assert "--sequence-parallel" in entry_args(minimax, "distill")
    # TargetHead keeps float32 rows of the LM head per TP rank, online and offline alike.
    for mode in ("online", "offline"):
        recipe = resolve_recipe("qwen3_8b_osprey_distill_2gpu_h100_bf16", [f"drafter.mode={mode}"])
        assert dict(make_plan(recipe).memory)["target LM head"] == QWEN3_8B.vocab_size * QWEN3_8B.hidden_size * 4
    head = dict(llama.memory)["target LM head"]
    assert head == -(-LLAMA33_70B.vocab_size // 4) * LLAMA33_70B.hidden_size * 4


def test_plan_refuses_a_layout_whose_tp_does_not_divide_the_heads(capsys):
    rc = cli.main(
        ["plan", "qwen3_4b_backbone_pretrain_10k_64gpu_h100_bf16", "--set", "layout.tensor_model_parallel_size=3"]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "--tensor-model-parallel-size 3 does not divide the model's num_attention_heads (32)" in err
    with pytest.raises(LayoutError, match=r"--target-tensor-model-parallel-size 16 does not divide .*\(8\)"):
        make_plan(
            resolve_recipe(
                "llama33_70b_osprey_distill_8gpu_h100_bf16",
                ["layout.target_tensor_model_parallel_size=16", "layout.gpus_per_node=16"],
            )
        )
    with pytest.raises(
        LayoutError, match=r"micro-batch-size 1 x data parallel 32 = 32 .*does not divide the global batch size \(2\)"
    ):
        make_plan(resolve_recipe("qwen3_8b_osprey_distill_2gpu_h100_bf16", ["layout.gpus_per_node=32"]))
    with pytest.raises(LayoutError, match="expert-model-parallel-size x expert-tensor-parallel = 16"):
        make_plan(
            resolve_recipe(
                "minimax_m25_osprey_distill_4gpu_b200_bf16", ["layout.target_expert_tensor_parallel_size=4"]
            ),
            "extract",
        )
    with pytest.raises(LayoutError, match=r"needs about .* GiB per GPU .*more than the 79.6 GiB of a H100"):
        make_plan(
            resolve_recipe(
                "llama33_70b_osprey_distill_8gpu_h100_bf16",
                ["layout.target_tensor_model_parallel_size=1", "layout.gpus_per_node=1"],
            )
        )


def test_stage_commands_print_then_run_or_only_print(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(
        cli.subprocess,
        "run",
        lambda argv, cwd, check: calls.append((argv, cwd)) or type("Done", (), {"returncode": 0})(),
    )
    assert cli.main(["distill", "tiny_cpu_osprey_distill_2proc_fp32:code", "--dry-run", "--", "--foo", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("osprey: ") and "--nproc-per-node=2 -m megatron_osprey.stages.distill" in out
    assert out.rstrip().endswith("--foo 1") and calls == []
    assert cli.main(["export", "tiny_cpu_osprey_distill_2proc_fp32", "--set", "data.export_format=hf"]) == 0
    ((argv, cwd),) = calls
    assert argv[1:] == [
        "-m",
        "megatron_osprey.stages.export",
        "--checkpoint",
        "tiny_runs/checkpoints/tiny_cpu_osprey_distill_2proc_fp32_chat",
        "--format",
        "hf",
        "--output",
        "tiny_runs/export/tiny_cpu_osprey_distill_2proc_fp32_chat",
    ]
    assert (cwd / "launcher" / "cli.py").is_file()
    assert (
        cli.main(["pretrain", "tiny_cpu_backbone_pretrain_2proc_fp32", "--set", "layout.gpus_per_node=3", "--dry-run"])
        == 2
    )
    assert "does not divide the global batch size (4)" in capsys.readouterr().err


@pytest.mark.parametrize("name", [n for n in RECIPES if get_recipe(n).stage in ("pretrain", "distill")])
def test_the_launcher_runs_the_config_the_entry_points_recipe_gives(name):
    """One registry: the argv `osprey` renders, parsed by the entry point, is `--recipe NAME`'s config."""
    recipe = get_recipe(name)
    parse = config_from_args if recipe.stage == "pretrain" else distill_config_from_args
    domains = ["chat", "science"] if takes_domain(name) else [None]
    for spec in (f"{name}:{d}" if d else name for d in domains):
        argv = entry_args(get_recipe(spec), recipe.stage)
        assert argv[:2] == ["-m", f"megatron_osprey.stages.{recipe.stage}"]
        launched = parse(argv[2:])
        named = parse(["--recipe", spec])
        assert named.recipe == spec
        named.recipe = None  # the only difference: the launcher's job does not know the name
        assert launched == named == get_recipe(spec).config()
        assert launched.checkpoint.save.endswith(get_recipe(spec).run_name)


@pytest.mark.parametrize(
    "name, fmt, fp8_recipe",
    [
        ("qwen3_8b_osprey_distill_2gpu_h100_fp8", "hybrid", "tensorwise"),
        ("llama33_70b_eagle3_distill_8gpu_b200_mxfp8", "e4m3", "mxfp8"),
        ("minimax_m25_osprey_distill_8gpu_h100_fp8", "hybrid", "tensorwise"),
    ],
)
def test_the_fp8_target_settings_reach_the_job_which_refuses_them(name, fmt, fp8_recipe, tmp_path):
    argv = entry_args(get_recipe(name), "distill")
    assert (_flag(argv, "--target-fp8-format"), _flag(argv, "--target-fp8-recipe")) == (fmt, fp8_recipe)
    cfg = distill_config_from_args(argv[2:])
    assert (cfg.target.fp8_format, cfg.target.fp8_recipe) == (fmt, fp8_recipe)
    assert cfg == stage_config(name, "distill")
    # The job checks it before building anything: the frozen target runs in BF16 only.
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    (tmp_path / "init" / "megatron").mkdir(parents=True)
    data = tmp_path / "chat.jsonl"
    data.write_text("")
    cfg.target.target, cfg.data.data_path = str(tmp_path / "target"), [str(data)]
    cfg.drafter.drafter_init = None if cfg.drafter.baseline else str(tmp_path / "init")
    with pytest.raises(ValueError, match=f"--target-fp8-format {fmt} .* not implemented"):
        cfg.validate(world_size=get_recipe(name).layout.world_size)


@pytest.mark.parametrize(
    "name",
    [
        "qwen3_8b_osprey_distill_2gpu_h100_bf16",
        "qwen3_8b_eagle3_distill_2gpu_h100_bf16",
        "qwen3_8b_eagle3_2layer_distill_2gpu_b200_bf16",
    ],
)
def test_qwen3_8b_recipes_are_the_papers_budget(name):
    """One 4096-token sequence per GPU on 2 GPUs: global batch 2, 3 epochs of 65,000 = 97,500 updates."""
    recipe = get_recipe(name)
    t = recipe.training
    assert (
        t.micro_batch_size,
        t.global_batch_size,
        t.seq_length,
        t.lr,
        t.lr_warmup_fraction,
        t.clip_grad,
        t.epochs,
    ) == (1, 2, 4096, 1e-4, 0.04, 1.0, 3)
    plan = make_plan(recipe)
    assert plan.data_parallel_size == 2 and plan.iterations == 97_500 and plan.tokens == 97_500 * 2 * 4096
    lines = "\n".join(plan.lines())
    assert "97,500 iterations" in lines
    assert "3 epochs x 65,000 examples / global batch 2; global batch 2 (1 per data-parallel rank)" in lines
    assert "warmup 3,900 iterations, clip 1" in lines


def test_distill_paper_recipe_has_the_papers_budget():
    for name in ("qwen3_8b_osprey_distill_2gpu_h100_bf16", "qwen3_8b_eagle3_distill_2gpu_h100_bf16"):
        cfg = stage_config(name, "distill")
        assert (
            cfg.training.global_batch_size,
            cfg.training.num_train_iters(),
            cfg.optimizer.lr,
            cfg.optimizer.clip_grad,
            cfg.lr_warmup_fraction,
            cfg.warmup_iters(),
        ) == (2, 97_500, 1e-4, 1.0, 0.04, 3900)


def test_the_entry_points_refuse_another_stages_recipe(capsys):
    with pytest.raises(SystemExit):
        distill_config_from_args(["--recipe", "qwen3_4b_backbone_pretrain_10k_64gpu_h100_bf16"])
    assert "is a pretrain recipe; distill takes one of: qwen3_8b_osprey_distill" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        config_from_args(["--recipe", "tiny_cpu_demo_1proc_fp32"])
    assert "is a demo recipe" in capsys.readouterr().err


def test_plan_refuses_a_zero_batch_size_in_one_line(capsys):
    recipe = "qwen3_4b_backbone_pretrain_10k_64gpu_h100_bf16"
    assert cli.main(["plan", recipe, "--set", "training.micro_batch_size=0"]) == 2
    err = capsys.readouterr().err
    assert "training.micro_batch_size must be >= 1, got 0" in err and "Traceback" not in err


def test_a_recipe_setting_the_entry_point_cannot_take_is_refused_before_launch():
    # Pretraining has no expert parallelism flag: the launcher says so instead of starting a job that would not parse.
    recipe = resolve_recipe("tiny_cpu_backbone_pretrain_2proc_fp32", ["layout.expert_model_parallel_size=2"])
    with pytest.raises(ValueError, match=r"parallel.expert_model_parallel_size = 2 has no command-line flag"):
        entry_args(recipe, "pretrain")
