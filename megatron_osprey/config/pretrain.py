"""Stage 2 (backbone pretraining) configuration: one dataclass per component, composed."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from megatron_osprey.base.hardware import transformer_engine_usable
from megatron_osprey.parallel import ParallelConfig

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")


@dataclasses.dataclass
class ModelSection:
    """Where the architecture and the initial weights come from, and the numerics."""

    backbone: str | None = None  # Stage 1 output: run_config.yaml + megatron/ + hf/
    hf_model: str | None = None  # or a HF model directory (all its layers)
    transformer_impl: str = "auto"
    bf16: bool = False
    fp8_format: str | None = None
    fp8_recipe: str = "delayed"


@dataclasses.dataclass
class TrainingSection:
    """Batch geometry, run length and the ways a run ends early."""

    micro_batch_size: int = 1
    global_batch_size: int = 256
    seq_length: int = 4096
    train_iters: int | None = None
    train_samples: int | None = None
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    exit_signal_handler: bool = False
    # Megatron's --check-for-nan-in-loss-and-grad stops at the first; fp16 loss scaling may want a little slack.
    max_nonfinite_loss_steps: int = 1  # stop after this many consecutive NaN/inf losses; 0: never

    def num_train_iters(self) -> int:
        """--train-iters, or --train-samples rounded up to whole global batches."""
        if self.train_iters is not None:
            return self.train_iters
        return math.ceil(self.train_samples / self.global_batch_size)


@dataclasses.dataclass
class OptimizerSection:
    """AdamW, its schedule and clipping (Megatron-LM names)."""

    lr: float = 3e-4
    min_lr: float = 3e-5
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None  # None: decay over the whole run
    lr_decay_style: str = "cosine"
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_style: str = "exponential"
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    use_distributed_optimizer: bool = False
    # On resume, take --lr/--min-lr/--train-iters... from the flags, not the checkpoint (Megatron's flag).
    override_opt_param_scheduler: bool = False
    # Megatron-LM's default is the DP-reshardable distributed-optimizer format.
    dist_ckpt_optim_fully_reshardable: bool = False


@dataclasses.dataclass
class DataSection:
    """Megatron indexed data: `[weight] prefix` pairs or one prefix, and the split."""

    data_path: list[str] = dataclasses.field(default_factory=list)
    split: str = "969,30,1"
    data_cache_path: str | None = None
    eod_token_id: int | None = None  # None: the model config's eos_token_id


@dataclasses.dataclass
class CheckpointSection:
    """Dist checkpoints: where to save and load, how often, what to restore."""

    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    ckpt_step: int | None = None
    no_load_optim: bool = False
    no_load_rng: bool = False


@dataclasses.dataclass
class LoggingSection:
    """Console, TensorBoard and wandb; evaluation cadence; MFU's peak."""

    log_interval: int = 10
    eval_interval: int = 1000
    eval_iters: int = 10
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    wandb_mode: str = "offline"  # the entry module resolves WANDB_MODE into this
    peak_tflops: float | None = None  # per device; None: look the GPU up, n/a on CPU
    progress_bar: bool = True


