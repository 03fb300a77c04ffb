"""Render slurm/<template>.sbatch for one stage of a recipe: `{{ name }}` placeholders, nothing else.

Every template gets the same variables, so a new template needs no code:
  job_name, run_name, recipe, stage, nodes, ntasks_per_node, cpus_per_task, time, sbatch_options (extra #SBATCH
  lines: partition, account, GPUs, memory, array), repo (where jobs run and relative paths resolve), run_dir,
  log_dir, stage_dir, python (the interpreter `osprey` runs on), container_image, container_mounts, entry (the job's
  argv after the interpreter, shell-quoted: the stage module, --recipe, --run-dir, --set ...), train_iters,
  servers_per_node, server_tp, server_port, server_timeout, server_mem (each regeneration server's share of
  resources.regenerate.mem), server_engine (servers.engine; empty: the template's default), cpu_kv_cache_bytes
  (vLLM's KV cache on CPU), reasoning_parser, context_length, sglang_flags (a regeneration server's extra SGLang
  flags: --trust-remote-code), sglang_eval_flags (an eval server's: --trust-remote-code, --ep-size,
  --disable-custom-all-reduce),
  batch_sizes, hardware, path_target, eval_data, method, train_domain, export_dir.
An unknown placeholder is an error naming the template; values are plain words, so a template may put them inside
double quotes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
import sys
from pathlib import Path

from launcher.commands import job_args, work_dir
from megatron_osprey.base.engines import CPU_KV_CACHE_BYTES
from megatron_osprey.config.overrides import apply_overrides
from megatron_osprey.recipes.layout import logs_dir, stage_dir
from megatron_osprey.recipes.recipe import DISTRIBUTED_STAGES, NODE_GPUS, Recipe
from megatron_osprey.recipes.registry import split_overrides

# The templates: the top-level slurm/ of a checkout, or the copy an installed wheel carries (package data).
TEMPLATE_DIRS = (Path(__file__).resolve().parent.parent / "slurm", Path(__file__).resolve().parent / "slurm")
STAGE_TEMPLATES = {stage: "distributed" for stage in DISTRIBUTED_STAGES}
STAGE_TEMPLATES |= {"regenerate": "regenerate"}
# Evaluation on GPUs serves the exported drafter with SGLang; on CPU it runs the project's own engine; a recipe whose
# servers are vLLM's (servers.engine=vllm) evaluates in vLLM beside the reference engine, on either.
GPU_EVAL_TEMPLATE = "eval_sglang"
VLLM_EVAL_TEMPLATE = "eval_vllm"
DEFAULT_TEMPLATE = "stage"
# GPUs in one H100 / B200 node: the regeneration server pool fills whole nodes.
GPUS_PER_NODE = NODE_GPUS
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
# Characters that would change the meaning of a double-quoted shell word.
_UNSAFE = re.compile(r"[\"'$`\\\n\r]")
# Values on #SBATCH lines: sbatch reads the whole line as options; these take plain names, times and paths only.
_SBATCH_SAFE = re.compile(r"[A-Za-z0-9_.,:@+/%=-]+")
_SBATCH_VALUES = ("job_name", "time", "log_dir", "partition", "account", "mem")
# Slurm's memory sizes: a whole number with an optional unit (K, M, G, T; none means M).
_SLURM_MEM = re.compile(r"(\d+)([KMGT]?)", re.IGNORECASE)
_MIB_PER_UNIT = {"k": 1 / 1024, "": 1, "m": 1, "g": 1024, "t": 1024**2}


def template_dir() -> Path:
    for candidate in TEMPLATE_DIRS:
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"no Slurm templates at {' or '.join(map(str, TEMPLATE_DIRS))}.")


@dataclasses.dataclass
class SubmitOptions:
    """Scheduler choices made at submit time; unset ones fall back to the recipe, then the environment."""

    partition: str | None = None
    account: str | None = None
    time: str | None = None
    container_image: str | None = None
    container_mounts: str | None = None
    python: str | None = None  # the jobs' interpreter; default: the one running `osprey`
    template_dir: Path | None = None


def template_name(recipe: Recipe, stage: str) -> str:
    """The template a stage renders: the recipe's slurm.templates override, else the stage's default."""
    if stage in recipe.slurm.templates:
        return recipe.slurm.templates[stage]
    if stage == "evaluate" and recipe.servers.engine == "vllm":
        return VLLM_EVAL_TEMPLATE
    if stage == "evaluate" and recipe.hardware != "cpu":
        return GPU_EVAL_TEMPLATE
    return STAGE_TEMPLATES.get(stage, DEFAULT_TEMPLATE)


def _check_sbatch_value(key: str, value, source: str) -> None:
    """A value bound for an #SBATCH line: letters, digits and _ . , : @ + / % = - only."""
    if value is not None and value != "" and not _SBATCH_SAFE.fullmatch(str(value)):
        raise ValueError(
            f"{key} = {value!r} (from {source}) may hold only letters, digits and _ . , : @ + / % = -; "
            "a space, quote or newline would add lines or options to the sbatch script."
        )


