"""The shared training loop's own configs (batch and length, optimizer and schedule, checkpoints, logging),
their checks and their Megatron-LM-named flags. Torch-free: recipes and `osprey plan` read them.

A training stage composes these sections with its model and data sections (stages/pretrain.py,
stages/distill.py); the loop reads only these.
"""

from __future__ import annotations

import dataclasses
import math

from megatron_osprey.config.flags import STORE_TRUE, Flag, skip_checksum_flag
from megatron_osprey.parallel.config import ParallelConfig

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
# Adam's beta2, by name. The release distills with SpecForge's BF16Optimizer, a torch.optim.AdamW left at torch's
# default betas (0.9, 0.999) (LeanModels/Osprey scripts/train_eagle3.py -> specforge/optimizer.py): distillation's
# default (stages/distill.py). 0.95 is the GPT-pretraining convention (Megatron-LM's GPT recipes, GPT-3, Llama),
# which Stage 2 keeps as OptimizerConfig's default and which distillation inherited from it until it was found to
# differ from the release; it is kept as a named value (`--adam-beta2 0.95`) for runs that reproduce that setting.
ADAM_BETA2_RELEASE = 0.999
ADAM_BETA2_GPT = 0.95
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


@dataclasses.dataclass
class TrainingConfig:
    """Batch geometry, run length and the ways a run ends early."""

    micro_batch_size: int = 1
    # None: one micro-batch per data-parallel rank (Megatron-LM's default); validate() fills it in.
    global_batch_size: int | None = None
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
class OptimizerConfig:
    """AdamW, its schedule and clipping (Megatron-LM names)."""

    lr: float = 3e-4
    min_lr: float = 3e-5
    lr_warmup_iters: int = 0
    # Warmup as a share of the run (Megatron-LM's --lr-warmup-fraction); --lr-warmup-iters wins when set.
    lr_warmup_fraction: float | None = None
    lr_decay_iters: int | None = None  # None: decay over the whole run
    lr_decay_style: str = "cosine"
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_style: str = "exponential"
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = ADAM_BETA2_GPT  # Stage 2's; distillation's default is ADAM_BETA2_RELEASE
    adam_eps: float = 1e-8
    use_distributed_optimizer: bool = False
    # Overlap the gradient reduce-scatter with the backward and the parameter all-gather with the next forward
    # (Megatron-LM's flags). Both use CUDA streams, so a run without CUDA (gloo) keeps them off.
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    # On resume, take --lr/--min-lr/--train-iters... from the flags, not the checkpoint (Megatron's flag).
    override_opt_param_scheduler: bool = False
    # Megatron-LM's default is the DP-reshardable distributed-optimizer format.
    dist_ckpt_optim_fully_reshardable: bool = False

    def decay_iters(self, train_iters: int) -> int:
        """The schedule's length: --lr-decay-iters (a cosine longer than the run, stopped early), else the run's."""
        return self.lr_decay_iters or train_iters

    def warmup_iters(self, train_iters: int) -> int:
        """--lr-warmup-iters, else --lr-warmup-fraction of the schedule's length (Megatron-LM's: of
        --lr-decay-iters when set, as the release's warmup ratio is of its total cosine steps)."""
        if self.lr_warmup_iters or self.lr_warmup_fraction is None:
            return self.lr_warmup_iters
        return int(round(self.lr_warmup_fraction * self.decay_iters(train_iters)))

    def lr_at(self, train_iters: int, step: int) -> float:
        """The learning rate Megatron-Core's OptimizerParamScheduler gives after `step` updates (torch-free, for
        `osprey plan`: the warmup, the decay, and the rate a run stopped before the decay's end finishes at)."""
        warmup, decay = self.warmup_iters(train_iters), self.decay_iters(train_iters)
        if warmup > 0 and step <= warmup:
            return self.lr * step / warmup
        if self.lr_decay_style == "constant":
            return self.lr
        if step > decay:
            return self.min_lr
        if self.lr_decay_style == "inverse-square-root":
            return max(self.min_lr, self.lr * max(warmup, 1) ** 0.5 / max(step, 1) ** 0.5)
        ratio = (step - warmup) / (decay - warmup)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD
            start = decay - self.lr_wsd_decay_iters
            wsd = max(0.0, (step - start) / self.lr_wsd_decay_iters)
            coeff = {
                "linear": 1.0 - wsd,
                "cosine": 0.5 * (math.cos(math.pi * wsd) + 1.0),
                "exponential": 2.0 * 0.5**wsd - 1.0,
                "minus_sqrt": 1.0 - math.sqrt(wsd),
            }[self.lr_wsd_decay_style]
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def schedule(self, train_iters: int) -> dict:
        """The schedule as `osprey plan` shows it: warmup, the decay's total length, the stop step, the final lr."""
        final = self.lr_at(train_iters, train_iters)
        return {
            "decay_style": self.lr_decay_style,
            "peak_lr": self.lr,
            "min_lr": self.min_lr,
            "warmup_iters": self.warmup_iters(train_iters),
            "decay_iters": self.decay_iters(train_iters),
            "stop_iter": train_iters,
            "final_lr": final,
            "final_lr_share_of_peak": final / self.lr,
        }


