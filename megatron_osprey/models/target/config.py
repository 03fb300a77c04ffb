"""The frozen target: where it is and, inside a distillation job, how it is split (torch-free)."""

from __future__ import annotations

import dataclasses

from megatron_osprey.config.flags import Flag
from megatron_osprey.parallel.config import ParallelConfig

# How evaluation and Draft-OPD rollouts run the target: the HF model (whole on each rank, its KV cache) or the
# Megatron-Core one (sharded over the job's tensor- and expert-parallel groups, exact recompute).
TARGET_BACKENDS = ("hf", "megatron")


@dataclasses.dataclass
class TargetConfig:
    """A HF model directory (config.json, tokenizer, weights) and its online layout."""

    path: str | None = None
    # The online target shares the job's model-parallel groups: its TP must be the drafter's, and
    # it is not pipelined. EP applies to MoE targets only (the drafter is dense). None: the job's.
    tensor_model_parallel_size: int | None = None
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int | None = None
    expert_tensor_parallel_size: int | None = None

    def fold_into(self, parallel: ParallelConfig) -> None:
        """Fold the --target-* parallel sizes into the job's layout, refusing what one job cannot run."""
        if self.tensor_model_parallel_size not in (None, parallel.tensor_model_parallel_size):
            raise ValueError(
                f"--target-tensor-model-parallel-size {self.tensor_model_parallel_size} differs from "
                f"--tensor-model-parallel-size {parallel.tensor_model_parallel_size}: the online target and the "
                f"drafter share one tensor-parallel group; set both to the same size (or train --mode offline)."
            )
        if self.pipeline_model_parallel_size != 1:
            raise ValueError(
                "--target-pipeline-model-parallel-size must be 1 for online distillation; extract hidden states "
                "with pipeline parallelism (the extract stage) and train --mode offline."
            )
        if self.expert_model_parallel_size is not None:
            parallel.expert_model_parallel_size = self.expert_model_parallel_size
        if self.expert_tensor_parallel_size is not None:
            parallel.expert_tensor_parallel_size = self.expert_tensor_parallel_size


TARGET_FLAGS = [
    Flag("--target", "path", {"help": "the target's HF directory (config, tokenizer, weights)"}),
]
TARGET_LAYOUT_FLAGS = [
    Flag("--target-tensor-model-parallel-size", "tensor_model_parallel_size", {"type": int}),
    Flag("--target-pipeline-model-parallel-size", "pipeline_model_parallel_size", {"type": int}),
    Flag("--target-expert-model-parallel-size", "expert_model_parallel_size", {"type": int}),
    Flag("--target-expert-tensor-parallel-size", "expert_tensor_parallel_size", {"type": int}),
]
