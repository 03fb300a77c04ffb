"""Qwen3-MoE and MiniMax-M2 in Megatron-Core from HF safetensors: logits, routing bias, FP8 dequant, memory estimate."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.base.memory import TargetMemoryError, check_fits, estimate_target_memory
from megatron_osprey.convert.hf_to_megatron import load_hf_weights
from megatron_osprey.convert.safetensors_io import SafetensorsCheckpoint, dequantize_fp8_blocks
from megatron_osprey.convert.weight_map import Split, match_rule_indices, rules_for
from megatron_osprey.models.backbone.gpt import build_gpt_model, rotary_inv_freq
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.testing.tiny_models import (
    VOCAB,
    causal_logits,
    make_moe_hf_model,
    minimax_m2_config,
    qwen3_moe_config,
)

IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))


def megatron_logits(directory) -> torch.Tensor:
    arch = ModelArch.from_hf_config(directory)
    cfg = ParallelConfig()
    with parallel_context(cfg):
        model = build_gpt_model(arch, cfg, perform_initialization=False).eval()
        load_hf_weights(model, directory, arch, 0, 1)
        with torch.no_grad():
            return causal_logits(model, IDS)[..., :VOCAB]


@pytest.mark.parametrize(
    "make,kwargs",
    [
        (qwen3_moe_config, {"norm_topk_prob": True}),
        (qwen3_moe_config, {"norm_topk_prob": False}),
        (minimax_m2_config, {}),
    ],
)
def test_moe_logits_equal_hf_at_tp1(tmp_path, make, kwargs):
    hf = make_moe_hf_model(make(layers=2, **kwargs), tmp_path)
    with torch.no_grad():
        expected = hf(IDS).logits
    assert (megatron_logits(tmp_path) - expected).abs().max().item() < 1e-4


def test_minimax_arch_reads_routing_partial_rope_and_projection_qk_norm(tmp_path):
    make_moe_hf_model(minimax_m2_config(layers=2), tmp_path)
    arch = ModelArch.from_hf_config(tmp_path)
    assert (arch.num_experts, arch.moe_router_topk, arch.moe_score_function) == (8, 2, "sigmoid")
    assert arch.moe_expert_bias and arch.qk_norm_over_projection
    assert arch.rotary_dim == 16 and arch.rotary_percent == 0.5
    assert rotary_inv_freq(arch).shape == (8,)


def test_minimax_routing_bias_changes_the_output(tmp_path):
    """The bias only picks experts; the test model's bias is large enough that dropping it shows."""
    hf = make_moe_hf_model(minimax_m2_config(layers=2), tmp_path)
    with torch.no_grad():
        with_bias = hf(IDS).logits
        for layer in hf.model.layers:
            layer.mlp.e_score_correction_bias.zero_()
        without_bias = hf(IDS).logits
    assert (with_bias - without_bias).abs().max().item() > 1e-3
    assert (megatron_logits(tmp_path) - with_bias).abs().max().item() < 1e-4


def test_expert_rules_map_local_experts_and_te_grouped_names(tmp_path):
    make_moe_hf_model(minimax_m2_config(layers=2), tmp_path)
    arch = ModelArch.from_hf_config(tmp_path)
    rule, idx = match_rule_indices("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight", rules_for(arch))
    assert idx == {"layer": 1, "expert": 3} and rule.expert
    assert rule.hf[0].format(layer=1, expert=7) == "model.layers.1.block_sparse_moe.experts.7.w1.weight"
    te_rules = rules_for(arch, "transformer_engine")
    rule, idx = match_rule_indices("decoder.layers.0.mlp.experts.linear_fc2.weight5", te_rules)
    assert idx == {"layer": 0, "expert": 5} and rule.expert
    assert rule.hf[0].format(layer=0, expert=5) == "model.layers.0.block_sparse_moe.experts.5.w2.weight"
    # MoE layers keep a standalone pre-MLP norm under TE; the attention norm is fused into the QKV.
    rule, idx = match_rule_indices("decoder.layers.1.pre_mlp_layernorm.weight", te_rules)
    assert idx == {"layer": 1} and rule.split == Split.REPLICATED
    assert rule.hf == ("model.layers.{layer}.post_attention_layernorm.weight",)
    rule, idx = match_rule_indices("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", te_rules)
    assert idx == {"layer": 1} and rule.split == Split.REPLICATED
    assert rule.hf == ("model.layers.{layer}.input_layernorm.weight",)
    # The local spec's standalone attention norm has no place under TE: it is fused there.
    assert match_rule_indices("decoder.layers.1.input_layernorm.weight", te_rules) is None


