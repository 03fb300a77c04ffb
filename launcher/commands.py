"""Recipe + stage -> the entry point's argv (Megatron-LM flag names), locally or for a Slurm task.

Pretrain and distill render the recipe's own config (Recipe.config()) as the flags that rebuild it,
so the job runs the config the entry point's `--recipe NAME` would give.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

from megatron_osprey.config.args import ARGUMENT_GROUPS, config_flags, flag_word
from megatron_osprey.config.distill_args import DISTILL_GROUPS
from megatron_osprey.config.recipes.recipe import Recipe

REPO_ROOT = Path(__file__).resolve().parent.parent


def work_dir() -> Path:
    """Where relative recipe paths resolve and jobs run: the checkout when launched from one (its
    pyproject.toml marks it), else the current directory, since an installed wheel's REPO_ROOT is
    site-packages, which is neither the user's nor writable."""
    return REPO_ROOT if (REPO_ROOT / "pyproject.toml").is_file() else Path.cwd()


@dataclasses.dataclass(frozen=True)
class EntryPoint:
    """How a stage starts: a module (`-m`) or a script, and whether it runs one process per GPU."""

    # Modules only (`-m`), never tools/*.py: an installed wheel has the package but no tools/.
    program: tuple[str, ...]  # ("-m", "megatron_osprey.stages.pretrain")
    distributed: bool


ENTRY_POINTS = {
    "prune": EntryPoint(("-m", "megatron_osprey.stages.prune"), False),
    "preprocess": EntryPoint(("-m", "megatron_osprey.data.preprocess_cli"), False),
    "pretrain": EntryPoint(("-m", "megatron_osprey.stages.pretrain"), True),
    "adapt": EntryPoint(("-m", "megatron_osprey.stages.adapt"), False),
    "regenerate": EntryPoint(("-m", "megatron_osprey.stages.regenerate"), False),
    "extract": EntryPoint(("-m", "megatron_osprey.stages.extract"), True),
    "distill": EntryPoint(("-m", "megatron_osprey.stages.distill"), True),
    "eval": EntryPoint(("-m", "megatron_osprey.stages.evaluate"), False),
    "export": EntryPoint(("-m", "megatron_osprey.stages.export"), False),
    "demo": EntryPoint(("-m", "megatron_osprey.demo"), False),
}


def _need(recipe: Recipe, stage: str, what: str) -> None:
    if getattr(recipe, what) is None:
        raise ValueError(f"recipe {recipe.name} has no {what} model; `osprey {stage}` needs one (set {what}=<shape>).")


def target_parallel_flags(recipe: Recipe, prefix: str) -> list[str]:
    """The frozen target's TP/PP/EP (prefix '--target-' for distill, '--' for extraction)."""
    lay = recipe.layout
    flags = [
        f"{prefix}tensor-model-parallel-size",
        str(lay.target_tensor_model_parallel_size),
        f"{prefix}pipeline-model-parallel-size",
        str(lay.target_pipeline_model_parallel_size),
        f"{prefix}expert-model-parallel-size",
        str(lay.target_expert_model_parallel_size),
    ]
    if lay.target_expert_tensor_parallel_size is not None:
        flags += [f"{prefix}expert-tensor-parallel-size", str(lay.target_expert_tensor_parallel_size)]
    return flags


def _aux(recipe: Recipe) -> list[str]:
    ids = recipe.drafter.aux_layer_ids
    return ["--aux-layer-ids", *map(str, ids)] if ids else []


