"""Named Stage 2 recipes (`--recipe NAME`): plain functions named by model, scale, hardware, precision."""

from __future__ import annotations

import types
from typing import Callable

from megatron_osprey.config.pretrain import PretrainConfig


def qwen3_4b_2layer_pretrain_8gpu_h100_bf16() -> PretrainConfig:
    """The paper's backbone (Qwen3-4B, first 2 layers) on FineWeb, one 8xH100 node, BF16."""
    cfg = PretrainConfig()
    cfg.model.bf16 = True
    cfg.model.transformer_impl = "transformer_engine"
    cfg.training.micro_batch_size = 4
    cfg.training.global_batch_size = 256
    cfg.training.seq_length = 4096
    # The paper trains 55k steps; 10k captures nearly all of the gain.
    cfg.training.train_iters = 10_000
    cfg.optimizer.lr = 3e-4
    cfg.optimizer.min_lr = 3e-5
    cfg.optimizer.lr_warmup_iters = 500
    cfg.optimizer.lr_decay_style = "cosine"
    cfg.optimizer.use_distributed_optimizer = True
    cfg.checkpoint.save_interval = 1000
    cfg.logging.eval_interval = 1000
    cfg.logging.eval_iters = 20
    return cfg


def qwen3_4b_2layer_pretrain_8gpu_h100_fp8() -> PretrainConfig:
    """As the BF16 recipe, with FP8 (hybrid, delayed scaling) GEMMs in the decoder layers."""
    cfg = qwen3_4b_2layer_pretrain_8gpu_h100_bf16()
    cfg.model.fp8_format = "hybrid"
    cfg.model.fp8_recipe = "delayed"
    return cfg


def qwen3_4b_2layer_pretrain_8gpu_b200_mxfp8() -> PretrainConfig:
    """As the BF16 recipe, with MXFP8 on B200."""
    cfg = qwen3_4b_2layer_pretrain_8gpu_h100_bf16()
    cfg.model.fp8_format = "e4m3"
    cfg.model.fp8_recipe = "mxfp8"
    cfg.training.micro_batch_size = 8
    return cfg


def tiny_pretrain_cpu_fp32() -> PretrainConfig:
    """A toy run for laptops and CI: gloo, local spec, float32, short sequences."""
    cfg = PretrainConfig()
    cfg.model.transformer_impl = "local"
    cfg.training.micro_batch_size = 2
    cfg.training.global_batch_size = 4
    cfg.training.seq_length = 64
    cfg.training.train_iters = 20
    cfg.optimizer.lr = 1e-3
    cfg.optimizer.min_lr = 1e-4
    cfg.optimizer.lr_warmup_iters = 2
    cfg.optimizer.weight_decay = 0.01
    cfg.data.split = "90,10,0"
    cfg.logging.log_interval = 1
    cfg.logging.eval_interval = 10
    cfg.logging.eval_iters = 2
    return cfg


RECIPES: types.MappingProxyType[str, Callable[[], PretrainConfig]] = types.MappingProxyType({
    fn.__name__: fn
    for fn in (
        qwen3_4b_2layer_pretrain_8gpu_h100_bf16,
        qwen3_4b_2layer_pretrain_8gpu_h100_fp8,
        qwen3_4b_2layer_pretrain_8gpu_b200_mxfp8,
        tiny_pretrain_cpu_fp32,
    )
})


def recipe(name: str | None) -> PretrainConfig:
    """The named recipe's config, or the defaults for None."""
    if name is None:
        return PretrainConfig()
    if name not in RECIPES:
        raise ValueError(f"--recipe {name!r} is unknown; available: {', '.join(sorted(RECIPES))}.")
    cfg = RECIPES[name]()
    cfg.recipe = name
    return cfg