@dataclasses.dataclass
class CheckpointConfig:
    """Dist checkpoints: where to save and load, how often, what to restore."""

    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    ckpt_step: int | None = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    # Load without comparing the files with the sha256 the save recorded (a known-good copy on slow storage).
    skip_checksum: bool = False


@dataclasses.dataclass
class LoggingConfig:
    """Console, TensorBoard and wandb; evaluation cadence; MFU's peak."""

    log_interval: int = 10
    eval_interval: int = 1000
    eval_iters: int = 10
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    wandb_mode: str = "offline"  # the stage resolves WANDB_MODE into this
    peak_tflops: float | None = None  # per device; None: look the GPU up, n/a on CPU
    progress_bar: bool = True


def validate_training(training: TrainingConfig, parallel: ParallelConfig, world_size: int) -> None:
    """Batch sizes divide, and the run has a length; an unset global batch becomes micro-batch x DP."""
    if (training.train_iters is None) == (training.train_samples is None):
        raise ValueError("pass exactly one of --train-iters or --train-samples.")
    for flag, value in (("--train-iters", training.train_iters), ("--train-samples", training.train_samples)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1 (the run's length), got {value}.")
    if training.max_nonfinite_loss_steps < 0:
        raise ValueError(f"--max-nonfinite-loss-steps must be >= 0, got {training.max_nonfinite_loss_steps}.")
    for name in ("micro_batch_size", "global_batch_size", "seq_length"):
        value = getattr(training, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}.")
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
    if training.global_batch_size is None:
        training.global_batch_size = training.micro_batch_size * dp
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


def validate_optimizer(optimizer: OptimizerConfig, training: TrainingConfig) -> None:
    """Learning rates, clipping, schedule names and lengths that Megatron's scheduler accepts."""
    for flag, value in (("--lr", optimizer.lr), ("--min-lr", optimizer.min_lr)):
        if not math.isfinite(value) or value < 0 or (flag == "--lr" and value == 0):
            raise ValueError(f"{flag} must be a finite number {'> 0' if flag == '--lr' else '>= 0'}, got {value}.")
    if not math.isfinite(optimizer.clip_grad) or optimizer.clip_grad < 0:
        raise ValueError(f"--clip-grad must be >= 0 (0 turns clipping off), got {optimizer.clip_grad}.")
    if optimizer.lr_decay_style not in LR_DECAY_STYLES:
        raise ValueError(f"--lr-decay-style must be one of {LR_DECAY_STYLES}, got {optimizer.lr_decay_style!r}.")
    if optimizer.lr_decay_style == "WSD":
        if not optimizer.lr_wsd_decay_iters:
            raise ValueError("--lr-decay-style WSD needs --lr-wsd-decay-iters (the length of the final decay).")
        if optimizer.lr_wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(f"--lr-wsd-decay-style must be one of {WSD_DECAY_STYLES}.")
    if optimizer.min_lr > optimizer.lr:
        raise ValueError(f"--min-lr {optimizer.min_lr} is above --lr {optimizer.lr}.")
    if optimizer.overlap_param_gather and not (optimizer.use_distributed_optimizer and optimizer.overlap_grad_reduce):
        raise ValueError(
            "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce (the parameter "
            "all-gather exists only under the distributed optimizer, and Megatron-Core starts it from the grad sync)."
        )
    decay = optimizer.decay_iters(training.num_train_iters())
    warmup = optimizer.warmup_iters(training.num_train_iters())
    if warmup >= decay:  # Megatron's scheduler asserts warmup < decay
        raise ValueError(
            f"--lr-warmup-iters {warmup} must be below the decay length {decay} (--lr-decay-iters, else the run's "
            f"length)."
        )


TRAINING_FLAGS = [
    Flag("--micro-batch-size", "micro_batch_size", {"type": int}),
    Flag("--global-batch-size", "global_batch_size", {"type": int}),
    Flag("--seq-length", "seq_length", {"type": int}),
    Flag("--train-iters", "train_iters", {"type": int}),
    Flag("--train-samples", "train_samples", {"type": int}),
    Flag("--exit-interval", "exit_interval", {"type": int}),
    Flag("--exit-duration-in-mins", "exit_duration_in_mins", {"type": float}),
    Flag("--exit-signal-handler", "exit_signal_handler", STORE_TRUE),
    Flag(
        "--max-nonfinite-loss-steps",
        "max_nonfinite_loss_steps",
        {"type": int, "help": "stop with an error after N consecutive NaN/inf losses (default 1; 0: never)"},
    ),
]
OPTIMIZER_FLAGS = [
    Flag("--lr", "lr", {"type": float}),
    Flag("--min-lr", "min_lr", {"type": float}),
    Flag("--lr-warmup-iters", "lr_warmup_iters", {"type": int}),
    Flag("--lr-warmup-fraction", "lr_warmup_fraction", {"type": float, "help": "warmup as a share of the run"}),
    Flag("--lr-decay-iters", "lr_decay_iters", {"type": int}),
    Flag("--lr-decay-style", "lr_decay_style", {"choices": list(LR_DECAY_STYLES)}),
    Flag("--lr-wsd-decay-iters", "lr_wsd_decay_iters", {"type": int}),
    Flag("--lr-wsd-decay-style", "lr_wsd_decay_style", {}),
    Flag("--weight-decay", "weight_decay", {"type": float}),
    Flag("--clip-grad", "clip_grad", {"type": float}),
    Flag("--adam-beta1", "adam_beta1", {"type": float}),
    Flag("--adam-beta2", "adam_beta2", {"type": float}),
    Flag("--adam-eps", "adam_eps", {"type": float}),
    Flag("--use-distributed-optimizer", "use_distributed_optimizer", STORE_TRUE),
    Flag("--overlap-grad-reduce", "overlap_grad_reduce", STORE_TRUE),
    Flag("--overlap-param-gather", "overlap_param_gather", STORE_TRUE),
    Flag("--dist-ckpt-optim-fully-reshardable", "dist_ckpt_optim_fully_reshardable", STORE_TRUE),
    Flag(
        "--override-opt-param-scheduler",
        "override_opt_param_scheduler",
        {
            "action": "store_true",
            "help": "on resume, switch to the schedule these flags give (Megatron-LM's "
            "--override-opt_param-scheduler) instead of refusing a change",
        },
    ),
]
CHECKPOINT_FLAGS = [
    Flag("--save", "save", {}),
    Flag("--load", "load", {}),
    Flag("--save-interval", "save_interval", {"type": int}),
    Flag("--ckpt-step", "ckpt_step", {"type": int}),
    Flag("--no-load-optim", "no_load_optim", STORE_TRUE),
    Flag("--no-load-rng", "no_load_rng", STORE_TRUE),
    skip_checksum_flag("--load (and pretrain's --backbone, distill's --drafter-init)"),
]
LOGGING_FLAGS = [
    Flag("--log-interval", "log_interval", {"type": int}),
    Flag("--eval-interval", "eval_interval", {"type": int}),
    Flag("--eval-iters", "eval_iters", {"type": int}),
    Flag("--tensorboard-dir", "tensorboard_dir", {}),
    Flag("--wandb-project", "wandb_project", {}),
    Flag("--wandb-exp-name", "wandb_exp_name", {}),
    Flag("--wandb-save-dir", "wandb_save_dir", {}),
    Flag("--peak-tflops", "peak_tflops", {"type": float, "help": "per-device peak for MFU"}),
    Flag("--no-progress-bar", "progress_bar", {"action": "store_false"}),
]
