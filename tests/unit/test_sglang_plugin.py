"""The real SGLang plugin module, imported against a CPU stand-in of the sglang==0.5.23 modules it uses
(tests/sglang_standin): an exported checkpoint loads through its load_weights with every weight name
matched both ways, its forward gives the Megatron drafter's logits, and stock SGLang (mocked) either
refuses an export or loads every weight of it."""

import dataclasses
import importlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.export.formats import export_drafter
from megatron_osprey.export.sglang_plugin.weight_names import PLUGIN_ARCHITECTURES
from megatron_osprey.models.drafter.convert import load_reference_state
from megatron_osprey.models.drafter.model import DrafterArch, build_drafter_model, eagle3_body
from megatron_osprey.models.drafter.reference import ReferenceDrafter
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.testing.tiny_models import qwen3_config
from tests.plugin_state import fused_state
from tests.sglang_stock import stock_load

STANDIN = Path(__file__).resolve().parents[1] / "sglang_standin"
PLUGIN = "megatron_osprey.export.sglang_plugin.eagle3_models"
VOCAB, DRAFT_VOCAB, TARGET_HIDDEN = 300, 200, 48


def _ours(name: str) -> bool:
    return name == "sglang" or name.startswith("sglang.") or name == PLUGIN


@pytest.fixture
def plugin(monkeypatch):
    """The plugin module imported with the stand-in on sys.path; both are removed afterwards."""
    monkeypatch.syspath_prepend(str(STANDIN))
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if _ours(name)}
    try:
        yield importlib.import_module(PLUGIN)
    finally:
        for name in [n for n in sys.modules if _ours(n)]:
            del sys.modules[name]
        sys.modules.update(saved)


def _llama_body(layers: int) -> ModelArch:
    return ModelArch.from_hf_config(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": VOCAB,
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5,
        }
    )


def _arch(case: str) -> DrafterArch:
    if case.endswith("+norms"):  # both drift options: fc_norm and norm_output in the export
        return dataclasses.replace(_arch(case[: -len("+norms")]), hidden_post_norm=True, aux_hidden_norm=True)
    common = dict(
        target_hidden_size=TARGET_HIDDEN, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=(1, 2, 3)
    )
    if case == "osprey-qwen3":
        return DrafterArch(body=ModelArch.from_hf_config(qwen3_config(layers=2)), variant="osprey", **common)
    if case == "osprey-llama":
        return DrafterArch(body=_llama_body(2), variant="osprey", **common)
    target = ModelArch.from_hf_config(qwen3_config(layers=8))  # EAGLE-3: Llama layers even for Qwen3
    extra = case.rsplit("-", 1)[1]
    return DrafterArch(
        body=eagle3_body(target, 2),
        variant="eagle3",
        eagle3_extra_layers=extra,
        **(common | {"target_hidden_size": target.hidden_size}),
    )


def _exported(case: str, directory: Path) -> tuple[DrafterArch, ReferenceDrafter]:
    arch = _arch(case)
    torch.manual_seed(0)
    reference = ReferenceDrafter(arch.reference_config())
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.1 * torch.randn_like(param))  # W_new, norms and all: every weight matters
    reference.set_draft_vocab(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:DRAFT_VOCAB])
    export_drafter(reference.eval(), "sglang", directory)
    return arch, reference


def _plugin_model(plugin, directory: Path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(directory))  # what SGLang hands the model class
    classes = {cls.__name__: cls for cls in plugin.EntryClass}
    return classes[config.architectures[0]](config)


CASES = [
    "osprey-qwen3",
    "osprey-llama",
    "eagle3-2-fused",
    "eagle3-2-plain",
    "osprey-llama+norms",
    "eagle3-2-fused+norms",
]


@pytest.mark.parametrize("case", CASES)
def test_plugin_loads_every_weight_and_gives_the_megatron_logits(plugin, case, tmp_path):
    arch, reference = _exported(case, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"][0] in PLUGIN_ARCHITECTURES  # stock SGLang does not know the name
    model = _plugin_model(plugin, tmp_path).eval()
    tensors = load_file(str(tmp_path / "model.safetensors"))
    model.load_weights(iter(tensors.items()))

    # Every checkpoint tensor lands in a parameter, every parameter is loaded, with the right values.
    params = dict(model.named_parameters())
    expected = fused_state(tensors)
    assert set(params) == set(expected)
    for name, param in params.items():
        assert torch.equal(param.detach(), expected[name]), name
    assert torch.equal(model.get_hot_token_id(), torch.nonzero(reference.t2d).flatten())

    ids = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(2))
    aux = torch.randn(9, 3 * arch.target_hidden_size, generator=torch.Generator().manual_seed(3))
    batch = SimpleNamespace(spec_info=SimpleNamespace(hidden_states=aux))
    with torch.no_grad():
        out = model(ids, torch.arange(9), batch)
        with parallel_context(ParallelConfig()):
            megatron = build_drafter_model(arch, ParallelConfig()).eval()
            load_reference_state(megatron, reference.state_dict(), 0, 1)
            megatron_logits, megatron_hidden = megatron(ids[None], aux_hidden=aux[None])
    torch.testing.assert_close(out.next_token_logits, megatron_logits[0, :, :DRAFT_VOCAB], atol=2e-5, rtol=0)
    # The hidden the next draft step reads back as g: pre-norm, or final-normed under --hidden-post-norm.
    if arch.hidden_post_norm:
        assert config["norm_output"] is True and config["fc_norm"] is True
        with torch.no_grad():
            megatron_hidden = megatron.final_layernorm(megatron_hidden)
    torch.testing.assert_close(out.hidden_states[0], megatron_hidden[:, 0], atol=2e-5, rtol=0)


def test_plugin_registers_only_its_own_names_and_refuses_what_it_cannot_serve(plugin, tmp_path):
    assert [cls.__name__ for cls in plugin.EntryClass] == list(PLUGIN_ARCHITECTURES)
    _exported("eagle3-2-plain", tmp_path / "plain")
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    from transformers import AutoConfig

    as_qwen3 = AutoConfig.for_model("qwen3", **{k: v for k, v in config.items() if k not in ("model_type",)})
    with pytest.raises(ValueError, match="plain layers"):
        plugin.OspreyQwen3ForCausalLMEagle3(as_qwen3)
    unsaid = AutoConfig.for_model(
        "llama", **{k: v for k, v in config.items() if k not in ("model_type", "eagle3_extra_layers")}
    )
    with pytest.raises(ValueError, match="eagle3_extra_layers"):
        plugin.OspreyLlamaForCausalLMEagle3(unsaid)
    model = _plugin_model(plugin, tmp_path / "plain")
    tensors = load_file(str(tmp_path / "plain" / "model.safetensors"))
    tensors.pop("layers.1.mlp.down_proj.weight")
    with pytest.raises(RuntimeError, match="down_proj"):
        model.load_weights(iter(tensors.items()))


@pytest.mark.parametrize("case", CASES)
def test_stock_sglang_refuses_every_export_that_needs_the_plugin(case, tmp_path):
    _exported(case, tmp_path)
    with pytest.raises(ValueError, match="not supported"):
        stock_load(tmp_path)
