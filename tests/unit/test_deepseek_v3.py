"""DeepSeek-V3 and Kimi-K2 as targets: their published config.json read completely (every field implemented or
refused by name), the shape and the parameter count, `osprey plan` on them, and the Megatron model against
transformers' DeepseekV3ForCausalLM at TP 1 (q_lora_rank null, FP8 block-scaled weights, multi-token-prediction
weights skipped). TP 2 and EP 2 are tests/distributed/test_targets_deepseek.py.

DEEPSEEK_V3 is deepseek-ai/DeepSeek-V3's config.json as published on the Hugging Face Hub. KIMI_K2_INSTRUCT is
moonshotai/Kimi-K2-Instruct's (model_type kimi_k2, architectures DeepseekV3ForCausalLM), written from the
published values.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_osprey.base.arch import ModelArch, load_target_config
from megatron_osprey.base.config_fields import FIELDS

REPO = Path(__file__).resolve().parents[2]

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.46.3",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

KIMI_K2_INSTRUCT = {
    **DEEPSEEK_V3,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 131072,
    "model_type": "kimi_k2",
    "n_group": 1,
    "n_routed_experts": 384,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "pretraining_tp": 1,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "seq_aux": True,
    "topk_group": 1,
    "transformers_version": "4.48.3",
    "vocab_size": 163840,
}
KIMI_K2_INSTRUCT.pop("ep_size")

# Fields of these configs the forward never reads: remote-code pointers, deployment and training-loss settings.
INERT = {
    "architectures", "model_type", "transformers_version", "bos_token_id", "eos_token_id", "initializer_range",
    "use_cache", "attention_dropout", "auto_map", "ep_size", "aux_loss_alpha", "seq_aux",
}  # fmt: skip


def _moe(experts, layers, groups, group_topk, scaling):
    return {
        "num_experts": experts,
        "router_topk": 8,
        "expert_ffn_hidden_size": 2048,
        "score_function": "sigmoid",
        "norm_topk_prob": True,
        "expert_bias": True,
        "moe_layers": layers,
        "shared_expert_ffn_hidden_size": 2048,
        "router_groups": groups,
        "router_group_topk": group_topk,
        "topk_scaling_factor": scaling,
    }


def _mla(factor, beta_fast, beta_slow):
    return {
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rope_interleave": True,
        "rope_type": "yarn",
        "yarn": {
            "factor": factor,
            "original_max_position_embeddings": 4096,
            "beta_fast": beta_fast,
            "beta_slow": beta_slow,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    }


def _shape(heads, vocab, theta, max_positions, moe, mla):
    return {
        "family": "deepseek_v3",
        "num_layers": 61,
        "hidden_size": 7168,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": 192,
        "ffn_hidden_size": 18432,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "rope_theta": theta,
        "rope_scaling": None,
        "rotary_dim": 64,
        "max_position_embeddings": max_positions,
        "qk_norm": None,
        "moe": moe,
        "mla": mla,
    }


# (published config, its shape, its parameters without the MTP module in billions, default aux layers)
CASES = {
    "DeepSeek-V3": (
        DEEPSEEK_V3,
        _shape(128, 129280, 10000.0, 163840, _moe(256, list(range(3, 61)), 8, 4, 2.5), _mla(40.0, 32.0, 1.0)),
        671.03,  # the release's "671B main model weights"
        [1, 29, 57],
    ),
    "Kimi-K2-Instruct": (
        KIMI_K2_INSTRUCT,
        _shape(64, 163840, 50000.0, 131072, _moe(384, list(range(1, 61)), 0, 0, 2.827), _mla(32.0, 1.0, 1.0)),
        1026.41,  # "1T total parameters" in the model card
        [1, 29, 57],
    ),
}


def _write(tmp_path: Path, config: dict, name: str = "target") -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("name", list(CASES))
def test_published_config_gives_the_shape_the_parameters_and_the_default_taps(tmp_path, name):
    config, shape, billions, aux = CASES[name]
    arch = load_target_config(_write(tmp_path, config))
    assert arch.shape() == shape
    assert round(arch.num_parameters() / 1e9, 2) == billions
    assert arch.default_aux_layer_ids == aux
    assert arch.hf_config["model_type"] == config["model_type"] and arch.hf_architecture == "DeepseekV3ForCausalLM"


def test_every_field_of_the_published_configs_is_a_row_or_known_to_be_inert():
    rows = {field.name for field in FIELDS}
    published = {key for config, *_ in CASES.values() for key in config}
    assert published - rows - INERT == set()
    assert rows & INERT == set()


BAD = [
    ({"scoring_func": "softmax"}, r'scoring_func "softmax" is not supported: the router is built with sigmoid'),
    ({"topk_method": "greedy"}, r'topk_method "greedy" is not supported: the router is built as noaux_tc'),
    ({"quantization_config": {"quant_method": "awq"}}, r"quantization_config .* only block-scaled e4m3 FP8"),
    ({"qk_rope_head_dim": 63}, r"qk_rope_head_dim 63 is not supported: RoPE rotates channel pairs"),
    ({"kv_lora_rank": None}, r"kv_lora_rank is missing; a deepseek_v3 config\.json needs it"),
    ({"topk_group": 3}, r"n_group 8 with topk_group 3 and num_experts_per_tok 8 is not supported"),
    ({"norm_topk_prob": False}, r"norm_topk_prob false is not supported: Megatron-Core's sigmoid router"),
    ({"rms_norm_eps": 1e-05}, r"rms_norm_eps 1e-05 is not supported for DeepSeek-V3: the latent q/kv norms"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"rope_scaling type 'dynamic' is not supported"),
    ({"n_group": 7}, r"n_group 7 does not divide n_routed_experts 256"),
]


@pytest.mark.parametrize("edits, message", BAD, ids=[next(iter(b[0])) + str(i) for i, b in enumerate(BAD)])
def test_a_deepseek_field_that_changes_the_computation_is_refused_by_name(tmp_path, edits, message):
    config = {k: v for k, v in {**DEEPSEEK_V3, **edits}.items() if v is not None}
    target = _write(tmp_path, config)
    with pytest.raises(ValueError, match=rf"^{target / 'config.json'}: {message}"):
        load_target_config(target)


def _plan(recipe: str, target: Path, *overrides: str):
    from launcher.plan import make_plan
    from megatron_osprey.recipes import resolve_recipe

    return make_plan(resolve_recipe(recipe, [f"paths.target={target}", *overrides]), "distill")


def test_osprey_plan_json_of_the_published_deepseek_v3_config(tmp_path):
    """8 x B200 holds DeepSeek-V3 in BF16 (dequantized from its FP8 checkpoint at load): the CLI's plan."""
    deepseek = _write(tmp_path, DEEPSEEK_V3, "deepseek")
    command = [sys.executable, "-m", "launcher.cli", "plan", "deepseek_v3_osprey_distill_8gpu_b200_bf16"]
    command += ["--stage", "distill", "--json", "--set", f"paths.target={deepseek}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["target"] == {
        "model_type": "deepseek_v3",
        "source": f"{deepseek}/config.json",
        "num_layers": 61,
        "hidden_size": 7168,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "vocab_size": 129280,
        "num_experts": 256,
        "aux_layer_ids": [1, 29, 57],  # the default rule [1, L//2 - 1, L - 4]
    }
    # Measured: target weights 156.41 GiB per GPU at TP 8 / EP 8, 165.07 GiB in all, of 179.
    assert plan["fits"] and plan["needs"] is None
    assert round(plan["memory_breakdown_gib"]["target weights"], 2) == 156.41


