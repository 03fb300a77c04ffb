"""pretrain_gpt's contract for the backbone: forward_step(data_iterator, model) -> (output, loss_func)."""

from __future__ import annotations

import functools

import torch
from megatron.core.utils import unwrap_model


def masked_token_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """(sum of per-token losses, token count, report) so the schedule averages over all tokens of the step."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss.detach(), num_tokens.detach().float()])
    return loss, num_tokens, {"lm loss": report}


def true_vocab_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-token loss over the real vocabulary: Megatron's padding rows (to 128 x TP) get no probability.

    Without this the loss depends on the TP size (more padding at TP=2) and differs
    from the HF model's; padded logits are set to -inf before the vocab-parallel softmax.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    local = logits.shape[-1]
    first = mpu.get_tensor_model_parallel_rank() * local
    if first + local > vocab_size:
        padded = torch.arange(first, first + local, device=logits.device) >= vocab_size
        logits = logits.masked_fill(padded, float("-inf"))
    return vocab_parallel_cross_entropy(logits, labels)


def gpt_forward_step(data_iterator, model):
    """One micro-batch through a GPTModel stage; the last stage returns per-token losses [b, s]."""
    batch = next(data_iterator)
    gpt = unwrap_model(model)
    # attention_mask None: the causal mask is the attention's own (no [s, s] tensor per sample).
    output = model(batch["tokens"], batch["position_ids"], attention_mask=None)
    if gpt.post_process:
        output = true_vocab_cross_entropy(output, batch["labels"], gpt.osprey_arch.vocab_size)
    return output, functools.partial(masked_token_loss, batch["loss_mask"])
