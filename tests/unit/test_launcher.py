"""The launcher: every recipe plans (without torch), jobs receive the recipe rather than flags, and the config a job
resolves is the one `osprey plan` prints."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cli import main as osprey
from launcher.cli import resolved_config
from launcher.commands import job_args, local_argv
from launcher.plan import LayoutError, check_plan, make_plan
from launcher.render import render
from megatron_osprey.base.run_config import to_plain
from megatron_osprey.recipes import RECIPES, get_recipe, resolve_recipe
from megatron_osprey.recipes.registry import stage_resolver
from tests.unit.test_target_configs import LLAMA31_8B_INSTRUCT, MINIMAX_M25, QWEN3_30B_A3B, QWEN3_32B

REPO = Path(__file__).resolve().parents[2]

_NO_TORCH = """
import sys, json, io, contextlib
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not installed on this login node")
sys.meta_path.insert(0, Block())
from launcher.cli import main
out = {}
for name in sys.argv[1:]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main(["plan", name, "--json"])
    out[name] = (code, buffer.getvalue())
assert "torch" not in sys.modules
print(json.dumps(out))
"""


def test_every_listed_recipe_plans_in_a_process_where_torch_cannot_import():
    done = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, *RECIPES], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    plans = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(plans) == set(RECIPES) and len(plans) >= 30
    for name, (code, text) in plans.items():
        assert code == 0, (name, text)
        plan = json.loads(text)
        one = plan if isinstance(plan, dict) else plan[-1]
        assert one["fits"] is True and one["memory_gib_per_gpu"] > 0, name


def _plan(name: str, stage: str, overrides=()) -> dict:
    return make_plan(resolve_recipe(name, list(overrides)), stage).to_json()


def test_plan_json_carries_the_budget_and_the_target_shape():
    qwen = _plan("qwen3_8b_osprey_distill_2gpu_h100_bf16", "distill")
    assert (qwen["train_iters"], qwen["global_batch_size"], qwen["seq_length"]) == (97_500, 2, 4096)
    assert qwen["tokens"] == 97_500 * 2 * 4096
    assert qwen["target"]["hidden_size"] == 4096 and qwen["target"]["num_layers"] == 36
    assert qwen["target"]["aux_layer_ids"] == [1, 17, 32]
    assert {"memory_gib_per_gpu", "gpu_memory_gib", "fits"} <= set(qwen) and qwen["gpu_memory_gib"] == 79.6
    llama = _plan("llama33_70b_osprey_distill_8gpu_h100_bf16", "distill")
    assert (llama["train_iters"], llama["global_batch_size"]) == (37_500, 8)  # the release's train.sh
    minimax = _plan("minimax_m25_osprey_distill_8gpu_h100_bf16", "distill")
    # The release's run (examples/minimax-m25/train.sh): stopped at step 35,000 of a 53,172-step cosine.
    assert minimax["target"]["aux_layer_ids"] == [1, 30, 58] and minimax["train_iters"] == 35_000
    assert minimax["fits"] and 55 < minimax["memory_gib_per_gpu"] < 79.6  # BF16 at TP 8 / EP 8 on H100
    assert get_recipe("minimax_m25_osprey_distill_8gpu_h100_bf16").domain == "code"  # the paper: code only
    for label, steps in (("55k", 55_000), ("10k", 10_000)):
        plan = _plan(f"qwen3_4b_backbone_pretrain_{label}_64gpu_h100_bf16", "pretrain")
        assert (plan["train_iters"], plan["global_batch_size"], plan["seq_length"]) == (steps, 2048, 4096)
    assert _plan("qwen3_4b_backbone_pretrain_55k_64gpu_h100_bf16", "pretrain")["tokens"] == 461_373_440_000


def test_an_own_target_is_planned_from_its_config_json_alone(tmp_path):
    target = tmp_path / "Qwen3-32B"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(QWEN3_32B))
    spec = "qwen3_8b_osprey_distill_2gpu_h100_bf16"
    plan = _plan(spec, "distill", [f"paths.target={target}"])
    assert plan["target"]["hidden_size"] == 5120 and plan["target"]["num_layers"] == 64
    assert plan["target"]["aux_layer_ids"] == [1, 31, 60] and plan["target"]["source"].endswith("config.json")
    (target / "config.json").write_text(json.dumps(QWEN3_32B | {"num_hidden_layers": 48}))
    assert _plan(spec, "distill", [f"paths.target={target}"])["target"]["num_layers"] == 48
    with pytest.raises(ValueError, match="Hugging Face Hub id"):
        _plan(spec, "distill", ["paths.target=Qwen/Qwen3-32B"])


@pytest.mark.parametrize(
    "config, recipe, layout",
    [
        (QWEN3_32B, "qwen3_8b_osprey_distill_2gpu_h100_bf16", []),
        (LLAMA31_8B_INSTRUCT, "llama33_70b_osprey_distill_8gpu_h100_bf16", []),
        # 4 KV heads: TP 8 is refused naming the flag, so the 8-GPU MoE layout takes TP 4 here.
        (QWEN3_30B_A3B, "minimax_m25_osprey_distill_8gpu_h100_bf16", ["distill.parallel.tensor_model_parallel_size=4"]),
        (MINIMAX_M25, "minimax_m25_osprey_distill_8gpu_h100_bf16", []),
    ],
)
def test_each_published_config_is_planned_from_its_config_json_alone(tmp_path, config, recipe, layout):
    (tmp_path / "config.json").write_text(json.dumps(config))
    plan = _plan(recipe, "distill", [f"paths.target={tmp_path}", *layout])
    target = plan["target"]
    assert (target["hidden_size"], target["num_layers"]) == (config["hidden_size"], config["num_hidden_layers"])
    layers = config["num_hidden_layers"]
    assert target["aux_layer_ids"] == [1, layers // 2 - 1, layers - 4]  # EAGLE-3's low / mid / high
    assert plan["memory_gib_per_gpu"] > 0 and isinstance(plan["fits"], bool)


def test_a_layout_that_does_not_divide_is_refused_naming_the_flag():
    with pytest.raises(LayoutError, match=r"tensor-model-parallel-size \(3\)"):
        _plan("qwen3_8b_osprey_distill_2gpu_h100_bf16", "distill", ["distill.parallel.tensor_model_parallel_size=3"])
    with pytest.raises(LayoutError, match="global-batch-size 3"):
        _plan("qwen3_8b_osprey_distill_2gpu_h100_bf16", "distill", ["distill.training.global_batch_size=3"])
    bigger = ["distill.training.micro_batch_size=8", "distill.training.global_batch_size=16"]
    plan = make_plan(resolve_recipe("qwen3_8b_osprey_distill_2gpu_h100_bf16", bigger), "distill")
    with pytest.raises(LayoutError, match="more than the 79.6 GiB"):
        check_plan(plan)


def test_a_gpu_recipe_without_transformer_engine_is_refused_for_moe_and_sequence_parallel():
    with pytest.raises(LayoutError, match="needs Transformer Engine"):
        _plan("minimax_m25_osprey_distill_8gpu_h100_bf16", "distill", ["distill.drafter.transformer_impl=local"])
    with pytest.raises(LayoutError, match="--sequence-parallel on CUDA needs Transformer Engine"):
        _plan("qwen3_4b_backbone_pretrain_10k_64gpu_h100_bf16", "pretrain",
              ["pretrain.model.transformer_impl=local", "pretrain.parallel.sequence_parallel=true",
               "pretrain.parallel.tensor_model_parallel_size=2"])  # fmt: skip
    cpu = ["pretrain.parallel.sequence_parallel=true", "pretrain.parallel.tensor_model_parallel_size=2"]
    # The CPU layer handles torch norms under SP.
    assert _plan("tiny_cpu_backbone_pretrain_2proc_fp32", "pretrain", cpu)["fits"]


def test_a_job_receives_the_recipe_and_its_overrides_not_a_flag_list(tmp_path):
    args = job_args("qwen3_8b_osprey_distill_2gpu_h100_bf16:code", "distill", str(tmp_path), ["training.lr=2e-4"])
    assert args == [
        "-m",
        "megatron_osprey",
        "distill",
        "--recipe",
        "qwen3_8b_osprey_distill_2gpu_h100_bf16:code",
        "--run-dir",
        str(tmp_path),
        "--set",
        "training.lr=2e-4",
    ]
    recipe = get_recipe("tiny_cpu_backbone_pretrain_2proc_fp32")
    argv = local_argv(recipe, "tiny_cpu_backbone_pretrain_2proc_fp32", "pretrain", str(tmp_path))
    assert Path(argv[0]).name == "torchrun" and "--nproc-per-node=2" in argv
    assert local_argv(recipe, "tiny_cpu_backbone_pretrain_2proc_fp32", "preprocess", str(tmp_path))[0] == sys.executable


def test_the_config_a_job_resolves_is_what_plan_prints(tmp_path, capsys):
    spec, run_dir = "qwen3_8b_osprey_distill_2gpu_h100_bf16:math", str(tmp_path / "run")
    overrides = ["optimizer.lr=2e-4", "paths.target=/models/qwen3_8b", "distill.ttt.ttt_steps=3"]
    sets = [word for o in overrides for word in ("--set", o)]
    assert osprey(["plan", spec, "--stage", "distill", "--run-dir", run_dir, "--config", *sets]) == 0
    out = capsys.readouterr().out
    printed = json.loads(out[out.index("\n{") :])
    assert printed["stage"] == "distill"
    _, stage_overrides = stage_resolver(spec, "distill", overrides, run_dir)
    assert stage_overrides == ["optimizer.lr=2e-4"]  # a key of the stage's config; the others shape the recipe
    resolved = resolved_config(spec, "distill", overrides, run_dir)
    assert resolved.training.seq_length == 4096 and resolved.ttt.ttt_steps == 3
    assert resolved.target.path == "/models/qwen3_8b" and resolved.data.domain == "math"
    assert resolved.drafter.drafter_init == f"{run_dir}/adapt" and resolved.checkpoint.save == f"{run_dir}/distill"
    # The stage module's own parse of the job's argv gives the very config the plan printed.
    from megatron_osprey.stages.distill import config_from_args

    config, invocation = config_from_args(job_args(spec, "distill", run_dir, overrides)[3:], recipes=stage_resolver)
    assert to_plain(config) == to_plain(resolved) == printed["config"] and invocation.recipe == spec
    assert config.optimizer.lr == 2e-4


def test_adapt_reads_the_pretrained_backbone_of_its_chain():
    recipe = get_recipe("smollm2_cpu_smoke")
    assert recipe.config("adapt", "/r").backbone == "/r/pretrain"
    assert recipe.config("pretrain", "/r").model.backbone == "/r/prune"
    assert recipe.config("pretrain", "/r").data.data_path == ["/r/preprocess/text_text_document"]
    assert recipe.config("distill", "/r").drafter.drafter_init == "/r/adapt"
    assert recipe.config("distill", "/r").data.hidden_states == "/r/extract"
    assert recipe.config("export", "/r").checkpoint == "/r/distill"
    # A target chain without pretraining reads the backbone a pretraining run left (paths.backbone).
    osprey = resolve_recipe("qwen3_8b_osprey_distill_2gpu_h100_bf16", ["paths.backbone=/runs/bb/pretrain"])
    assert osprey.config("adapt", "/r").backbone == "/runs/bb/pretrain"


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_stage_of_every_recipe_renders_a_script_that_bash_and_shellcheck_accept(name, tmp_path):
    recipe = get_recipe(name)
    paths = []
    for stage in recipe.chain:
        script = render(recipe, name, stage, str(tmp_path / "run"), ["optimizer.lr=1e-4"] if stage == "distill" else [])
        path = tmp_path / f"{stage}.sbatch"
        path.write_text(script)
        paths.append(path)
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0, stage
        if "sglang.launch_server" not in script or stage == "regenerate":  # GPU eval serves the export instead
            assert f"ENTRY=(-m megatron_osprey {stage} --recipe " in script, stage
        assert "--gpus-per-node" in script or recipe.hardware == "cpu", stage
    if shutil.which("shellcheck"):  # .ci/run installs it
        lint = subprocess.run(["shellcheck", "-S", "warning", *map(str, paths)], capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout[-3000:]


def test_eval_on_gpus_sweeps_batch_sizes_with_a_target_only_pass(tmp_path):
    name = "qwen3_8b_osprey_distill_2gpu_h100_bf16"
    script = render(get_recipe(name), name, "evaluate", str(tmp_path))
    assert 'BATCH_SIZES="${BATCH_SIZES:-1 16}"' in script
    assert '--max-running-requests "$batch"' in script and "target_only" in script
    assert "--max-running-requests 1 " not in script
    regen = render(get_recipe(name), name, "regenerate", str(tmp_path))
    assert '"$SGLANG_PYTHON" -m sglang.launch_server' in regen and "--reasoning-parser" in regen
    assert "--api-key-env OSPREY_SERVER_API_KEY" in regen and 'echo "$OSPREY_SERVER_API_KEY' not in regen
    assert f'PYTHON="${{PYTHON:-{sys.executable}}}"' in regen


def test_a_stage_level_train_iters_reaches_the_templates_requeue_check(tmp_path):
    # The job applies `training.train_iters=...` itself; the template must compare against the same number.
    name = "tiny_cpu_backbone_pretrain_2proc_fp32"
    recipe = get_recipe(name)
    iters = 3 * recipe.pretrain.training.train_iters
    script = render(recipe, name, "pretrain", str(tmp_path), [f"training.train_iters={iters}"])
    assert f"\nTRAIN_ITERS={iters}\n" in script and f"--set training.train_iters={iters}" in script


@pytest.mark.parametrize("key, value", [("cpus_per_task", -4), ("nodes", 0), ("array_tasks", 0), ("gpus_per_node", 0)])
def test_values_that_would_break_the_script_are_refused(tmp_path, key, value):
    name = "smollm2_cpu_smoke"
    with pytest.raises(ValueError, match="quote"):
        render(get_recipe(name), name, "prune", str(tmp_path / "it's"))
    with pytest.raises(ValueError, match=rf"^recipe {name}: resources\.extract\.{key} must be at least 1\.$"):
        render(resolve_recipe(name, [f"resources.extract.{key}={value}"]), name, "extract", str(tmp_path))
    # A recipe built in code, never validated, is refused when its script is rendered.
    recipe = get_recipe(name)
    bad = dataclasses.replace(recipe.stage_resources("extract"), **{key: value})
    unchecked = dataclasses.replace(recipe, resources={**recipe.resources, "extract": bad})
    with pytest.raises(ValueError, match=rf"^resources\.extract\.{key} must be at least 1, got {value}\.$"):
        render(unchecked, name, "extract", str(tmp_path))


def test_each_default_is_written_once():
    # The defaults of the TTT depth and the global batch live in their components' configs, nowhere else.
    package = REPO / "megatron_osprey"
    hits = {}
    for pattern in (r"ttt_steps\s*(:\s*int\s*)?=\s*5\b", r"global_batch_size\s*(:\s*int \| None\s*)?=\s*None\b"):
        hits[pattern] = [
            str(p.relative_to(REPO))
            for p in package.rglob("*.py")
            for line in p.read_text().splitlines()
            if re.search(pattern, line) and not line.strip().startswith("#")
        ]
    assert list(hits.values()) == [["megatron_osprey/losses/config.py"], ["megatron_osprey/training/config.py"]]


def test_yaml_recipe_is_a_base_plus_keys(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("base: qwen3_8b_osprey_distill_2gpu_h100_bf16:code\ndistill:\n  ttt:\n    ttt_steps: 4\n")
    recipe = resolve_recipe(str(path))
    assert recipe.name == "mine" and recipe.domain == "code" and recipe.distill.ttt.ttt_steps == 4
    path.write_text("base: qwen3_8b_osprey_distill_2gpu_h100_bf16\ndistill:\n  ttt:\n    nope: 4\n")
    with pytest.raises(ValueError, match="no key 'nope'"):
        resolve_recipe(str(path))


def test_osprey_errors_are_one_line(capsys):
    assert osprey(["plan", "no_such_recipe"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("osprey: error: recipe 'no_such_recipe' is unknown") and err.count("\n") == 1


def test_osprey_ngram_runs_the_ngram_stage_with_its_own_flags(tmp_path):
    from launcher.cli import FLAG_DOORS
    from launcher.commands import FLAG_STAGES

    assert set(FLAG_DOORS) == set(FLAG_STAGES)
    script = "import sys; from launcher.cli import main; sys.exit(main(sys.argv[1:]))"
    run = [sys.executable, "-c", script, "ngram"]
    shown = subprocess.run([*run, "--help"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0 and "python -m megatron_osprey ngram" in shown.stdout, shown.stderr
    assert "--order" in shown.stdout and "--tokenizer" in shown.stdout
    refused = subprocess.run(
        [*run, "--tokenizer", str(tmp_path), "--output", str(tmp_path / "ng")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 2 and refused.stderr.strip() == "error: --input is required."


_STUB_SRUN = """#!/bin/bash
printf '%s\\n' "$*" >> "$SRUN_LOG"
"""
# A server is healthy once its srun step has started (the stub logs its --port).
_STUB_CURL = """#!/bin/bash
port="${!#%/health}"; grep -q -- "--port ${port##*:} " "$SRUN_LOG"
"""
_STUB_SCONTROL = """#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] && tr ',' '\\n' <<<"$3"
"""


def _run_regenerate(script: str, tmp_path: Path, srun: str = _STUB_SRUN) -> list[str]:
    """The rendered regenerate job run under stub srun / scontrol / curl; the srun command lines it issued."""
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", script, re.M).group(1))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", srun), ("scontrol", _STUB_SCONTROL), ("curl", _STUB_CURL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    path, log = tmp_path / "regenerate.sbatch", tmp_path / "srun.log"
    path.write_text(script)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": ",".join(f"node{i}" for i in range(nodes)),
        "SRUN_LOG": str(log),
        "OSPREY_REPO": str(tmp_path),
    }
    done = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return log.read_text().splitlines()


# srun that also writes down whether its step got the job's key as VLLM_API_KEY (never its value).
_STUB_SRUN_KEY = """#!/bin/bash
printf '%s\\n' "$*" >> "$SRUN_LOG"
if [[ -n "${VLLM_API_KEY:-}" && "$VLLM_API_KEY" == "$OSPREY_SERVER_API_KEY" ]]; then
  printf '%s\\n' "$*" >> "$SRUN_LOG.keyed"
