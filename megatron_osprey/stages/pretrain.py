"""Stage 2: pretrain the pruned backbone on web text (next-token loss), with Megatron-LM's flags.

    torchrun --nproc_per_node=N -m megatron_osprey.stages.pretrain --recipe NAME --backbone PRUNED_DIR \\
        --data-path PREFIX [Megatron-LM flags ...]      (see --help; `-m megatron_osprey.pretrain` is the same)

Config: PretrainConfig (megatron_osprey/config/pretrain.py; flags and --recipe in config/args.py).
The training itself is training/pretraining.py on the shared assembly of training/.
"""

from __future__ import annotations

import sys

from megatron_osprey.config.args import config_from_args
from megatron_osprey.config.pretrain import PretrainConfig
from megatron_osprey.stages.cli import in_process_groups, training_main


def run(config: PretrainConfig):
    """Pretrain; every rank of the job calls it. Returns the PretrainResult (train state, loss history)."""
    from megatron_osprey.training.pretraining import run_pretrain

    return in_process_groups(config, run_pretrain)


def main(argv: list[str] | None = None) -> int:
    """Parse the flags (--help), pretrain; returns the exit code: 2 bad input (one line), 1 a non-finite loss."""
    return training_main(config_from_args(argv), run)


if __name__ == "__main__":
    # The guard matters: every checkpoint save starts a multiprocessing Manager with spawn.
    sys.exit(main())
