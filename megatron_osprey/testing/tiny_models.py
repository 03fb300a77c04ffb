"""Tiny random HF models for tests and benchmarks: Qwen3 (decoupled head_dim, qk-norm), Llama (llama3 RoPE), the
mixture-of-experts families (Qwen3-MoE, MiniMax-M2, GLM-4.5, gpt-oss, DeepSeek-V3), and Qwen2 (q/k/v biases),
Mistral and Gemma 3 (sliding windows shorter than the test sequences)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 300


def qwen3_config(tie: bool = True, layers: int = 4, vocab: int = VOCAB):
    from transformers import Qwen3Config

    # head_dim 32 with hidden 64 and 4 heads: head_dim != hidden / heads, as in Qwen3.
    return Qwen3Config(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        rope_theta=1000000.0,
    )


def llama_config(tie: bool = False, layers: int = 4, vocab: int = VOCAB):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )


def make_hf_model(config, directory: str | Path, seed: int = 0):
    """Build a random HF model from `config`, save it (safetensors) to `directory`, return it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    # Norm weights start at 1 (Gemma's at 0) and biases at 0: perturb them so a wrong mapping shows in the logits.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(str(directory))
    return model


def truncated_logits(model, input_ids: torch.Tensor, num_layers: int) -> torch.Tensor:
    """HF logits through the first `num_layers` blocks + final norm + LM head."""
    with torch.no_grad():
        hidden = model(input_ids, output_hidden_states=True).hidden_states[num_layers]
        return model.lm_head(model.model.norm(hidden))


def qwen3_moe_config(layers: int = 4, vocab: int = VOCAB, norm_topk_prob: bool = True):
    """Tiny Qwen3-MoE: 8 experts, top-2, per-head qk-norm, head_dim != hidden / heads."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    )


def minimax_m2_config(layers: int = 4, vocab: int = VOCAB):
    """Tiny MiniMax-M2: 8 experts, top-2 sigmoid routing with a bias, partial RoPE, whole-projection qk-norm."""
    from transformers import MiniMaxM2Config

    return MiniMaxM2Config(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rotary_dim=16,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
        bos_token_id=None,
        eos_token_id=None,
        use_qk_norm=True,
        qk_norm_type="per_layer",
        scoring_func="sigmoid",
        use_routing_bias=True,
        shared_intermediate_size=0,
    )


def deepseek_v3_config(layers: int = 4, vocab: int = VOCAB, q_lora_rank: int | None = 32):
    """Tiny DeepSeek-V3: MLA (q/kv latents 32, nope 16 + rope 8, v 16), layer 0 dense, then 8 routed experts in 4
    groups (2 kept, top-4: 2 x topk_group, as the release's 8 = 2 x 4) plus a shared expert, YaRN x4 with mscale."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        vocab_size=vocab,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
    )


