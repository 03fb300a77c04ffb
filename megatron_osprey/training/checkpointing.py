"""Megatron dist checkpoints: `iter_NNNNNNN/` + run_config.yaml, the latest pointer written last."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from megatron_osprey.config.run_config import save_run_config
from megatron_osprey.convert.safetensors_io import write_text_atomic

LATEST_FILE = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def read_latest_iteration(root: str | Path) -> int | None:
    """The iteration the latest pointer names, or None when there is no complete checkpoint."""
    pointer = Path(root) / LATEST_FILE
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{pointer} does not hold an iteration number: {text!r}.")
    return int(text)


def save_checkpoint(
    root: str | Path,
    iteration: int,
    sharded_state_dict: dict,
    run_config: dict[str, Any],
) -> Path:
    """Save collectively into a temp dir, rename it into place, then move the latest pointer."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    final = iteration_dir(root, iteration)
    staging = root / f".tmp_{final.name}"
    rank = torch.distributed.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)  # left by a save that was killed midway
        staging.mkdir()
    torch.distributed.barrier()
    dist_checkpointing.save(sharded_state_dict, str(staging))
    torch.distributed.barrier()
    if rank == 0:
        save_run_config(staging / "run_config.yaml", run_config)
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
        write_text_atomic(root / LATEST_FILE, f"{iteration}\n")
    torch.distributed.barrier()
    return final


def load_checkpoint(root: str | Path, sharded_state_dict: dict, iteration: int | None = None) -> tuple[dict, int]:
    """Load (resharding as needed) the named or latest iteration; returns (state, iteration)."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    if iteration is None:
        iteration = read_latest_iteration(root)
        if iteration is None:
            raise FileNotFoundError(
                f"no complete checkpoint under {root}: {LATEST_FILE} is missing."
            )
    path = iteration_dir(root, iteration)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} named by {root / LATEST_FILE} is missing.")
    return dist_checkpointing.load(sharded_state_dict, str(path)), iteration