def _sbatch_lines(recipe: Recipe, stage: str, options: SubmitOptions, tasks: int) -> list[str]:
    res = recipe.stage_resources(stage)
    partition = options.partition or recipe.slurm.partition or os.environ.get("SBATCH_PARTITION")
    account = options.account or recipe.slurm.account or os.environ.get("SBATCH_ACCOUNT")
    _check_sbatch_value("partition", partition, "--partition, slurm.partition or SBATCH_PARTITION")
    _check_sbatch_value("account", account, "--account, slurm.account or SBATCH_ACCOUNT")
    _check_sbatch_value("mem", res.mem, f"resources.{stage}.mem")
    lines = [f"#SBATCH --partition={partition}"] if partition else []
    lines += [f"#SBATCH --account={account}"] if account else []
    if recipe.hardware != "cpu":
        gpus = GPUS_PER_NODE if stage == "regenerate" else res.gpus_per_node if stage != "evaluate" else tasks
        lines.append(f"#SBATCH --gpus-per-node={gpus}")
    if res.mem:
        lines.append(f"#SBATCH --mem={res.mem}")
    if res.array_tasks > 1:
        lines.append(f"#SBATCH --array=0-{res.array_tasks - 1}")
    return lines


def server_mem_share(mem: str | None, servers_per_node: int) -> str:
    """Each server step's share of the job's memory per node (`mem`, Slurm units), in M or G; "" when unset."""
    if not mem:
        return ""
    match = _SLURM_MEM.fullmatch(str(mem).strip())
    if match is None:
        raise ValueError(
            f"resources.regenerate.mem = {mem!r} is not a Slurm memory size (a number, optionally K, M, G or T)."
        )
    mib = int(int(match.group(1)) * _MIB_PER_UNIT[match.group(2).lower()]) // servers_per_node
    if mib < 1:
        raise ValueError(f"resources.regenerate.mem = {mem!r} leaves under 1M for each of {servers_per_node} servers.")
    return f"{mib // 1024}G" if mib % 1024 == 0 else f"{mib}M"


