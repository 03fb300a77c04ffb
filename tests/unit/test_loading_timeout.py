"""The barrier after a target's load waits under --loading-timeout-minutes, not the collective timeout: two real
gloo ranks whose process group times out after 3 s, one of them 'loading' 6 s."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from megatron_osprey.parallel import ParallelConfig, loading_window
from megatron_osprey.parallel.state import _init_process_group

DEFAULT_TIMEOUT_MIN = 0.05  # 3 s: what the training collectives wait
LOADING_TIMEOUT_MIN = 0.5  # 30 s
SLOW_LOAD_S = 6.0  # rank 1's load: past the collective timeout, inside the loading one


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, port: int, out: str, with_window: bool) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    config = ParallelConfig(
        distributed_timeout_minutes=DEFAULT_TIMEOUT_MIN, loading_timeout_minutes=LOADING_TIMEOUT_MIN
    )
    _init_process_group(config)  # the stages' own start: the default group gets --distributed-timeout-minutes
    result = {}
    try:
        start = time.perf_counter()
        window = loading_window(config) if with_window else _no_window()
        with window:
            if rank == 1:
                time.sleep(SLOW_LOAD_S)  # this rank's share of the target loads slowly
        result["after_load_s"] = time.perf_counter() - start
        total = torch.ones(1)
        torch.distributed.all_reduce(total)  # the first training collective, under the 3 s timeout
        result["all_reduce"] = float(total)
    except RuntimeError as err:
        result["error"] = str(err)[:300]
    result["seconds"] = time.perf_counter() - start
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # a rank whose peer timed out must not wait in the process group's teardown


class _no_window:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _spawn(tmp_path: Path, with_window: bool) -> list[dict]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(_free_port(), str(tmp_path), with_window), nprocs=2, join=True)
    return [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]


def test_a_rank_loading_past_the_collective_timeout_gets_through_the_loading_barrier(tmp_path):
    fast, slow = _spawn(tmp_path, with_window=True)
    assert "error" not in fast and "error" not in slow, (fast, slow)
    assert fast["all_reduce"] == slow["all_reduce"] == 2.0
    # The fast rank waited for the slow one in the barrier, longer than the collective timeout allows.
    assert fast["after_load_s"] >= SLOW_LOAD_S - 0.5 > DEFAULT_TIMEOUT_MIN * 60


def test_without_the_loading_barrier_the_first_collective_times_out(tmp_path):
    fast, _ = _spawn(tmp_path, with_window=False)
    assert "all_reduce" not in fast and "error" in fast, fast
    assert "timed out" in fast["error"].lower() or "timeout" in fast["error"].lower(), fast
    assert fast["seconds"] < SLOW_LOAD_S  # it gave up at the collective timeout, before rank 1 came


def test_the_loading_timeout_is_a_flag_of_distill_and_extract_and_must_be_positive():
    from megatron_osprey.stages import distill, extract
    from megatron_osprey.stages.cli import parse_config

    argv = ["--target", "t", "--data", "d", "--output", "o", "--loading-timeout-minutes", "90"]
    config, _ = parse_config(argv, "extract", extract.ExtractConfig, extract.FLAGS, extract.__doc__)
    assert config.parallel.loading_timeout_minutes == 90
    assert config.parallel.distributed_timeout_minutes == ParallelConfig().distributed_timeout_minutes
    config, _ = distill.config_from_args(["--loading-timeout-minutes", "45"])
    assert config.parallel.loading_timeout_minutes == 45
    with pytest.raises(ValueError, match="--loading-timeout-minutes must be > 0"):
        ParallelConfig(loading_timeout_minutes=0).validate(1)