def make_moe_hf_model(config, directory: str | Path, seed: int = 0):
    """make_hf_model plus a non-zero MiniMax routing bias, so that a bias ignored by the loader shows."""
    model = make_hf_model(config, directory, seed)
    biases = [(n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    if biases:
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for _, buf in biases:
                # Comparable to sigmoid scores (0..1): it changes which experts are picked.
                buf.copy_(0.3 * torch.randn(buf.shape, generator=generator))
        model.save_pretrained(str(directory))
    return model


def qwen2_config(layers: int = 4, vocab: int = VOCAB):
    """Tiny Qwen2 (Qwen2.5): biases on q/k/v, none on o_proj; no sliding window (use_sliding_window false)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


# Shorter than the 32-token test sequences, so the window changes the output.
TINY_SLIDING_WINDOW = 8


def mistral_config(layers: int = 4, vocab: int = VOCAB, sliding_window: int | None = TINY_SLIDING_WINDOW):
    """Tiny Mistral: head_dim != hidden / heads, every layer attends through a sliding window."""
    from transformers import MistralConfig

    return MistralConfig(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=96,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        sliding_window=sliding_window,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


def gemma3_config(layers: int = 4, vocab: int = VOCAB):
    """Tiny Gemma 3 text model: two sliding layers then a global one, two RoPE bases (the global one linearly
    scaled), query_pre_attn_scalar != head_dim, q/k norms, sandwich norms, tied and sqrt(hidden)-scaled embeddings."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=96,
        vocab_size=vocab,
        max_position_embeddings=256,
        query_pre_attn_scalar=24,
        sliding_window=TINY_SLIDING_WINDOW,
        layer_types=["sliding_attention" if (i + 1) % 3 else "full_attention" for i in range(layers)],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )


def gemma3_multimodal_config(layers: int = 4, vocab: int = VOCAB):
    """Tiny multimodal Gemma 3 (Gemma3ForConditionalGeneration): gemma3_config's language model beside a one-layer
    vision tower; its checkpoint keeps the language model under language_model.model.*, as the published one."""
    from transformers import Gemma3Config

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    return Gemma3Config(
        text_config=gemma3_config(layers, vocab).to_dict(),
        vision_config=dict(vision, patch_size=14),
        mm_tokens_per_image=4,
        image_token_index=vocab - 1,
        boi_token_index=vocab - 2,
        eoi_token_index=vocab - 3,
    )


TINY_TARGET_CONFIGS = {
    "llama": lambda vocab: llama_config(layers=6, vocab=vocab),
    "qwen3": lambda vocab: qwen3_config(tie=False, layers=6, vocab=vocab),
    "qwen3_moe": lambda vocab: qwen3_moe_config(layers=6, vocab=vocab),
    "minimax_m2": lambda vocab: minimax_m2_config(layers=6, vocab=vocab),
    "glm4_moe": lambda vocab: glm4_moe_config(layers=6, vocab=vocab),
    "gpt_oss": lambda vocab: gpt_oss_config(layers=6, vocab=vocab),
    "deepseek_v3": lambda vocab: deepseek_v3_config(layers=4, vocab=vocab),
    "qwen2": lambda vocab: qwen2_config(layers=6, vocab=vocab),
    "mistral": lambda vocab: mistral_config(layers=6, vocab=vocab),
    "gemma3_text": lambda vocab: gemma3_config(layers=6, vocab=vocab),
    "gemma3": lambda vocab: gemma3_multimodal_config(layers=6, vocab=vocab),
}


def write_chat_target(directory: str | Path, family: str, seed: int = 0, mxfp4: bool = False):
    """A 6-layer random target of `family` with a tiny chat tokenizer saved beside it; returns the HF model
    (`mxfp4`: gpt-oss's experts written as MXFP4, see make_glm_gptoss_model)."""
    from megatron_osprey.data.regenerate.tiny_target import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer("llama3" if family == "llama" else "qwen3")
    config = TINY_TARGET_CONFIGS[family](len(tokenizer))
    if family in ("glm4_moe", "gpt_oss"):
        model = make_glm_gptoss_model(config, directory, seed, mxfp4=mxfp4 and family == "gpt_oss")
    else:
        model = make_moe_hf_model(config, directory, seed)
    tokenizer.save_pretrained(str(directory))
    return model


def write_conversations_jsonl(path: str | Path, count: int, seed: int = 0) -> Path:
    """`count` short two-turn conversations with varied lengths, as conversations JSONL."""
    import json
    import random

    rng = random.Random(seed)
    words = "the cat sat on a mat while two dogs ran past quickly and it rained over hills".split()
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(count):
            question = " ".join(rng.choice(words) for _ in range(rng.randint(2, 12)))
            answer = " ".join(rng.choice(words) for _ in range(rng.randint(3, 20)))
            row = {
                "id": f"conv-{i:04d}",
                "conversations": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
            }
            handle.write(json.dumps(row) + "\n")
    return Path(path)


def causal_logits(model, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [batch, seq, padded_vocab / TP] of a single-stage GPTModel on `input_ids`."""
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return model(input_ids, position_ids, attention_mask=None)


def write_byte_level_bpe(out: Path, texts, vocab_size: int, special_tokens, config: dict) -> Path:
    """A byte-level BPE trained on `texts` saved as OUT/tokenizer.json, with `config` as tokenizer_config.json."""
    from megatron_osprey.data.regenerate.tiny_target import train_byte_level_bpe

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train_byte_level_bpe(texts, vocab_size, special_tokens).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def glm4_moe_config(layers: int = 4, vocab: int = VOCAB):
    """Tiny GLM-4.5: a dense first layer, then 8 experts (top-4 within the best 2 of 4 groups) beside a shared expert,
    sigmoid routing with a bias and a scaling factor, partial RoPE, q/k/v biases, per-head q/k norm."""
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        use_qk_norm=True,
        attention_bias=True,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
        num_nextn_predict_layers=1,
    )


def gpt_oss_config(layers: int = 4, vocab: int = VOCAB):
    """Tiny gpt-oss: sliding (window 8) and full layers alternating, sinks, biases, YaRN, 8 experts top-2 with the
    clamped SwiGLU (limit 7)."""
    from transformers import GptOssConfig

    return GptOssConfig(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=vocab,
        sliding_window=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 8,
        },
        attn_implementation="eager",  # the sinks are in HF's eager attention
    )


def make_glm_gptoss_model(config, directory: str | Path, seed: int = 0, mxfp4: bool = False):
    """make_hf_model for GLM-4.5 / gpt-oss with every zero-initialized tensor HF leaves (routing bias, sinks,
    linear biases, router) made random, so that one the loader ignores shows. `mxfp4` (gpt-oss): the experts are
    rounded to MXFP4 in the returned model and written as `_blocks` + `_scales`, as the released checkpoints are."""
    from safetensors.torch import load_file, save_file

    from megatron_osprey.convert.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX, dequantize_mxfp4, quantize_mxfp4

    model = make_hf_model(config, directory, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("e_score_correction_bias", "sinks", "bias")) or ".router." in name:
                tensor.copy_(0.3 * torch.randn(tensor.shape, generator=generator))
            if name.endswith(("gate_up_proj", "down_proj")) and tensor.dim() == 3:
                # Wide enough that the gpt-oss clamp (|x| <= 7) cuts some gate / up values.
                tensor.mul_(40.0)
    model.save_pretrained(str(directory))
    if mxfp4:
        path = Path(directory) / "model.safetensors"
        tensors = load_file(str(path))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                    blocks, scales = quantize_mxfp4(param.transpose(1, 2))  # stored [experts, out, in]
                    param.copy_(dequantize_mxfp4(blocks, scales).transpose(1, 2))
                    del tensors[name]
                    tensors[name + BLOCKS_SUFFIX] = blocks
                    tensors[name + SCALES_SUFFIX] = scales
        save_file(tensors, str(path), metadata={"format": "pt"})
        config_path = Path(directory) / "config.json"
        written = json.loads(config_path.read_text())
        written["quantization_config"] = {"quant_method": "mxfp4"}
        config_path.write_text(json.dumps(written, indent=2))
    return model
