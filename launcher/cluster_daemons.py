"""The local cluster's daemons: start them (`up`), find them by their pid files (`status`), stop them (`down`)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from launcher.cluster_config import (
    DAEMONS,
    ClusterPaths,
    cannot_start_reason,
    cluster_env,
    cluster_paths,
    daemon_binary,
    ensure_installed,
    prepare_state_dir,
)

# ----------------------------------------------------------------------------------------------- processes


def _pid_alive(pid: int) -> bool:
    """True while pid exists and is not a zombie (a reaped-late daemon must not look alive)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def recorded_pid(paths: ClusterPaths, daemon: str) -> int | None:
    """The pid in daemon's pid file when that process is alive, is `daemon`, and names this state directory.

    The last two checks keep a recycled pid, or another cluster's daemon, from ever being signalled.
    """
    try:
        pid = int(paths.pid_file(daemon).read_text().split()[0])
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        return None
    if comm != daemon or str(paths.root) not in cmdline or not _pid_alive(pid):
        return None
    return pid


def _stop(pid: int, timeout: float) -> None:
    """TERM, wait up to timeout, then KILL."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return


def _daemon_argv(paths: ClusterPaths, daemon: str, node: str) -> list[str]:
    if daemon == "munged":
        m = paths.munge_dir
        return [
            daemon_binary("munged"),
            # Below a 0700 directory (root's home holds the default state dir) munged refuses to start without
            # --force, because other users could not reach its socket; here every client runs as root.
            "--force",
            f"--key-file={paths.munge_key}",
            f"--socket={paths.munge_socket}",
            f"--pid-file={paths.pid_file('munged')}",
            f"--log-file={paths.log_file('munged')}",
            f"--seed-file={m / 'munged.seed'}",
        ]
    if daemon == "slurmctld":
        return [daemon_binary("slurmctld"), "-c", "-f", str(paths.conf)]  # -c: start with an empty queue
    return [daemon_binary("slurmd"), "-f", str(paths.conf), "-N", node]


def _start(paths: ClusterPaths, daemon: str, node: str) -> int:
    """Run the daemon (it forks into the background and writes its pid file); returns its pid."""
    paths.pid_file(daemon).unlink(missing_ok=True)
    early = paths.logs / f"{daemon}.stderr"  # what it says before its own log opens
    with open(early, "w") as err:
        code = subprocess.run(
            _daemon_argv(paths, daemon, node),
            cwd=paths.root,
            env=cluster_env(paths.root),
            stdin=subprocess.DEVNULL,
            stdout=err,
            stderr=err,
            timeout=60,
            check=False,
        ).returncode
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        pid = recorded_pid(paths, daemon)
        if pid is not None:
            return pid
        if code != 0:
            break
        time.sleep(0.1)
    said = " / ".join(early.read_text().strip().splitlines()[-2:])
    raise RuntimeError(
        f"{daemon} did not start (exit code {code}{': ' + said if said else ''}); read {paths.log_file(daemon)}."
    )


def _sinfo_node(paths: ClusterPaths) -> str | None:
    """sinfo's line for our node: 'NAME STATE CPUS MEMORY', or None when slurmctld does not answer."""
    done = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N %T %c %m"],
        env=cluster_env(paths.root),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


# ----------------------------------------------------------------------------------------------- up / status / down


def up(
    state_dir: str | os.PathLike | None = None, *, timeout: float = 60.0, say: Callable[[str], None] = print
) -> Path:
    """Start munged, slurmctld and slurmd for a one-node cluster in state_dir; returns slurm.conf's path."""
    paths = cluster_paths(state_dir)
    # A unix socket path longer than sun_path (108 bytes) cannot be bound.
    if len(str(paths.munge_socket).encode()) > 100:
        raise ValueError(f"--dir {paths.root} is too long for munge's socket path; choose a shorter directory.")
    running = {daemon: recorded_pid(paths, daemon) for daemon in DAEMONS}
    if all(running.values()):
        say(f"osprey: the cluster in {paths.root} is already running ({_describe(running)})")
        say(f"export SLURM_CONF={shlex.quote(str(paths.conf))}")
        return paths.conf
    if any(running.values()):
        say(f"osprey: restarting the partly running cluster in {paths.root} ({_describe(running)})")
        down(paths.root, say=say)
    reason = cannot_start_reason()
    if reason:
        raise RuntimeError(reason)
    ensure_installed(say)
    node = prepare_state_dir(paths)
    try:
        started = {daemon: _start(paths, daemon, node) for daemon in DAEMONS}
        line = _wait_idle(paths, node, timeout)
    except BaseException:
        down(paths.root, say=lambda _: None)  # no half-started cluster; the logs stay for reading
        raise
    say(f"osprey: cluster up in {paths.root} ({_describe(started)}); node {line}")
    say(f"export SLURM_CONF={shlex.quote(str(paths.conf))}")
    return paths.conf


