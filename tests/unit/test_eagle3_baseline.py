"""The EAGLE-3 baseline is EAGLE-3: TTT 5 in the matched recipes, a Llama-style midlayer without q/k norm
whatever the target, a stock-loadable one-layer export, and the paper's fused 2-layer variant."""

import json

import pytest
import torch

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.models.drafter.model import DrafterArch, build_drafter_model, eagle3_body
from megatron_osprey.models.drafter.reference import ReferenceDrafter
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.recipes import RECIPES, get_recipe
from megatron_osprey.stages.distill import DistillConfig
from megatron_osprey.stages.distill import config_from_args as distill_config_and_invocation
from megatron_osprey.testing.tiny_models import llama_config, qwen3_config
from megatron_osprey.training.distillation import drafter_arch


def stage_config(name: str, stage: str):
    """A registered recipe's config for one stage (its paths unset)."""
    return getattr(get_recipe(name), stage)


def distill_config_from_args(argv):
    return distill_config_and_invocation(argv)[0]


def test_matched_recipes_train_both_arms_with_ttt_5():
    osprey = stage_config("qwen3_8b_osprey_distill_2gpu_h100_bf16", "distill")
    eagle3 = stage_config("qwen3_8b_eagle3_distill_2gpu_h100_bf16", "distill")
    assert osprey.ttt.ttt_steps == eagle3.ttt.ttt_steps == 5
    assert stage_config("qwen3_8b_eagle3_ttt7_distill_2gpu_h100_bf16", "distill").ttt.ttt_steps == 7  # only when named
    two = stage_config("qwen3_8b_eagle3_2layer_distill_2gpu_h100_bf16", "distill")
    assert (two.drafter.eagle3_num_layers, two.drafter.eagle3_extra_layers, two.ttt.ttt_steps) == (2, "fused", 5)
    assert DistillConfig().ttt.ttt_steps == 5


def test_registry_eagle3_recipes_use_ttt_5():
    eagle3 = [name for name in RECIPES if "eagle3" in name and "ttt7" not in name]
    assert len(eagle3) > 10
    for name in eagle3:
        assert RECIPES[name]().distill.ttt.ttt_steps == 5, name


def test_eagle3_num_layers_2_is_the_fused_variant_and_plain_must_be_named():
    cfg = distill_config_from_args(["--baseline", "eagle3", "--eagle3-num-layers", "2"])
    assert cfg.drafter.eagle3_extra_layers == "fused"
    cfg = distill_config_from_args(
        ["--baseline", "eagle3", "--eagle3-num-layers", "2", "--eagle3-extra-layers", "plain"]
    )
    assert cfg.drafter.eagle3_extra_layers == "plain"


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_target")
    qwen3_config(layers=8, tie=False).save_pretrained(directory)
    return directory


def baseline_arch(target_dir, layers=1, extra="fused") -> DrafterArch:
    cfg = DistillConfig()
    cfg.target.path = str(target_dir)
    cfg.drafter.baseline = "eagle3"
    cfg.drafter.eagle3_num_layers = layers
    cfg.drafter.eagle3_extra_layers = extra
    cfg.drafter.draft_vocab_size = 100
    return drafter_arch(cfg, ModelArch.from_hf_config(target_dir))


def test_baseline_layer_has_no_qk_norm_on_a_qwen3_target(qwen3_target):
    target = ModelArch.from_hf_config(qwen3_target)
    assert target.qk_layernorm  # the target has them; the EAGLE-3 layer must not
    arch = baseline_arch(qwen3_target)
    body = arch.body
    assert (body.family, body.qk_layernorm, body.qkv_bias) == ("llama", False, False)
    assert (
        body.hidden_size,
        body.num_attention_heads,
        body.num_query_groups,
        body.head_dim,
        body.ffn_hidden_size,
        body.rope_theta,
    ) == (
        target.hidden_size,
        target.num_attention_heads,
        target.num_query_groups,
        target.head_dim,
        target.ffn_hidden_size,
        target.rope_theta,
    )
    assert DrafterArch.from_dict(arch.to_dict()) == arch  # the saved run config rebuilds the same layer
    with parallel_context(ParallelConfig()):
        model = build_drafter_model(arch, ParallelConfig())
    names = [name for name, _ in model.named_parameters()]
    assert not [name for name in names if "q_layernorm" in name or "k_layernorm" in name]
    assert not arch.reference_config().qk_layernorm


