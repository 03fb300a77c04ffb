#!/usr/bin/env python
"""The prepared device check: one call on one GPU proves what a CPU cannot. One JSON line per check.

    python benchmarks/gpu_check.py               # one GPU (sized for one H100, about 8 minutes)
    python benchmarks/gpu_check.py --dry-run     # CPU, toy sizes: the same code paths (tests run this)
    python benchmarks/gpu_check.py --only ttt_memory ttt_loss

Checks (each line: {"check": NAME, "ok": true|false, ...figures, with "peak_gib", the device's peak allocated
memory, and where the plan sizes the same shapes "plan_gib", `osprey plan`'s figure; models are freed with
gc.collect() between the models of a check and between checks); a check that raises, or runs past its time,
prints ok false and its error, and the next check still runs). A lent GPU gives about 15 minutes of device time,
start-up included, so the checks share --total-budget seconds (default 480): each gets its weighted share of what
remains, at most --check-timeout; a check left without time prints "skipped: budget spent"; a check stuck where the
alarm cannot reach it (inside a C call) ends the run at the budget. The last line: {"summary": "gpu_check", "ok",
"elapsed_s", "total_budget_s", "failed", "skipped"}.
  init         torch.distributed up with NCCL and the CPU compatibility layer off (an NCCL all-reduce).
  placement    every parameter, buffer and rotary table of the drafter and the backbone on the GPU.
  train_steps  one BF16 training step of the drafter (TTT loss) and of the backbone (LM loss), each
               with and without the distributed optimizer: finite losses and grad norms.
  checkpoint   a training checkpoint saved, then loaded into fresh chunks (bitwise equal weights); and
               its model weights loaded into the other optimizer layout's model through the dist-ckpt
               reshard path. One GPU cannot change TP/PP: tests/distributed covers that on CPU.
  ttt_memory   peak memory of one layer's TTT attention (forward + backward) at seq 4096, K = 1..5
               with Osprey's Qwen3 drafter heads (32 q, 8 kv, head_dim 128, BF16) against
               `ttt_attention_bytes` (what `osprey plan` budgets), and the old exact attention at K 1-2.
  ttt_loss     the Megatron drafter's TTT loss on the GPU (float32, the local spec: TE would run its GEMMs in
               TF32) against the plain-PyTorch reference drafter's on the CPU, same weights and batch.
  te_spec      Megatron-Core's Transformer Engine spec (what every GPU recipe builds): one BF16 training step
               of the backbone GPT and one with FP8 delayed scaling (hybrid), and that FP8 model saved and
               loaded with TE's _extra_state (bitwise equal weights). Without TE: a line saying it is absent
               (failing on a GPU).
  drafter_te   the drafter built with TE as the recipes build it: one BF16 TTT training step, and its TTT
               logits on the local spec's weights against the local spec's.
  target_path  a tiny Qwen3 HF checkpoint written here (no download), every linear FP8 block-scaled (16x16):
               HF -> Megatron loaded on the device (dequantized there), the online target's forward and layer
               capture against the HF forward on the dequantized values.
  throughput   BF16 tokens/s and MFU of the 2-layer Qwen3-4B backbone shape with the local spec
               (benchmarks/train_throughput.py, seq 4096).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

CHECKS = (
    "init", "placement", "train_steps", "checkpoint", "ttt_memory", "ttt_loss", "te_spec", "drafter_te",
    "target_path", "throughput",
)  # fmt: skip
# Relative shares of the total budget, by the work each does (the real run is not timed yet): train_steps builds
# four models and pays the first step's compilation of the fused ops, checkpoint builds three and saves, ttt_memory
# runs seven attention passes at seq 4096, throughput 13 steps; init builds nothing, placement and ttt_loss two.
# te_spec builds three models and saves one, drafter_te three, target_path writes and loads one tiny target.
WEIGHTS = dict(
    init=1, placement=1, train_steps=3, checkpoint=2, ttt_memory=2, ttt_loss=1, te_spec=2, drafter_te=2,
    target_path=1, throughput=2,
)  # fmt: skip
MIN_CHECK_S = 1.0  # a share below this cannot even build a model: the check is skipped
WATCHDOG_GRACE_S = 5.0  # past the budget, a check the alarm could not stop ends the run


from gpu_checks import (  # noqa: E402  (benchmarks/ is on sys.path above)
    GPU,
    TOY,
    check_checkpoint,
    check_init,
    check_placement,
    check_throughput,
    check_train_steps,
    check_ttt_loss,
    check_ttt_memory,
    emit,
)
from gpu_checks_te import check_drafter_te, check_target_path, check_te_spec  # noqa: E402


def _free_memory() -> None:
    """Drop what the last check built (its models, optimizers, cached blocks) before the next one."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


class CheckTimeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise CheckTimeout(
        "ran past its time (its share of --total-budget, at most --check-timeout; a child process may have died "
        "while the check waited on it)"
    )


