"""The CUDA-only paths, checked on the CPU where a CPU can reach them (the rest: benchmarks/gpu_check.py)."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest
import torch

from megatron_osprey.models.backbone import gpt
from megatron_osprey.parallel import ParallelConfig, parallel_context
from tests.ttt_fixtures import make_drafter

ROOT = Path(__file__).resolve().parents[2]


def test_fused_softmax_needs_apex_kernels_not_just_cuda(monkeypatch):
    # With CUDA but without apex's scaled_masked_softmax_cuda the fusion must stay off (it would
    # raise ModuleNotFoundError at the first step).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not gpt.have_fused_softmax()
    arch = make_drafter()[0].body
    assert gpt.transformer_config(arch, ParallelConfig()).masked_softmax_fusion is False

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if "softmax_cuda" in name else real(name, *a)
    )
    assert gpt.have_fused_softmax()


def test_every_parameter_buffer_and_rotary_table_moves_to_the_training_device():
    from megatron_osprey.models.drafter.model import build_drafter_model
    from megatron_osprey.training import setup

    arch, _ = make_drafter()
    with parallel_context(ParallelConfig()) as state:
        model = build_drafter_model(arch, state.config)
        # Built on the CPU (as fusion_fc, the torch norms and d2t/t2d are even on a GPU machine);
        # "meta" stands in for the GPU: a plain Module.to would leave the rotary table behind.
        assert setup.training_device() == torch.device("cpu")
        setup.place_on_device([model], torch.device("meta"))
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert {"fusion_fc.weight", "d2t", "t2d"} <= set(tensors)
    assert any("q_layernorm" in name for name in tensors)
    assert {name for name, t in tensors.items() if t.device.type != "meta"} == set()
    assert model.rotary_pos_emb.inv_freq.device.type == "meta"


def test_build_model_chunks_places_chunks_before_wrapping(monkeypatch):
    from megatron_osprey.models.drafter.model import build_drafter_model
    from megatron_osprey.training import setup

    arch, _ = make_drafter()
    placed = []
    real = setup.place_on_device

    def spy(chunks, device):
        placed.append((tuple(type(c).__name__ for c in chunks), device))
        return real(chunks, device)

    monkeypatch.setattr(setup, "place_on_device", spy)
    with parallel_context(ParallelConfig()) as state:
        provider = lambda **_: build_drafter_model(arch, state.config)  # noqa: E731
        setup.build_model_chunks(provider, state.config, bf16=False, use_distributed_optimizer=False)
    # The bare model (not yet DDP / Float16Module), to the training device.
    assert placed == [(("OspreyDrafterModel",), torch.device("cpu"))]


def test_drafter_norms_are_valid_under_sequence_parallel_without_the_cpu_compat_layer():
    from types import SimpleNamespace

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_osprey.models.drafter.model import SequenceParallelRMSNorm, drafter_layer_specs
    from megatron_osprey.parallel import cpu_compat

    config = SimpleNamespace(
        sequence_parallel=True,
        layernorm_zero_centered_gamma=False,
        persist_layer_norm=False,
        memory_efficient_layer_norm=False,
        normalization="RMSNorm",
    )
    norm = SequenceParallelRMSNorm(config, hidden_size=8, eps=1e-6)
    assert getattr(norm.weight, "sequence_parallel", False)  # finalize_model_grads all-reduces it over TP
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), torch.nn.RMSNorm(8, eps=1e-6)(x))
    # Megatron-Core's own torch norm asserts sequence parallel off once the CPU patch is not there (CUDA).
    assert not cpu_compat.is_active()  # outside parallel_context: Megatron-Core as on a GPU
    with pytest.raises(AssertionError, match="sequence parallel not supported"):
        WrappedTorchNorm(config, hidden_size=8)
    arch, _ = make_drafter()
    for spec in drafter_layer_specs(arch, "local"):
        sub = spec.submodules
        attention = sub.self_attention.submodules
        for module in (sub.input_layernorm, sub.pre_mlp_layernorm, attention.q_layernorm, attention.k_layernorm):
            assert module is SequenceParallelRMSNorm


def test_context_parallel_is_refused_with_the_flag_named():
    from megatron_osprey.models.drafter.model import build_drafter_model
    from megatron_osprey.training.config import TrainingConfig, validate_training

    training = TrainingConfig(train_iters=10, micro_batch_size=1, global_batch_size=2, seq_length=64)
    with pytest.raises(ValueError, match="--context-parallel-size 2 is not supported: batches are not split"):
        validate_training(training, ParallelConfig(context_parallel_size=2), world_size=2)
    arch, _ = make_drafter()
    with pytest.raises(ValueError, match="--context-parallel-size 2: the drafter's TTT attention"):
        build_drafter_model(arch, ParallelConfig(context_parallel_size=2))


class _LinearWithExtraState(torch.nn.Linear):
    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features, bias=False)
        torch.nn.init.zeros_(self.weight)

    def get_extra_state(self):
        return {"fp8_scale": 1.0}

    def set_extra_state(self, state):
        pass


def test_a_local_spec_checkpoint_loads_into_a_model_with_te_extra_state(tmp_path):
    # A TE model's state dict has `_extra_state` entries a local-spec (CPU) Stage 1/3 checkpoint lacks.
    from megatron_osprey.models.drafter.model import build_drafter_model
    from megatron_osprey.training.checkpointing import load_model_weights, save_checkpoint

    arch, _ = make_drafter()
    with parallel_context(ParallelConfig()) as state:
        source = build_drafter_model(arch, state.config)
        save_checkpoint(tmp_path, 0, source.sharded_state_dict(), {"note": "local spec"})
        target = build_drafter_model(arch, state.config)
        # What TE modules add: non-tensor state under `<module>._extra_state`.
        target.fusion_fc = _LinearWithExtraState(*reversed(source.fusion_fc.weight.shape))
        assert "fusion_fc._extra_state" in target.sharded_state_dict()
        load_model_weights(tmp_path, target)
    torch.testing.assert_close(target.fusion_fc.weight, source.fusion_fc.weight)


def test_packaging_allows_python_312_pins_te_and_leaves_a_containers_torch():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    spec = project["requires-python"]
    assert ">=3.11" in spec and "<3.13" in spec
    torch_req = next(d for d in project["dependencies"] if d.startswith("torch"))
    assert "==" not in torch_req  # an NGC container's own CUDA torch must satisfy it
    # megatron-core a range (its low end is the lock's, its high end cpu-newest.txt's): a cluster image keeps its own.
    assert "megatron-core>=0.16.1,<0.20" in project["dependencies"]
    assert project["optional-dependencies"]["gpu"] == ["transformer-engine[pytorch]>=2.9,<2.12"]
    # `make venv` still installs the exact CPU torch first.
    assert "pip install -q -c $(LOCK) torch==2.13.0" in (ROOT / "Makefile").read_text()
    assert sys.version_info[:2] >= (3, 11)


def test_distributed_timeout_is_a_flag_of_extraction_and_must_be_positive():
    from megatron_osprey.stages import extract
    from megatron_osprey.stages.cli import parse_config

    argv = ["--target", "t", "--data", "d", "--output", "o", "--distributed-timeout-minutes", "45"]
    config, _ = parse_config(argv, "extract", extract.ExtractConfig, extract.FLAGS, extract.__doc__)
    assert config.parallel.distributed_timeout_minutes == 45
    with pytest.raises(ValueError, match="--distributed-timeout-minutes must be > 0"):
        ParallelConfig(distributed_timeout_minutes=0).validate(1)
