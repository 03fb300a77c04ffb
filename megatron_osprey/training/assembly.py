"""One training assembly for every stage that trains: build, (re)load, log, run the shared loop.

Pretraining and distillation differ only in what a TrainSpec supplies (compare
torchtitan's TrainSpec, or Megatron-Bridge's distill() being pretrain() with
another step): the model provider and its initial weights, the forward_step, the
data iterators, the FLOPs of one iteration and what happens after the last step.
Everything else (DDP chunks, optimizer and scheduler, resume, metrics, the loop,
checkpoints) is built here, once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import yaml

from megatron_osprey.base.checksums import skipped_checksum_note
from megatron_osprey.base.run_config import to_plain
from megatron_osprey.parallel import ParallelState
from megatron_osprey.training import checkpointing, resume_check
from megatron_osprey.training.flops import device_peak_tflops
from megatron_osprey.training.loop import TrainState, train
from megatron_osprey.training.metrics import MetricsLogger, ThroughputModel
from megatron_osprey.training.optimizer import sharding_metadata
from megatron_osprey.training.setup import (
    build_model_chunks,
    build_optimizer_and_scheduler,
    make_train_run,
    overlap_settings,
)


@dataclasses.dataclass
class TrainSpec:
    """What one stage supplies to run_training."""

    run_config: dict[str, Any]  # saved beside every checkpoint; its "config" is printed at start
    model_provider: Callable  # (pre_process, post_process, vp_stage) -> this rank's module
    initialize: Callable[[list], None]  # initial weights into fresh chunks (skipped on resume)
    forward_step: Callable[[list], Callable]  # model chunks -> Megatron's forward_step(data_iterator, model)
    # (chunks, start state, notes to log) -> (train iterator, valid iterator factory or None)
    data_iterators: Callable[[list, TrainState, list[str]], tuple[Any, Any]]
    flops_per_iteration: Callable[[list], float]  # model chunks -> FLOPs of one global batch
    bf16: bool = False
    fp8: bool = False
    progress_label: str = "pretrain"  # the progress bar's name
    finish: Callable[[list, TrainState], None] | None = None  # after the loop, e.g. export the result
    # On resume, a schedule flag that differs from the checkpoint's is refused naming the flag that sets it.
    scheduler_flags: dict[str, str] | None = None
    # flag -> recorded setting (training/resume_check.py): a resume onto other data or another run is refused.
    run_identity: dict[str, dict] | None = None


@dataclasses.dataclass
class TrainResult:
    model: list
    state: TrainState
    history: list[dict[str, float]]
    notes: list[str]


def train_stage(
    cfg,
    spec: TrainSpec,
    parallel: ParallelState,
    settings: Callable[[], dict[str, dict]],
    *,
    warmup_fraction: bool = False,
) -> TrainResult:
    """run_training with what every stage derives from `cfg` alike: the schedule flags a resume names and the run
    identity, the shared training settings and then the stage's own `settings`, built on rank 0.

    With `warmup_fraction` the warmup is named as a share of the run (--lr-warmup-fraction), as distillation sets it.
    """
    length = "--train-iters" if cfg.training.train_iters is not None else "--train-samples"
    decay = "--lr-decay-iters" if cfg.optimizer.lr_decay_iters else None
    warmup = f"--lr-warmup-fraction x {length}" if warmup_fraction else "--lr-warmup-iters"
    spec = dataclasses.replace(
        spec,
        scheduler_flags=checkpointing.scheduler_flags(decay, length, warmup_flag=warmup),
        run_identity=resume_check.built_on_rank0(
            lambda: resume_check.training_settings(cfg, parallel.dp_size) | settings()
        ),
    )
    return run_training(cfg, spec, parallel)


def run_training(cfg, spec: TrainSpec, parallel: ParallelState) -> TrainResult:
    """Build, (re)load and train one stage; collective over every rank of `parallel`."""
    if parallel.rank == 0:
        print(
            "resolved configuration:\n" + yaml.safe_dump(to_plain(spec.run_config["config"]), sort_keys=False),
            flush=True,
        )
    notes = []
    # One writer per --save: a second run would delete the first one's staging directory mid-save.
    lock = checkpointing.acquire_save_lock(cfg.checkpoint.save) if cfg.checkpoint.save else None
    if lock is not None and lock.stale:
        notes.append(f"--save {cfg.checkpoint.save}: took over the writer lock of {lock.stale}, which died holding it")
    try:
        return _run_locked(cfg, spec, parallel, notes)
    finally:
        if lock is not None:
            lock.release()


def _run_locked(cfg, spec: TrainSpec, parallel: ParallelState, notes: list[str]) -> TrainResult:
    is_writer = parallel.rank == 0
    train_iters = cfg.training.num_train_iters()
    resume = checkpointing.resume_iteration(cfg.checkpoint)
    if cfg.checkpoint.load and resume is None:
        notes.append(f"--load {cfg.checkpoint.load}: no checkpoint there yet; starting from the initial weights")
    overlap_grad_reduce, overlap_param_gather = overlap_settings(cfg.optimizer, parallel.device.type == "cuda")
    model = build_model_chunks(
        spec.model_provider,
        cfg.parallel,
        bf16=spec.bf16,
        use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
        initialize=None if resume is not None else spec.initialize,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
    )
    optimizer, scheduler = build_optimizer_and_scheduler(model, cfg.optimizer, bf16=spec.bf16, train_iters=train_iters)
    metadata = sharding_metadata(cfg.optimizer) | {"use_distributed_optimizer": cfg.optimizer.use_distributed_optimizer}
    state = TrainState()
    if resume is not None:
        info = checkpointing.load_training_checkpoint(
            cfg.checkpoint.load,
            model,
            optimizer,
            scheduler,
            metadata,
            iteration=resume,
            load_optim=not cfg.checkpoint.no_load_optim,
            load_rng=not cfg.checkpoint.no_load_rng,
            scheduler_flags=spec.scheduler_flags,
            verify=not cfg.checkpoint.skip_checksum,
            run_identity=spec.run_identity,
        )
        if cfg.checkpoint.skip_checksum:
            notes.append(skipped_checksum_note(cfg.checkpoint.load))
        state = TrainState(info["iteration"], info["consumed_train_samples"])
        notes += info["notes"] + [f"resumed from {cfg.checkpoint.load} at iteration {state.iteration}"]

    forward_step = spec.forward_step(model)
    train_iterator, valid_iterator = spec.data_iterators(model, state, notes)
    throughput = ThroughputModel(
        tokens_per_iteration=cfg.training.global_batch_size * cfg.training.seq_length,
        flops_per_iteration=spec.flops_per_iteration(model),
        world_size=parallel.world_size,
        peak_tflops=device_peak_tflops(cfg.logging.peak_tflops, fp8=spec.fp8),
    )
    metrics = MetricsLogger(
        cfg.logging,
        throughput,
        is_writer=is_writer,
        total_iters=train_iters,
        start_iter=state.iteration,
        save_dir=cfg.checkpoint.save,
        run_config=spec.run_config,
        desc=spec.progress_label,
    )
    for note in notes:
        metrics.note(note)
    run = make_train_run(
        cfg, model, optimizer, scheduler, metrics, spec.run_config, metadata, parallel, spec.run_identity
    )
    try:
        state = train(run, state, forward_step, train_iterator, valid_iterator)
    finally:
        metrics.close()
    if spec.finish is not None:
        spec.finish(model, state)
    return TrainResult(model, state, metrics.history, notes)