def _guarded(name: str, limit_s: float, fn, *args) -> dict:
    """Run one check; an error or running past limit_s prints its failing line and the next check runs."""
    start = time.perf_counter()
    # A check that waits forever (a dead writer process in a checkpoint save) must not take the whole window.
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        line = fn(*args)
    except Exception as err:  # one failing check must not hide the others
        line = emit(
            name,
            False,
            error=f"{type(err).__name__}: {err}",
            traceback=traceback.format_exc()[-2000:],
            seconds=round(time.perf_counter() - start, 1),
            limit_s=round(limit_s, 1),
        )
        traceback.clear_frames(err.__traceback__)  # the frames hold the check's models alive
        del err
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    _free_memory()
    return line


class Budget:
    """The device window shared by the checks: each gets its weighted share of what remains, at most check_timeout.

    A watchdog thread ends the process WATCHDOG_GRACE_S after the budget when a check is stuck where SIGALRM cannot
    reach it (a C call that never returns, a hung collective), printing the lines the run still owes.
    """

    def __init__(self, total_s: float, check_timeout_s: float, names: list[str]):
        self.total_s, self.check_timeout_s = total_s, check_timeout_s
        self.pending, self.current, self.lines = list(names), None, []
        self.start = time.perf_counter()
        self._watchdog = threading.Timer(total_s + WATCHDOG_GRACE_S, self._overrun)
        self._watchdog.daemon = True
        self._watchdog.start()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def share(self, name: str) -> float:
        weights = sum(WEIGHTS[n] for n in self.pending)
        return min(self.check_timeout_s, (self.total_s - self.elapsed()) * WEIGHTS[name] / weights)

    def run(self, name: str, fn, *args) -> dict:
        """Run check `name` within its share, or print that it is skipped when the budget is spent."""
        limit = self.share(name)
        self.current = name
        self.pending.remove(name)
        if limit < MIN_CHECK_S:
            line = emit(name, False, error="skipped: budget spent", skipped=True, elapsed_s=round(self.elapsed(), 1))
        else:
            line = _guarded(name, limit, fn, *args)
        self.current = None
        self.lines.append(line)
        return line

    def summary(self) -> dict:
        self._watchdog.cancel()
        return _summary(self.lines, self.elapsed(), self.total_s)

    def _overrun(self) -> None:
        if self.current:
            self.lines.append(emit(self.current, False, error="ran past --total-budget where no alarm reaches"))
        for name in self.pending:
            self.lines.append(emit(name, False, error="skipped: budget spent", skipped=True))
        _summary(self.lines, self.elapsed(), self.total_s)
        os._exit(1)  # the main thread is stuck: nothing else ends it within the window


def _summary(lines: list[dict], elapsed_s: float, total_s: float) -> dict:
    line = {
        "summary": "gpu_check",
        "ok": bool(lines) and all(line["ok"] for line in lines),
        "elapsed_s": round(elapsed_s, 1),
        "total_budget_s": total_s,
        "failed": [line["check"] for line in lines if not line["ok"] and not line.get("skipped")],
        "skipped": [line["check"] for line in lines if line.get("skipped")],
    }
    print(json.dumps(line), flush=True)
    return line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU (no GPU needed)")
    parser.add_argument("--only", nargs="+", choices=CHECKS, default=list(CHECKS))
    parser.add_argument(
        "--check-timeout", type=float, default=180, metavar="S", help="seconds one check may run (default 180)"
    )
    parser.add_argument(
        "--total-budget",
        type=float,
        default=480,
        metavar="S",
        help="seconds all checks may take together (default 480: a 15-minute device window less start-up)",
    )
    args = parser.parse_args(argv)
    if not args.check_timeout > 0 or not args.total_budget > 0:
        parser.error("--check-timeout and --total-budget must be > 0 seconds")
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --dry-run for the CPU toy run.", file=sys.stderr)
        return 2
    sizes = TOY if args.dry_run else GPU
    from megatron_osprey.parallel import ParallelConfig, parallel_context

    in_context = [c for c in CHECKS if c not in ("ttt_memory", "throughput") and c in args.only]
    alone = [c for c in ("ttt_memory", "throughput") if c in args.only]
    budget = Budget(args.total_budget, args.check_timeout, in_context + alone)
    if in_context:
        with parallel_context(ParallelConfig()) as state:
            table = {
                "init": check_init,
                "placement": check_placement,
                "train_steps": check_train_steps,
                "checkpoint": check_checkpoint,
                "ttt_loss": check_ttt_loss,
                "te_spec": check_te_spec,
                "drafter_te": check_drafter_te,
                "target_path": check_target_path,
            }
            for name in in_context:
                budget.run(name, table[name], sizes, state)
    if "ttt_memory" in alone:
        budget.run("ttt_memory", check_ttt_memory, sizes)
    if "throughput" in alone:
        budget.run("throughput", check_throughput, sizes)
    return 0 if budget.summary()["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