@dataclasses.dataclass
class PretrainConfig:
    """Everything `python -m megatron_osprey.pretrain` runs from."""

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    training: TrainingSection = dataclasses.field(default_factory=TrainingSection)
    optimizer: OptimizerSection = dataclasses.field(default_factory=OptimizerSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    logging: LoggingSection = dataclasses.field(default_factory=LoggingSection)
    recipe: str | None = None

    def validate(self, world_size: int) -> None:
        """Checks that need no model: flags that contradict each other or cannot run here."""
        validate_model_source(self.model)
        validate_training(self.training, self.parallel, world_size)
        validate_optimizer(self.optimizer, self.training)
        validate_numerics(self.model)
        if not self.data.data_path:
            raise ValueError("--data-path is required: one PREFIX or `WEIGHT PREFIX` pairs.")
        if self.training.exit_signal_handler and not self.checkpoint.save:
            raise ValueError("--exit-signal-handler needs --save: a signal saves a checkpoint, then exits.")


def validate_model_source(model: ModelSection) -> None:
    """Exactly one of --backbone / --hf-model, and it has what it must."""
    if bool(model.backbone) == bool(model.hf_model):
        raise ValueError("pass exactly one of --backbone DIR (Stage 1 output) or --hf-model DIR.")
    if model.backbone:
        root = Path(model.backbone)
        for need in ("run_config.yaml", "megatron"):
            if not (root / need).exists():
                raise FileNotFoundError(
                    f"--backbone {root}: no {need} there (expected the output of tools/prune_backbone.py)."
                )
    elif not (Path(model.hf_model) / "config.json").is_file():
        raise FileNotFoundError(f"--hf-model {model.hf_model}: no config.json there (expected a HF model directory).")


def validate_training(training: TrainingSection, parallel: ParallelConfig, world_size: int) -> None:
    """Batch sizes divide, and the run has a length."""
    if (training.train_iters is None) == (training.train_samples is None):
        raise ValueError("pass exactly one of --train-iters or --train-samples.")
    if training.max_nonfinite_loss_steps < 0:
        raise ValueError(f"--max-nonfinite-loss-steps must be >= 0, got {training.max_nonfinite_loss_steps}.")
    for name in ("micro_batch_size", "global_batch_size", "seq_length"):
        if getattr(training, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(training, name)}.")
    if parallel.context_parallel_size != 1:
        # Megatron-Core expects each CP rank to hold its zigzag slice of the sequence
        # (get_batch_on_this_cp_rank) and scales the rotary table by CP; our batches are whole
        # sequences, so CP > 1 would train on wrong positions without an error. The drafter's TTT
        # attention is not context-parallel either.
        raise ValueError(
            f"--context-parallel-size {parallel.context_parallel_size} is not supported: batches are not split "
            f"per context-parallel rank; use --context-parallel-size 1 (and --sequence-parallel for long sequences)."
        )
    parallel.validate(world_size)
    dp = world_size // parallel.model_parallel_size()
    if training.global_batch_size % (training.micro_batch_size * dp):
        raise ValueError(
            f"--global-batch-size {training.global_batch_size} is not divisible by --micro-batch-size "
            f"{training.micro_batch_size} x data-parallel size {dp} = {training.micro_batch_size * dp}."
        )
    if training.seq_length % parallel.tensor_model_parallel_size and parallel.sequence_parallel:
        raise ValueError(
            f"--seq-length {training.seq_length} must be divisible by --tensor-model-parallel-size "
            f"{parallel.tensor_model_parallel_size} with --sequence-parallel."
        )


def validate_optimizer(optimizer: OptimizerSection, training: TrainingSection) -> None:
    """Schedule names and lengths that Megatron's scheduler accepts."""
    if optimizer.lr_decay_style not in LR_DECAY_STYLES:
        raise ValueError(f"--lr-decay-style must be one of {LR_DECAY_STYLES}, got {optimizer.lr_decay_style!r}.")
    if optimizer.lr_decay_style == "WSD":
        if not optimizer.lr_wsd_decay_iters:
            raise ValueError("--lr-decay-style WSD needs --lr-wsd-decay-iters (the length of the final decay).")
        if optimizer.lr_wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(f"--lr-wsd-decay-style must be one of {WSD_DECAY_STYLES}.")
    if optimizer.min_lr > optimizer.lr:
        raise ValueError(f"--min-lr {optimizer.min_lr} is above --lr {optimizer.lr}.")
    decay = optimizer.lr_decay_iters or training.num_train_iters()
    if optimizer.lr_warmup_iters >= decay:  # Megatron's scheduler asserts warmup < decay
        raise ValueError(
            f"--lr-warmup-iters {optimizer.lr_warmup_iters} must be below the decay length {decay} "
            f"(--lr-decay-iters, else the run's length)."
        )


def validate_numerics(model: ModelSection) -> None:
    """FP8 needs Transformer Engine on CUDA; say so before building anything."""
    if model.fp8_format is None:
        return
    if model.fp8_format not in FP8_FORMATS:
        raise ValueError(f"--fp8-format must be one of {FP8_FORMATS}, got {model.fp8_format!r}.")
    if model.fp8_recipe not in FP8_RECIPES:
        raise ValueError(f"--fp8-recipe must be one of {FP8_RECIPES}, got {model.fp8_recipe!r}.")
    if not transformer_engine_usable():
        raise RuntimeError(
            "--fp8-format needs CUDA and Transformer Engine (pip install -e '.[gpu]' on a GPU machine); "
            "drop it to train in float32/bf16 on this machine."
        )
    if model.transformer_impl == "local":
        raise ValueError("--fp8-format needs --transformer-impl transformer_engine (or auto).")


def validate_against_model(config: PretrainConfig, max_position_embeddings: int, arch) -> None:
    """Checks that need the architecture: sequence length and TP/PP divisibility."""
    if config.training.seq_length > max_position_embeddings:
        raise ValueError(
            f"--seq-length {config.training.seq_length} exceeds the model's max_position_embeddings "
            f"({max_position_embeddings}); use --seq-length <= {max_position_embeddings}."
        )
    arch.validate_parallel(config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size)
