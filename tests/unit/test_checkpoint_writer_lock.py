"""One writer per --save: a second run is refused naming the holder; a dead holder's lock is taken over."""

import socket
import subprocess
import sys

import pytest

from megatron_osprey.base.locks import LockHeldError, acquire_writer_lock
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.training.checkpointing import SAVE_LOCK, acquire_save_lock

HOLDER = """
import sys
from megatron_osprey.base.locks import acquire_writer_lock
lock = acquire_writer_lock(sys.argv[1], "test")
print("held", flush=True)
sys.stdin.read()  # hold until the parent closes stdin or kills us
lock.release()
"""


def start_holder(path):
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_second_run_on_the_same_save_is_refused_naming_the_holder_then_a_dead_holder_is_taken_over(tmp_path):
    save = tmp_path / "save"
    child = start_holder(save / SAVE_LOCK)
    holder = f"pid {child.pid} on host {socket.gethostname()}"
    try:
        with parallel_context(ParallelConfig()):
            with pytest.raises(LockHeldError, match=rf"--save {save} is being written by {holder} \(lock "):
                acquire_save_lock(save)
            child.kill()  # what kill -9 or an OOM kill leaves: the file names a holder that is gone
            child.wait()
            lock = acquire_save_lock(save)
            assert lock.stale == holder
            lock.release()
            again = acquire_save_lock(save)  # a clean release leaves no holder to report
            assert again.stale is None
            again.release()
    finally:
        child.kill()
        child.wait()


def test_a_cleanly_released_lock_is_free_for_another_process(tmp_path):
    path = tmp_path / SAVE_LOCK
    child = start_holder(path)
    with pytest.raises(LockHeldError, match=f"pid {child.pid}"):
        acquire_writer_lock(path, "x")
    child.stdin.close()
    assert child.wait(timeout=30) == 0
    with acquire_writer_lock(path, "x") as lock:
        assert lock.stale is None
