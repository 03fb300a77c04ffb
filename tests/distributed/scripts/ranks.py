"""What every check script under torchrun shares: one gloo process group for the whole script (each layout inside
re-initializes only Megatron-Core's groups on top of it), and the ranks' figures merged on rank 0."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Callable

import torch


def merged_on_rank0(results: dict) -> dict | None:
    """Every rank's figures in one dict on rank 0 (a later rank's key wins); None on the other ranks."""
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, results)
    if torch.distributed.get_rank() != 0:
        return None
    merged: dict = {}
    for part in gathered:
        merged.update(part)
    return merged


def run_script(main: Callable, timeout_s: int = 120) -> None:
    """main(WORK, RESULT, *rest of argv) inside one gloo process group: argv[1:3] as paths, the rest as given."""
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        main(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:])
    finally:
        torch.distributed.destroy_process_group()
