"""Requeue on the real Slurm: what the pretrain template relies on.

Observed with Slurm 22.05 (and asserted here): `scontrol requeue JOB` sends TERM to the batch shell (its trap
runs) and kills the steps; the job waits cred_expire seconds (Reason=BeginTime), then runs again with
SLURM_RESTART_COUNT=1. `scancel --signal=TERM JOB` reaches only the srun steps, which is also where
`--signal=TERM@N` goes: a step that stops cleanly lets the script requeue itself with `scontrol requeue`.
`scancel --signal=TERM --batch JOB` reaches only the batch shell, never the step.

Then the real thing: the tiny backbone's pretrain stage, submitted through `osprey submit`, requeued with
`scontrol requeue` after its first checkpoint, resumes from it and ends with the losses of the same job run
without interruption, iteration by iteration.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.cli import main as osprey
from launcher.cluster import wait_for_jobs
from megatron_osprey.recipes import get_recipe
from tests.distributed.scripts.check_pretrain_fixtures import make_backbone, make_corpus
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


def _requeued_once(slurm_cluster, tmp_path, script: str, interrupt: list[str]) -> list[str]:
    """Submit `script`, run `interrupt + [jobid]` once it started, require one restart to COMPLETED with exit 0;
    the job's own `@` lines (not Slurm's or bash's)."""
    env = slurm_cluster["env"]
    jobid = sbatch(write_script(tmp_path / "job.sh", script), env)
    wait_running(jobid, env, tmp_path / "started")
    subprocess.run([*interrupt, jobid], env=env, check=True)
    state = wait_for_jobs([jobid], env, timeout=60)[jobid]
    out = (tmp_path / "job.out").read_text()
    assert (state.state, state.exit_code, state.restarts) == ("COMPLETED", 0, 1), out
    return [line[1:] for line in out.splitlines() if line.startswith("@")]


def test_scontrol_requeue_runs_the_job_again(slurm_cluster, tmp_path):
    lines = _requeued_once(slurm_cluster, tmp_path, TRAPPED, ["scontrol", "requeue"])
    assert lines == ["start restart=0", "batch TERM restart=0", "start restart=1", "done restart=1"]


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
    lines = _requeued_once(slurm_cluster, tmp_path, SELF_REQUEUE, ["scancel", "--signal=TERM"])
    assert lines == ["start restart=0", "step TERM", "step exit 0", "start restart=1", "done restart=1"]


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


RECIPE = "tiny_cpu_backbone_pretrain_2proc_fp32"
ITERS = 40  # the recipe's 20, doubled: the requeue must land while most of the run is still ahead
OVERRIDES = [f"training.train_iters={ITERS}"]


def _inputs(run_dir: Path, work: Path) -> None:
    """What the chain's prune and preprocess stages would have written: the pruned toy backbone and a corpus."""
    make_backbone(work)
    shutil.copytree(work / "backbone", run_dir / "prune")
    make_corpus(get_recipe(RECIPE).config("preprocess", str(run_dir)).output_path())


def _submit(run_dir: Path) -> str:
    argv = ["submit", RECIPE, "--stage", "pretrain", "--run-dir", str(run_dir), "--python", sys.executable]
    for override in OVERRIDES:
        argv += ["--set", override]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert osprey(argv) == 0
    stage, jobid = out.getvalue().split()
    assert stage == "pretrain"
    return jobid


def _scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(iteration, value) of one metric as the stage logged it to TensorBoard, across restarts."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "pretrain" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()  # a restarted writer's purge_step drops the steps the first run logged past its checkpoint
    return [(e.step, e.value) for e in events.Scalars(tag)]


def _log(run_dir: Path, jobid: str, restart: int) -> str:
    return next((run_dir / "logs").glob(f"*-{jobid}-restart{restart}.log")).read_text()


def test_a_requeued_pretrain_job_resumes_and_ends_with_the_uninterrupted_losses(slurm_cluster, tmp_path):
    env = slurm_cluster["env"]
    start = time.monotonic()
    requeued, straight = tmp_path / "requeued", tmp_path / "straight"
    _inputs(requeued, tmp_path / "work")
    shutil.copytree(requeued, straight)
    first = _submit(requeued)
    second = _submit(straight)  # waits for the CPUs, then runs while the first one waits to start again
    latest = requeued / "pretrain" / "latest_checkpointed_iteration.txt"
    wait_until(latest.exists, 120, f"job {first}'s first checkpoint")
    subprocess.run(["scontrol", "requeue", first], env=env, check=True)
    states = wait_for_jobs([first, second], env, timeout=240)
    seconds = time.monotonic() - start

    before, after = _log(requeued, first, 0), _log(requeued, first, 1)
    assert (states[first].state, states[first].restarts) == ("COMPLETED", 1), after[-3000:]
    assert (states[second].state, states[second].restarts) == ("COMPLETED", 0), _log(straight, second, 0)[-3000:]
    reached = max(int(i) for i in re.findall(rf"iteration\s+(\d+)/{ITERS}", before))
    resumed = int(re.search(r"resumed from \S+ at iteration (\d+)", after).group(1))
    print(f"requeue test: {seconds:.0f} s; cut at iteration {reached}/{ITERS}, resumed from {resumed}")
    assert 0 < resumed <= reached < ITERS, (resumed, reached)  # the requeue cut the run short, mid-way
    assert re.search(rf"iteration\s+{resumed + 1}/{ITERS}", after) and not re.search(r"iteration\s+1/", after)

    # Iteration by iteration, the same losses as the run that never stopped (the same 2 gloo ranks: bit for bit).
    for tag in ("loss/train", "loss/valid"):
        got, want = _scalars(requeued, tag), _scalars(straight, tag)
        assert got == want and want, tag
    assert [step for step, _ in _scalars(straight, "loss/train")] == list(range(1, ITERS + 1))
    assert (requeued / "pretrain" / "hf").is_dir()
