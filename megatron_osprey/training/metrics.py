"""Training metrics to the console, TensorBoard and wandb, and the rank-0 progress bar.

Only rank 0 writes. Throughput counts the tokens of whole global batches over
the wall time between log lines, per device (world size).
"""

from __future__ import annotations

import dataclasses
import hashlib
import resource
import time
from pathlib import Path
from typing import Any

import torch

from megatron_osprey.base.atomic_io import write_text_atomic
from megatron_osprey.training.config import LoggingConfig
from megatron_osprey.training.flops import mfu

WANDB_ID_FILE = "wandb_run_id.txt"


def peak_memory_gib() -> tuple[float, str]:
    """(GiB, source): CUDA max_memory_allocated on GPU, else this process's peak RSS."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30, "cuda max_memory_allocated"
    # ru_maxrss is KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "process peak RSS"


def wandb_run_id(save_dir: str | None, exp_name: str | None, project: str) -> str:
    """A stable run id: the one stored in the checkpoint dir, else derived from --save / --wandb-exp-name."""
    if save_dir:
        stored = Path(save_dir) / WANDB_ID_FILE
        if stored.is_file():
            return stored.read_text().strip()
    seed = f"{Path(save_dir).resolve() if save_dir else ''}|{exp_name or ''}|{project}"
    return hashlib.sha1(seed.encode()).hexdigest()[:16]


@dataclasses.dataclass
class ThroughputModel:
    """What one iteration processes: tokens and FLOPs of a global batch, spread over `world_size` devices."""

    tokens_per_iteration: int
    flops_per_iteration: float
    world_size: int
    peak_tflops: float | None


class MetricsLogger:
    """Accumulates steps between log lines and writes averaged metrics on rank 0."""

    def __init__(
        self,
        cfg: LoggingConfig,
        throughput: ThroughputModel,
        *,
        is_writer: bool,
        total_iters: int,
        start_iter: int,
        save_dir: str | None = None,
        run_config: dict[str, Any] | None = None,
        desc: str = "pretrain",
    ) -> None:
        self.cfg = cfg
        self.throughput = throughput
        self.is_writer = is_writer
        self.total_iters = total_iters
        self.history: list[dict[str, float]] = []
        self._tb = None
        self._wandb = None
        self._bar = None
        self._window_start = time.perf_counter()
        self._window: list[tuple[float, float | None]] = []
        self._extra: list[dict[str, float]] = []
        if not is_writer:
            return
        if cfg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=cfg.tensorboard_dir, purge_step=start_iter + 1)
        if cfg.wandb_project:
            self._wandb = _start_wandb(cfg, save_dir, run_config or {})
        if cfg.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_iters, initial=start_iter, desc=desc, unit="it", dynamic_ncols=True)

    def reset_window(self) -> None:
        """Start timing afresh (after evaluation or a checkpoint save, which are not training time)."""
        self._window_start = time.perf_counter()
        self._window.clear()
        self._extra.clear()

    def step(
        self, iteration: int, loss: float, lr: float, grad_norm: float | None, extra: dict[str, float] | None = None
    ) -> dict[str, float] | None:
        """Record one iteration; every --log-interval iterations write and return the metrics."""
        self._window.append((loss, grad_norm))
        self._extra.append(extra or {})
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
        if iteration % self.cfg.log_interval and iteration != self.total_iters:
            return None
        elapsed = max(time.perf_counter() - self._window_start, 1e-9)
        n = len(self._window)
        norms = [g for _, g in self._window if g is not None]
        tp = self.throughput
        tflops = tp.flops_per_iteration * n / elapsed / tp.world_size / 1e12
        memory, _ = peak_memory_gib()
        metrics = {
            "loss/train": sum(loss for loss, _ in self._window) / n,
            "optim/lr": lr,
            "optim/grad_norm": sum(norms) / len(norms) if norms else float("nan"),
            "throughput/tokens_per_sec_per_gpu": tp.tokens_per_iteration * n / elapsed / tp.world_size,
            "throughput/tflops_per_gpu": tflops,
            "throughput/iteration_time_s": elapsed / n,
            "memory/max_allocated_gib": memory,
        }
        for key in sorted({k for extra in self._extra for k in extra}):
            values = [extra[key] for extra in self._extra if key in extra]
            metrics[key] = sum(values) / len(values)
        achieved = mfu(tflops, tp.peak_tflops)
        if achieved is not None:
            metrics["throughput/mfu"] = achieved
        self.reset_window()
        self._write(iteration, metrics)
        return metrics

    def validation(self, iteration: int, loss: float, name: str | None = None, extra: dict | None = None) -> None:
        """Write loss/valid, or for a named held-out set loss/valid/NAME and its per-step metrics as valid/NAME/KEY."""
        if name is None:
            self._write(iteration, {"loss/valid": loss})
            return
        per_step = {f"valid/{name}/{key}": value for key, value in (extra or {}).items()}
        self._write(iteration, {f"loss/valid/{name}": loss, **per_step})

    def note(self, text: str) -> None:
        """A console line on rank 0 that does not break the progress bar."""
        if not self.is_writer:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def _write(self, iteration: int, metrics: dict[str, float]) -> None:
        self.history.append({"iteration": iteration, **metrics})
        if not self.is_writer:
            return
        self.note(format_line(iteration, self.total_iters, metrics))
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, iteration)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=iteration)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def format_line(iteration: int, total: int, metrics: dict[str, float]) -> str:
    """One console line, Megatron-style."""
    parts = [f"iteration {iteration:>7d}/{total}"]
    for key, value in metrics.items():
        if key == "memory/max_allocated_gib":
            source = "peak RSS" if not torch.cuda.is_available() else "cuda"
            parts.append(f"{key} ({source}): {value:.2f}")
        elif key == "throughput/mfu":
            parts.append(f"{key}: {100 * value:.1f}%")
        else:
            parts.append(f"{key}: {value:.6g}")
    if "loss/train" in metrics and "throughput/mfu" not in metrics:
        parts.append("throughput/mfu: n/a (no --peak-tflops on this device)")
    return " | ".join(parts)


def _start_wandb(cfg: LoggingConfig, save_dir: str | None, run_config: dict[str, Any]):
    """wandb (offline unless WANDB_MODE said otherwise), resuming the run stored beside the checkpoints."""
    import wandb

    from megatron_osprey.base.run_config import to_plain

    run_id = wandb_run_id(save_dir, cfg.wandb_exp_name, cfg.wandb_project)
    directory = Path(cfg.wandb_save_dir or (Path(save_dir) / "wandb" if save_dir else "wandb"))
    directory.mkdir(parents=True, exist_ok=True)
    if save_dir:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(save_dir) / WANDB_ID_FILE, run_id + "\n")
    return wandb.init(
        project=cfg.wandb_project,
        name=cfg.wandb_exp_name,
        id=run_id,
        resume="allow",
        dir=str(directory),
        mode=cfg.wandb_mode,
        config=to_plain(run_config),
    )
