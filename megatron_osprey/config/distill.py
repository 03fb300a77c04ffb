"""Stage 4 (distillation) configuration: the Stage 2 sections plus the drafter, the target and the data."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_osprey.config.pretrain import (
    CheckpointSection,
    LoggingSection,
    OptimizerSection,
    TrainingSection,
    validate_optimizer,
    validate_training,
)
from megatron_osprey.losses.ttt import TTTLossConfig
from megatron_osprey.parallel import ParallelConfig

MODES = ("online", "offline")
BASELINES = ("eagle3",)


@dataclasses.dataclass
class DrafterSection:
    """Which drafter trains: Osprey from Stage 3's output, or the EAGLE-3 baseline from scratch."""

    drafter_init: str | None = None  # Stage 3 --output (megatron/ + run_config.yaml)
    baseline: str | None = None  # "eagle3": from scratch, the target's frozen embedding
    eagle3_num_layers: int = 1  # 1 as published; 2 for the parameter-matched variant
    # Layers after the first: "fused" reads the target features again (the paper's 2-layer
    # baseline, SpecForge's layer stack); "plain" is SGLang's stock multi-layer draft.
    eagle3_extra_layers: str = "fused"
    draft_vocab_size: int = 32000  # EAGLE-3's reduced draft vocabulary
    aux_layer_ids: list[int] | None = None  # baseline only; Osprey's come from Stage 3
    transformer_impl: str = "auto"
    bf16: bool = False


@dataclasses.dataclass
class TargetSection:
    """The frozen target: a HF directory (config, tokenizer, weights) and, online, its layout."""

    target: str | None = None
    mode: str = "online"
    hidden_states: str | None = None  # offline: the store written by tools/extract_hidden_states.py
    # The online target shares the job's model-parallel groups: its TP must be the drafter's, and
    # it is not pipelined. EP applies to MoE targets only (the drafter is dense).
    tensor_model_parallel_size: int | None = None
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int | None = None
    expert_tensor_parallel_size: int | None = None
    # An FP8 forward of the frozen target (hybrid/tensorwise on H100, e4m3/mxfp8 on B200), as the *_fp8 and
    # *_mxfp8 recipes ask. It reaches the job so that the job can refuse it: the target is built in BF16.
    fp8_format: str | None = None
    fp8_recipe: str | None = None


@dataclasses.dataclass
class DistillDataSection:
    """Conversations JSONL (target-regenerated), tokenized through the target's chat template."""

    data_path: list[str] = dataclasses.field(default_factory=list)
    domain: str | None = None  # the training domain's name, recorded for the train x eval matrix
    enable_thinking: bool | None = None
    shuffle: bool = True


