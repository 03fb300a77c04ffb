"""The training loop shared by Stage 2 and Stage 4: a step function and the loop around it.

Whatever trains plugs in `forward_step(data_iterator, model) -> (output, loss_func)`
(Megatron-LM's pretrain_gpt contract); logging, checkpointing and metrics are
the TrainRun's collaborators, not the loop's business.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterator

import torch

from megatron_osprey.training.config import CheckpointConfig, LoggingConfig, TrainingConfig
from megatron_osprey.training.metrics import MetricsLogger
from megatron_osprey.training.scheduler import current_lr
from megatron_osprey.training.signals import Deadline, SignalFlag, any_rank


@dataclasses.dataclass
class TrainState:
    """Where a run is: restored from, and saved into, every checkpoint."""

    iteration: int = 0
    consumed_train_samples: int = 0


@dataclasses.dataclass
class StepResult:
    loss: float
    grad_norm: float | None
    lr: float
    skipped: bool
    extra: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class TrainRun:
    """What the loop drives: model chunks, optimizer, scheduler and the collaborators around them."""

    model: list
    optimizer: object
    scheduler: object
    training: TrainingConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    metrics: MetricsLogger
    save: Callable[[TrainState], None] | None  # None: no --save
    dp_size: int
    device: torch.device


def num_microbatches(training: TrainingConfig, dp_size: int) -> int:
    return training.global_batch_size // (training.micro_batch_size * dp_size)


def global_mean_loss(losses_reduced: list[dict], device: torch.device) -> float:
    """Token-weighted mean over micro-batches and DP ranks, known on every rank (PP included)."""
    from megatron.core import parallel_state as mpu

    total = torch.zeros(2, dtype=torch.float64, device=device)
    for report in losses_reduced:  # empty on all but the last pipeline stage
        total += report["lm loss"].to(device=device, dtype=torch.float64)
    torch.distributed.all_reduce(total, group=mpu.get_data_parallel_group())
    torch.distributed.all_reduce(total, group=mpu.get_pipeline_model_parallel_group())
    return (total[0] / total[1].clamp(min=1)).item()


def extra_means(losses_reduced: list[dict], device: torch.device) -> dict[str, float]:
    """Means of the other [sum, count] reports (e.g. per-TTT-step acc/ploss) over micro-batches and DP.

    Only without pipeline parallelism: every rank then holds the same report keys.
    """
    from megatron.core import parallel_state as mpu

    keys = sorted(k for k in (losses_reduced[0] if losses_reduced else {}) if k != "lm loss")
    if not keys or mpu.get_pipeline_model_parallel_world_size() > 1:
        return {}
    total = torch.zeros(len(keys), 2, dtype=torch.float64, device=device)
    for report in losses_reduced:
        total += torch.stack([report[k].to(device=device, dtype=torch.float64) for k in keys])
    torch.distributed.all_reduce(total, group=mpu.get_data_parallel_group())
    return {k: (total[i, 0] / total[i, 1].clamp(min=1)).item() for i, k in enumerate(keys)}


def gather_params(model: list) -> None:
    """Finish the parameter all-gather that --overlap-param-gather leaves to the next forward.

    After an optimizer step each rank holds only its shard of the updated weights until the next forward's
    pre-hooks gather the rest; an evaluation, a checkpoint save or the end of training needs them whole now.
    The pre-hooks then find the gather done and start the next one after the following step.
    """
    for chunk in model:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def _global_batch(forward_step: Callable, data_iterator, run: TrainRun, forward_only: bool) -> list[dict]:
    """One global batch through megatron-core's schedule (pipelined when PP > 1); the per-microbatch reports."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data_iterator,
        model=run.model,
        num_microbatches=num_microbatches(run.training, run.dp_size),
        seq_length=run.training.seq_length,
        micro_batch_size=run.training.micro_batch_size,
        forward_only=forward_only,
    )