def _wait_idle(paths: ClusterPaths, node: str, timeout: float) -> str:
    """sinfo's node line once the node is idle; RuntimeError naming the logs after timeout seconds."""
    deadline = time.monotonic() + timeout
    line = None
    while time.monotonic() < deadline:
        line = _sinfo_node(paths)
        if line is not None and line.split()[1] == "idle":
            return line
        time.sleep(0.5)
    raise RuntimeError(
        f"node {node} is not idle after {timeout:.0f} s (sinfo: {line or 'no answer'}); "
        f"read {paths.log_file('slurmctld')} and {paths.log_file('slurmd')}."
    )


@dataclass(frozen=True)
class ClusterStatus:
    """Which of our daemons are alive (pid or None) and sinfo's node line (None when slurmctld is down)."""

    state_dir: Path
    pids: dict[str, int | None]
    node: str | None

    @property
    def running(self) -> bool:
        return all(self.pids.values()) and self.node is not None


def status(state_dir: str | os.PathLike | None = None) -> ClusterStatus:
    """The daemons alive by their pid files, and sinfo's node line."""
    paths = cluster_paths(state_dir)
    pids = {daemon: recorded_pid(paths, daemon) for daemon in DAEMONS}
    node = _sinfo_node(paths) if pids["slurmctld"] and paths.conf.exists() else None
    return ClusterStatus(paths.root, pids, node)


def down(
    state_dir: str | os.PathLike | None = None, *, timeout: float = 15.0, say: Callable[[str], None] = print
) -> list[int]:
    """Cancel this cluster's jobs, then stop the daemons `up` recorded (TERM, wait, KILL); returns their pids.

    The directory stays, so the logs can still be read.
    """
    paths = cluster_paths(state_dir)
    pids = {daemon: recorded_pid(paths, daemon) for daemon in DAEMONS}
    if pids["slurmctld"]:
        _cancel_all_jobs(paths, timeout)
    stopped = []
    for daemon in reversed(DAEMONS):  # slurmd first, munged last: the others authenticate through it
        pid = pids[daemon]
        if pid is not None:
            _stop(pid, timeout)
            stopped.append(pid)
        paths.pid_file(daemon).unlink(missing_ok=True)
    say(
        f"osprey: stopped {_describe(pids)} in {paths.root}"
        if stopped
        else f"osprey: no daemon running in {paths.root}"
    )
    return stopped


def _cancel_all_jobs(paths: ClusterPaths, timeout: float) -> None:
    """scancel every job of this cluster and wait for them to leave the node, so no job outlives slurmd.

    Best effort: a slurmctld that does not answer is stopped all the same.
    """
    if not paths.conf.exists():
        return
    env = cluster_env(paths.root)

    def queued() -> list[str]:
        done = subprocess.run(["squeue", "-h", "-o", "%A"], env=env, capture_output=True, text=True, timeout=15)
        return done.stdout.split() if done.returncode == 0 else []

    try:
        jobs = queued()
        if not jobs:
            return
        subprocess.run(["scancel", *jobs], env=env, capture_output=True, timeout=15, check=False)
        deadline = time.monotonic() + timeout
        while queued() and time.monotonic() < deadline:
            time.sleep(0.2)
    except subprocess.TimeoutExpired:
        return


def _describe(pids: dict[str, int | None]) -> str:
    return ", ".join(f"{daemon} {pid}" if pid else f"{daemon} not running" for daemon, pid in pids.items())