@dataclasses.dataclass
class DistillConfig:
    """Everything `python -m megatron_osprey.distill` runs from; defaults are the paper's."""

    drafter: DrafterSection = dataclasses.field(default_factory=DrafterSection)
    target: TargetSection = dataclasses.field(default_factory=TargetSection)
    data: DistillDataSection = dataclasses.field(default_factory=DistillDataSection)
    ttt: TTTLossConfig = dataclasses.field(default_factory=TTTLossConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    training: TrainingSection = dataclasses.field(
        default_factory=lambda: TrainingSection(micro_batch_size=1, global_batch_size=2, seq_length=4096)
    )  # the paper's: one sequence per GPU, 2 GPUs
    optimizer: OptimizerSection = dataclasses.field(
        default_factory=lambda: OptimizerSection(
            lr=1e-4, min_lr=0.0, lr_decay_style="cosine", weight_decay=0.0, clip_grad=1.0
        )
    )
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    logging: LoggingSection = dataclasses.field(default_factory=LoggingSection)
    lr_warmup_fraction: float | None = 0.04  # the paper's 4%; --lr-warmup-iters wins when given
    recipe: str | None = None

    def validate(self, world_size: int) -> None:
        """Checks that need no model or data."""
        drafter, target = self.drafter, self.target
        if bool(drafter.drafter_init) == bool(drafter.baseline):
            raise ValueError("pass exactly one of --drafter-init STAGE3_OUTPUT (Osprey) or --baseline eagle3.")
        if drafter.baseline and drafter.baseline not in BASELINES:
            raise ValueError(f"--baseline must be one of {BASELINES}, got {drafter.baseline!r}.")
        if drafter.eagle3_extra_layers not in ("fused", "plain"):
            raise ValueError(f"--eagle3-extra-layers must be fused or plain, got {drafter.eagle3_extra_layers!r}.")
        if drafter.drafter_init and not (Path(drafter.drafter_init) / "megatron").is_dir():
            raise FileNotFoundError(
                f"--drafter-init {drafter.drafter_init}: no megatron/ there (expected the --output of "
                f"tools/adapt_drafter.py)."
            )
        if not target.target or not (Path(target.target) / "config.json").is_file():
            raise FileNotFoundError(f"--target {target.target}: no config.json there (a HF model directory).")
        if target.mode not in MODES:
            raise ValueError(f"--mode must be one of {MODES}, got {target.mode!r}.")
        if target.mode == "offline" and not target.hidden_states:
            raise ValueError("--mode offline needs --hidden-states STORE (from tools/extract_hidden_states.py).")
        if target.mode == "online" and not self.data.data_path:
            raise ValueError("--mode online needs --data-path CONVERSATIONS.jsonl.")
        for path in self.data.data_path:
            if not Path(path).is_file():
                raise FileNotFoundError(f"--data-path {path} does not exist.")
        if self.parallel.pipeline_model_parallel_size != 1:
            raise ValueError(
                "distillation runs the drafter and the online target without pipeline parallelism: use "
                "--pipeline-model-parallel-size 1 (extract hidden states with PP and train --mode offline "
                "for targets that need it)."
            )
        self.resolve_target_layout()
        if target.fp8_format or target.fp8_recipe:
            raise ValueError(
                f"--target-fp8-format {target.fp8_format} / --target-fp8-recipe {target.fp8_recipe}: an FP8 forward "
                f"of the frozen target is not implemented (it is built in BF16); drop both flags, or use the "
                f"recipe's _bf16 variant."
            )
        if self.ttt.ttt_steps < 1:
            raise ValueError(f"--ttt-steps must be >= 1, got {self.ttt.ttt_steps}.")
        validate_training(self.training, self.parallel, world_size)
        validate_optimizer(self.optimizer, self.training)

    def resolve_target_layout(self) -> None:
        """Fold the --target-* parallel sizes into the job's layout, refusing what one job cannot run."""
        target, parallel = self.target, self.parallel
        if target.tensor_model_parallel_size not in (None, parallel.tensor_model_parallel_size):
            raise ValueError(
                f"--target-tensor-model-parallel-size {target.tensor_model_parallel_size} differs from "
                f"--tensor-model-parallel-size {parallel.tensor_model_parallel_size}: the online target and the "
                f"drafter share one tensor-parallel group; set both to the same size (or train --mode offline)."
            )
        if target.pipeline_model_parallel_size != 1:
            raise ValueError(
                "--target-pipeline-model-parallel-size must be 1 for online distillation; extract hidden states "
                "with pipeline parallelism (tools/extract_hidden_states.py) and train --mode offline."
            )
        if target.expert_model_parallel_size is not None:
            parallel.expert_model_parallel_size = target.expert_model_parallel_size
        if target.expert_tensor_parallel_size is not None:
            parallel.expert_tensor_parallel_size = target.expert_tensor_parallel_size

    def warmup_iters(self) -> int:
        """--lr-warmup-iters, else the warmup fraction of the run (4% in the paper)."""
        if self.optimizer.lr_warmup_iters or self.lr_warmup_fraction is None:
            return self.optimizer.lr_warmup_iters
        return int(round(self.lr_warmup_fraction * self.training.num_train_iters()))
