"""What every stage's main() shares: one parser shape, a config from a recipe and flags, and errors as one line.

Every stage reads its command line the same way:

    python -m megatron_osprey STAGE [--recipe NAME[:DOMAIN]|FILE.yaml [--run-dir DIR]] [flags] [--set K=V ...]

Precedence: the stage Config's defaults < the recipe's config for this stage (recipe-level `--set` keys such as
`paths.target=DIR` shape the recipe first) < typed flags < this stage's `--set` keys (`training.lr=2e-4`).
A recipe is resolved by the recipe registry, which sits above the stages (its recipes build the stages'
configs): the job door (`python -m megatron_osprey`, megatron_osprey/__main__.py, through
`megatron_osprey.recipes.run_stage`) hands it in. No stage module imports the registry.

The exit codes are the same for every stage: 0 done; 2 bad input or an unusable file (one `error: ...` line on
stderr, no traceback); 1 a run that failed on its own (a non-finite training loss). A stage may add its own 1
(regeneration: some rows failed; evaluation: a lossless mismatch).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from megatron_osprey.base import provenance
from megatron_osprey.base.outputs import claimed_output
from megatron_osprey.config.flags import FlagGroups, add_flag_groups, apply_flags
from megatron_osprey.config.overrides import apply_overrides

# Bad input, an output made from other inputs, an unreadable input, a read-only or full disk.
INPUT_ERRORS = (ValueError, OSError)

# (spec, stage, overrides, run_dir) -> (the stage's config from the recipe, the overrides left for the stage)
RecipeResolver = Callable[[str, str, list[str], str | None], tuple[Any, list[str]]]


@dataclasses.dataclass(frozen=True)
class Invocation:
    """How a stage was started: its name, the recipe it came from and its command line (for provenance.json)."""

    stage: str
    recipe: str | None = None
    command: tuple[str, ...] = ()

    def record(self, directory: str | Path, config, inputs: dict, outputs: dict[str, str | Path]) -> Path:
        """Write DIRECTORY/provenance.json for this run: the config, the checked inputs and the hashed outputs."""
        return provenance.write_provenance(
            directory, self.stage, inputs, outputs, config=config, recipe=self.recipe, command=list(self.command)
        )

    def record_file(self, file: str | Path, config, inputs: dict, outputs: str | dict[str, str | Path]) -> Path:
        """Write FILE.provenance.json for this run's output FILE (others may share its directory): `outputs` names
        FILE, or maps names to the files written under that stem (a preprocessed PREFIX's .bin and .idx)."""
        return provenance.write_file_provenance(
            file, self.stage, inputs, outputs, config=config, recipe=self.recipe, command=list(self.command)
        )


def check_inputs(paths: dict[str, str | Path | None]) -> dict[str, dict[str, str]]:
    """Each named input's path and sha256, refusing one whose producer recorded other bytes (None: skipped)."""
    return {name: provenance.check_input(name, path) for name, path in paths.items() if path is not None}


def stage_parser(stage: str, description: str, groups: FlagGroups) -> argparse.ArgumentParser:
    """The parser every stage has: --recipe, --run-dir, --set and the stage's flag groups (typed flags only)."""
    parser = argparse.ArgumentParser(
        prog=f"python -m megatron_osprey {stage}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    recipe = parser.add_argument_group("recipe")
    recipe.add_argument(
        "--recipe",
        metavar="NAME[:DOMAIN]|FILE.yaml",
        help="start from a recipe's config for this stage (`osprey recipes` lists them)",
    )
    recipe.add_argument(
        "--run-dir", metavar="DIR", help="with --recipe: the run directory whose layout gives every path"
    )
    recipe.add_argument(
        "--set",
        dest="overrides",
        action="append",
        metavar="KEY=VALUE",
        help="override a config key (training.lr=2e-4) or, with --recipe, a recipe key (paths.target=DIR); "
        "repeatable, applied last",
    )
    add_flag_groups(parser, groups)
    return parser


def parse_config(
    argv: list[str] | None,
    stage: str,
    config_class: type,
    groups: FlagGroups,
    description: str,
    recipes: RecipeResolver | None = None,
):
    """(The stage's resolved config, how it was invoked) from argv (see the module docstring; None: no arguments,
    the program's own command line is read by its entry point, recipes.run_stage); bad input exits 2 with one
    line."""
    argv = [] if argv is None else list(argv)
    parser = stage_parser(stage, description, groups)
    typed = vars(parser.parse_args(argv))
    spec, run_dir, overrides = typed.pop("recipe", None), typed.pop("run_dir", None), typed.pop("overrides", [])
    try:
        if spec is None:
            if run_dir is not None:
                raise ValueError("--run-dir takes its layout from a recipe; pass --recipe NAME too.")
            config, stage_overrides = config_class(), overrides
        elif recipes is None:
            raise ValueError(
                f"--recipe needs the recipe registry: run this stage as `python -m megatron_osprey {stage}` "
                f"(or call megatron_osprey.recipes.run_stage)."
            )
        else:
            config, stage_overrides = recipes(spec, stage, overrides, run_dir)
        config = apply_flags(config, typed)
        config = apply_overrides(config, stage_overrides)
    except ValueError as error:
        parser.error(str(error))
    command = ("python", "-m", "megatron_osprey", stage, *argv)
    return config, Invocation(stage, spec, command)


def deprecated_module_door(stage: str) -> None:
    """`python -m megatron_osprey.stages.STAGE` (deprecated, kept for one release): replace this process with
    `python -m megatron_osprey STAGE` and the same arguments.

    The stage module already runs here as `__main__`; handing over to the door by importing it would import the
    same file a second time under its real name (two module objects, two flag tables). exec keeps the PID, the
    environment and the interpreter options (torchrun's and srun's tasks stay theirs) and starts the door clean.
    """
    print(
        f"warning: `python -m megatron_osprey.stages.{stage}` is deprecated and will be removed in the next "
        f"release; run `python -m megatron_osprey {stage}` (same flags).",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    orig = getattr(sys, "orig_argv", [sys.executable])
    at = len(orig) - len(sys.argv) - 1  # [python, *options, "-m", module, *args]: the options are kept
    options = orig[1:at] if at >= 1 and orig[at] == "-m" else []
    os.execv(sys.executable, [sys.executable, *options, "-m", "megatron_osprey", stage, *sys.argv[1:]])


def exit_code(
    call: Callable[[], int | None],
    *,
    also: tuple[type[BaseException], ...] = (),
    describe: Callable[[str], str] = str,
) -> int:
    """Run `call` and return its exit code (None: 0); on an input error (or one in `also`) print it as one
    line and return 2; on a non-finite loss, 1.

    `describe` rewrites the message before it is printed (regeneration removes credentials).
    """
    try:
        return call() or 0
    except (*INPUT_ERRORS, *also) as error:
        print(f"error: {describe(str(error))}", file=sys.stderr)
        return 2
    except FloatingPointError as error:  # a non-finite loss: the run failed, not its input
        print(f"error: {error}", file=sys.stderr)
        return 1


@contextlib.contextmanager
def claimed_by_rank0(output: str | Path, inputs: dict, overwrite: bool, stage: str) -> Iterator[Path]:
    """Collective, inside the process groups: a collective stage's output, claimed by rank 0 for the block
    (base/outputs.claimed_output: one writer, the stage's earlier or partial output emptied, WRITING_MARKER until
    provenance.json is written). Its refusal is broadcast, so every rank raises it instead of waiting for rank 0."""
    import torch

    rank0 = torch.distributed.get_rank() == 0
    with contextlib.ExitStack() as stack:
        refusal: list = [None]
        if rank0:
            try:
                stack.enter_context(claimed_output(output, inputs, overwrite, stage=stage))
            except INPUT_ERRORS as error:
                refusal = [(isinstance(error, FileExistsError), str(error))]
                torch.distributed.broadcast_object_list(refusal, src=0)
                raise
        torch.distributed.broadcast_object_list(refusal, src=0)
        if refusal[0] is not None:
            exists, message = refusal[0]
            raise (FileExistsError if exists else ValueError)(message)
        yield Path(output).expanduser()


def in_process_groups(parallel, work: Callable):
    """`work(state)` on this rank inside the process groups `parallel` describes (collective)."""
    from megatron_osprey.parallel import parallel_context

    with parallel_context(parallel) as state:
        return work(state)


def train_on_every_rank(config, invocation, inputs: dict, train: Callable, outputs: Callable[[Path], dict | None]):
    """The training stages' run(): rank 0 checks the inputs, every rank runs `train(config, state)` inside the
    process groups, and rank 0 records provenance in --save once `outputs(save)` names what was written."""
    checked = check_inputs(inputs) if is_rank0() else {}
    result = in_process_groups(config.parallel, lambda state: train(config, state))
    save = Path(config.checkpoint.save) if config.checkpoint.save else None
    written = outputs(save) if is_rank0() and save is not None else None
    if written:
        invocation.record(save, config, checked, written)
    return result


def train_main(config, invocation, run: Callable) -> int:
    """The training stages' main() once the flags are parsed: wandb's mode, then `run` on this rank; the exit
    code is 2 for bad input (one line), 1 for a non-finite loss."""
    resolve_wandb_mode(config)

    def train() -> None:  # run's result is for programmatic callers, not an exit code
        run(config, invocation)

    return exit_code(train)


def resolve_wandb_mode(config) -> None:
    """wandb stays offline unless the user chose a mode (WANDB_MODE); the API key is wandb's to read, never ours."""
    config.logging.wandb_mode = os.environ.get("WANDB_MODE", "offline")


def is_rank0() -> bool:
    """Rank 0 of a torchrun or srun job, or a single process: the one that prints the summary."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0
