"""Worker processes that encode RecordBatches in parallel and hand results back in input order."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import traceback
from dataclasses import dataclass
from typing import Iterable, Iterator, List

from megatron_osprey.data.fast_tokenizer import TokenizerSpec
from megatron_osprey.data.text_sources import RecordBatch
from megatron_osprey.data.token_encoding import BatchEncoder, EncodedBatch

# How long the reader waits on results before checking that workers are alive.
_POLL_SECONDS = 1.0


@dataclass(frozen=True)
class EncoderSettings:
    """Everything a worker needs to build its BatchEncoder (picklable)."""

    spec: TokenizerSpec
    json_key: str
    add_special_tokens: bool = True
    max_problems: int = 10


def _worker_main(settings: EncoderSettings, tasks: mp.Queue, results: mp.Queue) -> None:
    # Each worker is one tokenizing core: Rust-side threads on top of N worker
    # processes would oversubscribe the CPUs (and deadlock-warn after fork).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Ctrl-C is handled once, by the parent, which then terminates the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        encoder = BatchEncoder(settings.spec, settings.json_key, settings.add_special_tokens, settings.max_problems)
    except BaseException:
        results.put((-1, None, traceback.format_exc()))
        return
    while True:
        item = tasks.get()
        if item is None:
            return
        seq, batch = item
        try:
            results.put((seq, encoder.encode(batch), None))
        except BaseException:
            results.put((seq, None, traceback.format_exc()))
            return


def _context() -> mp.context.BaseContext:
    # fork starts workers in milliseconds and without re-importing torch via the
    # caller's __main__; spawn is the fallback where fork does not exist.
    methods = mp.get_all_start_methods()
    return mp.get_context("fork" if "fork" in methods else "spawn")


class EncodePool:
    """A fixed set of encoding processes; use as a context manager and call `imap`."""

    def __init__(self, settings: EncoderSettings, workers: int, in_flight_per_worker: int = 3) -> None:
        if workers < 1:
            raise ValueError(f"--workers must be at least 1 (got {workers}).")
        ctx = _context()
        self._tasks = ctx.Queue()
        self._results = ctx.Queue()
        self._max_in_flight = workers * in_flight_per_worker
        self._procs: List[mp.Process] = [
            ctx.Process(target=_worker_main, args=(settings, self._tasks, self._results), daemon=True)
            for _ in range(workers)
        ]
        for p in self._procs:
            p.start()

    def __enter__(self) -> "EncodePool":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.terminate()

    def _get(self):
        while True:
            try:
                return self._results.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                dead = [p for p in self._procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"an encoding worker exited with code {dead[0].exitcode} (killed, e.g. out of memory?)."
                    )

    def imap(self, batches: Iterable[RecordBatch]) -> Iterator[EncodedBatch]:
        """Encode batches on the workers; yield results in input order."""
        source = iter(batches)
        submitted = delivered = 0
        exhausted = False
        ready = {}
        while True:
            # Keep a bounded number of batches in flight: enough to keep every
            # worker busy, few enough to bound memory.
            while not exhausted and submitted - delivered < self._max_in_flight:
                batch = next(source, None)
                if batch is None:
                    exhausted = True
                    break
                self._tasks.put((submitted, batch))
                submitted += 1
            if exhausted and delivered == submitted:
                return
            while delivered not in ready:
                seq, result, error = self._get()
                if error is not None:
                    raise RuntimeError(f"an encoding worker failed:\n{error}")
                ready[seq] = result
            yield ready.pop(delivered)
            delivered += 1

    def close(self) -> None:
        """Stop the workers after their current task."""
        for _ in self._procs:
            self._tasks.put(None)
        for p in self._procs:
            p.join()

    def terminate(self) -> None:
        """Kill the workers now (on error or interrupt)."""
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join()
        # Pending task data must not block interpreter exit.
        self._tasks.cancel_join_thread()
        self._results.cancel_join_thread()