def template_context(
    recipe: Recipe,
    spec: str,
    stage: str,
    run_dir: str,
    overrides: list[str] | None = None,
    options: SubmitOptions | None = None,
    extra: list[str] | None = None,
) -> dict:
    """Every variable a template may use (see the module docstring)."""
    options = options or SubmitOptions()
    # The config the job will run: the recipe's, then the stage-level `--set` keys the job applies itself
    # (`training.train_iters=...` must reach the template's TRAIN_ITERS, or a stopped run would not requeue).
    config = recipe.config(stage, run_dir)
    config = apply_overrides(config, split_overrides(overrides or [], config)[1])
    res, pool = recipe.stage_resources(stage), recipe.servers
    for key in ("nodes", "gpus_per_node", "array_tasks", "cpus_per_task"):
        if int(getattr(res, key)) < 1:
            raise ValueError(f"resources.{stage}.{key} must be at least 1, got {getattr(res, key)}.")
    servers_per_node = recipe.tasks_per_node("regenerate")
    nodes = math.ceil(pool.servers / servers_per_node) if stage == "regenerate" else res.nodes
    training = getattr(config, "training", None)
    repo = work_dir()
    context = {
        "job_name": f"osprey-{stage}-{recipe.run_name}",
        "run_name": recipe.run_name,
        "recipe": recipe.name,
        "stage": stage,
        "hardware": recipe.hardware,
        "nodes": nodes,
        "ntasks_per_node": recipe.tasks_per_node(stage),
        "cpus_per_task": res.cpus_per_task,
        "time": options.time or res.time,
        "sbatch_options": "\n".join(_sbatch_lines(recipe, stage, options, pool.tensor_parallel_size)),
        "repo": str(repo),
        "run_dir": str(run_dir),
        "log_dir": logs_dir(run_dir),
        "stage_dir": stage_dir(run_dir, stage),
        "python": options.python or sys.executable,
        "container_image": (
            options.container_image or recipe.slurm.container_image or os.environ.get("CONTAINER_IMAGE", "")
        ),
        "container_mounts": options.container_mounts or recipe.slurm.container_mounts or f"{repo}:{repo}",
        "entry": shlex.join(job_args(spec, stage, run_dir, overrides, extra)),
        "train_iters": training.num_train_iters() if training is not None else 0,
        "servers_per_node": servers_per_node,
        "server_tp": pool.tensor_parallel_size,
        "server_port": pool.port,
        "server_timeout": pool.startup_timeout,
        # Without its own --mem an srun step takes all of the job's memory, and the next server step waits for it.
        "server_mem": server_mem_share(res.mem, servers_per_node) if stage == "regenerate" else "",
        "server_engine": pool.engine or "",
        "cpu_kv_cache_bytes": CPU_KV_CACHE_BYTES,
        "reasoning_parser": pool.reasoning_parser or "",
        "context_length": pool.context_length or "",
        "sglang_flags": " ".join(pool.sglang_flags(evaluation=False)),
        "sglang_eval_flags": " ".join(pool.sglang_flags(evaluation=True)),
        "batch_sizes": " ".join(str(b) for b in pool.batch_sizes),
        "path_target": recipe.path("target"),
        "eval_data": " ".join(recipe.path("eval_data", domain) for domain in recipe.eval_domains),
        "method": "eagle3" if recipe.distill is not None and recipe.distill.drafter.baseline else "osprey",
        "train_domain": recipe.domain or "",
        "export_dir": stage_dir(run_dir, "export"),
    }
    for key, value in context.items():
        if key not in ("entry", "sbatch_options") and _UNSAFE.search(str(value)):
            raise ValueError(
                f"{key} = {value!r} contains a quote, $, backslash or newline; "
                "use a plain path or name in the recipe, --set or the environment."
            )
    for key in _SBATCH_VALUES:
        if key in context:
            _check_sbatch_value(key, context[key], "the recipe or --set")
    return context


def render_text(text: str, context: dict, source: str) -> str:
    """Substitute `{{ name }}` placeholders; an unknown name raises naming `source`."""
    unknown = sorted({m.group(1) for m in _PLACEHOLDER.finditer(text)} - set(context))
    if unknown:
        raise ValueError(
            f"{source} uses unknown placeholder(s) {', '.join(unknown)}; available: {', '.join(sorted(context))}."
        )
    return _PLACEHOLDER.sub(lambda m: str(context[m.group(1)]), text)


def render(
    recipe: Recipe,
    spec: str,
    stage: str,
    run_dir: str,
    overrides: list[str] | None = None,
    options: SubmitOptions | None = None,
    extra: list[str] | None = None,
) -> str:
    """The sbatch script for `stage` of `recipe`, ready for sbatch."""
    options = options or SubmitOptions()
    name = template_name(recipe, stage)
    path = Path(options.template_dir or template_dir()) / f"{name}.sbatch"
    if not path.is_file():
        raise FileNotFoundError(f"Slurm template {path} does not exist (stage {stage} renders {name}.sbatch).")
    context = template_context(recipe, spec, stage, run_dir, overrides, options, extra)
    return render_text(path.read_text(), context, str(path))
