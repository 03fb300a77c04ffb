"""Launch a check script under `torchrun --nproc_per_node=N` (gloo) and return its JSON figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_torchrun(script: str, work: Path, nproc: int = 2, timeout: int = 600, extra: list[str] | None = None) -> dict:
    """Run tests/distributed/scripts/<script> on `nproc` ranks; raise with its output on failure."""
    work.mkdir(parents=True, exist_ok=True)
    result = work / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        "--master_port=0",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=127.0.0.1:0",
        str(ROOT / "tests" / "distributed" / "scripts" / script),
        str(work),
        str(result),
        *(extra or []),
    ]
    # start_new_session + kill on timeout: an orphaned checkpoint Manager must not hang CI.
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        raise AssertionError(f"{script} timed out after {timeout}s:\n{output[-6000:]}")
    if proc.returncode != 0 or not result.is_file():
        raise AssertionError(f"{script} failed (exit {proc.returncode}):\n{output[-6000:]}")
    return json.loads(result.read_text())
