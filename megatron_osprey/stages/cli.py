"""What every stage's main() shares: a config from its flags, and errors as one line plus an exit code.

The exit codes are the same for every stage: 0 done; 2 bad input or an unusable file (one
`error: ...` line on stderr, no traceback); 1 a run that failed on its own (a non-finite
training loss). A stage may add its own 1 (regeneration: some rows failed; evaluation: a
lossless mismatch).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Callable

# Bad input, an output made from other inputs, an unreadable input, a read-only or full disk.
INPUT_ERRORS = (ValueError, OSError)


def config_from_flags(config_class, args):
    """`config_class` filled from the parsed flags of the same names; fields without a flag keep their default."""
    names = {field.name for field in dataclasses.fields(config_class)}
    return config_class(**{name: value for name, value in vars(args).items() if name in names})


def exit_code(
    call: Callable[[], int | None], *, also: tuple[type[BaseException], ...] = (), describe: Callable[[str], str] = str
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


def in_process_groups(config, train: Callable):
    """`train(config, state)` on this rank inside the process groups `config.parallel` describes (collective)."""
    from megatron_osprey.parallel import parallel_context

    with parallel_context(config.parallel) as state:
        return train(config, state)


def training_main(config, run: Callable[[object], object]) -> int:
    """Run a training stage on this rank and return its exit code.

    wandb stays offline unless the user chose a mode (WANDB_MODE); the API key is wandb's to read, never ours.
    """
    config.logging.wandb_mode = os.environ.get("WANDB_MODE", "offline")

    def train() -> None:  # its result is for programmatic callers, not an exit code
        run(config)

    return exit_code(train)


def is_rank0() -> bool:
    """Rank 0 of a torchrun job, or a single process: the one that prints the summary."""
    return int(os.environ.get("RANK", "0")) == 0
