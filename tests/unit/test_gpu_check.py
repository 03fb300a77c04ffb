"""benchmarks/gpu_check.py: its CPU dry run at toy size passes every check; on a GPU, the real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ["init", "placement", "train_steps", "checkpoint", "ttt_loss", "ttt_memory", "throughput"]


def _run(*args: str, timeout: int) -> tuple[int, dict[str, dict], str]:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"check"')]
    return done.returncode, {line["check"]: line for line in lines}, done.stderr[-3000:]


def test_dry_run_prints_one_passing_json_line_per_check():
    code, lines, err = _run("--dry-run", timeout=900)
    assert list(lines) == CHECKS, err
    failed = {name: line for name, line in lines.items() if not line["ok"]}
    assert code == 0 and not failed, (failed, err)
    assert lines["init"]["backend"] == "gloo" and lines["init"]["compat_active"] is True
    assert lines["placement"]["off_device"] == []
    steps = lines["train_steps"]
    assert {"drafter_ddp", "drafter_distopt", "backbone_ddp", "backbone_distopt"} <= set(steps)
    assert lines["checkpoint"]["resumed_max_abs_diff"] == 0.0
    assert lines["ttt_loss"]["relative_diff"] < 1e-4
    assert [row["K"] for row in lines["ttt_memory"]["curve"] if row["impl"] == "linear"] == [1, 2, 3, 4, 5]
    assert lines["throughput"]["tokens_per_sec_per_device"] > 0


def test_without_cuda_the_real_run_refuses_clearly():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the real run is test_real_run_on_the_gpu")
    code, lines, err = _run(timeout=120)
    assert code == 2 and not lines and "no CUDA device; use --dry-run" in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_run_on_the_gpu():
    code, lines, err = _run(timeout=600)
    assert list(lines) == CHECKS and code == 0, (lines, err)
    assert lines["init"]["backend"] == "nccl" and lines["init"]["compat_active"] is False


def test_a_check_that_waits_forever_fails_at_its_time_limit_and_the_next_runs(monkeypatch):
    import importlib.util
    import threading
    import time

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclasses look their module up
    monkeypatch.setattr(sys, "path", list(sys.path))  # it puts the checkout and benchmarks/ first
    spec.loader.exec_module(gpu_check)
    start = time.perf_counter()
    line = gpu_check._guarded("checkpoint", 1, threading.Event().wait)  # a writer that never reports back
    assert time.perf_counter() - start < 10
    assert line["check"] == "checkpoint" and line["ok"] is False and line["error"].startswith("CheckTimeout: ")
    assert gpu_check._guarded("ttt_memory", 1, lambda: {"check": "ttt_memory", "ok": True})["ok"] is True
