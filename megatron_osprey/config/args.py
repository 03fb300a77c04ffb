"""Megatron-LM-named command-line flags, grouped, mapped onto PretrainConfig sections.

Precedence: dataclass defaults < `--recipe` < explicit flags < `--set section.key=value`.
Only flags the user typed are applied (argparse.SUPPRESS), so a recipe is never
silently overwritten by a flag's default.
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_osprey.config.overrides import apply_overrides
from megatron_osprey.config.pretrain import FP8_FORMATS, FP8_RECIPES, LR_DECAY_STYLES, PretrainConfig
from megatron_osprey.config.recipes import RECIPES, recipe

STORE_TRUE = {"action": "store_true"}

# group -> [(flag, "section.field", argparse kwargs)]
ARGUMENT_GROUPS: dict[str, list[tuple[str, str, dict[str, Any]]]] = {
    "model": [
        ("--backbone", "model.backbone", {"help": "Stage 1 output directory (run_config.yaml, megatron/, hf/)"}),
        ("--hf-model", "model.hf_model", {"help": "a HF model directory to start from instead"}),
        ("--transformer-impl", "model.transformer_impl", {"choices": ["auto", "local", "transformer_engine"]}),
        ("--bf16", "model.bf16", STORE_TRUE),
        ("--fp8-format", "model.fp8_format", {"choices": list(FP8_FORMATS)}),
        ("--fp8-recipe", "model.fp8_recipe", {"choices": list(FP8_RECIPES)}),
    ],
    "distributed": [
        ("--tensor-model-parallel-size", "parallel.tensor_model_parallel_size", {"type": int}),
        ("--pipeline-model-parallel-size", "parallel.pipeline_model_parallel_size", {"type": int}),
        ("--num-virtual-stages-per-pipeline-rank", "parallel.virtual_pipeline_model_parallel_size", {"type": int}),
        ("--context-parallel-size", "parallel.context_parallel_size", {"type": int}),
        ("--sequence-parallel", "parallel.sequence_parallel", STORE_TRUE),
        ("--distributed-backend", "parallel.distributed_backend", {"choices": ["nccl", "gloo"]}),
        ("--distributed-timeout-minutes", "parallel.distributed_timeout_minutes", {"type": float}),
        ("--seed", "parallel.seed", {"type": int}),
        ("--use-distributed-optimizer", "optimizer.use_distributed_optimizer", STORE_TRUE),
        ("--dist-ckpt-optim-fully-reshardable", "optimizer.dist_ckpt_optim_fully_reshardable", STORE_TRUE),
    ],
    "training": [
        ("--micro-batch-size", "training.micro_batch_size", {"type": int}),
        ("--global-batch-size", "training.global_batch_size", {"type": int}),
        ("--seq-length", "training.seq_length", {"type": int}),
        ("--train-iters", "training.train_iters", {"type": int}),
        ("--train-samples", "training.train_samples", {"type": int}),
        ("--exit-interval", "training.exit_interval", {"type": int}),
        ("--exit-duration-in-mins", "training.exit_duration_in_mins", {"type": float}),
        ("--exit-signal-handler", "training.exit_signal_handler", STORE_TRUE),
        ("--max-nonfinite-loss-steps", "training.max_nonfinite_loss_steps",
         {"type": int, "help": "stop with an error after N consecutive NaN/inf losses (default 1; 0: never)"}),
    ],
    "learning rate": [
        ("--lr", "optimizer.lr", {"type": float}),
        ("--min-lr", "optimizer.min_lr", {"type": float}),
        ("--lr-warmup-iters", "optimizer.lr_warmup_iters", {"type": int}),
        ("--lr-decay-iters", "optimizer.lr_decay_iters", {"type": int}),
        ("--lr-decay-style", "optimizer.lr_decay_style", {"choices": list(LR_DECAY_STYLES)}),
        ("--lr-wsd-decay-iters", "optimizer.lr_wsd_decay_iters", {"type": int}),
        ("--lr-wsd-decay-style", "optimizer.lr_wsd_decay_style", {}),
        ("--weight-decay", "optimizer.weight_decay", {"type": float}),
        ("--clip-grad", "optimizer.clip_grad", {"type": float}),
        ("--adam-beta1", "optimizer.adam_beta1", {"type": float}),
        ("--adam-beta2", "optimizer.adam_beta2", {"type": float}),
        ("--adam-eps", "optimizer.adam_eps", {"type": float}),
        ("--override-opt-param-scheduler", "optimizer.override_opt_param_scheduler",
         {"action": "store_true", "help": "on resume, switch to the schedule these flags give (Megatron-LM's "
                                          "--override-opt_param-scheduler) instead of refusing a change"}),
    ],
    "data": [
        ("--data-path", "data.data_path", {"nargs": "+", "help": "PREFIX, or WEIGHT PREFIX [WEIGHT PREFIX ...]"}),
        ("--split", "data.split", {"help": "train,valid,test weights, e.g. 969,30,1"}),
        ("--data-cache-path", "data.data_cache_path", {}),
        ("--eod-token-id", "data.eod_token_id", {"type": int}),
    ],
    "checkpointing": [
        ("--save", "checkpoint.save", {}),
        ("--load", "checkpoint.load", {}),
        ("--save-interval", "checkpoint.save_interval", {"type": int}),
        ("--ckpt-step", "checkpoint.ckpt_step", {"type": int}),
        ("--no-load-optim", "checkpoint.no_load_optim", STORE_TRUE),
        ("--no-load-rng", "checkpoint.no_load_rng", STORE_TRUE),
    ],
    "logging": [
        ("--log-interval", "logging.log_interval", {"type": int}),
        ("--eval-interval", "logging.eval_interval", {"type": int}),
        ("--eval-iters", "logging.eval_iters", {"type": int}),
        ("--tensorboard-dir", "logging.tensorboard_dir", {}),
        ("--wandb-project", "logging.wandb_project", {}),
        ("--wandb-exp-name", "logging.wandb_exp_name", {}),
        ("--wandb-save-dir", "logging.wandb_save_dir", {}),
        ("--peak-tflops", "logging.peak_tflops", {"type": float, "help": "per-device peak for MFU"}),
        ("--no-progress-bar", "logging.progress_bar", {"action": "store_false"}),
    ],
}


def build_parser(prog: str = "python -m megatron_osprey.pretrain") -> argparse.ArgumentParser:
    """The Stage 2 parser; only typed flags land in the namespace."""
    parser = argparse.ArgumentParser(prog=prog, argument_default=argparse.SUPPRESS,
                                     description="Stage 2: pretrain the pruned Osprey backbone.")
    parser.add_argument("--recipe", choices=sorted(RECIPES), help="start from a named recipe")
    parser.add_argument("--set", dest="overrides", action="append", metavar="SECTION.KEY=VALUE",
                        help="override any config key (repeatable; applied last)")
    for title, flags in ARGUMENT_GROUPS.items():
        group = parser.add_argument_group(title)
        for flag, dest, kwargs in flags:
            group.add_argument(flag, dest=dest, **kwargs)
    return parser


def config_from_args(argv: list[str] | None) -> PretrainConfig:
    """Parse argv into a resolved PretrainConfig (recipe, then flags, then --set)."""
    namespace = vars(build_parser().parse_args(argv))
    return apply_flags(recipe(namespace.pop("recipe", None)), namespace)


def apply_flags(cfg, namespace: dict[str, Any]):
    """Typed flags (dest "section.field", or a top-level field), then the --set overrides, onto cfg."""
    overrides = namespace.pop("overrides", [])
    for dest, value in namespace.items():
        if "." in dest:
            section, field = dest.split(".")
            setattr(getattr(cfg, section), field, value)
        else:
            setattr(cfg, dest, value)
    return apply_overrides(cfg, overrides)
