"""Render launcher/slurm/<template>.sbatch for a recipe and stage: `{{ name }}` placeholders, nothing else.

Every template gets the same variables, so a new template (e.g. launcher/slurm/eval_sglang.sbatch) needs no code:
  job_name, run_name, recipe, stage, nodes, gpus_per_node, ntasks_per_node, cpus_per_task, time, array,
  sbatch_options (extra #SBATCH lines: partition, account), repo (the checkout, else the current
  directory: where jobs run and relative paths resolve), log_dir, container_image,
  container_mounts, entry (the entry point's argv after `python`, shell-quoted), extra_args (the
  passthrough flags, shell-quoted), save_dir, train_iters, servers_per_node, server_tp, server_port,
  server_timeout, json_key, target_tp, target_pp, target_ep, eval_steps, eval_topk, eval_draft_tokens,
  and path_<key> for every resolved recipe path (path_target, path_save, path_export, path_eval_output, ...).
An unknown placeholder is an error naming the template; values are plain words, so a template may put
them inside double quotes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
from pathlib import Path

from launcher.commands import entry_args, work_dir
from megatron_osprey.config.recipes.recipe import Recipe

# Inside the package (package-data in pyproject.toml), so an installed wheel has them too.
TEMPLATE_DIR = Path(__file__).resolve().parent / "slurm"
STAGE_TEMPLATES = {
    "preprocess": "preprocess",
    "pretrain": "pretrain",
    "regenerate": "regenerate",
    "extract": "extract",
    "distill": "distill",
    "eval": "eval_sglang",
    "export": "export",
    "prune": "export",
    "adapt": "export",
}
# GPUs in one H100 / B200 node: the regeneration server pool fills whole nodes.
GPUS_PER_NODE = 8
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
# Characters that would change the meaning of a double-quoted shell word.
_UNSAFE = re.compile(r'["$`\\\n\r]')
# Values on #SBATCH lines: sbatch reads the whole line as options, so a space or newline would add options
# (or shell lines); these take plain names, times and paths only.
_SBATCH_SAFE = re.compile(r"[A-Za-z0-9_.,:@+/%=-]+")
_SBATCH_VALUES = ("job_name", "time", "log_dir", "partition", "account")


@dataclasses.dataclass
class SubmitOptions:
    """Scheduler choices made at submit time; unset ones fall back to the recipe, then the environment."""

    partition: str | None = None
    account: str | None = None
    time: str | None = None
    container_image: str | None = None
    container_mounts: str | None = None
    template_dir: Path = TEMPLATE_DIR


def template_name(recipe: Recipe, stage: str) -> str:
    """The template a stage renders: the recipe's slurm.templates override, else the stage default."""
    name = recipe.slurm.templates.get(stage) or STAGE_TEMPLATES.get(stage)
    if name is None:
        raise ValueError(f"stage {stage!r} has no Slurm template; run it locally with `osprey {stage}`.")
    return name


