"""Megatron-LM-named command-line flags, grouped, mapped onto PretrainConfig sections.

Precedence: dataclass defaults < `--recipe` < explicit flags < `--set section.key=value`.
Only flags the user typed are applied (argparse.SUPPRESS), so a recipe is never
silently overwritten by a flag's default. `config_flags` is the inverse: the flags that
rebuild a config from the defaults, which is how the `osprey` launcher starts a job.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from megatron_osprey.config.overrides import apply_overrides
from megatron_osprey.config.pretrain import FP8_FORMATS, FP8_RECIPES, LR_DECAY_STYLES, PretrainConfig
from megatron_osprey.config.recipes import stage_config

STORE_TRUE = {"action": "store_true"}

Flag = tuple[str, str, dict[str, Any]]  # (flag, "section.field", argparse kwargs)
ARGUMENT_GROUPS: dict[str, list[Flag]] = {
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
        (
            "--max-nonfinite-loss-steps",
            "training.max_nonfinite_loss_steps",
            {"type": int, "help": "stop with an error after N consecutive NaN/inf losses (default 1; 0: never)"},
        ),
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
        (
            "--override-opt-param-scheduler",
            "optimizer.override_opt_param_scheduler",
            {
                "action": "store_true",
                "help": "on resume, switch to the schedule these flags give (Megatron-LM's "
                "--override-opt_param-scheduler) instead of refusing a change",
            },
        ),
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


def build_parser(prog: str, description: str, stage: str, groups: dict[str, list[Flag]]) -> argparse.ArgumentParser:
    """A stage's parser: --recipe, --set and its flag groups; only typed flags land in the namespace."""
    parser = argparse.ArgumentParser(prog=prog, argument_default=argparse.SUPPRESS, description=description)
    parser.add_argument(
        "--recipe",
        metavar="NAME[:DOMAIN]",
        type=lambda spec: _recipe(spec, stage),
        help=f"start from a registered {stage} recipe (`osprey recipes` lists them)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="override any config key (repeatable; applied last)",
    )
    for title, flags in groups.items():
        group = parser.add_argument_group(title)
        for flag, dest, kwargs in flags:
            group.add_argument(flag, dest=dest, **kwargs)
    return parser


def _recipe(spec: str, stage: str):
    """--recipe's value: the registry's config for that stage (argparse turns the error into one line)."""
    try:
        cfg = stage_config(spec, stage)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    cfg.recipe = spec
    return cfg


def pretrain_parser() -> argparse.ArgumentParser:
    """The Stage 2 parser."""
    return build_parser(
        "python -m megatron_osprey.pretrain",
        "Stage 2: pretrain the pruned Osprey backbone.",
        "pretrain",
        ARGUMENT_GROUPS,
    )


def config_from_args(argv: list[str] | None) -> PretrainConfig:
    """Parse argv into a resolved PretrainConfig (recipe, then flags, then --set)."""
    namespace = vars(pretrain_parser().parse_args(argv))
    return apply_flags(namespace.pop("recipe", None) or PretrainConfig(), namespace)


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


def _get(cfg, dest: str):
    for part in dest.split("."):
        cfg = getattr(cfg, part)
    return cfg


def config_flags(cfg, groups: dict[str, list[Flag]]) -> list[str]:
    """The flags that turn the defaults into cfg (a field off its default without a flag is an error)."""
    default, flags, covered = type(cfg)(), [], set()
    for entries in groups.values():
        for flag, dest, kwargs in entries:
            covered.add(dest)
            value = _get(cfg, dest)
            if value == _get(default, dest):
                continue
            action = kwargs.get("action")
            if action in ("store_true", "store_false"):
                if value is not (action == "store_true"):
                    raise ValueError(f"{flag}: {dest} = {value!r} cannot be given by this flag.")
                flags.append(flag)
            elif isinstance(value, (list, tuple)):
                flags += [flag, *map(flag_word, value)]
            elif value is None:
                raise ValueError(f"{flag}: cannot be set back to unset on the command line; leave it at its default.")
            else:
                flags += [flag, flag_word(value)]
    for dest in _leaves(cfg):
        if dest not in covered and dest != "recipe" and _get(cfg, dest) != _get(default, dest):
            raise ValueError(f"{dest} = {_get(cfg, dest)!r} has no command-line flag; leave it at its default.")
    return flags


def flag_word(value) -> str:
    """A value as a flag word; whole floats without the trailing .0."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _leaves(cfg, prefix: str = "") -> list[str]:
    out = []
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        name = f"{prefix}{field.name}"
        out += _leaves(value, f"{name}.") if dataclasses.is_dataclass(value) else [name]
    return out
