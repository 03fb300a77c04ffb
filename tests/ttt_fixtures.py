"""A tiny target, a reduced-vocab drafter and one batch, shared by the TTT-loss tests (TP=1 and TP=2)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.models.drafter import DrafterArch
from megatron_osprey.models.reference_drafter import ReferenceDrafter
from megatron_osprey.testing.tiny_models import make_hf_model, qwen3_config

TARGET_VOCAB, TARGET_HIDDEN, DRAFT_VOCAB, SEQ, BATCH = 300, 48, 200, 20, 2


def make_target(directory: Path):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=TARGET_HIDDEN, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96, vocab_size=TARGET_VOCAB)
    return make_hf_model(config, directory, seed=3)


def make_drafter(draft_vocab: int = DRAFT_VOCAB, variant: str = "osprey") -> tuple[DrafterArch, ReferenceDrafter]:
    body = ModelArch.from_hf_config(qwen3_config(layers=2))
    arch = DrafterArch(body=body, target_hidden_size=TARGET_HIDDEN, vocab_size=TARGET_VOCAB,
                       draft_vocab_size=draft_vocab, aux_layer_ids=(1, 2, 3), variant=variant)
    torch.manual_seed(11)
    drafter = ReferenceDrafter(arch.reference_config())
    with torch.no_grad():
        for param in drafter.parameters():
            param.add_(0.05 * torch.randn_like(param))  # W_new != 0 so every step depends on g
    if draft_vocab < TARGET_VOCAB:
        ids = torch.randperm(TARGET_VOCAB, generator=torch.Generator().manual_seed(5))[:draft_vocab]
        drafter.set_draft_vocab(ids)
    return arch, drafter


def make_batch() -> dict:
    generator = torch.Generator().manual_seed(7)
    return {
        "input_ids": torch.randint(0, TARGET_VOCAB, (BATCH, SEQ), generator=generator),
        "loss_mask": torch.rand(BATCH, SEQ, generator=generator) > 0.2,
        "aux_hidden": torch.randn(BATCH, SEQ, 3 * TARGET_HIDDEN, generator=generator),
        "final_hidden": 3 * torch.randn(BATCH, SEQ, TARGET_HIDDEN, generator=generator),
    }