def _resources(recipe: Recipe, stage: str) -> dict[str, object]:
    """Nodes, GPUs, tasks and array range of the job `stage` submits."""
    lay, d = recipe.layout, recipe.data
    if stage in ("pretrain", "distill"):
        return dict(nodes=lay.nodes, gpus_per_node=lay.gpus_per_node, ntasks_per_node=lay.gpus_per_node, array="")
    if stage == "extract":
        return dict(
            nodes=lay.nodes,
            gpus_per_node=lay.gpus_per_node,
            ntasks_per_node=lay.gpus_per_node,
            array=f"0-{d.extract_shards - 1}",
        )
    if stage == "preprocess":
        return dict(nodes=1, gpus_per_node=0, ntasks_per_node=1, array=f"0-{d.preprocess_files - 1}")
    if stage == "regenerate":
        per_node = max(1, GPUS_PER_NODE // d.regenerate_server_tensor_parallel_size)
        return dict(
            nodes=math.ceil(d.regenerate_servers / per_node),
            gpus_per_node=GPUS_PER_NODE,
            ntasks_per_node=per_node,
            array="",
            servers_per_node=per_node,
        )
    if stage == "eval":
        gpus = lay.target_tensor_model_parallel_size * lay.target_pipeline_model_parallel_size
        return dict(nodes=1, gpus_per_node=gpus, ntasks_per_node=1, array="")
    return dict(nodes=1, gpus_per_node=1, ntasks_per_node=1, array="")


def template_context(recipe: Recipe, stage: str, options: SubmitOptions, extra: list[str] | None = None) -> dict:
    """Every variable a template may use (see the module docstring)."""
    paths = recipe.resolved_paths()
    partition = options.partition or recipe.slurm.partition or os.environ.get("SBATCH_PARTITION")
    account = options.account or recipe.slurm.account or os.environ.get("SBATCH_ACCOUNT")
    _check_sbatch_value("partition", partition, "--partition, slurm.partition or SBATCH_PARTITION")
    _check_sbatch_value("account", account, "--account, slurm.account or SBATCH_ACCOUNT")
    sbatch_lines = [f"#SBATCH --partition={partition}"] if partition else []
    sbatch_lines += [f"#SBATCH --account={account}"] if account else []
    cpus = recipe.data.preprocess_workers if stage == "preprocess" else recipe.slurm.cpus_per_task
    resources = _resources(recipe, stage)
    entry_kwargs = {"server_urls": []} if stage == "regenerate" else {}
    lay, d = recipe.layout, recipe.data
    repo = work_dir()
    context = {
        "job_name": f"osprey-{stage}-{recipe.run_name}",
        "run_name": recipe.run_name,
        "recipe": recipe.name,
        "stage": stage,
        "cpus_per_task": cpus,
        "time": options.time or recipe.slurm.time,
        "sbatch_options": "\n".join(sbatch_lines),
        "repo": str(repo),
        "log_dir": paths["logs"],
        "container_image": (
            options.container_image or recipe.slurm.container_image or os.environ.get("CONTAINER_IMAGE", "")
        ),
        "container_mounts": (options.container_mounts or recipe.slurm.container_mounts or f"{repo}:{repo}"),
        "entry": shlex.join(entry_args(recipe, stage, extra, **entry_kwargs)) if stage != "preprocess" else "",
        "extra_args": shlex.join([*recipe.extra_args, *(extra or [])]),
        "save_dir": paths["save"],
        "train_iters": recipe.training.iterations(),
        "servers_per_node": 1,
        "server_tp": d.regenerate_server_tensor_parallel_size,
        "server_port": 30000,
        "server_timeout": 1800,
        "json_key": d.tokenizer_json_key,
        "target_tp": lay.target_tensor_model_parallel_size,
        "target_pp": lay.target_pipeline_model_parallel_size,
        "target_ep": lay.target_expert_model_parallel_size,
        "eval_steps": d.eval_steps,
        "eval_topk": d.eval_topk,
        "eval_draft_tokens": d.eval_draft_tokens,
        "eval_data": " ".join(recipe.domain_path("eval_data", domain) for domain in recipe.drafter.eval_domains)
        if recipe.target is not None
        else "",
        "method": recipe.drafter.method,
        "train_domain": recipe.drafter.domain or "",
        **resources,
        **{f"path_{key}": value for key, value in paths.items()},
    }
    for key, value in context.items():
        if key not in ("entry", "extra_args", "sbatch_options") and _UNSAFE.search(str(value)):
            raise ValueError(
                f"{key} = {value!r} contains a quote, $, backslash or newline; "
                "use a plain path or name in the recipe, --set or the environment."
            )
    for key in _SBATCH_VALUES:
        if key in context:
            _check_sbatch_value(key, context[key], "the recipe or --set")
    return context


def _check_sbatch_value(key: str, value, source: str) -> None:
    """A value bound for an #SBATCH line: letters, digits and _ . , : @ + / % = - only."""
    if value is not None and value != "" and not _SBATCH_SAFE.fullmatch(str(value)):
        raise ValueError(
            f"{key} = {value!r} (from {source}) may hold only letters, digits and _ . , : @ + / % = -; "
            "a space, quote or newline would add lines or options to the sbatch script."
        )


def render_text(text: str, context: dict, source: str) -> str:
    """Substitute `{{ name }}` placeholders; an unknown name raises naming `source`."""
    unknown = sorted({m.group(1) for m in _PLACEHOLDER.finditer(text)} - set(context))
    if unknown:
        raise ValueError(
            f"{source} uses unknown placeholder(s) {', '.join(unknown)}; available: {', '.join(sorted(context))}."
        )
    return _PLACEHOLDER.sub(lambda m: str(context[m.group(1)]), text)


def render(recipe: Recipe, stage: str, options: SubmitOptions | None = None, extra: list[str] | None = None) -> str:
    """The sbatch script for `stage` of `recipe`, ready for sbatch."""
    options = options or SubmitOptions()
    name = template_name(recipe, stage)
    path = Path(options.template_dir) / f"{name}.sbatch"
    if not path.is_file():
        raise FileNotFoundError(f"Slurm template {path} does not exist (stage {stage} renders {name}.sbatch).")
    return render_text(path.read_text(), template_context(recipe, stage, options, extra), str(path))
