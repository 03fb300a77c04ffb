"""Stage 2 assembled: the backbone's GPTModel, GPT datasets and the shared loop, from a PretrainConfig."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from megatron_osprey.config.pretrain import PretrainConfig, validate_against_model
from megatron_osprey.config.run_config import load_run_config, to_plain
from megatron_osprey.models.arch import ModelArch
from megatron_osprey.parallel import ParallelState
from megatron_osprey.training import checkpointing, data
from megatron_osprey.training.flops import ModelShape, device_peak_tflops, training_flops_per_sequence
from megatron_osprey.training.gpt_step import gpt_forward_step
from megatron_osprey.training.loop import TrainState, train
from megatron_osprey.training.metrics import MetricsLogger, ThroughputModel
from megatron_osprey.training.optimizer import sharding_metadata
from megatron_osprey.training.setup import build_model_chunks, build_optimizer_and_scheduler, make_train_run


@dataclasses.dataclass
class PretrainResult:
    state: TrainState
    history: list[dict[str, float]]
    notes: list[str]


def backbone_arch(cfg: PretrainConfig) -> ModelArch:
    """The architecture: the Stage 1 run_config.yaml's hf_config, or the HF model's config.json."""
    if cfg.model.backbone:
        source = Path(cfg.model.backbone) / "run_config.yaml"
        hf_config = load_run_config(source).get("hf_config")
        if not hf_config:
            raise ValueError(f"--backbone {cfg.model.backbone}: {source} has no hf_config (not a Stage 1 output?).")
        return ModelArch.from_hf_config(hf_config, source=str(source))
    return ModelArch.from_hf_config(cfg.model.hf_model)


def model_provider(arch: ModelArch, cfg: PretrainConfig) -> Callable:
    """model_provider(pre_process, post_process, vp_stage) -> this rank's GPTModel stage."""
    from megatron_osprey.models.gpt import build_gpt_model

    overrides: dict[str, Any] = {}
    if cfg.model.fp8_format:
        overrides.update(fp8=cfg.model.fp8_format, fp8_recipe=cfg.model.fp8_recipe)
    return functools.partial(
        build_gpt_model, arch, cfg.parallel, transformer_impl=cfg.model.transformer_impl,
        params_dtype=torch.bfloat16 if cfg.model.bf16 else torch.float32, **overrides,
    )


def initial_weights(arch: ModelArch, cfg: PretrainConfig, state: ParallelState) -> Callable[[list], None]:
    """Loads the backbone (Stage 1 dist checkpoint, resharded) or the HF weights into fresh chunks."""
    from megatron_osprey.convert.hf_to_megatron import load_hf_weights

    def initialize(chunks: list) -> None:
        if cfg.model.backbone:
            checkpointing.load_backbone_weights(Path(cfg.model.backbone) / "megatron", chunks)
        else:
            for chunk in chunks:
                load_hf_weights(chunk, cfg.model.hf_model, arch, state.tp_rank,
                                cfg.parallel.tensor_model_parallel_size)

    return initialize


def resume_iteration(cfg: PretrainConfig) -> int | None:
    """The iteration --load resumes from, or None to start from the backbone."""
    if not cfg.checkpoint.load:
        return None
    if cfg.checkpoint.ckpt_step is not None:
        return cfg.checkpoint.ckpt_step
    return checkpointing.read_latest_iteration(cfg.checkpoint.load)