def train_step(forward_step: Callable, data_iterator, run: TrainRun) -> StepResult:
    """Forward and backward over one global batch (Megatron's PP schedules), then the optimizer step."""
    for chunk in run.model:
        chunk.zero_grad_buffer()
    run.optimizer.zero_grad()
    losses = _global_batch(forward_step, data_iterator, run, forward_only=False)
    lr = current_lr(run.optimizer)
    ok, grad_norm, _ = run.optimizer.step()
    if ok:
        run.scheduler.step(increment=1)
    norm = None if grad_norm is None else float(grad_norm)
    return StepResult(global_mean_loss(losses, run.device), norm, lr, not ok, extra_means(losses, run.device))


@torch.no_grad()
def evaluate(forward_step: Callable, data_iterator, run: TrainRun, iters: int | None = None, extra: bool = False):
    """Mean validation loss over `iters` (default --eval-iters) global batches, forward only; with `extra`, also the
    means of the other reports (per-TTT-step acc/ploss): (loss, {key: mean})."""
    for chunk in run.model:
        chunk.eval()
    reports = []
    for _ in range(run.logging.eval_iters if iters is None else iters):
        reports += _global_batch(forward_step, data_iterator, run, forward_only=True)
    for chunk in run.model:
        chunk.train()
    loss = global_mean_loss(reports, run.device)
    return (loss, extra_means(reports, run.device)) if extra else loss


@dataclasses.dataclass(frozen=True)
class HeldOutSet:
    """A named held-out set evaluated at every --eval-interval: a fresh iterator over it, and its global batches."""

    iterator: Callable[[], Iterator]
    iters: int


def _validate(forward_step: Callable, valid, run: TrainRun, iteration: int) -> None:
    """loss/valid over the one validation iterator, or loss/valid/NAME (and valid/NAME/acc/k...) per held-out set."""
    if callable(valid):
        run.metrics.validation(iteration, evaluate(forward_step, valid(), run))
        return
    for name, held_out in valid.items():
        loss, extra = evaluate(forward_step, held_out.iterator(), run, held_out.iters, extra=True)
        run.metrics.validation(iteration, loss, name, extra)


def train(
    run: TrainRun,
    state: TrainState,
    forward_step: Callable,
    train_iterator,
    valid_iterator: Callable[[], Iterator] | dict[str, HeldOutSet] | None = None,
) -> TrainState:
    """Train until --train-iters, --exit-interval, --exit-duration-in-mins or a signal; save as configured."""
    total = run.training.num_train_iters()
    deadline = Deadline(run.training.exit_duration_in_mins)
    saved_at = state.iteration
    nonfinite = 0
    with SignalFlag(enabled=run.training.exit_signal_handler) as signal_flag:
        while state.iteration < total:
            result = train_step(forward_step, train_iterator, run)
            state.iteration += 1
            state.consumed_train_samples += run.training.global_batch_size
            run.metrics.step(state.iteration, result.loss, result.lr, result.grad_norm, result.extra)
            # The loss is the global mean, so every rank takes this branch at the same step.
            nonfinite = 0 if math.isfinite(result.loss) else nonfinite + 1
            if nonfinite and nonfinite >= (run.training.max_nonfinite_loss_steps or math.inf):
                raise FloatingPointError(
                    f"the training loss was {result.loss} for {nonfinite} consecutive step(s) (iteration "
                    f"{state.iteration}); stopping without saving. Check the data and --lr, or raise "
                    f"--max-nonfinite-loss-steps (now {run.training.max_nonfinite_loss_steps})."
                )
            if valid_iterator and run.logging.eval_iters and state.iteration % run.logging.eval_interval == 0:
                gather_params(run.model)
                _validate(forward_step, valid_iterator, run, state.iteration)
                run.metrics.reset_window()
            # One all-reduce per step: every rank sees the same decision at the same iteration.
            stop = any_rank(signal_flag.received or deadline.passed(), run.device)
            stop = stop or state.iteration == run.training.exit_interval
            interval = run.checkpoint.save_interval
            if run.save and ((interval and state.iteration % interval == 0) or stop):
                gather_params(run.model)
                run.save(state)
                saved_at = state.iteration
                run.metrics.reset_window()
            if stop:
                run.metrics.note(f"stopping at iteration {state.iteration} (signal, time limit or --exit-interval)")
                gather_params(run.model)
                return state
    gather_params(run.model)  # what runs after the loop (an export, a caller) reads whole weights
    if run.save and saved_at != state.iteration:
        run.save(state)
    return state
