"""Stage 2 assembled: the backbone's GPTModel, GPT datasets and the shared loop, from the pretrain stage's config.

`cfg` is stages/pretrain.py's PretrainConfig: its sections model (BackboneConfig), data (IndexedDataConfig) and
the shared training sections (training/config.py).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable

import torch
from megatron.core.utils import unwrap_model

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.base.outputs import check_output_writable
from megatron_osprey.base.run_config import load_run_config
from megatron_osprey.data.micro_batches import micro_batches
from megatron_osprey.parallel import ParallelState
from megatron_osprey.training import checkpointing, data, resume_check
from megatron_osprey.training.assembly import TrainSpec, train_stage
from megatron_osprey.training.flops import training_flops_per_sequence
from megatron_osprey.training.gpt_step import gpt_forward_step
from megatron_osprey.training.loop import TrainState


@dataclasses.dataclass
class PretrainResult:
    state: TrainState
    history: list[dict[str, float]]
    notes: list[str]


def backbone_arch(cfg) -> ModelArch:
    """The architecture: the Stage 1 run_config.yaml's hf_config, or the HF model's config.json."""
    if cfg.model.backbone:
        source = Path(cfg.model.backbone) / "run_config.yaml"
        hf_config = load_run_config(source).get("hf_config")
        if not hf_config:
            raise ValueError(f"--backbone {cfg.model.backbone}: {source} has no hf_config (not a Stage 1 output?).")
        return ModelArch.from_hf_config(hf_config, source=str(source))
    return ModelArch.from_hf_config(cfg.model.hf_model)


def model_provider(arch: ModelArch, cfg) -> Callable:
    """model_provider(pre_process, post_process, vp_stage) -> this rank's GPTModel stage."""
    from megatron_osprey.models.backbone.gpt import build_gpt_model

    overrides: dict[str, Any] = {}
    if cfg.model.fp8_format:
        overrides.update(fp8=cfg.model.fp8_format, fp8_recipe=cfg.model.fp8_recipe)
    return functools.partial(
        build_gpt_model,
        arch,
        cfg.parallel,
        transformer_impl=cfg.model.transformer_impl,
        params_dtype=torch.bfloat16 if cfg.model.bf16 else torch.float32,
        **overrides,
    )


def initial_weights(arch: ModelArch, cfg, state: ParallelState) -> Callable[[list], None]:
    """Loads the backbone (Stage 1 dist checkpoint, resharded) or the HF weights into fresh chunks."""
    from megatron_osprey.convert.hf_to_megatron import load_hf_weights

    def initialize(chunks: list) -> None:
        if cfg.model.backbone:
            checkpointing.load_backbone_weights(
                Path(cfg.model.backbone) / "megatron", chunks, verify=not cfg.checkpoint.skip_checksum
            )
        else:
            for chunk in chunks:
                load_hf_weights(chunk, cfg.model.hf_model, arch, state.tp_rank, cfg.parallel.tensor_model_parallel_size)

    return initialize


def validate_against_model(cfg, arch: ModelArch) -> None:
    """Checks that need the architecture: sequence length and TP/PP divisibility."""
    if cfg.training.seq_length > arch.max_position_embeddings:
        raise ValueError(
            f"--seq-length {cfg.training.seq_length} exceeds the model's max_position_embeddings "
            f"({arch.max_position_embeddings}); use --seq-length <= {arch.max_position_embeddings}."
        )
    arch.validate_parallel(cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size)


