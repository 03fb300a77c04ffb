"""One place that brings Megatron-Core's model-parallel state up and down."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
from typing import Iterator

import torch

from megatron_osprey.parallel import cpu_compat
from megatron_osprey.parallel.config import ParallelConfig


def _parallel_state_property(getter: str) -> property:
    """A read-only property returning megatron.core.parallel_state.<getter>()."""

    def read(self) -> int:
        # Imported on use: megatron.core is heavy, and a config or --help needs none of it.
        from megatron.core import parallel_state as mpu

        return getattr(mpu, getter)()

    return property(read, doc=f"megatron.core.parallel_state.{getter}()")


@dataclasses.dataclass
class ParallelState:
    """What `initialize_parallel` set up: ranks, device and the process groups."""

    config: ParallelConfig
    rank: int
    world_size: int
    device: torch.device
    owns_process_group: bool
    compat: cpu_compat.CompatHandle | None = dataclasses.field(repr=False)

    # This rank's place in the layout, read from Megatron-Core's parallel_state (the one owner).
    tp_rank = _parallel_state_property("get_tensor_model_parallel_rank")
    pp_rank = _parallel_state_property("get_pipeline_model_parallel_rank")
    dp_rank = _parallel_state_property("get_data_parallel_rank")
    dp_size = _parallel_state_property("get_data_parallel_world_size")

    def process_groups(self):
        """Megatron-Core's ProcessGroupCollection for the current layout."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        return ProcessGroupCollection.use_mpu_process_groups()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def choose_cuda_device(local_rank: int, visible: int, cuda_visible_devices: str | None) -> int:
    """The CUDA device index of the task with LOCAL_RANK `local_rank` that sees `visible` GPUs.

    A launcher that shows every task all of a node's GPUs (torchrun, srun without GPU binding) wants
    LOCAL_RANK; one that binds one GPU per task (--gpus-per-task=1, a CUDA_VISIBLE_DEVICES per task)
    leaves each task a single device 0, whatever its LOCAL_RANK.
    """
    if visible > local_rank:
        return local_rank
    if visible == 1:
        return 0
    shown = "unset" if cuda_visible_devices is None else cuda_visible_devices
    raise ValueError(
        f"LOCAL_RANK {local_rank} has no GPU of its own: this task sees {visible} GPUs "
        f"(CUDA_VISIBLE_DEVICES={shown}); start one task per GPU with all of the node's GPUs visible to each, "
        f"or bind exactly one GPU per task (--gpus-per-task=1)."
    )


def _init_process_group(config: ParallelConfig) -> bool:
    """Start torch.distributed from torchrun's environment, or as a single local rank."""
    if torch.distributed.is_initialized():
        return False
    backend = config.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = datetime.timedelta(minutes=config.distributed_timeout_minutes)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if torch.cuda.is_available():
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            visible = torch.cuda.device_count()
            torch.cuda.set_device(choose_cuda_device(local_rank, visible, os.environ.get("CUDA_VISIBLE_DEVICES")))
        torch.distributed.init_process_group(backend=backend, timeout=timeout)
    else:
        # A single process (tests, the demo, tools): a loopback rendezvous of one rank.
        torch.distributed.init_process_group(
            backend=backend,
            init_method=f"tcp://127.0.0.1:{_free_port()}",
            rank=0,
            world_size=1,
            timeout=timeout,
        )
    return True


def initialize_parallel(config: ParallelConfig) -> ParallelState:
    """Initialize torch.distributed (if needed), Megatron-Core's groups and the RNG tracker."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    compat = cpu_compat.activate()
    owns = _init_process_group(config)
    world_size = torch.distributed.get_world_size()
    try:
        config.validate(world_size)
    except ValueError:
        if owns:
            torch.distributed.destroy_process_group()
        cpu_compat.deactivate(compat)
        raise
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        pipeline_model_parallel_size=config.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
        context_parallel_size=config.context_parallel_size,
        expert_model_parallel_size=config.expert_model_parallel_size,
        expert_tensor_parallel_size=config.expert_tensor_parallel_size,
        distributed_timeout_minutes=int(max(1, config.distributed_timeout_minutes)),
    )
    tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return ParallelState(
        config=config,
        rank=torch.distributed.get_rank(),
        world_size=world_size,
        device=device,
        owns_process_group=owns,
        compat=compat,
    )


def destroy_parallel(state: ParallelState) -> None:
    """Tear down what `initialize_parallel` set up, in reverse order."""
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    if state.owns_process_group and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    cpu_compat.deactivate(state.compat)


@contextlib.contextmanager
def process_group(config: ParallelConfig | None = None) -> Iterator[None]:
    """torch.distributed's default group held across several parallel_context()s: one rendezvous per job. Under srun
    a second init at the same MASTER_PORT can meet the first store's stale keys before rank 0 has torn it down."""
    owns = _init_process_group(config or ParallelConfig())
    try:
        yield
    finally:
        if owns and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@contextlib.contextmanager
def loading_window(config: ParallelConfig) -> Iterator[None]:
    """Ranks load at their own pace inside; on leaving, they wait for each other under --loading-timeout-minutes.

    The wait is a barrier on a gloo group of its own, created on entry while the ranks are still in step (a group
    made after the load would meet the slow rank under the default timeout), so the process group's timeout
    (--distributed-timeout-minutes) stays the training collectives'.
    """
    with waiting_window(config.loading_timeout_minutes):
        yield


@contextlib.contextmanager
def waiting_window(minutes: float) -> Iterator[None]:
    """Ranks work at their own pace inside (uneven work: loading, rollouts of uneven lengths); on leaving they wait
    for each other up to `minutes`, on a gloo group made on entry while they are still in step."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        yield
        return
    group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(minutes=minutes))
    try:
        yield
        torch.distributed.barrier(group=group)
    finally:
        torch.distributed.destroy_process_group(group)


@contextlib.contextmanager
def parallel_context(config: ParallelConfig | None = None) -> Iterator[ParallelState]:
    """`with parallel_context(cfg) as ps:` initializes, yields the state, and always tears down."""
    state = initialize_parallel(config or ParallelConfig())
    try:
        yield state
    finally:
        destroy_parallel(state)