def stage_flags(recipe: Recipe, stage: str, *, server_urls: list[str] | None = None) -> list[str]:
    """The entry point's flags for `stage`, built from the recipe (without the interpreter)."""
    p, d, dr = recipe.resolved_paths(), recipe.data, recipe.drafter
    if stage == "prune":
        _need(recipe, stage, "model")
        return ["--source", p["source"], "--num-layers", str(recipe.model.num_layers), "--output", p["backbone"]]
    if stage == "preprocess":
        return [
            "--input",
            p["pretrain_text"],
            "--json-key",
            d.tokenizer_json_key,
            "--tokenizer",
            p["tokenizer"],
            "--output-prefix",
            p["pretrain_data"],
            "--workers",
            str(d.preprocess_workers),
        ]
    if stage == "pretrain":
        _need(recipe, stage, "model")
        return config_flags(recipe.config(stage), ARGUMENT_GROUPS)
    if stage == "adapt":
        _need(recipe, stage, "target")
        flags = ["--backbone", p["backbone"], "--target", p["target"], "--output", p["drafter_init"], *_aux(recipe)]
        if dr.draft_vocab_size:
            flags += ["--draft-vocab-size", str(dr.draft_vocab_size), "--token-counts", p["token_counts"]]
        return flags
    if stage == "regenerate":
        _need(recipe, stage, "target")
        flags = ["--input", p["prompts"], "--output", p["conversations"], "--backend", "server"]
        for url in server_urls if server_urls is not None else d.regenerate_server_urls:
            flags += ["--server-url", url]
        return flags + [
            "--temperature",
            flag_word(d.regenerate_temperature),
            "--max-tokens",
            str(d.regenerate_max_tokens),
            "--concurrency",
            str(d.regenerate_concurrency),
        ]
    if stage == "extract":
        _need(recipe, stage, "target")
        flags = [
            "--target",
            p["target"],
            "--data",
            p["conversations"],
            "--output",
            p["hidden_states"],
            *_aux(recipe),
            "--encoding",
            d.hidden_state_encoding,
            *target_parallel_flags(recipe, "--"),
        ]
        if recipe.target.num_experts and recipe.layout.target_tensor_model_parallel_size > 1:
            flags.append("--sequence-parallel")  # the extraction tool requires it for MoE at TP > 1
        return flags + ["--max-length", str(recipe.training.seq_length), "--micro-batch-size", "1"]
    if stage == "distill":
        _need(recipe, stage, "target")
        return config_flags(recipe.config(stage), DISTILL_GROUPS)
    if stage == "eval":
        _need(recipe, stage, "target")
        data = [recipe.domain_path("eval_data", domain) for domain in dr.eval_domains]
        return [
            "--target",
            p["target"],
            "--drafter",
            p["export"],
            "--data",
            *data,
            "--output",
            p["eval_output"],
            "--steps",
            str(d.eval_steps),
            "--topk",
            str(d.eval_topk),
            "--draft-tokens",
            str(d.eval_draft_tokens),
        ]
    if stage == "export":
        return ["--checkpoint", p["save"], "--format", d.export_format, "--output", p["export"]]
    if stage == "demo":
        return ["--output", p["demo_output"]]
    raise ValueError(f"unknown stage {stage!r}; choose one of {', '.join(ENTRY_POINTS)}.")


def entry_args(recipe: Recipe, stage: str, extra: list[str] | None = None, **kwargs) -> list[str]:
    """Program and flags, without the interpreter: what each Slurm task runs after `python`."""
    return [*ENTRY_POINTS[stage].program, *stage_flags(recipe, stage, **kwargs), *recipe.extra_args, *(extra or [])]


def _torchrun() -> str:
    """The torchrun beside this interpreter (the venv's), else the one on PATH."""
    beside = Path(sys.executable).with_name("torchrun")
    return str(beside) if beside.exists() else (shutil.which("torchrun") or "torchrun")


def local_argv(
    recipe: Recipe,
    stage: str,
    extra: list[str] | None = None,
    *,
    python: str | None = None,
    torchrun: str | None = None,
) -> list[str]:
    """The full local command: torchrun (one process per GPU of one node) or python."""
    python = python or sys.executable
    args = entry_args(recipe, stage, extra)
    if not ENTRY_POINTS[stage].distributed:
        if stage == "regenerate" and not any(a == "--server-url" for a in args):
            raise ValueError(
                f"`osprey regenerate {recipe.name}` needs servers: pass --set "
                "data.regenerate_server_urls=[http://HOST:PORT] or use `osprey submit` to start a pool."
            )
        if stage == "preprocess" and recipe.data.preprocess_files > 1:
            raise ValueError(
                f"recipe {recipe.name} preprocesses {recipe.data.preprocess_files} files as a Slurm array; run "
                f"`osprey submit {recipe.name} --stage preprocess`, or --set data.preprocess_files=1 "
                "with paths.pretrain_text=<one input>."
            )
        return [python, *args]
    if recipe.layout.nodes > 1:
        raise ValueError(
            f"recipe {recipe.name} spans {recipe.layout.nodes} nodes; run it with `osprey submit {recipe.name}`, "
            "or shrink it for one machine with --set layout.nodes=1."
        )
    return [torchrun or _torchrun(), "--standalone", f"--nproc-per-node={recipe.layout.gpus_per_node}", *args]
