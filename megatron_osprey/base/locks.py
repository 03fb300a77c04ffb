"""One writer per output: an exclusive flock on a lock file that names its holder.

The kernel drops a flock when its process dies (kill -9 and out-of-memory kills included), so a lock
file left behind by a dead run is free to take: no pid guessing and no stale-lock timeout. The file
holds "pid host" of the current holder so a refused second run can name who has it; a clean release
empties it, so a free lock that still names a holder was left by a process that died, which the
taker-over reports. (flock is per host on some network filesystems: one writer per --save is then
guaranteed per node, and the holder's host in the refusal helps tell.)
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import socket
from pathlib import Path


class LockHeldError(ValueError):
    """Another live process holds the lock."""


@dataclasses.dataclass
class WriterLock:
    """A held lock: release() (or process exit) frees it. `stale` names a dead holder it replaced, if any."""

    path: Path
    fd: int | None
    stale: str | None = None

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # a named holder on a free lock now means one that died holding it
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "WriterLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(fd: int) -> str | None:
    text = os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
    return text or None


def describe_holder(text: str | None) -> str:
    """'pid 123 on host h' from a lock file's content ('an unknown process' when it names none)."""
    parts = (text or "").split()
    return f"pid {parts[0]} on host {parts[1]}" if len(parts) == 2 else "an unknown process"


def acquire_writer_lock(path: str | Path, what: str) -> WriterLock:
    """Take PATH's exclusive lock without waiting; LockHeldError naming the holder when a live process has it.

    `what` says what the lock guards, for the refusal ("checkpoint directory X").
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _holder(fd)
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise LockHeldError(
                f"{what} is being written by {describe_holder(holder)} (lock {path}); this run does not wait. "
                f"Let that run finish or stop it, or choose another directory."
            ) from None
        raise
    stale = _holder(fd)
    record = f"{os.getpid()} {socket.gethostname()}\n".encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    os.fsync(fd)
    return WriterLock(path, fd, describe_holder(stale) if stale else None)


def lock_is_held(path: str | Path) -> str | None:
    """The holder ('pid N on host H') when a live process holds PATH's lock, else None (no file, or a dead holder)."""
    path = Path(path)
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return describe_holder(_holder(fd))
    finally:
        os.close(fd)