@pytest.mark.parametrize(
    "name, recipe, one_node, needs, fitted",
    [
        # DeepSeek-V3 on H100: 8 GPUs are refused with the 4 nodes (EP 32) the recipe asks for, 50.88 GiB per GPU.
        ("deepseek", "deepseek_v3_osprey_distill_32gpu_h100_bf16", "expert_model_parallel_size=8", "671B-parameter "
         "target fits 4 nodes of 8 x H100 at expert parallel size 32", 50.88),
        # Kimi-K2's 1T parameters on B200 need 2 nodes (EP 16), 130.5 GiB per GPU.
        ("kimi", "deepseek_v3_osprey_distill_8gpu_b200_bf16", "expert_model_parallel_size=8", "1026B-parameter "
         "target fits 2 nodes of 8 x B200 at expert parallel size 16", 130.51),
    ],
)  # fmt: skip
def test_a_target_too_large_for_one_node_is_refused_naming_the_nodes_it_needs(
    tmp_path, name, recipe, one_node, needs, fitted
):
    from launcher.plan import LayoutError, check_plan

    target = _write(tmp_path, {"deepseek": DEEPSEEK_V3, "kimi": KIMI_K2_INSTRUCT}[name], name)
    small = _plan(recipe, target, "resources.distill.nodes=1", f"distill.parallel.{one_node}")
    assert small.to_json()["target"]["model_type"] == {"deepseek": "deepseek_v3", "kimi": "kimi_k2"}[name]
    assert not small.fits and small.to_json()["needs"].startswith(f"its {needs}")
    with pytest.raises(LayoutError, match=rf"more than the .* GiB of a .*; its {needs} \(about {fitted:.1f} GiB"):
        check_plan(small)
    nodes, ep = (4, 32) if "h100" in recipe else (2, 16)
    wide = _plan(
        recipe, target, f"resources.distill.nodes={nodes}", f"distill.parallel.expert_model_parallel_size={ep}"
    )
    check_plan(wide)
    # The refusal's estimate moves only the target's weights; the plan at that size agrees (measured 50.88 / 130.53).
    assert wide.world_size == nodes * 8 and abs(wide.memory_bytes / 2**30 - fitted) < 0.05