def quantize_fp8_blocks(weight: torch.Tensor, block: int):
    """Per-block e4m3 quantization as DeepSeek / MiniMax ship it: (fp8 weight, float32 scale_inv)."""
    rows, cols = weight.shape
    nr, nc = -(-rows // block), -(-cols // block)
    scale = torch.zeros(nr, nc)
    for i in range(nr):
        for j in range(nc):
            tile = weight[i * block : (i + 1) * block, j * block : (j + 1) * block]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return (weight / full).to(torch.float8_e4m3fn), scale


def test_fp8_dequantized_slices_equal_the_full_dequantization(tmp_path):
    from safetensors.torch import save_file

    weight = torch.randn(300, 260, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_fp8_blocks(weight, 128)
    save_file({"w.weight": q, "w.weight_scale_inv": scale}, str(tmp_path / "model.safetensors"))
    full = dequantize_fp8_blocks(q, scale, (128, 128))
    assert (full - weight).abs().max().item() < 0.07 * weight.abs().max().item()  # e4m3: 3 mantissa bits
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        assert torch.equal(ckpt.read("w.weight"), full)
        assert torch.equal(ckpt.read("w.weight", rows=(100, 290)), full[100:290])
        assert torch.equal(ckpt.read("w.weight", cols=(130, 255)), full[:, 130:255])
        assert torch.equal(ckpt.read("w.weight", rows=(127, 129), cols=(5, 200)), full[127:129, 5:200])


def write_fp8_minimax(tmp_path):
    """A tiny MiniMax-M2 checkpoint in bf16 and its FP8 copy (16x16 blocks, so tiny weights span several):
    (hf model, bf16 tensors, dequantized values of the FP8 tensors, the FP8 directory)."""
    from safetensors.torch import load_file, save_file

    hf = make_moe_hf_model(minimax_m2_config(layers=2), tmp_path / "bf16")
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        skip = tensor.dim() != 2 or "embed" in name or "lm_head" in name or name.endswith("gate.weight")
        if skip:
            quantized[name] = tensor
            continue
        q, scale = quantize_fp8_blocks(tensor.float(), 16)
        quantized[name], quantized[name + "_scale_inv"] = q, scale
        dequantized[name] = dequantize_fp8_blocks(q, scale, (16, 16))
    fp8_dir = tmp_path / "fp8"
    fp8_dir.mkdir()
    save_file(quantized, str(fp8_dir / "model.safetensors"))
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "float8_e4m3fn",
        "weight_block_size": [16, 16],
        "activation_scheme": "dynamic",
    }
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return hf, tensors, dequantized, fp8_dir


def test_fp8_block_scaled_minimax_checkpoint_loads_dequantized(tmp_path):
    """A synthetic FP8 MiniMax-M2 checkpoint matches HF on the same values."""
    hf, tensors, dequantized, fp8_dir = write_fp8_minimax(tmp_path)
    # The reference: the HF model holding exactly the dequantized values.
    state = dict(tensors, **dequantized)
    with torch.no_grad():
        for layer in range(2):
            prefix = f"model.layers.{layer}.block_sparse_moe.experts"
            experts = hf.model.layers[layer].mlp.experts
            for e in range(8):
                experts.gate_up_proj[e].copy_(
                    torch.cat([state[f"{prefix}.{e}.w1.weight"], state[f"{prefix}.{e}.w3.weight"]])
                )
                experts.down_proj[e].copy_(state[f"{prefix}.{e}.w2.weight"])
            attn = hf.model.layers[layer].self_attn
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(attn, proj).weight.copy_(state[f"model.layers.{layer}.self_attn.{proj}.weight"])
        expected = hf(IDS).logits
    got = megatron_logits(fp8_dir)
    assert (got - expected).abs().max().item() < 1e-4
    # And the FP8 rounding is visible: the bf16 checkpoint's logits differ.
    assert (megatron_logits(tmp_path / "bf16") - got).abs().max().item() > 1e-4


def _fp8_file(tmp_path):
    from safetensors.torch import save_file

    weight = torch.randn(300, 260, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_fp8_blocks(weight, 128)
    save_file({"w.weight": q, "w.weight_scale_inv": scale}, str(tmp_path / "model.safetensors"))
    return dequantize_fp8_blocks(q, scale, (128, 128))  # the CPU float32 path, whole tensor


def test_fp8_dequantized_on_a_device_in_the_model_dtype_is_bit_identical_to_the_cpu_path(tmp_path):
    full = _fp8_file(tmp_path)
    for dtype in (torch.bfloat16, torch.float32):
        with SafetensorsCheckpoint(tmp_path, device="cpu", dequantized_dtype=dtype) as ckpt:
            got = ckpt.read("w.weight", rows=(100, 290), cols=(5, 200))
        assert got.dtype == dtype and torch.equal(got, full[100:290, 5:200].to(dtype))
    # "meta" stands in for the GPU: the slice and its scales move there and the product is made there.
    with SafetensorsCheckpoint(tmp_path, device="meta", dequantized_dtype=torch.bfloat16) as ckpt:
        on_device = ckpt.read("w.weight", rows=(127, 129))
    assert (on_device.device.type, on_device.dtype, tuple(on_device.shape)) == ("meta", torch.bfloat16, (2, 260))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_dequantized_on_the_gpu_is_bit_identical_to_the_cpu_path(tmp_path):
    full = _fp8_file(tmp_path)
    with SafetensorsCheckpoint(tmp_path, device="cuda", dequantized_dtype=torch.bfloat16) as ckpt:
        got = ckpt.read("w.weight", rows=(100, 290), cols=(5, 200))
    assert got.is_cuda and torch.equal(got.cpu(), full[100:290, 5:200].to(torch.bfloat16))


def test_the_target_load_dequantizes_fp8_where_the_model_lives_in_its_dtype(tmp_path, monkeypatch):
    from megatron_osprey.convert import safetensors_io

    _, _, dequantized, fp8_dir = write_fp8_minimax(tmp_path)
    seen = []
    real = safetensors_io.dequantize_fp8_blocks

    def spy(weight, scale_inv, *args):
        out = real(weight, scale_inv, *args)
        seen.append((weight.device.type, out.device.type, out.dtype))
        return out

    monkeypatch.setattr(safetensors_io, "dequantize_fp8_blocks", spy)
    arch = ModelArch.from_hf_config(fp8_dir)
    with parallel_context(ParallelConfig()) as state:
        model = build_gpt_model(arch, state.config, perform_initialization=False)
        model.to(device="meta", dtype=torch.bfloat16)  # "meta" stands in for the rank's GPU
        load_hf_weights(model, fp8_dir, arch, 0, 1)
    # Every FP8 tensor of the checkpoint (q/k/v/o and each expert's w1/w2/w3) went through the device path.
    assert len(seen) == len(dequantized) and set(seen) == {("meta", "meta", torch.bfloat16)}


def _real_config(**fields) -> ModelArch:
    return ModelArch.from_hf_config(dict(fields))


LLAMA_70B = dict(
    model_type="llama",
    num_hidden_layers=80,
    hidden_size=8192,
    intermediate_size=28672,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
MINIMAX_M2 = dict(
    model_type="minimax_m2",
    num_hidden_layers=62,
    hidden_size=3072,
    intermediate_size=1536,
    num_attention_heads=48,
    num_key_value_heads=8,
    head_dim=128,
    rotary_dim=64,
    vocab_size=200064,
    num_local_experts=256,
    num_experts_per_tok=8,
    scoring_func="sigmoid",
    use_routing_bias=True,
    use_qk_norm=True,
    qk_norm_type="per_layer",
    shared_intermediate_size=0,
    rope_theta=5000000,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    max_position_embeddings=196608,
)


def test_published_parameter_counts():
    assert round(_real_config(**LLAMA_70B).num_parameters() / 1e9, 1) == 70.6  # Llama-3.3-70B
    assert round(_real_config(**MINIMAX_M2).num_parameters() / 1e9) == 229  # MiniMax-M2: 229B total


def test_memory_estimate_splits_weights_by_tp_and_ep():
    llama = _real_config(**LLAMA_70B)
    tp8 = estimate_target_memory(llama, tensor_parallel=8, micro_batch_size=1, seq_length=4096)
    # 70.6B bf16 parameters over 8 ranks, plus at most one vocab shard of imbalance.
    assert abs(tp8.weight_bytes - llama.num_parameters() * 2 / 8) < 0.04 * llama.num_parameters() * 2 / 8
    minimax = _real_config(**MINIMAX_M2)
    ep8 = estimate_target_memory(minimax, expert_parallel=8)
    ep4 = estimate_target_memory(minimax, expert_parallel=4)
    assert 50 < ep8.weight_bytes / 2**30 < 62  # ~458 GB of bf16 weights, experts split 8 ways
    assert ep4.weight_bytes > 1.9 * ep8.weight_bytes * 0.95


def test_layout_that_cannot_fit_is_refused_with_the_numbers():
    llama = _real_config(**LLAMA_70B)
    estimate = estimate_target_memory(llama, tensor_parallel=1)
    with pytest.raises(TargetMemoryError, match=r"weights 13[0-9]\.\d\d GiB.*exceeds --gpu-memory-gib 80"):
        check_fits(estimate, 80)
    check_fits(estimate_target_memory(llama, tensor_parallel=8), 80)  # 8 x H100 fits


def test_expert_parallel_must_divide_experts_and_needs_moe():
    with pytest.raises(ValueError, match="--expert-model-parallel-size 3 does not divide the model's num_experts"):
        _real_config(**MINIMAX_M2).validate_parallel(1, 1, 3)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        _real_config(**LLAMA_70B).validate_parallel(1, 1, 2)


def test_moe_cpu_patches_are_active_only_inside_the_context():
    import numpy as np
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu
    with parallel_context(ParallelConfig()):
        splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
        assert isinstance(splits, np.ndarray) and splits.tolist() == [3, 1]  # gloo needs host sizes
        assert moe_utils.te_general_gemm is None
        stream = token_dispatcher.torch.cuda.Stream()
        assert token_dispatcher.torch.cuda.current_stream() != stream
        stream.record_event().synchronize()
    assert token_dispatcher.torch is torch and moe_utils.maybe_move_tensor_to_cpu is original
    assert token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None
