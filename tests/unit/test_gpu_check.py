"""benchmarks/gpu_check.py: its CPU dry run at toy size passes every check; on a GPU, the real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CHECKS = [
    "init", "placement", "train_steps", "checkpoint", "ttt_loss", "te_spec", "drafter_te", "target_path",
    "ttt_memory", "throughput",
]  # fmt: skip


def _run(*args: str, timeout: int, command: list[str] | None = None) -> tuple[int, dict[str, dict], str]:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    done = subprocess.run(
        [*(command or [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")]), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    checks = {line["check"]: line for line in lines if "check" in line}
    summaries = [line for line in lines if "summary" in line]
    if summaries:
        assert lines[-1] is summaries[-1] and len(summaries) == 1, done.stdout  # one summary, last
        checks["summary"] = summaries[0]
    return done.returncode, checks, done.stderr[-3000:]


def test_dry_run_prints_one_passing_json_line_per_check():
    code, lines, err = _run("--dry-run", timeout=900)
    assert list(lines) == [*CHECKS, "summary"], err
    summary = lines.pop("summary")
    assert summary["ok"] is True and summary["failed"] == summary["skipped"] == []
    assert 0 < summary["elapsed_s"] < summary["total_budget_s"] == 480
    failed = {name: line for name, line in lines.items() if not line["ok"]}
    assert code == 0 and not failed, (failed, err)
    assert lines["init"]["backend"] == "gloo" and lines["init"]["compat_active"] is True
    assert lines["placement"]["off_device"] == []
    steps = lines["train_steps"]
    assert {"drafter_ddp", "drafter_distopt", "backbone_ddp", "backbone_distopt"} <= set(steps)
    assert lines["checkpoint"]["resumed_max_abs_diff"] == 0.0
    assert lines["ttt_loss"]["relative_diff"] < 1e-4 and lines["ttt_loss"]["transformer_impl"] == "local"
    # the drafter steps' peak beside the plan's figure for the same shapes (no device allocator on the CPU)
    assert steps["drafter_ddp"]["plan_gib"] > 0 and "peak_gib" in steps["drafter_ddp"]
    for name in ("te_spec", "drafter_te"):  # TE cannot be installed on a CPU machine: said, and no failure here
        assert lines[name]["transformer_engine"].startswith("absent"), lines[name]
    # the FP8 block-scaled checkpoint written here, through the online target, equals the HF forward (float32)
    assert lines["target_path"]["aux_rel_diff"] < 1e-4 and lines["target_path"]["final_rel_diff"] < 1e-4
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
    assert list(lines) == [*CHECKS, "summary"] and code == 0, (lines, err)
    assert lines["init"]["backend"] == "nccl" and lines["init"]["compat_active"] is False


@pytest.fixture
def gpu_check(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # its dataclasses look their module up
    monkeypatch.setattr(sys, "path", list(sys.path))  # it puts the checkout and benchmarks/ first
    spec.loader.exec_module(module)
    return module


def test_a_check_that_waits_forever_fails_at_its_time_limit_and_the_next_runs(gpu_check):
    import threading

    start = time.perf_counter()
    line = gpu_check._guarded("checkpoint", 1, threading.Event().wait)  # a writer that never reports back
    assert time.perf_counter() - start < 10
    assert line["check"] == "checkpoint" and line["ok"] is False and line["error"].startswith("CheckTimeout: ")
    assert gpu_check._guarded("ttt_memory", 1, lambda: {"check": "ttt_memory", "ok": True})["ok"] is True


# A run of gpu_check.main in which some checks are replaced (by name) with stand-ins: "hang" waits forever where
# the alarm reaches it, "stuck" waits with SIGALRM blocked (a C call that never returns), "pass" succeeds at once.
DRIVER = """
import importlib.util, signal, sys, threading, time
spec = importlib.util.spec_from_file_location("gpu_check", sys.argv[1])
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check
spec.loader.exec_module(gpu_check)
def stuck(*args):
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
    time.sleep(600)
behaviour = {
    "hang": lambda *args: threading.Event().wait(),
    "stuck": stuck,
}
for pair in sys.argv[2].split(","):
    name, how = pair.split("=")
    fn = behaviour.get(how, lambda *args, name=name: gpu_check.emit(name, True))
    setattr(gpu_check, "check_" + name, fn)
sys.exit(gpu_check.main(sys.argv[3:]))
"""


def _run_with(replaced: str, *args: str, timeout: int):
    command = [sys.executable, "-c", DRIVER, str(ROOT / "benchmarks" / "gpu_check.py"), replaced]
    start = time.perf_counter()
    code, lines, err = _run(*args, timeout=timeout, command=command)
    return code, lines, err, time.perf_counter() - start


def test_a_hanging_check_gets_its_share_of_the_total_budget_not_the_check_timeout():
    # ttt_memory and throughput weigh the same: the hanging one is stopped at half the budget (not at the
    # 180 s --check-timeout), and the next check still gets the other half and runs.
    code, lines, err, wall = _run_with(
        "ttt_memory=hang,throughput=pass",
        *("--dry-run", "--only", "ttt_memory", "throughput", "--total-budget", "6", "--check-timeout", "180"),
        timeout=120,
    )
    assert code == 1 and list(lines) == ["ttt_memory", "throughput", "summary"], err
    hung = lines["ttt_memory"]
    assert hung["ok"] is False and hung["error"].startswith("CheckTimeout: ")
    assert 2.5 <= hung["seconds"] <= 3.5 and hung["limit_s"] == 3.0
    assert lines["throughput"]["ok"] is True
    summary = lines["summary"]
    assert summary["failed"] == ["ttt_memory"] and summary["skipped"] == [] and summary["ok"] is False
    assert 2.5 <= summary["elapsed_s"] <= 6 and summary["total_budget_s"] == 6
    assert wall < 60  # the interpreter's start and imports, plus the 3 s share


def test_a_check_stuck_past_the_budget_ends_the_run_and_the_rest_are_skipped(gpu_check):
    code, lines, err, wall = _run_with(
        "ttt_memory=stuck,throughput=pass",
        *("--dry-run", "--only", "ttt_memory", "throughput", "--total-budget", "3"),
        timeout=120,
    )
    assert code == 1 and list(lines) == ["ttt_memory", "throughput", "summary"], err
    assert lines["ttt_memory"]["ok"] is False and "ran past --total-budget" in lines["ttt_memory"]["error"]
    assert lines["throughput"] == {
        "check": "throughput",
        "ok": False,
        "error": "skipped: budget spent",
        "skipped": True,
    }
    summary = lines["summary"]
    assert summary["failed"] == ["ttt_memory"] and summary["skipped"] == ["throughput"]
    # The budget plus the watchdog's grace, not the stuck check's 600 s.
    assert 3 + gpu_check.WATCHDOG_GRACE_S <= summary["elapsed_s"] < 3 + gpu_check.WATCHDOG_GRACE_S + 2
    assert wall < 60


def test_a_check_left_without_time_is_skipped_not_run(gpu_check):
    budget = gpu_check.Budget(0.5, 180, ["init", "throughput"])
    try:
        line = budget.run("init", lambda: pytest.fail("a check under MIN_CHECK_S must not run"))
        assert line["skipped"] is True and line["error"] == "skipped: budget spent" and line["ok"] is False
        summary = budget.summary()
    finally:
        budget._watchdog.cancel()
    assert summary["skipped"] == ["init"] and summary["ok"] is False