# ----- the Megatron model against transformers' DeepseekV3ForCausalLM at TP 1 ------------------------------------


def _megatron_logits(directory, ids) -> torch.Tensor:
    from megatron_osprey.convert.hf_to_megatron import load_hf_weights
    from megatron_osprey.models.backbone.gpt import build_gpt_model
    from megatron_osprey.parallel import ParallelConfig, parallel_context
    from megatron_osprey.testing.tiny_models import causal_logits

    arch = ModelArch.from_hf_config(directory)
    cfg = ParallelConfig()
    with parallel_context(cfg):
        model = build_gpt_model(arch, cfg, perform_initialization=False).eval()
        load_hf_weights(model, directory, arch, 0, 1)
        with torch.no_grad():
            return causal_logits(model, ids)[..., : arch.vocab_size]


def test_without_a_query_latent_and_with_rope_halves_the_logits_equal_hf(tmp_path):
    """q_lora_rank null (one q_proj) and rope_interleave false (rope rows stored as halves)."""
    from megatron_osprey.models.backbone.mla import builds_mla_without_query_latent
    from megatron_osprey.testing.tiny_models import VOCAB, deepseek_v3_config, make_moe_hf_model

    config = deepseek_v3_config(layers=2, q_lora_rank=None)
    config.rope_interleave = False
    hf = make_moe_hf_model(config, tmp_path)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    if not builds_mla_without_query_latent():  # megatron-core 0.19: refused in one line, not built wrong
        with pytest.raises(ValueError, match="without a query latent .q_lora_rank null. needs megatron-core 0.18"):
            _megatron_logits(tmp_path, ids)
        return
    with torch.no_grad():
        expected = hf(ids).logits
    error = (_megatron_logits(tmp_path, ids) - expected).abs().max().item()
    print(f"deepseek_v3 q_lora_rank null, rope halves, TP 1: logits {error:.2e} (max {expected.abs().max():.2f})")
    assert error < 2e-6  # measured 1.5e-7 (logits of max 0.64)


def test_fp8_weights_are_dequantized_and_mtp_weights_are_skipped(tmp_path):
    """The tiny model's attention, dense and shared-expert projections as 16x16-block FP8, plus a
    multi-token-prediction module stored as the release stores it (model.layers.{L}.*, with shapes that would fail
    to load): the logits equal HF's on the dequantized values, and the MTP tensors are named as skipped."""
    from safetensors.torch import load_file, save_file

    from megatron_osprey.convert.deepseek_v3 import mtp_weight_names
    from megatron_osprey.convert.safetensors_io import dequantize_fp8_blocks
    from megatron_osprey.testing.tiny_models import VOCAB, deepseek_v3_config, make_moe_hf_model
    from tests.unit.test_moe_conversion import quantize_fp8_blocks

    hf = make_moe_hf_model(deepseek_v3_config(layers=2), tmp_path / "bf16")
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    stored, values = {}, {}
    for name, tensor in tensors.items():
        # Routed experts stay as they are: transformers holds them fused, so the reference could not take them.
        if tensor.dim() == 2 and "proj" in name and ".experts." not in name:
            q, scale = quantize_fp8_blocks(tensor.float(), 16)
            stored[name], stored[name + "_scale_inv"] = q, scale
            values[name] = dequantize_fp8_blocks(q, scale, (16, 16))
        else:
            stored[name] = tensor
    mtp = {"model.layers.2.eh_proj.weight": torch.zeros(64, 128), "model.layers.2.enorm.weight": torch.zeros(3)}
    mtp["model.layers.2.self_attn.q_a_proj.weight"] = torch.zeros(5, 5)
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    save_file({**stored, **mtp}, str(fp8 / "model.safetensors"))
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}
    config["num_nextn_predict_layers"] = 1
    (fp8 / "config.json").write_text(json.dumps(config))
    hf.load_state_dict(values, strict=False)  # the reference holds the dequantized values
    assert all(torch.equal(hf.get_parameter(name), value) for name, value in values.items())
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(ids).logits
    got = _megatron_logits(fp8, ids)
    error, rounding = (got - expected).abs().max().item(), (_megatron_logits(tmp_path / "bf16", ids) - got).abs().max()
    print(f"deepseek_v3 FP8 at TP 1: logits {error:.2e}; the FP8 rounding itself moves them by {rounding:.2e}")
    assert error < 2e-6  # measured 1.8e-7
    assert rounding > 1e-4
    assert mtp_weight_names(ModelArch.from_hf_config(fp8), [*stored, *mtp]) == sorted(mtp)
