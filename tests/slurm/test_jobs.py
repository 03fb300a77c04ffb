"""Real jobs on the session's single-node Slurm: srun ranks, a gloo all-reduce, exit codes and dependencies."""

from __future__ import annotations

import socket
import sys

import pytest

from launcher.cluster import job_state, wait_for_jobs
from tests.slurm.jobs import sbatch, write_script

pytestmark = pytest.mark.slurm


def test_two_task_srun_runs_both_ranks(slurm_cluster, tmp_path):
    script = write_script(
        tmp_path / "ranks.sh", "#SBATCH -n 2 -o ranks.out\nsrun bash -c 'echo rank=$SLURM_PROCID/$SLURM_NTASKS'\n"
    )
    jobid = sbatch(script, slurm_cluster["env"])
    state = wait_for_jobs([jobid], slurm_cluster["env"], timeout=30)[jobid]
    assert (state.state, state.exit_code, state.restarts) == ("COMPLETED", 0, 0)
    assert sorted((tmp_path / "ranks.out").read_text().split()) == ["rank=0/2", "rank=1/2"]


GLOO = """\
import datetime, os
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} via {os.environ['MASTER_ADDR']}: sum {value.item():g}")
dist.destroy_process_group()
"""


def test_gloo_all_reduce_from_slurm_variables(slurm_cluster, tmp_path):
    (tmp_path / "gloo.py").write_text(GLOO)
    # The rendezvous as the sbatch templates set it up: first host of the allocation, RANK from SLURM_PROCID.
    script = write_script(
        tmp_path / "gloo.sh",
        f"""#SBATCH -n 2 -o gloo.out
set -euo pipefail
export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
srun bash -c 'export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS; exec "$@"' task \\
  {sys.executable} gloo.py
""",
    )
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    jobid = sbatch(script, {**slurm_cluster["env"], "MASTER_PORT": str(port)})
    state = wait_for_jobs([jobid], slurm_cluster["env"], timeout=90)[jobid]
    out = (tmp_path / "gloo.out").read_text()
    assert state.state == "COMPLETED", out
    node = socket.gethostname().split(".")[0]
    lines = sorted(line for line in out.splitlines() if line.startswith("rank "))
    assert lines == [f"rank 0 of 2 via {node}: sum 3", f"rank 1 of 2 via {node}: sum 3"], out


def test_failed_job_and_its_dependent(slurm_cluster, tmp_path):
    """A failing job reports its exit code; a job after it (afterok) is cancelled instead of pending forever."""
    env = slurm_cluster["env"]
    failing = sbatch(write_script(tmp_path / "fail.sh", "#SBATCH -n 1 -o fail.out\nexit 3\n"), env)
    after = sbatch(
        write_script(tmp_path / "after.sh", "#SBATCH -n 1 -o after.out\necho ran\n"),
        env,
        f"--dependency=afterok:{failing}",
    )
    states = wait_for_jobs([failing, after], env, timeout=30)
    assert (states[failing].state, states[failing].exit_code) == ("FAILED", 3)
    assert states[after].state == "CANCELLED"
    assert not (tmp_path / "after.out").exists()
    assert job_state(failing, env) == states[failing]


def test_unknown_job_is_a_clear_error(slurm_cluster):
    with pytest.raises(ValueError, match="does not know job 999999"):
        job_state(999999, slurm_cluster["env"])
