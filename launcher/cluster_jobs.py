"""Jobs on a Slurm cluster as `scontrol show job` reports them (no accounting database needed)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass

# Job states after which a job never runs again (`scontrol show job`'s JobState).
FINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
)


@dataclass(frozen=True)
class JobState:
    """One job as `scontrol show job` reports it."""

    job_id: str
    state: str  # JobState, e.g. PENDING, RUNNING, COMPLETED, FAILED
    exit_code: int
    exit_signal: int
    restarts: int  # how often the job was requeued (the job sees it as SLURM_RESTART_COUNT)
    run_time_s: int
    reason: str

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


_FIELD = re.compile(r"(?:^|\s)([A-Za-z][\w:/]*)=")


def parse_job_record(line: str) -> dict[str, str]:
    """`scontrol show job -o` prints one job per line as Key=Value pairs; a value may contain spaces."""
    keys = list(_FIELD.finditer(line))
    return {
        m.group(1): line[m.end() : (keys[i + 1].start() if i + 1 < len(keys) else len(line))].strip()
        for i, m in enumerate(keys)
    }


def _seconds(run_time: str) -> int:
    """Slurm's [D-]HH:MM:SS as seconds."""
    days, _, clock = run_time.rpartition("-")
    seconds = 0
    for part in clock.split(":"):
        seconds = seconds * 60 + int(part)
    return seconds + 86400 * int(days or 0)


def _job_state(record: dict[str, str]) -> JobState:
    code, _, sig = record.get("ExitCode", "0:0").partition(":")
    return JobState(
        job_id=record["JobId"],
        state=record.get("JobState", "UNKNOWN"),
        exit_code=int(code),
        exit_signal=int(sig or 0),
        restarts=int(record.get("Restarts", "0")),
        run_time_s=_seconds(record.get("RunTime", "0:0:0")),
        reason=record.get("Reason", "None"),
    )


def job_state(jobid: str | int, env: dict[str, str] | None = None) -> JobState:
    """The job's state, exit code, restart count and run time (`scontrol show job -o`; no accounting needed)."""
    done = subprocess.run(
        ["scontrol", "show", "job", "-o", str(jobid)], env=env, capture_output=True, text=True, timeout=30, check=False
    )
    if done.returncode != 0 or not done.stdout.strip():
        said = (done.stderr or done.stdout).strip()
        raise ValueError(
            f"scontrol does not know job {jobid} (SLURM_CONF={(env or os.environ).get('SLURM_CONF')}): {said}"
        )
    return _job_state(parse_job_record(done.stdout.strip().splitlines()[0]))


def wait_for_jobs(
    jobids: list[str | int], env: dict[str, str] | None = None, timeout: float = 600.0, poll: float = 1.0
) -> dict[str, JobState]:
    """Poll until every job is in a final state; returns {jobid: JobState}. TimeoutError names the stragglers."""
    deadline = time.monotonic() + timeout
    while True:
        states = {str(j): job_state(j, env) for j in jobids}
        if all(s.final for s in states.values()):
            return states
        if time.monotonic() >= deadline:
            waiting = ", ".join(f"{j} ({s.state}, {s.reason})" for j, s in states.items() if not s.final)
            raise TimeoutError(f"jobs still unfinished after {timeout:.0f} s: {waiting}")
        time.sleep(poll)
