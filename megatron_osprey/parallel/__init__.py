"""Process groups for Megatron-Core, and its CPU (gloo) compatibility layer."""

from megatron_osprey.parallel.state import (
    ParallelConfig,
    ParallelState,
    destroy_parallel,
    initialize_parallel,
    parallel_context,
)

__all__ = [
    "ParallelConfig",
    "ParallelState",
    "destroy_parallel",
    "initialize_parallel",
    "parallel_context",
]
