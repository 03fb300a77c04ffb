"""A local cluster's files under its state directory, what it needs installed, and the slurm.conf and munge key
`osprey cluster up` writes there."""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import socket
import subprocess
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


def cluster_paths(state_dir: str | os.PathLike | None) -> ClusterPaths:
    # Absolute, because `down` recognises our daemons by this path in their command lines.
    return ClusterPaths(Path(state_dir if state_dir is not None else default_state_dir()).expanduser().resolve())


def cluster_env(state_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """This process's environment plus SLURM_CONF pointing at the cluster in state_dir (for sbatch, squeue...)."""
    return {**os.environ, "SLURM_CONF": str(cluster_paths(state_dir).conf)}


def daemon_binary(name: str) -> str | None:
    """The daemon's path; Debian puts them in /usr/sbin, which a user's PATH may lack."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin"]))


def _installed() -> bool:
    return all(daemon_binary(name) for name in DAEMONS) and all(
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


def ensure_installed(say: Callable[[str], None]) -> None:
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


def prepare_state_dir(paths: ClusterPaths) -> str:
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
