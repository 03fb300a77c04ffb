"""Stage 2 entry point: `python -m megatron_osprey.pretrain` with Megatron-LM's flags (see --help)."""

from __future__ import annotations

import os
import sys

from megatron_osprey.config.args import config_from_args


def main(argv: list[str] | None = None) -> int:
    """Parse flags, bring up the process groups, pretrain; returns the exit code."""
    cfg = config_from_args(argv)
    # wandb stays offline unless the user chose a mode; the API key is wandb's to read, never ours.
    cfg.logging.wandb_mode = os.environ.get("WANDB_MODE", "offline")
    from megatron_osprey.parallel import parallel_context
    from megatron_osprey.training.pretraining import run_pretrain

    with parallel_context(cfg.parallel) as state:
        try:
            run_pretrain(cfg, state)
        except (ValueError, OSError) as error:  # bad input or an unusable file: one line, not a traceback
            print(f"error: {error}", file=sys.stderr)
            return 2
        except FloatingPointError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    # The guard matters: every checkpoint save starts a multiprocessing Manager with spawn.
    sys.exit(main())
