"""Stopping together: a SIGTERM flag and a wall-clock limit, agreed across ranks every step."""

from __future__ import annotations

import signal
import time

import torch


class SignalFlag:
    """Context manager: while inside, SIGTERM (or the given signal) only sets `received`."""

    def __init__(self, signum: int = signal.SIGTERM, enabled: bool = True) -> None:
        self.signum = signum
        self.enabled = enabled
        self.received = False
        self._previous = None

    def _handler(self, signum, frame) -> None:
        self.received = True

    def __enter__(self) -> "SignalFlag":
        if self.enabled:
            self._previous = signal.signal(self.signum, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            signal.signal(self.signum, self._previous)


def any_rank(flag: bool, device: torch.device | str = "cpu") -> bool:
    """True on every rank when `flag` is True on at least one (an all-reduce MAX)."""
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


class Deadline:
    """--exit-duration-in-mins measured from construction."""

    def __init__(self, minutes: float | None) -> None:
        self.start = time.monotonic()
        self.minutes = minutes

    def passed(self) -> bool:
        return self.minutes is not None and (time.monotonic() - self.start) / 60.0 >= self.minutes
