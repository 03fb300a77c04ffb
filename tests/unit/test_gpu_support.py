"""What the local spec cannot run on CUDA is refused naming Transformer Engine; fusions need a C compiler.
CUDA is mocked as present where the decision depends on it (the machine running the tests has none)."""

import logging

import pytest
import torch

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.models.backbone import gpu_support
from megatron_osprey.models.backbone.gpu_support import fusions_usable, refuse_without_transformer_engine
from megatron_osprey.parallel import ParallelConfig


@pytest.mark.parametrize(
    "is_moe,sequence_parallel,phrase",
    [(True, False, "mixture-of-experts"), (False, True, "--sequence-parallel")],
)
def test_local_spec_on_cuda_refuses_moe_and_sequence_parallel_naming_te(is_moe, sequence_parallel, phrase):
    with pytest.raises(ValueError, match="Transformer Engine") as error:
        refuse_without_transformer_engine(
            is_moe=is_moe, sequence_parallel=sequence_parallel, transformer_impl="local", cuda_available=True
        )
    assert phrase in str(error.value)
    for impl, cuda in (("transformer_engine", True), ("local", False)):  # TE present, or the CPU compat layer
        refuse_without_transformer_engine(
            is_moe=is_moe, sequence_parallel=sequence_parallel, transformer_impl=impl, cuda_available=cuda
        )


def test_build_gpt_model_refuses_before_building_when_cuda_is_present_without_te(monkeypatch):
    from megatron_osprey.models.backbone import gpt

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpt, "transformer_engine_usable", lambda: False)  # auto -> local
    arch = ModelArch.from_hf_config(
        {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}
    )  # fmt: skip
    with pytest.raises(ValueError, match="--sequence-parallel on CUDA needs Transformer Engine"):
        gpt.build_gpt_model(arch, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True))


def test_fusions_are_off_without_a_c_compiler_with_one_logged_sentence(monkeypatch, caplog):
    monkeypatch.setattr(gpu_support.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING):
        assert fusions_usable(on_gpu=True) is False
    assert len(caplog.records) == 1 and "no C compiler" in caplog.records[0].message
    monkeypatch.setattr(gpu_support.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(gpu_support, "python_header", lambda: "/usr/include/python3.12/Python.h")
    assert fusions_usable(on_gpu=True) is True
    assert fusions_usable(on_gpu=False) is False


def test_fusions_are_off_without_python_h_naming_the_include_directory(monkeypatch, caplog, tmp_path):
    """A slim image with gcc and no python3-dev: Triton's launcher build would fail at step 1."""
    monkeypatch.setattr(gpu_support.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(gpu_support.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    with caplog.at_level(logging.WARNING):
        assert fusions_usable(on_gpu=True) is False
    assert len(caplog.records) == 1
    assert "no Python.h" in caplog.records[0].message and str(tmp_path) in caplog.records[0].message
    (tmp_path / "Python.h").write_text("")
    assert fusions_usable(on_gpu=True) is True


def test_transformer_engine_counts_only_when_its_pytorch_extension_imports(monkeypatch):
    """TE 2.x's top-level import succeeds even when transformer_engine.pytorch fails (its __init__ swallows it)."""
    import sys
    import types

    from megatron_osprey.base.hardware import have_transformer_engine

    package = types.ModuleType("transformer_engine")
    package.__path__ = []  # a package without its pytorch submodule: that import fails
    monkeypatch.setitem(sys.modules, "transformer_engine", package)
    monkeypatch.delitem(sys.modules, "transformer_engine.pytorch", raising=False)
    assert have_transformer_engine() is False
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", types.ModuleType("transformer_engine.pytorch"))
    assert have_transformer_engine() is True
