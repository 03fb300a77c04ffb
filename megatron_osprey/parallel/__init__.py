"""Process groups for Megatron-Core, and its CPU (gloo) compatibility layer.

`ParallelConfig` (the layout) is torch-free; the process-group names load torch when first used, so that
recipes and `osprey plan` import this package on a machine without torch.
"""

from megatron_osprey.parallel.config import ParallelConfig

_STATE_NAMES = (
    "ParallelState", "destroy_parallel", "initialize_parallel", "loading_window", "parallel_context", "process_group",
    "waiting_window",
)  # fmt: skip

__all__ = ["ParallelConfig", *_STATE_NAMES]


def __getattr__(name: str):
    if name in _STATE_NAMES:
        from megatron_osprey.parallel import state

        return getattr(state, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
