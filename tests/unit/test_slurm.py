"""launcher/slurm/*.sbatch: every template renders for every recipe, parses, and wires srun / python as documented.

The rendered scripts run under bash with fake srun, scontrol, curl, python and sbatch on PATH that
record their command lines and environment.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from launcher import cli
from launcher.commands import REPO_ROOT
from launcher.render import STAGE_TEMPLATES, render, render_text
from megatron_osprey.config.recipes import RECIPES, get_recipe, resolve_recipe

FAKES = {
    "srun": r"""#!/usr/bin/env bash
echo "SRUN $*" >> "$FAKE_RECORD"
nodes=1; per_node=1; ntasks=""
while [[ $# -gt 0 && $1 == -* ]]; do
  case $1 in
    --nodes=*) nodes=${1#*=} ;;
    --ntasks-per-node=*) per_node=${1#*=} ;;
    --ntasks=*) ntasks=${1#*=} ;;
  esac
  shift
done
if [[ -n $ntasks ]]; then per_node=$ntasks; total=$ntasks; else total=$((nodes * per_node)); fi
for ((t = 0; t < total; t++)); do
  SLURM_PROCID=$t SLURM_LOCALID=$((t % per_node)) SLURM_NTASKS=$total "$@" || exit $?
done
""",
    "python": r"""#!/usr/bin/env bash
echo "PYTHON RANK=${RANK:-} LOCAL_RANK=${LOCAL_RANK:-} WORLD_SIZE=${WORLD_SIZE:-} MASTER_ADDR=${MASTER_ADDR:-} MASTER_PORT=${MASTER_PORT:-} ARGS=$*" >> "$FAKE_RECORD"
""",
    "scontrol": r"""#!/usr/bin/env bash
if [[ $1 == show && $2 == hostnames ]]; then tr ',' '\n' <<< "$3"; exit 0; fi
echo "SCONTROL $*" >> "$FAKE_RECORD"
""",
    "curl": """#!/usr/bin/env bash
echo "CURL $*" >> "$FAKE_RECORD"
""",
    "sbatch": """#!/usr/bin/env bash
echo "SBATCH $*" >> "$FAKE_RECORD"
echo "Submitted batch job 4242"
""",
}


@pytest.fixture
def fake_bin(tmp_path):
    """A PATH directory of recording fakes, and the record file they append to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKES.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    record = tmp_path / "record.txt"
    return bin_dir, record


def _run(script: str, tmp_path: Path, fake_bin, **env) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir, record = fake_bin
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CONTAINER_", "MASTER_"))}
    base.pop("PYTHON", None)
    full_env = {
        **base,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_RECORD": str(record),
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "nodeA,nodeB",
        **env,
    }
    done = subprocess.run(["bash", str(path)], env=full_env, capture_output=True, text=True, timeout=60)
    lines = record.read_text().splitlines() if record.exists() else []
    return done, lines


def _python_calls(lines: list[str]) -> list[dict]:
    calls = []
    for line in lines:
        if line.startswith("PYTHON "):
            head, _, args = line[len("PYTHON ") :].partition(" ARGS=")
            fields = dict(item.split("=", 1) for item in head.split())
            calls.append({**fields, "args": shlex.split(args)})
    return calls


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_every_template_renders_for_every_recipe_and_parses(tmp_path):
    rendered = 0
    for name in RECIPES:
        recipe = get_recipe(name)
        for stage, template in STAGE_TEMPLATES.items():
            if stage in ("regenerate", "extract", "distill", "adapt", "eval") and recipe.target is None:
                continue
            script = render(recipe, stage)
            assert "{{" not in script and script.startswith("#!/bin/bash\n")
            for line in (
                "set -euo pipefail",
                "TERM@300",
                "#SBATCH --requeue",
                ': "${SLURM_JOB_ID:?',
                "git -C",
                "SLURM_RESTART_COUNT",
            ):
                assert line in script, (name, stage, line)
            # A script that traps TERM itself needs the signal sent to the batch shell (B:).
            signal = "#SBATCH --signal=B:TERM@300" if "trap on_term TERM" in script else "#SBATCH --signal=TERM@300"
            assert signal in script, (name, stage)
            # Slurm 22.05-23.02 gives each srun task one CPU unless srun itself asks (the --overlap
            # client step of regenerate shares the servers' allocation).
            for srun in (line.strip() for line in script.splitlines() if line.strip().startswith("srun ")):
                assert "--cpus-per-task=" in srun or "--overlap" in srun, (name, stage, srun)
            path = tmp_path / f"{name}-{stage}.sbatch"
            path.write_text(script)
            check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
            assert check.returncode == 0, (name, stage, check.stderr)
            rendered += 1
    assert rendered > 200


def test_unknown_placeholder_is_refused_naming_the_template():
    with pytest.raises(ValueError, match="my.sbatch uses unknown placeholder.*no_such_thing"):
        render_text("#SBATCH --nodes={{ nodes }} {{no_such_thing}}", {"nodes": 1}, "my.sbatch")
    assert render_text("a={{ nodes }}/{{nodes}}", {"nodes": 3}, "x") == "a=3/3"


def test_distill_job_wires_ranks_resume_logs_and_requeue(tmp_path, fake_bin):
    recipe = resolve_recipe(
        "tiny_cpu_osprey_distill_2proc_fp32:code",
        [f"paths.root={tmp_path}/runs", "layout.nodes=2", "training.global_batch_size=8"],
    )
    script = render(recipe, "distill")
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=2" in script
    save = Path(recipe.resolved_paths()["save"])
    save.mkdir(parents=True)
    (save / "latest_checkpointed_iteration.txt").write_text("5")  # stopped short of train_iters
    done, lines = _run(script, tmp_path, fake_bin, SLURM_RESTART_COUNT="3")
    assert done.returncode == 0, done.stderr + done.stdout

    calls = _python_calls(lines)
    assert [(c["RANK"], c["LOCAL_RANK"], c["WORLD_SIZE"]) for c in calls] == [
        ("0", "0", "4"),
        ("1", "1", "4"),
        ("2", "0", "4"),
        ("3", "1", "4"),
    ]
    assert {c["MASTER_ADDR"] for c in calls} == {"nodeA"} and {c["MASTER_PORT"] for c in calls} == {str(20000 + 77)}
    args = calls[0]["args"]
    assert args[:2] == ["-m", "megatron_osprey.stages.distill"]
    assert _flag(args, "--load") == _flag(args, "--save") == str(save)
    srun = [line for line in lines if line.startswith("SRUN ")]
    assert len(srun) == 1 and "--nodes=2 --ntasks-per-node=2" in srun[0] and "--container" not in srun[0]
    iters = recipe.training.iterations()
    assert "SCONTROL requeue 77" in lines and iters > 5

    log = Path(recipe.resolved_paths()["logs"]) / f"osprey-distill-{recipe.run_name}-77-restart3.log"
    head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    text = log.read_text()
    assert f"git {head.strip()}" in text and "restart 3" in text

    # Finished: no requeue. Container image set: pyxis flags on the srun line.
    (save / "latest_checkpointed_iteration.txt").write_text(str(iters))
    (tmp_path / "record.txt").unlink()
    done, lines = _run(script, tmp_path, fake_bin, CONTAINER_IMAGE="/img/osprey.sqsh")
    assert done.returncode == 0, done.stderr
    assert not any(line.startswith("SCONTROL requeue") for line in lines)
    srun = next(line for line in lines if line.startswith("SRUN "))
    assert "--container-image=/img/osprey.sqsh" in srun and f"--container-workdir={REPO_ROOT}" in srun


def test_pretrain_job_runs_one_task_per_gpu_of_every_node(tmp_path, fake_bin):
    recipe = resolve_recipe("qwen3_4b_backbone_pretrain_10k_64gpu_h100_bf16", [f"paths.root={tmp_path}/runs"])
    nodes = ",".join(f"gpu{i:03d}" for i in range(8))
    done, lines = _run(render(recipe, "pretrain"), tmp_path, fake_bin, SLURM_JOB_NODELIST=nodes)
    assert done.returncode == 0, done.stderr
    calls = _python_calls(lines)
    assert len(calls) == 64 and sorted(int(c["RANK"]) for c in calls) == list(range(64))
    assert {c["WORLD_SIZE"] for c in calls} == {"64"} and {c["MASTER_ADDR"] for c in calls} == {"gpu000"}
    assert {c["LOCAL_RANK"] for c in calls} == {str(i) for i in range(8)}
    args = calls[0]["args"]
    assert _flag(args, "--load") == _flag(args, "--save") and _flag(args, "--train-iters") == "10000"


def test_extract_array_task_picks_its_shard(tmp_path, fake_bin):
    recipe = resolve_recipe("llama33_70b_osprey_distill_8gpu_h100_bf16", [f"paths.root={tmp_path}/runs"])
    script = render(recipe, "extract")
    assert "#SBATCH --array=0-15" in script
    done, lines = _run(
        script,
        tmp_path,
        fake_bin,
        SLURM_ARRAY_TASK_ID="5",
        SLURM_ARRAY_TASK_MIN="2",
        SLURM_ARRAY_TASK_COUNT="4",
        SLURM_ARRAY_JOB_ID="70",
    )
    assert done.returncode == 0, done.stderr
    calls = _python_calls(lines)
    assert len(calls) == 8 and {c["WORLD_SIZE"] for c in calls} == {"8"}
    args = calls[0]["args"]
    assert args[:2] == ["-m", "megatron_osprey.stages.extract"] and _flag(args, "--shard") == "3/4"
    assert _flag(args, "--tensor-model-parallel-size") == "4"
    assert (Path(recipe.resolved_paths()["logs"]) / f"osprey-extract-{recipe.run_name}-70_5-restart0.log").is_file()
    done, _ = _run(script, tmp_path, fake_bin)  # not an array job
    assert done.returncode != 0 and "SLURM_ARRAY_TASK_ID is unset" in done.stderr


def test_preprocess_array_task_reads_its_line_of_the_input_list(tmp_path, fake_bin):
    inputs = tmp_path / "files.txt"
    inputs.write_text("/data/a.jsonl.zst\n/data/b.jsonl.zst\n")
    recipe = resolve_recipe(
        "qwen3_4b_backbone_pretrain_10k_64gpu_h100_bf16",
        [f"paths.root={tmp_path}/runs", f"paths.pretrain_text={inputs}", "data.preprocess_files=2"],
    )
    script = render(recipe, "preprocess", extra=["--strict"])
    assert "#SBATCH --array=0-1" in script and "--gpus-per-node" not in script
    done, lines = _run(script, tmp_path, fake_bin, SLURM_ARRAY_TASK_ID="1", SLURM_CPUS_PER_TASK="12")
    assert done.returncode == 0, done.stderr
    (call,) = _python_calls(lines)
    args = call["args"]
    assert args[:2] == ["-m", "megatron_osprey.data.preprocess_cli"] and _flag(args, "--input") == "/data/b.jsonl.zst"
    assert _flag(args, "--output-prefix") == f"{tmp_path}/runs/data/fineweb/fineweb_00001"
    assert _flag(args, "--workers") == "12" and args[-1] == "--strict"
    done, _ = _run(script, tmp_path, fake_bin, SLURM_ARRAY_TASK_ID="2")
    assert done.returncode != 0


def test_regenerate_starts_a_server_pool_then_uses_every_url(tmp_path, fake_bin):
    recipe = resolve_recipe(
        "llama33_70b_osprey_distill_8gpu_h100_bf16:code", [f"paths.root={tmp_path}/runs", "data.regenerate_servers=4"]
    )
    script = render(recipe, "regenerate")
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=2" in script
    done, lines = _run(script, tmp_path, fake_bin, SERVER_PORT="31000")
    assert done.returncode == 0, done.stderr
    servers = [c for c in _python_calls(lines) if c["args"][:2] == ["-m", "sglang.launch_server"]]
    assert len(servers) == 4 and {_flag(c["args"], "--tp-size") for c in servers} == {"4"}
    assert {_flag(c["args"], "--model-path") for c in servers} == {f"{tmp_path}/runs/models/llama33_70b"}
    urls = ["http://nodeA:31000", "http://nodeA:31001", "http://nodeB:31000", "http://nodeB:31001"]
    assert [line.split()[-1] for line in lines if line.startswith("CURL")] == [f"{u}/health" for u in urls]
    (client,) = [c for c in _python_calls(lines) if c["args"][:2] == ["-m", "megatron_osprey.stages.regenerate"]]
    args = client["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--server-url"] == urls
    assert _flag(args, "--output") == f"{tmp_path}/runs/data/llama33_70b/code.jsonl"


def test_export_job_and_missing_job_id(tmp_path, fake_bin):
    recipe = resolve_recipe("qwen3_8b_osprey_distill_2gpu_h100_bf16", [f"paths.root={tmp_path}/runs"])
    script = render(recipe, "export")
    done, lines = _run(script, tmp_path, fake_bin)
    assert done.returncode == 0, done.stderr
    (call,) = _python_calls(lines)
    assert call["args"][:4] == ["-m", "megatron_osprey.stages.export", "--checkpoint", recipe.resolved_paths()["save"]]
    done, _ = _run(script, tmp_path, fake_bin, SLURM_JOB_ID="")
    assert done.returncode != 0 and "submit this script with sbatch" in done.stderr


def test_submit_dry_run_prints_and_submit_calls_sbatch(tmp_path, fake_bin, capsys, monkeypatch):
    bin_dir, record = fake_bin
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_RECORD", str(record))
    monkeypatch.delenv("SBATCH_PARTITION", raising=False)
    monkeypatch.setenv("SBATCH_ACCOUNT", "proj42")
    args = [
        "submit",
        "qwen3_4b_backbone_pretrain_10k_64gpu_h100_bf16",
        "--set",
        f"paths.root={tmp_path}/runs",
        "--partition",
        "batch",
        "--time",
        "01:00:00",
    ]
    assert cli.main(args + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    for line in (
        "#SBATCH --nodes=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=batch",
        "#SBATCH --account=proj42",
        "#SBATCH --time=01:00:00",
    ):
        assert line in out
    assert not record.exists()

    assert cli.main(args) == 0
    (line,) = record.read_text().splitlines()
    path = Path(line.split()[1])
    assert line.startswith("SBATCH ") and path.parent == tmp_path / "runs" / "logs" / "sbatch"
    assert path.read_text().strip() == out.strip()
    assert cli.main(["submit", "tiny_cpu_demo_1proc_fp32", "--dry-run"]) == 2
    assert "has no Slurm template" in capsys.readouterr().err


def test_eval_sglang_renders_the_recipes_target_drafter_and_tp(tmp_path, fake_bin):
    recipe = resolve_recipe("llama33_70b_osprey_distill_8gpu_h100_bf16:code", [f"paths.root={tmp_path}/runs"])
    script = render(recipe, "eval")
    paths = recipe.resolved_paths()
    # 70B at the target's TP 4: four GPUs, and SGLang started with --tp-size 4; logs where submit creates them.
    for line in (
        "#SBATCH --gpus-per-node=4",
        f"#SBATCH --output={paths['logs']}/%x-%j.out",
        "#SBATCH --signal=B:TERM@300",
    ):
        assert line in script
    done, lines = _run(script, tmp_path, fake_bin)
    assert done.returncode == 0, done.stderr + done.stdout
    (bench,) = [c for c in _python_calls(lines) if c["args"][:1] == ["tools/sglang_bench.py"]]
    log = Path(paths["logs"]) / f"osprey-eval-{recipe.run_name}-77-restart0.log"
    # The server runs in the background and may be stopped before the fake records it: read the echoed command.
    server = next(line for line in log.read_text().splitlines() if line.startswith("server: ")).split()[1:]
    assert server[1:3] == ["-m", "sglang.launch_server"]
    assert _flag(server, "--tp-size") == "4" and _flag(server, "--model-path") == paths["target"]
    assert _flag(server, "--speculative-draft-model-path") == paths["export"]
    data = [a for i, a in enumerate(bench["args"]) if i and bench["args"][i - 1] == "--data"]
    assert data == [recipe.domain_path("eval_data", d) for d in recipe.drafter.eval_domains]
    assert _flag(bench["args"], "--output") == paths["eval_output"] and _flag(bench["args"], "--train-domain") == "code"


@pytest.mark.parametrize(
    "where,value",
    [
        ("option", "batch\n#SBATCH --wrap=evil"),
        ("option", "batch; rm -rf ~"),
        ("env", "batch\ntouch /tmp/owned"),
        ("recipe", "gpu --wrap=x"),
        ("account", "proj\rx"),
    ],
)
def test_sbatch_values_that_would_inject_lines_or_options_are_refused(monkeypatch, where, value):
    from launcher.render import SubmitOptions

    value = value.replace("\\n", "\n").replace("\\r", "\r")
    monkeypatch.delenv("SBATCH_PARTITION", raising=False)
    monkeypatch.delenv("SBATCH_ACCOUNT", raising=False)
    overrides, options = [], SubmitOptions()
    if where == "option":
        options = SubmitOptions(partition=value)
    elif where == "account":
        options = SubmitOptions(account=value)
    elif where == "env":
        monkeypatch.setenv("SBATCH_PARTITION", value)
    else:
        overrides = [f"slurm.partition={value}"]
    recipe = resolve_recipe("qwen3_4b_backbone_pretrain_10k_64gpu_h100_bf16", overrides)
    with pytest.raises(ValueError, match="may hold only letters, digits"):
        render(recipe, "pretrain", options)
