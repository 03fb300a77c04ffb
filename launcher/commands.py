"""Recipe + stage -> the command a job (or a local run) executes: the job door and the stage, the recipe and its
overrides.

A job never receives a flag list rebuilt from a config: it receives `--recipe NAME[:DOMAIN]|FILE.yaml --run-dir
DIR --set KEY=VALUE ...` and resolves the recipe itself, through the same registry `osprey plan` reads, so the config
it runs is the one the plan printed. Flags typed after `--` are passed through untouched.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from megatron_osprey.recipes.recipe import DISTRIBUTED_STAGES, STAGES, Recipe

REPO_ROOT = Path(__file__).resolve().parent.parent
# Stages outside every recipe's chain, run with their own flags only (`osprey data ...`, `osprey ngram ...`).
FLAG_STAGES = ("data", "ngram", "suite")


def work_dir() -> Path:
    """Where relative recipe paths resolve and jobs run: the current directory (a checkout or a project folder)."""
    return Path.cwd()


# The job door (megatron_osprey/__main__.py): it resolves the recipe and imports the stage module once.
JOB_DOOR = "megatron_osprey"


def stage_module(stage: str) -> str:
    """The module that holds `stage` (its Config, flags, run() and main()); jobs reach it through the door."""
    if stage not in (*STAGES, *FLAG_STAGES):
        raise ValueError(f"unknown stage {stage!r}; choose one of {', '.join((*STAGES, *FLAG_STAGES))}.")
    return f"megatron_osprey.stages.{stage}"


def stage_command(stage: str) -> list[str]:
    """The interpreter arguments that run `stage` through the job door: `-m megatron_osprey STAGE`."""
    stage_module(stage)  # an unknown stage: one clear error
    return ["-m", JOB_DOOR, stage]


def job_args(
    spec: str, stage: str, run_dir: str | None, overrides: list[str] | None = None, extra: list[str] | None = None
) -> list[str]:
    """The argv after the interpreter: the job door and the stage, the recipe, the run directory and the overrides."""
    args = [*stage_command(stage), "--recipe", spec]
    if run_dir:
        args += ["--run-dir", str(run_dir)]
    for text in overrides or []:
        args += ["--set", text]
    return args + list(extra or [])


def _torchrun() -> str:
    """The torchrun beside this interpreter (the venv's), else the one on PATH."""
    beside = Path(sys.executable).with_name("torchrun")
    return str(beside) if beside.exists() else (shutil.which("torchrun") or "torchrun")


def local_argv(
    recipe: Recipe,
    spec: str,
    stage: str,
    run_dir: str | None,
    overrides: list[str] | None = None,
    extra: list[str] | None = None,
    *,
    python: str | None = None,
) -> list[str]:
    """The full local command: torchrun (one process per device of one node) or python."""
    python = python or sys.executable
    args = job_args(spec, stage, run_dir, overrides, extra)
    res = recipe.stage_resources(stage)
    if stage == "regenerate" and not recipe.config(stage, run_dir).server_url and "--server-url" not in (extra or []):
        raise ValueError(
            f"`osprey regenerate {recipe.name}` needs servers: pass `-- --server-url http://HOST:PORT` or run the "
            f"chain on a cluster (`osprey pipeline`), whose regenerate job starts a pool."
        )
    if res.array_tasks > 1:
        raise ValueError(
            f"recipe {recipe.name} runs {stage} as a Slurm array of {res.array_tasks} tasks; run it with "
            f"`osprey pipeline` or `osprey submit {recipe.name} --stage {stage}`, or --set "
            f"resources.{stage}.array_tasks=1."
        )
    if stage not in DISTRIBUTED_STAGES:
        return [python, *args]
    if res.nodes > 1:
        raise ValueError(
            f"recipe {recipe.name} runs {stage} on {res.nodes} nodes; submit it (`osprey submit` or `osprey "
            f"pipeline`), or shrink it for one machine with --set resources.{stage}.nodes=1."
        )
    return [_torchrun(), "--standalone", f"--nproc-per-node={res.gpus_per_node}", *args]
