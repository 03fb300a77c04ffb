"""The parallel layout, with Megatron-LM's argument names (torch-free: recipes and `osprey plan` read it)."""

from __future__ import annotations

import dataclasses

from megatron_osprey.config.flags import STORE_TRUE, Flag


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclasses.dataclass
class ParallelConfig:
    """Parallel layout, with Megatron-LM's argument names."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    sequence_parallel: bool = False
    distributed_backend: str | None = None  # None: nccl with CUDA, gloo without
    distributed_timeout_minutes: float = 10.0
    # Only the barrier after a target's load waits this long (parallel.state.loading_window); the training
    # collectives keep --distributed-timeout-minutes.
    loading_timeout_minutes: float = 60.0
    seed: int = 1234

    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the (dense) model."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    def dense_layout(self) -> ParallelConfig:
        """The layout a dense model (the drafter) is built with inside this job: expert parallel size 1.

        Megatron-Core carves the expert-parallel group out of the data-parallel ranks, so a dense model in a job
        laid out for a mixture-of-experts target keeps the job's TP/PP/CP and DP and is replicated over the EP
        ranks (its TransformerConfig refuses an expert-parallel size without experts).
        """
        return dataclasses.replace(self, expert_model_parallel_size=1, expert_tensor_parallel_size=None)

    def validate(self, world_size: int) -> None:
        """Raise one clear error when the layout does not fit `world_size` ranks."""
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}.")
        mp = self.model_parallel_size()
        if world_size % mp:
            raise ValueError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size "
                f"({self.tensor_model_parallel_size}) x --pipeline-model-parallel-size "
                f"({self.pipeline_model_parallel_size}) x --context-parallel-size "
                f"({self.context_parallel_size}) = {mp}."
            )
        etp = self.expert_tensor_parallel_size or self.tensor_model_parallel_size
        expert_mp = etp * self.expert_model_parallel_size * self.pipeline_model_parallel_size
        if world_size % expert_mp:
            raise ValueError(
                f"world size {world_size} is not divisible by --expert-model-parallel-size "
                f"({self.expert_model_parallel_size}) x --expert-tensor-parallel-size ({etp}) x "
                f"--pipeline-model-parallel-size ({self.pipeline_model_parallel_size})."
            )
        if not self.distributed_timeout_minutes > 0:
            raise ValueError(f"--distributed-timeout-minutes must be > 0, got {self.distributed_timeout_minutes}.")
        if not self.loading_timeout_minutes > 0:
            raise ValueError(f"--loading-timeout-minutes must be > 0, got {self.loading_timeout_minutes}.")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1.")
        if self.context_parallel_size > 1 and not _cuda_available():
            raise ValueError(
                "--context-parallel-size > 1 needs Transformer Engine attention on CUDA; it cannot run on the CPU."
            )


PARALLEL_FLAGS = [
    Flag("--tensor-model-parallel-size", "tensor_model_parallel_size", {"type": int}),
    Flag("--pipeline-model-parallel-size", "pipeline_model_parallel_size", {"type": int}),
    Flag("--num-virtual-stages-per-pipeline-rank", "virtual_pipeline_model_parallel_size", {"type": int}),
    Flag("--context-parallel-size", "context_parallel_size", {"type": int}),
    Flag("--sequence-parallel", "sequence_parallel", STORE_TRUE),
    Flag("--distributed-backend", "distributed_backend", {"choices": ["nccl", "gloo"]}),
    Flag("--distributed-timeout-minutes", "distributed_timeout_minutes", {"type": float}),
    Flag("--seed", "seed", {"type": int}),
]
# Where a stage runs a mixture-of-experts target on its own (extract, rollout): its experts' layout.
EXPERT_PARALLEL_FLAGS = [
    Flag("--expert-model-parallel-size", "expert_model_parallel_size", {"type": int}),
    Flag("--expert-tensor-parallel-size", "expert_tensor_parallel_size", {"type": int}),
]
# Where a stage loads a target (distill, extract): how long ranks wait for each other after the load.
LOADING_TIMEOUT_FLAG = Flag(
    "--loading-timeout-minutes",
    "loading_timeout_minutes",
    {"type": float, "help": "minutes ranks wait for the slowest one after loading the target"},
)