def test_moe_target_gets_a_dense_llama_layer():
    from megatron_osprey.testing.tiny_models import qwen3_moe_config

    target = ModelArch.from_hf_config(qwen3_moe_config().to_dict() | {"mlp_intermediate_size": 80})
    body = eagle3_body(target, 1)
    assert (body.is_dense, body.ffn_hidden_size, body.qk_layernorm) == (True, 80, False)
    with pytest.raises(ValueError, match="mlp_intermediate_size"):
        eagle3_body(ModelArch.from_hf_config(qwen3_moe_config()), 1)


def _random_reference(arch: DrafterArch, seed: int = 0) -> ReferenceDrafter:
    torch.manual_seed(seed)
    drafter = ReferenceDrafter(arch.reference_config())
    with torch.no_grad():
        for param in drafter.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return drafter


@pytest.mark.parametrize("extra", ["fused", "plain"])
def test_two_layer_baseline_megatron_equals_reference(qwen3_target, extra):
    from megatron_osprey.models.drafter.convert import load_reference_state

    arch = baseline_arch(qwen3_target, layers=2, extra=extra)
    reference = _random_reference(arch)
    kinds = [layer.kind for layer in reference.layers]
    assert kinds == (["eagle3", "eagle3"] if extra == "fused" else ["eagle3", "plain"])
    ids = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    aux = torch.randn(2, 12, 3 * arch.target_hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference.ttt_forward(ids, aux, 3)
    with parallel_context(ParallelConfig()):
        model = build_drafter_model(arch, ParallelConfig()).eval()
        fused = [hasattr(layer.self_attention, "hidden_norm") for layer in model.decoder.layers]
        assert fused == [True, extra == "fused"]
        load_reference_state(model, reference.state_dict(), 0, 1)
        with torch.no_grad():
            got, _ = model.ttt_forward(ids, aux, 3)
    for k in range(3):
        torch.testing.assert_close(got[k][..., : arch.draft_vocab_size], expected[k], atol=2e-5, rtol=0)
    if extra == "fused":  # the second layer reads the embedding too: changing it changes the output
        with torch.no_grad():
            reference.layers[1].input_layernorm.weight.mul_(3.0)
            assert not torch.allclose(reference.ttt_forward(ids, aux, 1)[0], expected[0])


def test_one_layer_baseline_exports_to_stock_sglang_and_speculators(qwen3_target, tmp_path):
    from megatron_osprey.export.formats import export_drafter, read_export
    from tests.sglang_stock import stock_load

    arch = baseline_arch(qwen3_target, layers=1)
    drafter = _random_reference(arch)
    export_drafter(drafter, "sglang", tmp_path / "sg")
    config = json.loads((tmp_path / "sg" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    result = stock_load(tmp_path / "sg")
    assert result.skipped == [] and result.missing == []  # stock SGLang loads every tensor into every parameter
    assert "model.layers.0.hidden_norm.weight" in result.loaded  # midlayer.* is 0.5.23's legacy name of layers.0
    with torch.no_grad():
        ids = torch.randint(0, arch.vocab_size, (1, 7))
        aux = torch.randn(1, 7, 3 * arch.target_hidden_size)
        torch.testing.assert_close(
            read_export(tmp_path / "sg")(ids, aux_hidden=aux)[0], drafter(ids, aux_hidden=aux)[0], atol=0, rtol=0
        )


def test_one_layer_llama_target_baseline_exports_to_speculators(tmp_path):
    from megatron_osprey.export.formats import export_drafter, read_export

    llama_config(layers=8).save_pretrained(tmp_path / "target")
    arch = baseline_arch(tmp_path / "target", layers=1)
    drafter = _random_reference(arch)
    export_drafter(drafter, "speculators", tmp_path / "spec")
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["architectures"] == ["Eagle3Speculator"]
    back = read_export(tmp_path / "spec")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in drafter.state_dict().items())