fi
"""


def _fake_vllm_venv(root: Path, with_preload: bool) -> Path:
    python = root / ".venv-vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    if with_preload:
        (root / ".venv-vllm" / "lib").mkdir()
        (root / ".venv-vllm" / "lib" / "libiomp5.so").write_text("")
    return python


def test_the_cpu_smoke_regenerates_through_vllm_where_the_checkout_has_its_environment(tmp_path):
    cpu = get_recipe("smollm2_cpu_smoke")
    script = render(cpu, "smollm2_cpu_smoke", "regenerate", str(tmp_path / "run"))
    python = _fake_vllm_venv(tmp_path, with_preload=True)  # OSPREY_REPO is tmp_path: its .venv-vllm is found
    lines = _run_regenerate(script, tmp_path, srun=_STUB_SRUN_KEY)
    servers = [line for line in lines if "vllm.entrypoints.openai.api_server" in line]
    assert len(servers) == 1 and not [line for line in lines if "serve_local.py" in line]
    server = servers[0]
    assert f"env LD_PRELOAD={tmp_path}/.venv-vllm/lib/libiomp5.so {python} -m vllm.entrypoints" in server
    assert "--host 127.0.0.1 " in server and "--tensor-parallel-size 1 " in server
    assert "--enforce-eager --kv-cache-memory-bytes 1073741824" in server
    assert "api-key" not in server.replace("--api-key-env OSPREY_SERVER_API_KEY", "")  # the key travels in the env
    assert server in (tmp_path / "srun.log.keyed").read_text().splitlines()
    (client,) = [line for line in lines if "-m megatron_osprey regenerate" in line]
    assert "--api-key-env OSPREY_SERVER_API_KEY" in client and "--server-url http://127.0.0.1:" in client


def test_the_regeneration_engine_is_a_recipe_and_environment_choice(tmp_path):
    name = "qwen3_8b_osprey_distill_2gpu_h100_bf16"
    script = render(resolve_recipe(name, ["servers.engine=vllm"]), name, "regenerate", str(tmp_path / "run"))
    assert 'SERVER_ENGINE="${SERVER_ENGINE:-vllm}"' in script
    _fake_vllm_venv(tmp_path, with_preload=True)
    lines = _run_regenerate(script, tmp_path)
    servers = [line for line in lines if "vllm.entrypoints.openai.api_server" in line]
    assert len(servers) == get_recipe(name).servers.servers and not any("sglang" in line for line in lines)
    # GPUs: one GPU per server at TP 1, the recipe's reasoning parser and context length, no CPU-only flags.
    assert all("--gpus=1 " in line and "--reasoning-parser qwen3 " in line for line in servers)
    assert all("--max-model-len " in line and "--enforce-eager" not in line and "LD_PRELOAD" not in line
               for line in servers)  # fmt: skip
    # Without the engine's environment the job stops with the install sentence; a CPU job falls back to the local
    # server, and SERVER_ENGINE chooses at submit time.
    bare = tmp_path / "bare"
    bare.mkdir()
    path = bare / "job.sbatch"
    path.write_text(script)
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n0", "OSPREY_REPO": str(bare)}
    done = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "install it with `make engine-vllm`" in done.stderr
    cpu = render(get_recipe("smollm2_cpu_smoke"), "smollm2_cpu_smoke", "regenerate", str(bare / "run"))
    assert any("serve_local.py" in line for line in _run_regenerate(cpu, bare))
    with pytest.raises(ValueError, match="servers.engine 'tgi' is not one of sglang, vllm, local"):
        resolve_recipe(name, ["servers.engine=tgi"]).validate()


def _mib(size: str) -> int:
    return int(size[:-1]) * {"M": 1, "G": 1024, "T": 1024**2}[size[-1]]


REGENERATING = ("qwen3_8b_osprey_distill_2gpu_h100_bf16", "llama33_70b_eagle3_distill_8gpu_b200_bf16")


@pytest.mark.parametrize("name", REGENERATING)
def test_each_regeneration_server_step_asks_for_its_share_of_the_node_memory(name, tmp_path):
    recipe = get_recipe(name)
    script = render(recipe, name, "regenerate", str(tmp_path / "run"))
    node_mem = re.search(r"^#SBATCH --mem=(\S+)$", script, re.M).group(1)
    per_node = int(re.search(r"^#SBATCH --ntasks-per-node=(\d+)$", script, re.M).group(1))
    lines = _run_regenerate(script, tmp_path)
    servers = [line for line in lines if "sglang.launch_server" in line]
    assert len(servers) == recipe.servers.servers and per_node == 8 // recipe.servers.tensor_parallel_size
    shares = {re.search(r"--mem=(\S+)", line).group(1) for line in servers if "--exact" in line and "--mem=" in line}
    assert len(shares) == 1 and len([line for line in servers if "--mem=" in line]) == len(servers)
    # The servers of one node together ask for the job's memory per node, so they all start at once.
    assert 0 <= _mib(node_mem) - per_node * _mib(shares.pop()) < per_node
    client = [line for line in lines if "-m megatron_osprey regenerate" in line]
    assert len(client) == 1 and "--overlap" in client[0] and "--mem=" not in client[0]


def test_the_regeneration_memory_is_a_recipe_setting(tmp_path):
    gpu = [n for n in RECIPES if "regenerate" in get_recipe(n).chain and get_recipe(n).hardware != "cpu"]
    share = re.compile(r'^SERVER_MEM="\d+[MG]"$', re.M)
    assert gpu and all(share.search(render(get_recipe(n), n, "regenerate", "r")) for n in gpu)
    name = "qwen3_8b_osprey_distill_2gpu_h100_bf16"
    script = render(resolve_recipe(name, ["resources.regenerate.mem=800G"]), name, "regenerate", str(tmp_path))
    assert "#SBATCH --mem=800G" in script and 'SERVER_MEM="100G"' in script  # 8 servers at TP 1
    with pytest.raises(ValueError, match="resources.regenerate.mem = '800GiB' is not a Slurm memory size"):
        render(resolve_recipe(name, ["resources.regenerate.mem=800GiB"]), name, "regenerate", str(tmp_path))
    # The CPU smoke chain has one local server: it asks for the whole job's memory, as before.
    cpu = get_recipe("smollm2_cpu_smoke")
    lines = _run_regenerate(render(cpu, "smollm2_cpu_smoke", "regenerate", str(tmp_path / "run")), tmp_path)
    servers = [line for line in lines if "tools/serve_local.py" in line]
    assert len(servers) == 1 and f"--mem={cpu.stage_resources('regenerate').mem} " in servers[0]


# srun's own options (and pyxis's), then the task's command, started here as Slurm starts task 0.
_STUB_TASK_SRUN = """#!/bin/bash
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NTASKS=1 exec "$@"
"""
_STUB_PYTHON = """#!/bin/bash
env > "$TASK_ENV"
printf '%s\\n' "$@" > "$TASK_ENV.args"
"""


def _task_environment(script: str, tmp_path: Path) -> tuple[dict[str, str], list[str]]:
    """Run a rendered distributed job under stub srun / scontrol; the environment and arguments its training
    process got."""
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", script, re.M).group(1))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", _STUB_TASK_SRUN), ("scontrol", _STUB_SCONTROL), ("python-task", _STUB_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    path, task_env = tmp_path / "job.sbatch", tmp_path / "task.env"
    path.write_text(script)
    task_env.unlink(missing_ok=True)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": ",".join(f"node{i}" for i in range(nodes)),
        "OSPREY_REPO": str(tmp_path),
        "PYTHON": str(bin_dir / "python-task"),
        "TASK_ENV": str(task_env),
    }
    done = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=60)
    logs = "".join(p.read_text() for p in tmp_path.rglob("*.log"))
    assert done.returncode == 0 and task_env.is_file(), done.stdout + done.stderr + logs
    args = Path(f"{task_env}.args").read_text().splitlines()
    return dict(line.split("=", 1) for line in task_env.read_text().splitlines() if "=" in line), args


GPU_RECIPES = sorted(n for n in RECIPES if get_recipe(n).hardware != "cpu")


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_every_megatron_stage_of_a_gpu_recipe_trains_with_one_cuda_connection(name, tmp_path):
    # Megatron-Core overlaps tensor-parallel communication with compute only when kernels queue on one
    # connection: the training process of each Megatron stage must see CUDA_DEVICE_MAX_CONNECTIONS=1.
    from launcher.render import template_name

    recipe = get_recipe(name)
    stages = [stage for stage in recipe.chain if template_name(recipe, stage) == "distributed"]
    assert stages, name
    for stage in stages:
        env, args = _task_environment(render(recipe, name, stage, str(tmp_path / "run")), tmp_path)
        assert env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1", (stage, env)
        # The training process itself, past srun and the task wrapper: its rank and its stage's module.
        assert env["RANK"] == "0" and env["WORLD_SIZE"] == "1", env
        assert args[args.index("-m") :][:4] == ["-m", "megatron_osprey", stage, "--recipe"], args


def test_osprey_demo_runs_the_demo_with_its_own_flags():
    script = "import sys; from launcher.cli import main; sys.exit(main(sys.argv[1:]))"
    run = [sys.executable, "-c", script, "demo"]
    shown = subprocess.run([*run, "--help"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0 and "--arms" in shown.stdout and "--full" in shown.stdout, shown.stderr
    refused = subprocess.run([*run, "--arms", "bogus"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--arms bogus" in refused.stderr


def _run_stage_job(script: str, tmp_path: Path, **environ: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """A rendered one-step job run under a stub srun that logs its command line; (the run, the srun lines)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(_STUB_SRUN)
    (bin_dir / "srun").chmod(0o755)
    path, log = tmp_path / "job.sbatch", tmp_path / "srun.log"
    path.write_text(script)
    log.unlink(missing_ok=True)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "4242", "SRUN_LOG": str(log), **environ}
    env.setdefault("OSPREY_REPO", str(tmp_path))
    done = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=60)
    return done, log.read_text().splitlines() if log.exists() else []


