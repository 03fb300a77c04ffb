"""Submitting test jobs to the session's cluster."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from launcher.cluster import job_state


def sbatch(script: Path, env: dict[str, str], *args: str) -> str:
    """Submit script (from its own directory); returns the job id."""
    done = subprocess.run(
        ["sbatch", "--parsable", *args, str(script)], cwd=script.parent, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def write_script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)
    return path


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.2)


def wait_running(jobid: str, env: dict[str, str], marker: Path, timeout: float = 30) -> None:
    """Until the job runs and its script has written marker (so its traps are installed)."""
    wait_until(lambda: job_state(jobid, env).state == "RUNNING" and marker.exists(), timeout, f"job {jobid} to run")
