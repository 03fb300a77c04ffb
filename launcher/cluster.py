"""`osprey cluster up|status|down`: a real one-node Slurm on this machine (Debian's slurm-wlm and munge).

Everything the cluster writes lives under one state directory (default $OSPREY_CACHE/slurm): the munge key,
socket and logs, slurm.conf, the daemons' state, spool, logs and pid files. Slurm commands find this cluster
through SLURM_CONF (`cluster_env` builds that environment). `down` signals only the processes whose pid files
are in that directory and whose command line names it, so another cluster on the same machine is never touched.
The queue starts empty at every `up`: slurmctld is started with -c (a local test cluster, not a service).
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from megatron_osprey.assets.download import osprey_cache_dir

DAEMONS = ("munged", "slurmctld", "slurmd")  # start order; `down` stops them in reverse
PARTITION = "local"
# How long a requeued job waits before it may start again (Slurm's default is 120 s, its minimum 5 s): on one
# node the credential only has to outlive a local launch.
CRED_EXPIRE_S = 10
DEFAULT_PORTS = (6817, 6818)  # slurmctld, slurmd: Slurm's own defaults, used when they are free
# Job states after which a job never runs again (`scontrol show job`'s JobState).
FINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
)


@dataclass(frozen=True)
class ClusterPaths:
    """Every file of one local cluster, all under `root`."""

    root: Path

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def munge_dir(self) -> Path:
        return self.root / "munge"

    @property
    def munge_key(self) -> Path:
        return self.munge_dir / "munge.key"

    @property
    def munge_socket(self) -> Path:
        return self.munge_dir / "munge.socket.2"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def spool(self) -> Path:
        return self.root / "spool"

    @property
    def logs(self) -> Path:
        return self.root / "log"

    def pid_file(self, daemon: str) -> Path:
        return self.root / "run" / f"{daemon}.pid"

    def log_file(self, daemon: str) -> Path:
        return self.logs / f"{daemon}.log"


def default_state_dir() -> Path:
    """$OSPREY_CACHE/slurm, else ~/.cache/megatron_osprey/slurm."""
    return osprey_cache_dir("slurm")


def _paths(state_dir: str | os.PathLike | None) -> ClusterPaths:
    # Absolute, because `down` recognises our daemons by this path in their command lines.
    return ClusterPaths(Path(state_dir if state_dir is not None else default_state_dir()).expanduser().resolve())


def cluster_env(state_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """This process's environment plus SLURM_CONF pointing at the cluster in state_dir (for sbatch, squeue...)."""
    return {**os.environ, "SLURM_CONF": str(_paths(state_dir).conf)}


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


# ----------------------------------------------------------------------------------------------- install + config


def _daemon_binary(name: str) -> str | None:
    """The daemon's path; Debian puts them in /usr/sbin, which a user's PATH may lack."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin"]))


def _installed() -> bool:
    return all(_daemon_binary(name) for name in DAEMONS) and all(
        shutil.which(n) for n in ("sinfo", "sbatch", "scontrol")
    )


def cannot_start_reason() -> str | None:
    """Why `up` cannot work on this machine (not root; Slurm missing and no apt-get), or None."""
    if os.geteuid() != 0:
        return "osprey cluster up runs munged, slurmctld and slurmd as root (SlurmUser=root): rerun it as root."
    if not _installed() and shutil.which("apt-get") is None:
        return (
            "Slurm or munge is not installed and there is no apt-get: install slurmctld, slurmd, "
            "the Slurm client commands and munged with this system's package manager, then rerun."
        )
    return None


def _ensure_installed(say: Callable[[str], None]) -> None:
    """apt-get install slurm-wlm munge when a daemon or a Slurm command is missing."""
    if _installed():
        return
    say("osprey: installing slurm-wlm and munge with apt-get (about a minute)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"]):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"`{shlex.join(argv)}` failed with exit code {done.returncode}: {' / '.join(tail)}")


def _free_port(preferred: int, taken: set[int]) -> int:
    """preferred when nothing listens on it, else a free port the kernel picks."""
    for port in (preferred, 0):
        if port in taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free TCP port for the Slurm daemons")


def node_resources() -> tuple[int, int]:
    """(CPUs this process may use, physical memory in MiB): what slurmd will find, never more."""
    cpus = len(os.sched_getaffinity(0))
    memory_mib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20
    return cpus, memory_mib


def render_conf(paths: ClusterPaths, node: str, ports: tuple[int, int], cpus: int, memory_mib: int) -> str:
    """slurm.conf for one node (this host at 127.0.0.1), root daemons, no accounting, requeue allowed."""
    return f"""\
