"""Stage 2: pretrain the pruned backbone on web text (next-token loss), with Megatron-LM's flags.

    torchrun --nproc_per_node=N -m megatron_osprey pretrain --backbone PRUNED_DIR --data-path PREFIX \\
        [--recipe NAME [--run-dir DIR]] [Megatron-LM flags ...] [--set section.key=value ...]

The training itself is training/pretraining.py on the shared assembly of training/.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_osprey.config.flags import under, without
from megatron_osprey.data.config import INDEXED_DATA_FLAGS, IndexedDataConfig
from megatron_osprey.models.backbone.config import BACKBONE_FLAGS, BackboneConfig
from megatron_osprey.parallel.config import PARALLEL_FLAGS, ParallelConfig
from megatron_osprey.stages.cli import (
    Invocation,
    parse_config,
    train_main,
    train_on_every_rank,
)
from megatron_osprey.training.config import (
    CHECKPOINT_FLAGS,
    LOGGING_FLAGS,
    OPTIMIZER_FLAGS,
    TRAINING_FLAGS,
    CheckpointConfig,
    LoggingConfig,
    OptimizerConfig,
    TrainingConfig,
    validate_optimizer,
    validate_training,
)


@dataclasses.dataclass
class PretrainConfig:
    """Everything Stage 2 runs from: the backbone, the indexed text and the shared training sections."""

    model: BackboneConfig = dataclasses.field(default_factory=BackboneConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: IndexedDataConfig = dataclasses.field(default_factory=IndexedDataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)

    def validate(self, world_size: int) -> None:
        """Checks that need no model: flags that contradict each other or cannot run here."""
        self.model.validate()
        validate_training(self.training, self.parallel, world_size)
        validate_optimizer(self.optimizer, self.training)
        if not self.data.data_path:
            raise ValueError("--data-path is required: one PREFIX or `WEIGHT PREFIX` pairs.")
        if self.training.exit_signal_handler and not self.checkpoint.save:
            raise ValueError("--exit-signal-handler needs --save: a signal saves a checkpoint, then exits.")


FLAGS = {
    "model": under("model", BACKBONE_FLAGS),
    "distributed": under("parallel", PARALLEL_FLAGS),
    "training": under("training", TRAINING_FLAGS),
    "learning rate": under("optimizer", OPTIMIZER_FLAGS),
    "data": under("data", INDEXED_DATA_FLAGS),
    "checkpointing": under("checkpoint", CHECKPOINT_FLAGS),
    "logging": under("logging", LOGGING_FLAGS),
}
# Flags of the shared training sections that Stage 4 also takes (it runs no validation split).
SHARED_TRAINING_FLAGS = {
    "distributed": FLAGS["distributed"],
    "training": FLAGS["training"],
    "learning rate": FLAGS["learning rate"],
    "checkpointing": FLAGS["checkpointing"],
    "logging": without(FLAGS["logging"], ("--eval-interval", "--eval-iters")),
}


def _inputs(config: PretrainConfig) -> dict:
    """What pretraining reads: the backbone (the prune stage's output) and the indexed text files."""
    inputs = {}
    if config.model.backbone:
        backbone = Path(config.model.backbone)
        inputs |= {"backbone": backbone / "megatron", "backbone_config": backbone / "run_config.yaml"}
    prefixes = [p for p in config.data.data_path if not _is_weight(p)]
    for i, prefix in enumerate(prefixes):
        inputs |= {f"data{i}.bin": f"{prefix}.bin", f"data{i}.idx": f"{prefix}.idx"}
    return inputs


def _is_weight(word: str) -> bool:
    try:
        float(word)
        return True
    except ValueError:
        return False


def run(config: PretrainConfig, invocation: Invocation = Invocation("pretrain")):
    """Pretrain; every rank of the job calls it. Returns the PretrainResult (train state, loss history).

    With --save, SAVE/provenance.json records the backbone Stage 3 reads (SAVE/hf, SAVE/run_config.yaml)."""
    from megatron_osprey.training.pretraining import run_pretrain

    return train_on_every_rank(config, invocation, _inputs(config), run_pretrain, _outputs)


def _outputs(save: Path) -> dict | None:
    return {"hf": save / "hf", "run_config": save / "run_config.yaml"} if (save / "hf").is_dir() else None


def config_from_args(argv: list[str] | None = None, recipes=None):
    """(The resolved config, its Invocation); `--help` lists the flags; `recipes` resolves --recipe."""
    return parse_config(argv, "pretrain", PretrainConfig, FLAGS, __doc__, recipes)


def main(argv: list[str] | None = None, recipes=None) -> int:
    """Parse the flags, pretrain; returns the exit code: 2 bad input (one line), 1 a non-finite loss."""
    return train_main(*config_from_args(argv, recipes), run)


if __name__ == "__main__":
    # Deprecated for one release: hands over to the job door (`python -m megatron_osprey pretrain`) by exec,
    # so the job never imports this file twice; the recipe registry above the stages is the door's to import.
    from megatron_osprey.stages.cli import deprecated_module_door

    deprecated_module_door("pretrain")
