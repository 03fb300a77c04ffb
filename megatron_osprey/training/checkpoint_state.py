"""The pieces of a training checkpoint besides the optimizer and scheduler: the parallel layout it was saved in,
every RNG stream (one ShardedObject per rank) and the model chunks' sharded keys."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.utils import unwrap_model

CHECKPOINT_FORMAT_VERSION = 1


def parallel_layout() -> dict[str, int]:
    """This run's TP/PP/DP sizes; RNG states only make sense reloaded into the same layout."""
    from megatron.core import parallel_state as mpu

    return {
        "tensor_model_parallel_size": mpu.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": mpu.get_pipeline_model_parallel_world_size(),
        "data_parallel_size": mpu.get_data_parallel_world_size(),
    }


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch (and CUDA) generators and Megatron's RNG-tracker streams, as plain data and tensors
    (what a weights-only load decodes: NumPy's key array travels as a tensor, not a pickled ndarray)."""
    import random

    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "random": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached_gaussian),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of capture_rng_state."""
    import random

    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["random"])
    name, keys, *rest = state["numpy"]
    # A tensor since capture_rng_state saves one; an ndarray in checkpoints saved before.
    keys = keys.numpy().astype(np.uint32) if isinstance(keys, torch.Tensor) else keys
    np.random.set_state((name, keys, *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def rng_sharded_object(data: Any):
    """One RNG state per (PP, TP, DP) rank: a ShardedObject that no other rank replicates."""
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    layout = parallel_layout()
    shape = (layout["pipeline_model_parallel_size"], layout["tensor_model_parallel_size"], layout["data_parallel_size"])
    offset = (
        mpu.get_pipeline_model_parallel_rank(),
        mpu.get_tensor_model_parallel_rank(),
        mpu.get_data_parallel_rank(),
    )
    return ShardedObject("rng_state", data, shape, offset, replica_id=0)


def model_sharded_state_dict(model_chunks: list, metadata: dict) -> dict:
    # The bare GPTModel's keys, as Stage 1 writes them: wrappers (DDP, Float16Module) are run-time only.
    if len(model_chunks) == 1:
        return {"model": unwrap_model(model_chunks[0]).sharded_state_dict(metadata=metadata)}
    return {f"model{i}": unwrap_model(c).sharded_state_dict(metadata=metadata) for i, c in enumerate(model_chunks)}


def load_model_state(model_chunks: list, loaded: dict) -> None:
    """Inverse of model_sharded_state_dict: the loaded keys into the bare model chunks."""
    if len(model_chunks) == 1:
        unwrap_model(model_chunks[0]).load_state_dict(loaded["model"])
    else:
        for i, chunk in enumerate(model_chunks):
            unwrap_model(chunk).load_state_dict(loaded[f"model{i}"])