# Written by `osprey cluster up` at every start; edits are lost.
ClusterName=osprey
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={paths.munge_socket},cred_expire={CRED_EXPIRE_S}
StateSaveLocation={paths.state}
SlurmdSpoolDir={paths.spool}
SlurmctldPidFile={paths.pid_file("slurmctld")}
SlurmdPidFile={paths.pid_file("slurmd")}
SlurmctldLogFile={paths.log_file("slurmctld")}
SlurmdLogFile={paths.log_file("slurmd")}
PlugStackConfig={paths.root / "plugstack.conf"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# A requeued or dependent job starts within seconds rather than at the next minute's scheduling pass.
SchedulerParameters=sched_interval=2,bf_interval=5
DependencyParameters=kill_invalid_depend
JobRequeue=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
# Finished jobs stay visible to `scontrol show job` (there is no accounting database) for an hour.
MinJobAge=3600
KillWait=10
MailProg=/bin/true
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mib} State=UNKNOWN
PartitionName={PARTITION} Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def _prepare(paths: ClusterPaths) -> str:
    """Create the directories, the munge key (kept across restarts) and slurm.conf; returns the node name."""
    for directory in (paths.root, paths.state, paths.spool, paths.logs, paths.pid_file("x").parent):
        directory.mkdir(parents=True, exist_ok=True)
    # Others may enter these two, so munged reaches its socket without complaint wherever the parents allow.
    for directory in (paths.root, paths.munge_dir):
        directory.mkdir(exist_ok=True)
        os.chmod(directory, 0o755)
    if not paths.munge_key.exists():
        fd = os.open(paths.munge_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(1024))
    (paths.root / "plugstack.conf").write_text("")
    node = socket.gethostname().split(".")[0]
    ctld = _free_port(DEFAULT_PORTS[0], set())
    slurmd = _free_port(DEFAULT_PORTS[1], {ctld})
    paths.conf.write_text(render_conf(paths, node, (ctld, slurmd), *node_resources()))
    return node


def _daemon_argv(paths: ClusterPaths, daemon: str, node: str) -> list[str]:
    if daemon == "munged":
        m = paths.munge_dir
        return [
            _daemon_binary("munged"),
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
        return [_daemon_binary("slurmctld"), "-c", "-f", str(paths.conf)]  # -c: start with an empty queue
    return [_daemon_binary("slurmd"), "-f", str(paths.conf), "-N", node]


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
    paths = _paths(state_dir)
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
    _ensure_installed(say)
    node = _prepare(paths)
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
    paths = _paths(state_dir)
    pids = {daemon: recorded_pid(paths, daemon) for daemon in DAEMONS}
    node = _sinfo_node(paths) if pids["slurmctld"] and paths.conf.exists() else None
    return ClusterStatus(paths.root, pids, node)


def down(
    state_dir: str | os.PathLike | None = None, *, timeout: float = 15.0, say: Callable[[str], None] = print
) -> list[int]:
    """Cancel this cluster's jobs, then stop the daemons `up` recorded (TERM, wait, KILL); returns their pids.

    The directory stays, so the logs can still be read.
    """
    paths = _paths(state_dir)
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


# ----------------------------------------------------------------------------------------------- jobs


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


# ----------------------------------------------------------------------------------------------- CLI


def _add_actions(actions: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--dir", type=Path, default=None, help=f"the cluster's state directory (default: {default_state_dir()})"
    )
    p = actions.add_parser(
        "up", parents=[common], help="install if needed, start munged/slurmctld/slurmd, wait for idle"
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the node to be idle (default 60)")
    actions.add_parser("status", parents=[common], help="which daemons run, and sinfo's node line")
    actions.add_parser("down", parents=[common], help="cancel the jobs and stop the daemons `up` started")


def add_cluster_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `cluster up|status|down [--dir D]` to the `osprey` command's subparsers."""
    parser = subparsers.add_parser(
        "cluster", help="a single-node Slurm on this machine (for tests and trying the sbatch templates)"
    )
    _add_actions(parser.add_subparsers(dest="cluster_command", required=True, metavar="ACTION"))
    return parser


def run_cluster(args: argparse.Namespace) -> int:
    """Run `osprey cluster ACTION`; errors print one `osprey: error:` line and return 2."""
    try:
        if args.cluster_command == "up":
            up(args.dir, timeout=args.timeout)
            return 0
        if args.cluster_command == "down":
            down(args.dir)
            return 0
        state = status(args.dir)
        for daemon, pid in state.pids.items():
            print(f"{daemon:<10} {f'running (pid {pid})' if pid else 'not running'}")
        print(f"{'node':<10} {state.node or '(slurmctld does not answer)'}")
        print(f"export SLURM_CONF={shlex.quote(str(_paths(args.dir).conf))}")
        return 0 if state.running else 1
    except (ValueError, RuntimeError, OSError, subprocess.SubprocessError) as err:
        print(f"osprey: error: {err}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.cluster", description=__doc__.splitlines()[0])
    _add_actions(parser.add_subparsers(dest="cluster_command", required=True, metavar="ACTION"))
    return run_cluster(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