def run_pretrain(cfg, parallel: ParallelState, forward_step: Callable = gpt_forward_step) -> PretrainResult:
    """Validate, then train through the shared assembly; collective over every rank of `parallel`."""
    cfg.validate(parallel.world_size)
    arch = backbone_arch(cfg)
    validate_against_model(cfg, arch)
    data.check_prefixes(data.parse_blend(cfg.data.data_path)[0])
    if cfg.checkpoint.save:
        check_output_writable(cfg.checkpoint.save, "--save")
    prefixes = data.parse_blend(cfg.data.data_path)[0]
    for prefix in prefixes:
        data.check_has_documents(prefix)
    vocab_notes = data.check_vocabulary(prefixes, arch.vocab_size)  # out-of-vocabulary ids refused before step 1
    train_iters = cfg.training.num_train_iters()
    sizes = data.split_sizes(
        train_iters, cfg.training.global_batch_size, cfg.logging.eval_iters, cfg.logging.eval_interval
    )
    data.plan_splits(cfg.data, prefixes, sizes)  # an empty split that is read is refused before the model is built
    run_config = {"stage": "pretrain", "config": cfg, "world_size": parallel.world_size, "hf_config": arch.hf_config}

    def finish(model: list, state: TrainState) -> None:
        if cfg.checkpoint.save and state.iteration >= train_iters:
            export_backbone(cfg, arch, model, run_config | {"iteration": state.iteration}, parallel)

    padded_vocab = arch.padded_vocab_size(cfg.parallel.tensor_model_parallel_size)
    spec = TrainSpec(
        run_config=run_config,
        model_provider=model_provider(arch, cfg),
        initialize=initial_weights(arch, cfg, parallel),
        forward_step=lambda model: forward_step,
        data_iterators=functools.partial(gpt_data_iterators, cfg, arch, parallel, sizes, vocab_notes),
        flops_per_iteration=lambda model: (
            cfg.training.global_batch_size * training_flops_per_sequence(arch, cfg.training.seq_length, padded_vocab)
        ),
        bf16=cfg.model.bf16,
        fp8=bool(cfg.model.fp8_format),
        finish=finish,
    )
    result = train_stage(cfg, spec, parallel, functools.partial(pretrain_settings, cfg, arch, prefixes))
    return PretrainResult(result.state, result.history, result.notes)


def gpt_data_iterators(
    cfg,
    arch: ModelArch,
    parallel: ParallelState,
    sizes: list[int],
    vocab_notes: list[str],
    model: list,
    state: TrainState,
    notes: list[str],
):
    """TrainSpec.data_iterators of pretraining: GPT datasets of the blend, each batch's token ids checked."""
    source = " ".join(cfg.data.data_path)
    tokenizer = data.DatasetTokenizer(arch.vocab_size, data.eod_token_id(arch.hf_config, cfg.data.eod_token_id))
    train_ds, valid_ds, _ = data.build_gpt_datasets(
        cfg.data, tokenizer, cfg.training.seq_length, cfg.parallel.seed, sizes
    )

    notes += vocab_notes

    def collate(samples: list[dict]) -> dict:
        batch = data.stack_samples(samples)
        data.check_token_ids(batch, arch.vocab_size, source)  # also datasets too large for the scan
        return batch

    def iterators(dataset, consumed: int):
        # Interleaved pipelines take one iterator per virtual stage, each at the same position.
        its = [
            micro_batches(
                dataset,
                consumed,
                cfg.training.micro_batch_size,
                parallel.dp_rank,
                parallel.dp_size,
                collate,
                device=parallel.device,
            )
            for _ in model
        ]
        return its if len(its) > 1 else its[0]

    if valid_ds is None and cfg.logging.eval_iters:
        notes.append(f"--split {cfg.data.split} leaves no validation data: loss/valid is not computed")
    valid = (lambda: iterators(valid_ds, 0)) if valid_ds is not None else None
    return iterators(train_ds, state.consumed_train_samples), valid


def pretrain_settings(cfg, arch: ModelArch, prefixes: list[str]) -> dict[str, dict]:
    """Pretraining's own part of the run identity a resume compares (training/resume_check.py)."""
    return {
        "--mode": resume_check.setting("pretrain"),
        "--data-path": resume_check.indexed_data_setting(cfg.data.data_path, prefixes),
        "--split": resume_check.setting(cfg.data.split),
        "--backbone": resume_check.setting(arch.hf_config, str(cfg.model.backbone or cfg.model.hf_model)),
    }


def export_backbone(cfg, arch: ModelArch, model: list, run_config: dict, parallel: ParallelState) -> None:
    """A finished run also leaves SAVE/hf/ and SAVE/run_config.yaml: the layout Stage 3 reads as --backbone."""
    from megatron_osprey.base.hf_files import copy_tokenizer_files
    from megatron_osprey.base.run_config import save_run_config
    from megatron_osprey.convert.megatron_to_hf import export_to_hf

    save = Path(cfg.checkpoint.save)
    export_to_hf(unwrap_model(model), arch, save / "hf")
    if parallel.rank == 0:
        source = Path(cfg.model.backbone) / "hf" if cfg.model.backbone else Path(cfg.model.hf_model)
        copy_tokenizer_files(source, save / "hf", with_generation_config=True)
        save_run_config(save / "run_config.yaml", run_config)
    torch.distributed.barrier()
