"""The CPU compatibility layer: on only without CUDA, canary-pinned, numerically inert."""

import torch

from megatron_osprey.parallel import ParallelConfig, cpu_compat, parallel_context


def test_canary_call_sites_still_match_the_installed_megatron():
    from megatron.core import package_info

    assert cpu_compat.check_megatron_version() == package_info.__version__
    cpu_compat.check_call_sites()  # raises if an upgrade moved a patched call site


def test_the_supported_range_is_pyprojects_and_holds_both_tested_ends():
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    (declared,) = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "megatron-core"]
    assert str(declared.specifier) == ",".join(sorted(cpu_compat.SUPPORTED_MEGATRON_CORE))
    # The lock's release and the newest lock's, a source build's local label, and the ends just outside.
    assert cpu_compat.supported("0.16.1") and cpu_compat.supported("0.19.2") and cpu_compat.supported("0.19.2+abc")
    for outside in ("0.16.0", "0.15.3", "0.20.0", "0.20.0rc0"):
        assert not cpu_compat.supported(outside), outside


def test_a_release_outside_the_range_is_refused_in_one_line(monkeypatch):
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", "0.20.1")
    try:
        cpu_compat.check_megatron_version()
    except RuntimeError as error:
        message = str(error)
    else:
        raise AssertionError("0.20.1 was accepted")
    assert "\n" not in message and "megatron-core>=0.16.1,<0.20 but 0.20.1 is installed" in message


def test_canary_fails_loudly_when_a_call_site_moves(monkeypatch):
    monkeypatch.setitem(cpu_compat.TORCH_CUDA_CALL_SITES, "megatron.core.utils", "no_such_snippet(")
    try:
        cpu_compat.check_call_sites()
    except RuntimeError as error:
        assert "megatron.core.utils" in str(error)
    else:
        raise AssertionError("canary did not fire")


def test_inactive_when_cuda_is_present(monkeypatch):
    original = torch.cuda.current_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.activate() is None
    assert torch.cuda.current_device is original
    assert not cpu_compat.is_active()


def test_activates_without_cuda_and_restores_everything():
    from megatron.core.tensor_parallel import random as mcore_random

    before = (torch.cuda.current_device, torch.Tensor.cuda, torch.Tensor.type, mcore_random._set_cuda_rng_state)
    with parallel_context(ParallelConfig()):
        assert cpu_compat.is_active()
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.zeros(2).type() == "torch.cuda.FloatTensor"  # what Megatron's optimizer checks
    assert not cpu_compat.is_active()
    after = (torch.cuda.current_device, torch.Tensor.cuda, torch.Tensor.type, mcore_random._set_cuda_rng_state)
    assert before == after
    assert torch.zeros(2).type() == "torch.FloatTensor"


def test_rng_tracker_streams_are_distinct_and_restore_the_default_stream():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    with parallel_context(ParallelConfig(seed=7)):
        tracker = get_cuda_rng_tracker()
        torch.manual_seed(0)
        state = torch.get_rng_state()
        with tracker.fork():  # the tensor-model-parallel stream
            in_tp_stream = torch.rand(4)
        after_fork = torch.rand(4)
        torch.set_rng_state(state)
        plain = torch.rand(4)
        # The fork drew from its own stream and left the default stream untouched.
        assert torch.equal(after_fork, plain)
        assert not torch.equal(in_tp_stream, plain)
        # The tracker stream is the seeded one: seed + 2718 + tp_rank.
        expected = torch.Generator().manual_seed(7 + 2718)
        assert torch.equal(in_tp_stream, torch.rand(4, generator=expected))


def test_hardcoded_cuda_factories_land_on_cpu():
    from megatron.core.transformer.utils import get_default_causal_mask

    with parallel_context(ParallelConfig()):
        mask = get_default_causal_mask(4)
        assert mask.device.type == "cpu"
        assert mask.tolist()[0] == [False, True, True, True]


def test_grad_buffer_streams_are_cpu_no_ops():
    # megatron-core 0.17+ has the grad buffers wait on the current CUDA stream before each reduction.
    from megatron.core.distributed import param_and_grad_buffer as buffers

    with parallel_context(ParallelConfig()):
        stream = buffers.torch.cuda.current_stream()
        stream.wait_event(buffers.torch.cuda.Event())
        assert buffers.torch.cuda.current_stream() is stream
        assert buffers.torch.zeros(2, device="cuda").device.type == "cpu"
