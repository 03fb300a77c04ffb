"""The demo's step runner: each step is an entry point run as a subprocess, logged, timed and resumable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class StepRunner:
    """Runs the entry points as subprocesses, logs each to OUTPUT/logs/, prints progress with timings.

    A step whose command line already finished in this output directory is skipped (the demo resumes).
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
        return float(record.get("seconds", 0.0)) if record.get("command") == command else None

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
            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
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
            for line in process.stdout:
                log.write(line)
                if line.startswith(self.SHOWN):
                    print("    " + _short(line.rstrip()), flush=True)
            code = process.wait()
        seconds = time.time() - began
        self.timed(name, seconds)
        if code != 0:
            tail = log_path.read_text().splitlines()[-25:]
            raise RuntimeError(f"demo step {name} failed (exit {code}); see {log_path}:\n" + "\n".join(tail))
        # The interpreter path is left out so that a resumed run from another venv still matches.
        write_json_atomic(self.done / f"{name}.json", {"command": command[1:], "seconds": round(seconds, 1)})
        print(f"    done in {seconds:.0f}s", flush=True)


def _short(line: str) -> str:
    keep = ("loss/train", "acc/0", "optim/lr")
    if not line.startswith("iteration"):
        return line[:160]
    parts = line.split(" | ")
    return " | ".join([parts[0]] + [p for p in parts[1:] if p.startswith(keep)])
