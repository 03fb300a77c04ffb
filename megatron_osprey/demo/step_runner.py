"""The demo's step runner: each step is an entry point run as a subprocess, logged, timed and resumable."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _through_door(command: list[str] | None) -> list[str] | None:
    """A recorded command as the job door spells it: a step recorded as `-m megatron_osprey.stages.STAGE` (before
    the door) ran the same stage with the same flags, so a demo resumed across the upgrade keeps it."""
    if not command:
        return command
    words = []
    for word in command:
        if words and words[-1] == "-m" and word.startswith("megatron_osprey.stages."):
            words += ["megatron_osprey", word.removeprefix("megatron_osprey.stages.")]
        else:
            words.append(word)
    return words


def demo_threads() -> int:
    """The threads each step computes on: OMP_NUM_THREADS, else 2 (what the steps' environment sets)."""
    return int(os.environ.get("OMP_NUM_THREADS", "2"))


class StepRunner:
    """Runs the entry points as subprocesses, logs each to OUTPUT/logs/, prints progress with timings.

    A step whose command line already finished in this output directory is skipped (the demo resumes). A training
    step's iteration lines are shown with the step's ETA, at most one per `progress_every` seconds (and its last);
    a step that shows nothing for `heartbeat_after` seconds gets a line saying it still runs, and its last output.
    """

    SHOWN = (
        "iteration ",
        "pruned ",
        "adapted ",
        "error",
        "regenerate:",
        "wrote ",
        "AL ",
        "extract: wrote",
        "eval:",
        "vllm:",
    )
    progress_every = 20.0
    heartbeat_after = 60.0

    def __init__(self, output: Path, total_steps: int):
        self.output = output
        self.logs = output / "logs"
        self.done = output / ".steps"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.done.mkdir(parents=True, exist_ok=True)
        self.total = total_steps
        self.index = 0
        self.start = time.time()
        self.timings: dict[str, float] = {}
        self.earlier: dict[str, float] = {}  # seconds of the steps skipped because an earlier run finished them

    def header(self, name: str) -> None:
        self.index += 1
        elapsed = time.time() - self.start
        print(f"\n[{self.index}/{self.total}] {name}   (demo time {elapsed / 60:.1f} min)", flush=True)

    def finished(self, name: str, command: list[str]) -> float | None:
        """The recorded seconds of step `name` if it already finished with this command, else None."""
        marker = self.done / f"{name}.json"
        if not marker.is_file():
            return None
        record = json.loads(marker.read_text())
        return float(record.get("seconds", 0.0)) if _through_door(record.get("command")) == command else None

    def timed(self, name: str, seconds: float) -> None:
        self.timings[name] = self.timings.get(name, 0.0) + seconds

    def run(self, name: str, argv: list, torchrun: int = 0) -> None:
        """Run `python ARGV` (or torchrun with N processes); stream the notable lines; fail loudly."""
        from megatron_osprey.base.atomic_io import write_json_atomic

        prefix = [sys.executable]
        if torchrun:
            prefix += [
                "-m",
                "torch.distributed.run",
                f"--nproc_per_node={torchrun}",
                "--master_addr=127.0.0.1",
                "--master_port=0",
                "--rdzv_backend=c10d",
                "--rdzv_endpoint=127.0.0.1:0",
            ]
        command = prefix + [str(a) for a in argv]
        earlier = self.finished(name, command[1:])
        if earlier is not None:
            self.earlier[name] = earlier
            print(f"    {name}: finished in an earlier run, skipped", flush=True)
            return
        log_path = self.logs / f"{name}.log"
        began = time.time()
        env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS=str(demo_threads()),
            TOKENIZERS_PARALLELISM="false",
            WANDB_MODE="offline",
        )
        with open(log_path, "w") as log:
            log.write("$ " + " ".join(command) + "\n")
            process = subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            progress = _Progress(name, began, self.progress_every, self.heartbeat_after)
            progress.start()
            try:
                for line in process.stdout:
                    log.write(line)
                    progress.line(line.rstrip(), line.startswith(self.SHOWN))
            finally:
                progress.stop()
            code = process.wait()
        seconds = time.time() - began
        self.timed(name, seconds)
        if code != 0:
            tail = log_path.read_text().splitlines()[-25:]
            raise RuntimeError(f"demo step {name} failed (exit {code}); see {log_path}:\n" + "\n".join(tail))
        # The interpreter path is left out so that a resumed run from another venv still matches.
        write_json_atomic(self.done / f"{name}.json", {"command": command[1:], "seconds": round(seconds, 1)})
        print(f"    done in {seconds:.0f}s", flush=True)


_ITERATION = re.compile(r"^iteration\s+(\d+)/(\d+)")


def eta_text(elapsed: float, iteration: int, total: int) -> str:
    """`ETA 3.2 min` for the remaining iterations at the step's mean rate so far (start-up included)."""
    remaining = elapsed / max(iteration, 1) * max(total - iteration, 0)
    return f"ETA {remaining / 60:.1f} min" if remaining >= 60 else f"ETA {remaining:.0f}s"


class _Progress:
    """What one running step prints: its notable lines (iteration lines throttled, with an ETA) and, from a
    thread, a heartbeat when it has printed nothing for a while, so a slow machine never looks like a hung one."""

    def __init__(self, name: str, began: float, every: float, heartbeat_after: float):
        self.name, self.began, self.every, self.heartbeat_after = name, began, every, heartbeat_after
        self.last_shown = began
        self.last_line = ""
        self.held: str | None = None  # an iteration line not shown yet (throttled)
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._heartbeat, name=f"progress-{name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()
        with self.lock:
            if self.held is not None:  # the last iteration line is always shown
                self._show(self.held, time.time())

    def line(self, text: str, notable: bool) -> None:
        now = time.time()
        with self.lock:
            if text.strip():
                self.last_line = text.strip()
            if not notable:
                return
            match = _ITERATION.match(text)
            if match is None:
                self._show(_short(text), now)
                return
            iteration, total = int(match.group(1)), int(match.group(2))
            shown = f"{_short(text)} | {eta_text(now - self.began, iteration, total)}"
            if iteration in (1, total) or now - self.last_shown >= self.every:
                self._show(shown, now)
            else:
                self.held = shown

    def _show(self, text: str, now: float) -> None:
        print("    " + text, flush=True)
        self.last_shown, self.held = now, None

    def _heartbeat(self) -> None:
        while not self.stopped.wait(min(5.0, self.heartbeat_after)):
            now = time.time()
            with self.lock:
                if self.held is not None and now - self.last_shown >= self.every:
                    self._show(self.held, now)
                elif now - self.last_shown >= self.heartbeat_after:
                    last = f"; last output: {self.last_line[:120]}" if self.last_line else ""
                    self._show(f"{self.name}: still running, {(now - self.began) / 60:.1f} min so far{last}", now)


def _short(line: str) -> str:
    keep = ("loss/train", "acc/0", "optim/lr")
    if not line.startswith("iteration"):
        return line[:160]
    parts = line.split(" | ")
    return " | ".join([parts[0]] + [p for p in parts[1:] if p.startswith(keep)])
