"""`osprey cluster up|status|down`: a real one-node Slurm on this machine (Debian's slurm-wlm and munge).

Everything the cluster writes lives under one state directory (default $OSPREY_CACHE/slurm): the munge key,
socket and logs, slurm.conf, the daemons' state, spool, logs and pid files. Slurm commands find this cluster
through SLURM_CONF (`cluster_env` builds that environment). `down` signals only the processes whose pid files
are in that directory and whose command line names it, so another cluster on the same machine is never touched.
The queue starts empty at every `up`: slurmctld is started with -c (a local test cluster, not a service).

This module is the command; the state directory and slurm.conf are cluster_config's, the daemons' lifecycle
cluster_daemons', and job states cluster_jobs'.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from launcher.cluster_config import (
    DAEMONS,
    ClusterPaths,
    cannot_start_reason,
    cluster_env,
    cluster_paths,
    default_state_dir,
)
from launcher.cluster_daemons import down, recorded_pid, status, up
from launcher.cluster_jobs import job_state, wait_for_jobs

# What tests and scripts import from here, besides the CLI.
__all__ = [
    "DAEMONS",
    "ClusterPaths",
    "add_cluster_parser",
    "cannot_start_reason",
    "cluster_env",
    "down",
    "job_state",
    "main",
    "recorded_pid",
    "run_cluster",
    "status",
    "up",
    "wait_for_jobs",
]


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
        print(f"export SLURM_CONF={shlex.quote(str(cluster_paths(args.dir).conf))}")
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
