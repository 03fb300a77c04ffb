"""Stage 4: distill the adapted drafter against a frozen target (TTT loss), online or from a hidden-state store.

    torchrun --nproc_per_node=N -m megatron_osprey.stages.distill --recipe NAME --drafter-init ADAPTED_DIR \\
        --target TARGET_DIR --mode online|offline [--hidden-states STORE] [flags ...]
        (see --help; `-m megatron_osprey.distill` is the same)

Config: DistillConfig (megatron_osprey/config/distill.py; flags and --recipe in config/distill_args.py).
The training itself is training/distillation.py on the shared assembly of training/.
"""

from __future__ import annotations

import sys

from megatron_osprey.config.distill import DistillConfig
from megatron_osprey.config.distill_args import distill_config_from_args
from megatron_osprey.stages.cli import in_process_groups, training_main


def run(config: DistillConfig):
    """Distill; every rank of the job calls it. Online, the frozen target runs on the same ranks and
    model-parallel groups; offline, the ranks read the hidden-state store instead."""
    from megatron_osprey.training.distillation import run_distill

    return in_process_groups(config, run_distill)


def main(argv: list[str] | None = None) -> int:
    """Parse the flags (--help), distill; returns the exit code: 2 bad input (one line), 1 a non-finite loss."""
    return training_main(distill_config_from_args(argv), run)


if __name__ == "__main__":
    # The guard matters: every checkpoint save starts a multiprocessing Manager with spawn.
    sys.exit(main())