def test_a_vllm_recipe_evaluates_in_vllm_with_its_tensor_parallel_size_and_concurrency_sweep(tmp_path):
    name = "llama33_70b_eagle3_distill_8gpu_b200_bf16"
    recipe = resolve_recipe(name, ["servers.engine=vllm", "servers.batch_sizes=[1,4,16]"])
    tp = recipe.servers.tensor_parallel_size
    assert tp > 1
    script = render(recipe, name, "evaluate", str(tmp_path / "run"))
    assert (
        script.startswith("#!/bin/bash\n# Evaluate the exported drafter in vLLM")
        and "-m megatron_osprey evaluate" in script
    )
    assert f"#SBATCH --gpus-per-node={tp}" in script
    python = _fake_vllm_venv(tmp_path, with_preload=False)
    done, (line,) = _run_stage_job(script, tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"--gpus={tp} " in line and "-m megatron_osprey evaluate --recipe " + name in line
    assert line.endswith(
        f"--engine vllm --vllm-python {python} --vllm-concurrency 1 4 16 "
        f"--vllm-tensor-parallel-size {tp} --vllm-compile"
    )
    # Named vLLM but not installed: the install sentence, no job step.
    bare = tmp_path / "bare"
    bare.mkdir()
    done, lines = _run_stage_job(script, bare)
    (log,) = (tmp_path / "run" / "logs").glob("osprey-evaluate-*-restart0.log")
    assert done.returncode == 1 and "install it with `make engine-vllm`" in log.read_text() and not lines
    if shutil.which("shellcheck"):
        (tmp_path / "eval_vllm.sbatch").write_text(script)
        lint = subprocess.run(["shellcheck", "-S", "warning", str(tmp_path / "eval_vllm.sbatch")], capture_output=True)
        assert lint.returncode == 0, lint.stdout.decode()


def test_the_cpu_chain_can_evaluate_in_vllm_where_the_job_finds_it(tmp_path):
    name = "smollm2_cpu_smoke"
    recipe = get_recipe(name)  # its eval job is eval_vllm's, with the concurrency sweep 1 and 4
    assert recipe.slurm.templates == {"evaluate": "eval_vllm"}
    script = render(recipe, name, "evaluate", str(tmp_path / "run"))
    python = _fake_vllm_venv(tmp_path, with_preload=True)
    done, (line,) = _run_stage_job(script, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--gpus" not in line and line.endswith(f"--engine vllm --vllm-python {python} --vllm-concurrency 1 4")
    # No engine and none named: the reference engine alone, as the CPU stage template runs it.
    bare = tmp_path / "bare"
    bare.mkdir()
    done, (line,) = _run_stage_job(script, bare)
    assert done.returncode == 0 and "--engine" not in line
    assert line.endswith(f"-m megatron_osprey evaluate --recipe {name} --run-dir {tmp_path / 'run'}")


@pytest.mark.parametrize("domain", ["../../escape", "a/b", "..", ".hidden"])
def test_a_recipe_domain_that_leaves_the_run_directory_is_refused_naming_it(tmp_path, capsys, domain):
    # The case: RECIPE:../../x gave job names and log paths (prompts/../../x.jsonl) outside the run dir.
    spec = f"qwen3_8b_osprey_distill_2gpu_h100_bf16:{domain}"
    assert osprey(["plan", spec, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"domain {domain!r} is not a domain name" in err and err.count("\n") == 1, err
    # A YAML recipe's domain and eval domains too.
    recipe_file = tmp_path / "mine.yaml"
    recipe_file.write_text(f"base: qwen3_8b_osprey_distill_2gpu_h100_bf16:code\neval_domains: [math, '{domain}']\n")
    with pytest.raises(ValueError, match=rf"recipe mine: eval_domains {re.escape(repr(domain))} is not a domain name"):
        resolve_recipe(str(recipe_file))
    assert get_recipe("qwen3_8b_osprey_distill_2gpu_h100_bf16:code.v2-x_1").domain == "code.v2-x_1"


def test_cpus_per_task_follow_the_node_and_plan_refuses_what_a_node_cannot_give(tmp_path, capsys):
    """8 tasks x 16 CPUs never schedule on a 96-vCPU H100 node: a task gets the node's CPUs per GPU (12), a
    regeneration server its GPUs' share, and a layout asking more CPUs or GPUs than a node has is refused."""
    name = "llama33_70b_osprey_distill_8gpu_h100_bf16"
    recipe = get_recipe(name)
    assert recipe.stage_resources("distill").cpus_per_task == 12
    assert recipe.stage_resources("regenerate").cpus_per_task == 96 // recipe.tasks_per_node("regenerate")
    assert "node: 8 task(s) x 12 CPUs = 96 of 96 CPUs, 8 of 8 GPUs" in make_plan(recipe, "distill").checks
    script = render(get_recipe(name), name, "distill", str(tmp_path))
    assert "#SBATCH --cpus-per-task=12" in script and "--ntasks-per-node=8" in script
    bigger = resolve_recipe(name, ["slurm.cpus_per_node=224"])
    assert bigger.stage_resources("distill").cpus_per_task == 28
    assert osprey(["plan", name, "--stage", "distill", "--set", "resources.distill.cpus_per_task=16"]) == 2
    err = capsys.readouterr().err
    assert "8 task(s) per node x resources.distill.cpus_per_task 16 = 128 CPUs, more than the 96" in err
    assert osprey(["plan", name, "--stage", "distill", "--set", "resources.distill.gpus_per_node=16"]) == 2
    assert "resources.distill.gpus_per_node 16 is more than the 8 GPUs" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name", ["minimax_m25_osprey_distill_8gpu_h100_bf16", "minimax_m25_osprey_opd_distill_4gpu_b200_bf16"]
)
def test_a_moe_targets_distill_plans_the_dense_drafter_at_ep1_inside_the_jobs_ep(name):
    """The job's EP is the MoE target's; the drafter is validated (and built) with EP 1 inside that layout."""
    recipe = get_recipe(name)
    ep = recipe.config("distill").parallel.expert_model_parallel_size
    assert ep > 1
    checks = make_plan(recipe, "distill").checks
    assert f"drafter: dense, built at expert parallel size 1 inside the job's EP {ep} layout" in " ".join(checks)
