"""Requeue on the real Slurm: what the pretrain template relies on.

Observed with Slurm 22.05 (and asserted here): `scontrol requeue JOB` sends TERM to the batch shell (its trap
runs) and kills the steps; the job waits cred_expire seconds (Reason=BeginTime), then runs again with
SLURM_RESTART_COUNT=1. `scancel --signal=TERM JOB` reaches only the srun steps, which is also where
`--signal=TERM@N` goes: a step that stops cleanly lets the script requeue itself with `scontrol requeue`.
`scancel --signal=TERM --batch JOB` reaches only the batch shell, never the step.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from launcher.cluster import wait_for_jobs
from tests.slurm.jobs import sbatch, wait_running, wait_until, write_script

pytestmark = pytest.mark.slurm

TRAPPED = """\
#SBATCH -n 1 --requeue --open-mode=append -o job.out
echo "@start restart=${SLURM_RESTART_COUNT:-0}"
trap 'echo "@batch TERM restart=${SLURM_RESTART_COUNT:-0}"; exit 143' TERM
if [[ "${SLURM_RESTART_COUNT:-0}" == 0 ]]; then
  touch started
  sleep 120 & wait
fi
echo "@done restart=${SLURM_RESTART_COUNT:-0}"
"""


def test_scontrol_requeue_runs_the_job_again(slurm_cluster, tmp_path):
    env = slurm_cluster["env"]
    jobid = sbatch(write_script(tmp_path / "trapped.sh", TRAPPED), env)
    wait_running(jobid, env, tmp_path / "started")
    subprocess.run(["scontrol", "requeue", jobid], env=env, check=True)
    state = wait_for_jobs([jobid], env, timeout=60)[jobid]
    out = (tmp_path / "job.out").read_text()
    assert (state.state, state.exit_code, state.restarts) == ("COMPLETED", 0, 1), out
    lines = [line[1:] for line in out.splitlines() if line.startswith("@")]  # ours, not Slurm's or bash's
    assert lines == ["start restart=0", "batch TERM restart=0", "start restart=1", "done restart=1"], out


SELF_REQUEUE = """\
#SBATCH -n 1 --requeue --open-mode=append -o job.out
echo "@start restart=${SLURM_RESTART_COUNT:-0}"
if [[ "${SLURM_RESTART_COUNT:-0}" == 0 ]]; then
  srun bash -c 'trap "echo @step TERM; exit 0" TERM; touch started; for i in $(seq 1200); do sleep 0.1; done; exit 7'
  status=$?
  echo "@step exit $status"
  scontrol requeue "$SLURM_JOB_ID"
  exit "$status"
fi
echo "@done restart=${SLURM_RESTART_COUNT:-0}"
"""


def test_step_signal_then_self_requeue(slurm_cluster, tmp_path):
    """The pretrain template's path: TERM to the step (as from --signal=TERM@300), clean stop, scontrol requeue."""
    env = slurm_cluster["env"]
    jobid = sbatch(write_script(tmp_path / "self.sh", SELF_REQUEUE), env)
    wait_running(jobid, env, tmp_path / "started")
    subprocess.run(["scancel", "--signal=TERM", jobid], env=env, check=True)
    state = wait_for_jobs([jobid], env, timeout=60)[jobid]
    out = (tmp_path / "job.out").read_text()
    assert (state.state, state.exit_code, state.restarts) == ("COMPLETED", 0, 1), out
    lines = [line[1:] for line in out.splitlines() if line.startswith("@")]  # ours, not Slurm's or bash's
    assert lines == ["start restart=0", "step TERM", "step exit 0", "start restart=1", "done restart=1"], out


BATCH_ONLY = """\
#SBATCH -n 1 -o job.out
trap 'echo "@batch TERM"' TERM
srun bash -c 'trap "echo @step TERM; exit 0" TERM; touch started; for i in $(seq 1200); do sleep 0.1; done' &
wait $!
echo "@wait ended"
touch waited
wait
"""


def test_scancel_batch_signals_only_the_batch_shell(slurm_cluster, tmp_path):
    env = slurm_cluster["env"]
    jobid = sbatch(write_script(tmp_path / "batch.sh", BATCH_ONLY), env)
    wait_running(jobid, env, tmp_path / "started")
    subprocess.run(["scancel", "--signal=TERM", "--batch", jobid], env=env, check=True)
    wait_until((tmp_path / "waited").exists, 20, "the batch shell's trap")
    time.sleep(1)  # a step that had been signalled too would have printed by now
    out = (tmp_path / "job.out").read_text()
    subprocess.run(["scancel", jobid], env=env, check=True)
    wait_for_jobs([jobid], env, timeout=30)
    assert "@batch TERM" in out and "@step TERM" not in out, out
