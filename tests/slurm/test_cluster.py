"""`osprey cluster` itself: idempotent up, status, and a down that stops only its own daemons."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from launcher.cluster import DAEMONS, ClusterPaths, down, recorded_pid, status, up
from tests.slurm.jobs import wait_until

REPO = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _fake_daemon(binary: Path) -> subprocess.Popen:
    """A process whose name is binary's (a copy of sleep), e.g. 'slurmd'."""
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(shutil.which("sleep"), binary)
    process = subprocess.Popen([str(binary), "300"])
    comm = Path(f"/proc/{process.pid}/comm")
    wait_until(lambda: comm.read_text().strip() == binary.name, 10, f"{binary.name} to exec")  # lags under gVisor
    return process


def test_down_signals_only_recorded_pids_that_name_the_directory(tmp_path):
    """A same-named process outside the state directory survives even when a pid file points at it."""
    paths = ClusterPaths(tmp_path / "cluster")
    stranger = _fake_daemon(tmp_path / "elsewhere" / "slurmd")  # named slurmd, command line outside the cluster dir
    ours = _fake_daemon(paths.root / "bin" / "slurmctld")  # named slurmctld, command line inside it
    try:
        paths.pid_file("slurmd").parent.mkdir(parents=True)
        paths.pid_file("slurmd").write_text(f"{stranger.pid}\n")
        paths.pid_file("slurmctld").write_text(f"{ours.pid}\n")
        paths.pid_file("munged").write_text(f"{ours.pid}\n")  # right directory, wrong name
        assert recorded_pid(paths, "slurmd") is None
        assert recorded_pid(paths, "munged") is None
        assert recorded_pid(paths, "slurmctld") == ours.pid
        stopped = down(paths.root, timeout=5, say=lambda _: None)
        assert stopped == [ours.pid]
        assert ours.wait(timeout=5) == -15  # TERM was enough
        assert stranger.poll() is None
    finally:
        for process in (stranger, ours):
            process.kill()
            process.wait()


def test_cli_error_is_one_line_and_exit_2(tmp_path):
    too_long = tmp_path / ("d" * 120)
    done = subprocess.run(
        [sys.executable, "-m", "launcher.cluster", "up", "--dir", str(too_long)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("osprey: error: --dir ") and done.stderr.count("\n") == 1, done.stderr


def test_launcher_cluster_does_not_import_torch():
    code = "import sys, launcher.cluster; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


@pytest.mark.slurm
def test_up_again_and_status(slurm_cluster):
    before = status(slurm_cluster["state_dir"])
    assert before.running and before.node.split()[1] in ("idle", "mixed", "allocated"), before
    said = []
    t0 = time.monotonic()
    up(slurm_cluster["state_dir"], say=said.append)
    assert time.monotonic() - t0 < 5
    assert "already running" in said[0] and said[1] == f"export SLURM_CONF={slurm_cluster['state_dir']}/slurm.conf"
    assert status(slurm_cluster["state_dir"]).pids == before.pids
    cli = subprocess.run(
        [sys.executable, "-m", "launcher.cluster", "status", "--dir", str(slurm_cluster["state_dir"])],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 0, cli.stderr
    assert f"slurmd     running (pid {before.pids['slurmd']})" in cli.stdout


@pytest.mark.slurm
def test_second_cluster_down_leaves_no_daemon_and_spares_the_first(slurm_cluster):
    second_dir = Path(tempfile.mkdtemp(prefix="osprey-slurm-second-"))  # short: see conftest
    try:
        _second_cluster(slurm_cluster["state_dir"], second_dir)
    finally:
        down(second_dir, say=lambda _: None)
        shutil.rmtree(second_dir)


def _second_cluster(first_dir: Path, second_dir: Path) -> None:
    first = status(first_dir)
    up(second_dir, say=lambda _: None)
    second = status(second_dir)
    assert second.running and set(second.pids.values()).isdisjoint(first.pids.values())
    stopped = down(second_dir, say=lambda _: None)
    assert sorted(stopped) == sorted(second.pids.values())
    assert not any(_alive(pid) for pid in second.pids.values())
    assert not any(status(second_dir).pids.values())
    assert (second_dir / "log" / "slurmctld.log").exists()  # logs stay
    after = status(first_dir)
    assert after.running and after.pids == first.pids
    assert set(DAEMONS) == set(after.pids)