def run_pretrain(cfg: PretrainConfig, parallel: ParallelState,
                 forward_step: Callable = gpt_forward_step) -> PretrainResult:
    """Validate, build, (re)load, train; collective over every rank of `parallel`."""
    cfg.validate(parallel.world_size)
    arch = backbone_arch(cfg)
    validate_against_model(cfg, arch.max_position_embeddings, arch)
    data.check_prefixes(data.parse_blend(cfg.data.data_path)[0])
    if cfg.checkpoint.save:
        checkpointing.check_writable(cfg.checkpoint.save, "--save")
    is_writer = parallel.rank == 0
    train_iters = cfg.training.num_train_iters()
    run_config = {"stage": "pretrain", "config": cfg, "world_size": parallel.world_size,
                  "hf_config": arch.hf_config}
    if is_writer:
        print("resolved configuration:\n" + yaml.safe_dump(to_plain(run_config["config"]), sort_keys=False),
              flush=True)

    resume = resume_iteration(cfg)
    prefixes = data.parse_blend(cfg.data.data_path)[0]
    for prefix in prefixes:
        data.check_has_documents(prefix)
    notes = data.check_vocabulary(prefixes, arch.vocab_size)
    if cfg.checkpoint.load and resume is None:
        notes.append(f"--load {cfg.checkpoint.load}: no checkpoint there yet; starting from the initial weights")
    model = build_model_chunks(
        model_provider(arch, cfg), cfg.parallel, bf16=cfg.model.bf16,
        use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
        initialize=None if resume is not None else initial_weights(arch, cfg, parallel),
    )
    optimizer, scheduler = build_optimizer_and_scheduler(model, cfg.optimizer, bf16=cfg.model.bf16,
                                                         train_iters=train_iters)
    metadata = sharding_metadata(cfg.optimizer) | {
        "use_distributed_optimizer": cfg.optimizer.use_distributed_optimizer}
    state = TrainState()
    if resume is not None:
        info = checkpointing.load_training_checkpoint(
            cfg.checkpoint.load, model, optimizer, scheduler, metadata, iteration=resume,
            load_optim=not cfg.checkpoint.no_load_optim, load_rng=not cfg.checkpoint.no_load_rng,
            scheduler_flags=checkpointing.scheduler_flags(
                "--lr-decay-iters" if cfg.optimizer.lr_decay_iters else None,
                "--train-iters" if cfg.training.train_iters is not None else "--train-samples"))
        state = TrainState(info["iteration"], info["consumed_train_samples"])
        notes += info["notes"]
        notes.append(f"resumed from {cfg.checkpoint.load} at iteration {state.iteration}")

    dp_rank, dp_size = parallel.dp_rank, parallel.dp_size
    tokenizer = data.DatasetTokenizer(arch.vocab_size, data.eod_token_id(arch.hf_config, cfg.data.eod_token_id))
    sizes = data.split_sizes(train_iters, cfg.training.global_batch_size, cfg.logging.eval_iters,
                             cfg.logging.eval_interval)
    train_ds, valid_ds, _ = data.build_gpt_datasets(cfg.data, tokenizer, cfg.training.seq_length,
                                                    cfg.parallel.seed, sizes)
    mbs = cfg.training.micro_batch_size

    def iterators(dataset, consumed: int):
        # Interleaved pipelines take one iterator per virtual stage, each at the same position.
        its = [data.micro_batches(dataset, consumed, mbs, dp_rank, dp_size, parallel.device,
                                  vocab_size=arch.vocab_size, source=" ".join(cfg.data.data_path)) for _ in model]
        return its if len(its) > 1 else its[0]

    train_iterator = iterators(train_ds, state.consumed_train_samples)
    valid_iterator = (lambda: iterators(valid_ds, 0)) if valid_ds is not None else None
    if valid_ds is None and cfg.logging.eval_iters:
        notes.append(f"--split {cfg.data.split} leaves no validation data: loss/valid is not computed")

    padded_vocab = arch.padded_vocab_size(cfg.parallel.tensor_model_parallel_size)
    seq = cfg.training.seq_length
    throughput = ThroughputModel(
        tokens_per_iteration=cfg.training.global_batch_size * seq,
        flops_per_iteration=cfg.training.global_batch_size
        * training_flops_per_sequence(ModelShape.from_arch(arch, padded_vocab), seq),
        world_size=parallel.world_size,
        peak_tflops=device_peak_tflops(cfg.logging.peak_tflops, fp8=bool(cfg.model.fp8_format)),
    )
    metrics = MetricsLogger(cfg.logging, throughput, is_writer=is_writer, total_iters=train_iters,
                            start_iter=state.iteration, save_dir=cfg.checkpoint.save, run_config=run_config)
    for note in notes:
        metrics.note(note)

    run = make_train_run(cfg, model, optimizer, scheduler, metrics, run_config, metadata, parallel)
    try:
        state = train(run, state, forward_step, train_iterator, valid_iterator)
    finally:
        metrics.close()
    if cfg.checkpoint.save and state.iteration >= train_iters:
        export_backbone(cfg, arch, model, run_config | {"iteration": state.iteration}, parallel)
    return PretrainResult(state, metrics.history, notes)


def export_backbone(cfg: PretrainConfig, arch: ModelArch, model: list, run_config: dict, parallel: ParallelState) -> None:
    """A finished run also leaves SAVE/hf/ and SAVE/run_config.yaml: the layout Stage 3 reads as --backbone."""
    import shutil

    from megatron_osprey.config.run_config import save_run_config
    from megatron_osprey.convert.megatron_to_hf import export_to_hf
    from megatron_osprey.models.prune import TOKENIZER_FILES

    save = Path(cfg.checkpoint.save)
    export_to_hf([checkpointing.unwrap(chunk) for chunk in model], arch, save / "hf")
    if parallel.rank == 0:
        source = Path(cfg.model.backbone) / "hf" if cfg.model.backbone else Path(cfg.model.hf_model)
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, save / "hf" / name)
        save_run_config(save / "run_config.yaml", run_config)
    torch.distributed.barrier()
