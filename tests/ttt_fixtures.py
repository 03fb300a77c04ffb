"""A tiny target, a reduced-vocab drafter and one batch, shared by the TTT-loss tests (TP=1 and TP=2)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.losses.ttt import TTTLossConfig
from megatron_osprey.models.drafter.model import DrafterArch
from megatron_osprey.models.drafter.reference import ReferenceDrafter
from megatron_osprey.testing.tiny_models import make_hf_model, qwen3_config

TARGET_VOCAB, TARGET_HIDDEN, DRAFT_VOCAB, SEQ, BATCH = 300, 48, 200, 20, 2


def make_target(directory: Path):
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=TARGET_HIDDEN,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=TARGET_VOCAB,
    )
    return make_hf_model(config, directory, seed=3)


def make_drafter(draft_vocab: int = DRAFT_VOCAB, variant: str = "osprey") -> tuple[DrafterArch, ReferenceDrafter]:
    body = ModelArch.from_hf_config(qwen3_config(layers=2))
    arch = DrafterArch(
        body=body,
        target_hidden_size=TARGET_HIDDEN,
        vocab_size=TARGET_VOCAB,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=(1, 2, 3),
        variant=variant,
    )
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


def reference_ttt_loss(
    drafter_logits: list[Tensor], target_full_logits: Tensor, loss_mask: Tensor, t2d: Tensor, config: TTTLossConfig
) -> tuple[Tensor, list[float]]:
    """The TTT loss written plainly, one row at a time, on full (unsharded) tensors.

    Returns the loss and the per-step mean soft CE over counted rows.
    """
    draft_ids = torch.nonzero(t2d).flatten()
    batch, seq = loss_mask.shape
    weighted_sum = torch.zeros(())
    per_step, step0_rows = [], 0
    for k, logits in enumerate(drafter_logits):
        losses = []
        for b in range(batch):
            for t in range(seq):
                j = t + 1 + k  # the target position this row is trained toward (it predicts x_{j+1})
                if j >= seq:  # past the sequence: padding rows of the shifted step
                    continue
                masked_token = j + 1 if config.mask_alignment == "predicted" else t + k
                if masked_token >= seq or not loss_mask[b, masked_token]:
                    continue
                full = target_full_logits[b, j].float()
                if not t2d[full.argmax()]:
                    continue
                p = torch.softmax(full[draft_ids], dim=-1)
                log_q = torch.log_softmax(logits[b, t, : draft_ids.numel()].float(), dim=-1)
                losses.append(-(p * log_q).sum())
        step_sum = torch.stack(losses).sum() if losses else torch.zeros(())
        step0_rows = len(losses) if k == 0 else step0_rows
        per_step.append(float(step_sum.detach()) / max(len(losses), 1))
        weighted_sum = weighted_sum + config.decay**k * step_sum
    denominator = batch * seq if config.normalization == "reference" else max(step0_rows, 1)
    return weighted_sum / denominator, per_step
