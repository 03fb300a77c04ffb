"""Which GPU a task takes: LOCAL_RANK where the task sees the node's GPUs, device 0 where it sees one, else refused.

CUDA is mocked: torch.cuda's device queries and torch.distributed's start are replaced, so the real
`_init_process_group` runs its device choice without a GPU or a rendezvous.
"""

from __future__ import annotations

import pytest
import torch

from megatron_osprey.parallel import ParallelConfig
from megatron_osprey.parallel import state as parallel_state


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA machine whose visible GPU count the test sets; records set_device and init_process_group."""
    calls = {"set_device": [], "init": []}
    visible = {"count": 1}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible["count"])
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls["set_device"].append(index))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kw: calls["init"].append(kw))

    def launch(local_rank: int, gpus: int, cuda_visible_devices: str | None = None):
        visible["count"] = gpus
        monkeypatch.setenv("RANK", str(local_rank))
        monkeypatch.setenv("WORLD_SIZE", "8")
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        if cuda_visible_devices is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cuda_visible_devices)
        return parallel_state._init_process_group(ParallelConfig())

    return launch, calls


@pytest.mark.parametrize("local_rank", [0, 3, 7])
def test_all_gpus_visible_takes_local_rank(fake_cuda, local_rank):
    launch, calls = fake_cuda
    assert launch(local_rank, gpus=8) is True
    assert calls["set_device"] == [local_rank]
    assert calls["init"][0]["backend"] == "nccl"


@pytest.mark.parametrize("local_rank", [0, 5])
def test_one_gpu_per_task_takes_device_zero(fake_cuda, local_rank):
    launch, calls = fake_cuda
    launch(local_rank, gpus=1, cuda_visible_devices=str(local_rank))
    assert calls["set_device"] == [0]
    assert len(calls["init"]) == 1


def test_too_few_visible_gpus_is_refused_before_the_rendezvous(fake_cuda):
    launch, calls = fake_cuda
    with pytest.raises(ValueError) as err:
        launch(3, gpus=2, cuda_visible_devices="4,5")
    assert "LOCAL_RANK 3 has no GPU of its own: this task sees 2 GPUs (CUDA_VISIBLE_DEVICES=4,5)" in str(err.value)
    assert calls == {"set_device": [], "init": []}


def test_choice_table():
    assert parallel_state.choose_cuda_device(2, 4, None) == 2
    assert parallel_state.choose_cuda_device(6, 1, "6") == 0
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=unset"):
        parallel_state.choose_cuda_device(4, 4, None)
