"""Tiny random HF models for tests: Qwen3 (decoupled head_dim, qk-norm) and Llama (llama3 RoPE)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 300


def qwen3_config(tie: bool = True, layers: int = 4, vocab: int = VOCAB):
    from transformers import Qwen3Config

    # head_dim 32 with hidden 64 and 4 heads: head_dim != hidden / heads, as in Qwen3.
    return Qwen3Config(
        hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=128, vocab_size=vocab, max_position_embeddings=256,
        tie_word_embeddings=tie, rope_theta=1000000.0,
    )


def llama_config(tie: bool = False, layers: int = 4, vocab: int = VOCAB):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, vocab_size=vocab, max_position_embeddings=256, tie_word_embeddings=tie,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )


def make_hf_model(config, directory: str | Path, seed: int = 0):
    """Build a random HF model from `config`, save it (safetensors) to `directory`, return it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    # Norm weights start at 1: perturb them so a wrong norm mapping shows in the logits.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(str(directory))
    return model


def truncated_logits(model, input_ids: torch.Tensor, num_layers: int) -> torch.Tensor:
    """HF logits through the first `num_layers` blocks + final norm + LM head."""
    with torch.no_grad():
        hidden = model(input_ids, output_hidden_states=True).hidden_states[num_layers]
        return model.lm_head(model.model.norm(hidden))
