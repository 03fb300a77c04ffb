"""SIGTERM to one rank of a `python -m megatron_osprey pretrain` job: both save at one iteration, exit 0."""

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.distributed.launch import ROOT
from tests.distributed.scripts.check_pretrain_fixtures import make_backbone, make_corpus

pytestmark = pytest.mark.distributed


def test_sigterm_saves_on_every_rank_and_exits_zero(tmp_path):
    prefix = make_corpus(tmp_path / "data" / "corpus_text_document")
    backbone = make_backbone(tmp_path)
    save = tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        "--master_port=0",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=127.0.0.1:0",
        "-m",
        "megatron_osprey",
        "pretrain",
        "--recipe",
        "tiny_cpu_backbone_pretrain_2proc_fp32",
        "--backbone",
        str(backbone),
        "--data-path",
        prefix,
        "--train-iters",
        "100000",
        "--save",
        str(save),
        "--load",
        str(save),
        "--tensorboard-dir",
        str(save / "tb"),
        "--exit-signal-handler",
        "--no-progress-bar",
        "--eval-iters",
        "0",
        "--split",
        "100,0,0",
    ]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if re.search(r"iteration\s+3/", line):
                break
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
        assert len(workers) == 1, "".join(lines[-50:])
        workers[0].send_signal(signal.SIGTERM)  # only rank 1 sees the signal
        deadline = time.time() + 180
        for line in proc.stdout:
            lines.append(line)
            assert time.time() < deadline
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    output = "".join(lines)
    assert rc == 0, output[-4000:]
    stopped = re.findall(r"stopping at iteration (\d+)", output)
    assert len(stopped) == 1, output[-4000:]
    iteration = int(stopped[0])
    assert iteration >= 3
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(iteration)
    assert (save / f"iter_{iteration:07d}" / "run_config.yaml").is_file()
    assert not list(save.glob(".tmp_*"))
