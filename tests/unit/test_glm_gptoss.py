"""GLM-4.5 (glm4_moe) and gpt-oss (gpt_oss) as targets, without a model: their published config.json files read
into a shape and an `osprey plan`, every field implemented or refused by name, MXFP4 dequantization, YaRN, and
the weight rules. The Megatron-vs-HF forward is tests/distributed/test_targets_glm_gptoss.py."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from launcher.cli import main as osprey
from megatron_osprey.base.arch import load_target_config
from megatron_osprey.base.config_fields import FIELDS
from megatron_osprey.convert.mxfp4 import dequantize_mxfp4, quantize_mxfp4, read_expert
from megatron_osprey.convert.safetensors_io import SafetensorsCheckpoint

# zai-org/GLM-4.5 config.json as published.
GLM_4_5 = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 5120, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1536,
    "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "num_hidden_layers": 92, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0", "use_cache": True, "use_qk_norm": True, "vocab_size": 151552,
}  # fmt: skip

# openai/gpt-oss-120b config.json as published.
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "num_local_experts": 128, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}  # fmt: skip

# Published fields the forward never reads: ids, training-only knobs, and duplicates HF itself ignores
# (experts_per_token beside num_experts_per_tok; initial_context_length beside the YaRN original length).
INERT = {
    "architectures", "model_type", "transformers_version", "pad_token_id", "eos_token_id", "initializer_range",
    "use_cache", "attention_dropout", "output_router_logits", "router_aux_loss_coef", "experts_per_token",
    "initial_context_length",
}  # fmt: skip

SHAPES = {
    "glm4_moe": (GLM_4_5, {
        "family": "glm4_moe", "num_layers": 92, "hidden_size": 5120, "num_attention_heads": 96,
        "num_key_value_heads": 8, "head_dim": 128, "ffn_hidden_size": 12288, "vocab_size": 151552,
        "tie_word_embeddings": False, "rope_theta": 1000000.0, "rope_scaling": None, "rotary_dim": 64,
        "max_position_embeddings": 131072, "qk_norm": "head",
        "moe": {"num_experts": 160, "router_topk": 8, "expert_ffn_hidden_size": 1536, "score_function": "sigmoid",
                "norm_topk_prob": True, "expert_bias": True, "moe_layers": list(range(3, 92)),
                "shared_expert_ffn_hidden_size": 1536, "router_groups": 0, "router_group_topk": 0,
                "topk_scaling_factor": 2.5},
        "mtp_layers_skipped": 1,
    }, [1, 45, 88]),
    "gpt_oss": (GPT_OSS_120B, {
        "family": "gpt_oss", "num_layers": 36, "hidden_size": 2880, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "ffn_hidden_size": 2880, "vocab_size": 201088,
        "tie_word_embeddings": False, "rope_theta": 150000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": False},
        "rotary_dim": 64, "max_position_embeddings": 131072, "qk_norm": None,
        "moe": {"num_experts": 128, "router_topk": 4, "expert_ffn_hidden_size": 2880, "score_function": "softmax",
                "norm_topk_prob": True, "expert_bias": False, "moe_layers": "all"},
        "attention_sinks": True, "linear_bias": True,
        "sliding_window": {"window": 128, "sliding_layers": 18, "full_layers": 18, "local_rope_theta": 150000.0},
        "activation": {"kind": "clamped_swiglu", "limit": 7.0},
    }, [1, 17, 32]),
}  # fmt: skip


def _write(tmp_path, config: dict, name: str = "target"):
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_the_published_config_gives_its_shape_and_parameter_count(tmp_path, family):
    config, shape, _ = SHAPES[family]
    arch = load_target_config(_write(tmp_path, config))
    assert arch.shape() == shape
    # GLM-4.5: 355B with its MTP layer (which the target never runs); gpt-oss-120b: 116.8B (its model card).
    billions = arch.num_parameters() / 1e9
    assert (350 < billions < 355) if family == "glm4_moe" else (116.5 < billions < 117.2), billions


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_every_published_field_is_a_row_or_inert(family):
    rows = {field.name for field in FIELDS if not field.families or family in field.families}
    assert set(SHAPES[family][0]) - rows - INERT == set()


# GLM-4.5 in BF16 (352B without its MTP layer) at TP 8 / EP 8 needs ~93 GiB per GPU: refused on H100, naming it.
PLANS = [("glm4_moe", "minimax_m25_osprey_distill_8gpu_h100_bf16", False),
         ("gpt_oss", "gpt_oss_120b_osprey_distill_8gpu_b200_bf16", True)]  # fmt: skip


@pytest.mark.parametrize("family, recipe, fits", PLANS)
def test_osprey_plan_of_the_published_config_prints_its_shape(tmp_path, capsys, family, recipe, fits):
    config, _, aux = SHAPES[family]
    target = _write(tmp_path, config)
    code = osprey(["plan", recipe, "--stage", "distill", "--set", f"paths.target={target}", "--json"])
    printed = capsys.readouterr()
    plan = json.loads(printed.out)
    assert (code, plan["fits"]) == ((0, True) if fits else (2, False)), printed.err
    if not fits:
        assert "more than the 79.6 GiB of a H100" in printed.err and 85 < plan["memory_gib_per_gpu"] < 100
    expected = {
        "model_type": family, "num_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
        "num_attention_heads": config["num_attention_heads"], "num_key_value_heads": 8,
        "vocab_size": config["vocab_size"],
        "num_experts": config.get("n_routed_experts") or config.get("num_local_experts"),
        "aux_layer_ids": aux,
    }  # fmt: skip
    assert {k: plan["target"][k] for k in expected} == expected


def test_the_gpt_oss_120b_recipes_fit_one_node_of_h100_and_of_b200(capsys):
    for hardware, capacity in (("h100", 79.6), ("b200", 179)):
        assert osprey(["plan", f"gpt_oss_120b_osprey_distill_8gpu_{hardware}_bf16", "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        # ~117B parameters in BF16 over TP 8 / EP 8: 27.2 GiB of target weights per GPU; 36.2 GiB planned.
        assert plan["fits"] is True and 30 < plan["memory_gib_per_gpu"] < 40 < capacity, plan["memory_gib_per_gpu"]
        assert plan["target"]["aux_layer_ids"] == [1, 17, 32]  # the default rule on 36 layers


BAD = [
    ("gpt_oss", {"swiglu_alpha": 1.5}, r"swiglu_alpha 1.5 is not supported: the experts' sigmoid slope"),
    ("gpt_oss", {"quantization_config": {"quant_method": "fp8"}}, r"quantization_config .* is not supported"),
    ("gpt_oss", {"layer_types": ["chunked_attention"] * 36}, r"layer_types .* is not supported: each layer is"),
    ("gpt_oss", {"rope_scaling": {"rope_type": "yarn", "factor": 32.0}}, r"needs original_max_position_embeddings"),
    ("gpt_oss", {"rope_scaling": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                  "mscale": 1.0}}, r"YaRN rope mscale is not supported"),
    ("gpt_oss", {"num_local_experts": None}, r"num_local_experts is missing"),
    ("glm4_moe", {"norm_topk_prob": False}, r"norm_topk_prob false is not supported"),
    ("glm4_moe", {"n_group": 8, "topk_group": 2}, r"group-limited routing with num_experts_per_tok 8 and topk_group 2"),
    ("glm4_moe", {"first_k_dense_replace": -1}, r"first_k_dense_replace -1 must be at least 0"),
    ("glm4_moe", {"n_shared_experts": "1"}, r'n_shared_experts must be an integer, not "1"'),
    ("glm4_moe", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_type 'yarn' is not supported"),
]  # fmt: skip


@pytest.mark.parametrize("family, edits, message", BAD)
def test_a_value_that_is_not_implemented_is_refused_by_name(tmp_path, family, edits, message):
    config = {k: v for k, v in {**SHAPES[family][0], **edits}.items() if v is not None}
    target = _write(tmp_path, config)
    with pytest.raises(ValueError, match=rf"^{target / 'config.json'}: .*{message}"):
        load_target_config(target)


def test_a_published_value_that_the_other_families_refuse_is_read_here(tmp_path):
    # attention_bias true and sliding layer_types are refused for llama/qwen3 but implemented for these two.
    assert load_target_config(_write(tmp_path, GPT_OSS_120B, "oss")).qkv_bias is True
    assert load_target_config(_write(tmp_path, GLM_4_5, "glm")).qkv_bias is True


def test_mxfp4_dequantizes_a_hand_made_block():
    # One block of 32 values: codes 0..15 then 15..0, two per byte with the low nibble first; scale byte 128 = 2^1.
    codes = list(range(16)) + list(range(15, -1, -1))
    blocks = torch.tensor([codes[i] | (codes[i + 1] << 4) for i in range(0, 32, 2)], dtype=torch.uint8)
    fp4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    expected = torch.tensor([2.0 * fp4[c] for c in codes])
    got = dequantize_mxfp4(blocks[None], torch.tensor([128], dtype=torch.uint8))
    assert torch.equal(got, expected)
    assert blocks[1].item() == 0x32  # codes 2 (low) and 3 (high)
    # Scale 127 is 2^0, 120 is 2^-7.
    assert torch.equal(dequantize_mxfp4(blocks[None], torch.tensor([120], dtype=torch.uint8)), expected / 256)
    with pytest.raises(ValueError, match=r"MXFP4 blocks \(1, 8\) do not match scales"):
        dequantize_mxfp4(blocks[None, :8], torch.tensor([128], dtype=torch.uint8))


def test_read_expert_equals_transformers_own_mxfp4_conversion(tmp_path):
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    experts, out_dim, in_dim = 3, 6, 64
    blocks, scales = quantize_mxfp4(torch.randn(experts, out_dim, in_dim, generator=generator) * 3)
    bias = torch.randn(experts, out_dim, generator=generator)
    name = "model.layers.0.mlp.experts.down_proj"
    save_file(
        {f"{name}_blocks": blocks, f"{name}_scales": scales, f"{name}_bias": bias}, str(tmp_path / "m.safetensors")
    )
    reference = _convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [experts, in, out]
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        for expert in range(experts):
            assert torch.equal(read_expert(ckpt, name, expert), reference[expert])
            assert torch.equal(read_expert(ckpt, f"{name}_bias", expert), bias[expert])
        with pytest.raises(KeyError, match=r"neither model.layers.0.mlp.experts.gate_up_proj nor its MXFP4"):
            read_expert(ckpt, "model.layers.0.mlp.experts.gate_up_proj", 0)


def test_yarn_inverse_frequencies_and_scale_are_hf_own(tmp_path):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_osprey.models.backbone.glm_gptoss import family_config_kwargs, yarn_inv_freq

    arch = load_target_config(_write(tmp_path, GPT_OSS_120B))
    # A deep copy: transformers writes rope_theta into the rope dict it is given.
    hf = GptOssConfig(**copy.deepcopy({k: v for k, v in GPT_OSS_120B.items() if k != "quantization_config"}))
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    assert torch.allclose(yarn_inv_freq(arch), inv_freq, rtol=1e-6, atol=0)  # measured: equal to the last bit
    # The clamped-SwiGLU branch imports Megatron-Core (seconds); the distributed test runs it.
    arch = dataclasses.replace(arch, activation="swiglu")
    kwargs = family_config_kwargs(arch, expert_tensor_parallel_size=1)
    assert kwargs["softmax_scale"] == pytest.approx(attention_factor**2 / 64**0.5, rel=1e-12)
    # The window's fields are the sliding-window families' own (Mistral, Gemma 3, gpt-oss).
    from megatron_osprey.models.backbone.dense_variants import variant_config_kwargs

    window = variant_config_kwargs(arch)
    assert window["window_size"] == (127, 0) and window["window_attn_skip_freq"][:4] == [1, 0, 1, 0]
    with pytest.raises(ValueError, match=r"set --expert-tensor-parallel-size 1 \(got 2\)"):
        family_config_kwargs(arch, expert_tensor_parallel_size=2)


def test_the_sliding_window_mask_is_hf_own():
    from transformers.masking_utils import sliding_window_causal_mask_function

    from megatron_osprey.models.backbone.sliding_window import sliding_window_mask

    keep = sliding_window_causal_mask_function(4)
    zero = torch.tensor(0)
    expected = torch.tensor(
        [[not keep(zero, zero, torch.tensor(q), torch.tensor(k)) for k in range(10)] for q in range(10)]
    )
    assert torch.equal(sliding_window_mask(10, 10, (3, 0), "cpu"), expected)


def test_the_weight_rules_of_each_spec():
    from megatron_osprey.base.arch import ModelArch
    from megatron_osprey.convert.weight_map import rules_for

    layer = "decoder.layers.{layer}"
    glm, oss = ModelArch.from_hf_config(GLM_4_5), ModelArch.from_hf_config(GPT_OSS_120B)
    glm_te = {rule.megatron: rule.hf for rule in rules_for(glm, "transformer_engine")}
    # Dense layers fuse the pre-MLP norm into fc1 under TE; MoE layers keep it standalone: both read the same tensor.
    fused, standalone = f"{layer}.mlp.linear_fc1.layer_norm_weight", f"{layer}.pre_mlp_layernorm.weight"
    assert glm_te[fused] == glm_te[standalone] == ("model.layers.{layer}.post_attention_layernorm.weight",)
    assert glm_te[f"{layer}.mlp.router.expert_bias"] == ("model.layers.{layer}.mlp.gate.e_score_correction_bias",)
    assert f"{layer}.self_attention.linear_proj.bias" not in glm_te  # GLM-4.5's o_proj has no bias
    oss_local = {rule.megatron: rule for rule in rules_for(oss, "local")}
    assert oss_local[f"{layer}.self_attention.core_attention.softmax_offset"].hf == (
        "model.layers.{layer}.self_attn.sinks",
    )
    assert oss_local[f"{layer}.mlp.router.bias"].hf == ("model.layers.{layer}.mlp.router.bias",)
    expert = f"{layer}.mlp.experts.local_experts.{{expert}}"
    assert oss_local[f"{expert}.linear_fc1.bias"].hf == ("model.layers.{layer}.mlp.experts.gate_up_proj_bias",)
    oss_te = {rule.megatron for rule in rules_for(oss, "transformer_engine")}
    assert {
        f"{layer}.mlp.experts.linear_fc1.bias{{expert}}",
        f"{layer}.mlp.experts.linear_fc2.bias{{expert}}",
    } <= oss_te


def test_an_interleaved_expert_is_split_into_gate_and_up_per_rank(tmp_path):
    from safetensors.torch import save_file

    from megatron_osprey.convert.sharding import read_shard
    from megatron_osprey.convert.weight_map import Split, WeightRule

    # Expert 1 of 2: hidden 2, ffn 4; column 2j is gate j, 2j + 1 is up j (HF's gate_up_proj [E, hidden, 2 ffn]).
    fused = torch.arange(2 * 2 * 8, dtype=torch.float32).reshape(2, 2, 8)
    save_file({"gate_up": fused, "down": fused[:, :, :4].transpose(1, 2).contiguous()}, str(tmp_path / "m.safetensors"))
    rule = WeightRule("fc1", ("gate_up",), Split.EXPERT_GATE_UP_INTERLEAVED, expert=True)
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        rank1 = read_shard(ckpt, rule, ["gate_up"], None, tp_rank=1, tp_size=2, expert=1)
        gate, up = fused[1].T[0::2], fused[1].T[1::2]  # [ffn, hidden] each
        assert torch.equal(rank1, torch.cat([gate[2:], up[2:]]))
        down = read_shard(ckpt, WeightRule("fc2", ("down",), Split.EXPERT_DOWN), ["down"], None, 0, 2, expert=1)
        assert torch.equal(down, fused[1, :, :4][:, :2])  # Megatron's [hidden, ffn], this rank's ffn half
