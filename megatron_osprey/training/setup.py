"""Build what the loop drives: DDP model chunks, optimizer and scheduler, wired for Megatron's schedules."""

from __future__ import annotations

from typing import Callable

import torch

from megatron_osprey.parallel import ParallelConfig
from megatron_osprey.training.config import OptimizerConfig


def training_device() -> torch.device:
    """This rank's GPU when CUDA is present (torch.cuda.set_device ran at initialization), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def place_on_device(chunks: list, device: torch.device) -> list:
    """Move every parameter, buffer and rotary table of `chunks` to `device`.

    Megatron-Core creates its own layers on the GPU, but plain torch modules (the drafter's
    fusion_fc, torch norms) and registered buffers (d2t / t2d) start on the CPU; without this a
    run without the distributed optimizer's flat buffer meets a device mismatch at step 1.
    RotaryEmbedding keeps `inv_freq` as a plain attribute, which Module.to does not move.
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    for chunk in chunks:
        chunk.to(device)
        for module in chunk.modules():
            if isinstance(module, RotaryEmbedding):
                module.inv_freq = module.inv_freq.to(device)
    return chunks


def overlap_settings(section: OptimizerConfig, on_gpu: bool) -> tuple[bool, bool]:
    """(overlap_grad_reduce, overlap_param_gather) as this run uses them: as configured with CUDA, off without.

    Megatron-Core overlaps on a CUDA communication stream; a CPU run (gloo, the compatibility layer) keeps its
    synchronous reduce-scatter and all-gather, so the same recipe runs on both.
    """
    if not on_gpu:
        return False, False
    return section.overlap_grad_reduce, section.overlap_param_gather and section.use_distributed_optimizer


def build_model_chunks(
    model_provider: Callable,
    parallel: ParallelConfig,
    *,
    bf16: bool,
    use_distributed_optimizer: bool,
    initialize: Callable[[list], None] | None = None,
    overlap_grad_reduce: bool = False,
    overlap_param_gather: bool = False,
) -> list:
    """model_provider(pre_process, post_process, vp_stage) per virtual stage, loaded by `initialize`, DDP-wrapped."""
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module
    from megatron.core.utils import get_model_config

    vp = parallel.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vp) if vp else [None]:
        chunk = model_provider(
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
        )
        # The loss is a sum over tokens; finalize_model_grads divides by the step's token count.
        get_model_config(chunk).calculate_per_token_loss = True
        chunks.append(chunk)
    if initialize is not None:
        # Before the optimizer exists: its fp32 master copies are taken from these weights.
        initialize(chunks)
    # Before Float16Module and DDP: both take the parameters where they are.
    chunks = place_on_device(chunks, training_device())
    if bf16:
        chunks = [Float16Module(get_model_config(c), c) for c in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=bf16,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    return [
        # Only the first chunk buckets: Megatron-LM's choice for interleaved pipelines.
        DistributedDataParallel(config=get_model_config(c), ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]


def build_optimizer_and_scheduler(model: list, section: OptimizerConfig, *, bf16: bool, train_iters: int):
    """get_megatron_optimizer + OptimizerParamScheduler, and the hooks the schedules call."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    from megatron_osprey.training.optimizer import build_optimizer
    from megatron_osprey.training.scheduler import build_scheduler

    optimizer = build_optimizer(model, section, bf16)
    scheduler = build_scheduler(optimizer, section, train_iters)
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if model[0].ddp_config.overlap_grad_reduce:
        # As Megatron-LM: the schedules hold the grad sync back until the last micro-batch (no_sync), and under
        # pipeline parallelism start each chunk's sync as soon as its last backward is done.
        # One chunk: the plain callables the non-interleaved schedules call; several: one per chunk.
        no_sync, grad_sync = [c.no_sync for c in model], [c.start_grad_sync for c in model]
        config.no_sync_func = no_sync[0] if len(model) == 1 else no_sync
        config.grad_sync_func = grad_sync[0] if len(model) == 1 else grad_sync
    return optimizer, scheduler


def make_train_run(
    cfg, model: list, optimizer, scheduler, metrics, run_config: dict, metadata: dict, parallel, run_identity=None
):
    """The loop's TrainRun, with a saver writing full training checkpoints to cfg.checkpoint.save (if set)."""
    from megatron_osprey.training import checkpointing
    from megatron_osprey.training.loop import TrainRun, TrainState

    def save(state: TrainState) -> None:
        path = checkpointing.save_training_checkpoint(
            cfg.checkpoint.save,
            state.iteration,
            state.consumed_train_samples,
            model,
            optimizer,
            scheduler,
            run_config | {"iteration": state.iteration},
            metadata,
            run_identity,
        )
        metrics.note(f"saved checkpoint {path}")

    return TrainRun(
        model,
        optimizer,
        scheduler,
        cfg.training,
        cfg.checkpoint,
        cfg.logging,
        metrics,
        save if cfg.checkpoint.save else None,
        parallel.dp_size,
        parallel.device,
    )
