"""The frozen target's final norm and LM head: target logits recomputed from its final hidden state.

Target logits are never stored. Distillation recomputes them from the target's
final (pre-norm) hidden state, in both modes, through this module: its rows are
vocab-parallel like the drafter's output layer, so the TTT loss never gathers a
vocabulary across TP ranks. Each rank reads only its rows from safetensors.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from megatron_osprey.base.arch import padded_size
from megatron_osprey.convert.safetensors_io import SafetensorsCheckpoint
from megatron_osprey.losses.ttt import vocab_parallel_argmax

_ROW_BLOCK = 8192


def _shard_range(size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    per = padded_size(size, tp_size) // tp_size
    return tp_rank * per, (tp_rank + 1) * per


def _read_rows(ckpt: SafetensorsCheckpoint, name: str, ids: Tensor, width: int, dtype) -> Tensor:
    """Rows `ids` of a [V, H] tensor, read block by block (never the whole matrix at once)."""
    out = torch.zeros(len(ids), width, dtype=dtype)
    if len(ids) == 0:
        return out
    order = torch.argsort(ids)
    sorted_ids = ids[order]
    start = 0
    while start < len(sorted_ids):
        first = int(sorted_ids[start])
        end = torch.searchsorted(sorted_ids, first + _ROW_BLOCK).item()
        block = ckpt.read(name, rows=(first, int(sorted_ids[end - 1]) + 1))
        out[order[start:end]] = block[sorted_ids[start:end] - first].to(dtype)
        start = end
    return out


class TargetHead(torch.nn.Module):
    """Final RMSNorm + LM head of the target: draft-vocab logits and the argmax-in-draft mask."""

    def __init__(
        self,
        norm_weight: Tensor,
        eps: float,
        head_shard: Tensor,
        draft_shard: Tensor | None,
        vocab_size: int,
        t2d: Tensor,
        tp_group=None,
    ):
        super().__init__()
        self.register_buffer("norm_weight", norm_weight)
        self.register_buffer("head_shard", head_shard)
        self.register_buffer("draft_shard", head_shard if draft_shard is None else draft_shard)
        self.register_buffer("t2d", t2d)
        self.eps = eps
        self.vocab_size = vocab_size
        self.full_draft_vocab = draft_shard is None
        self.tp_group = tp_group

    @classmethod
    def from_hf(
        cls,
        target_dir: str | Path,
        t2d: Tensor,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group=None,
        dtype: torch.dtype = torch.float32,
        arch=None,
    ) -> "TargetHead":
        """Read this TP rank's rows of the target's `lm_head` (or tied embedding) and its final norm; `arch` is
        the target's parsed config.json (a ModelArch) when the caller has it already."""
        from megatron_osprey.base.arch import ModelArch
        from megatron_osprey.convert.weight_map import hf_checkpoint_name

        arch = arch or ModelArch.from_hf_config(target_dir)
        vocab, hidden, eps = arch.vocab_size, arch.hidden_size, arch.rms_norm_eps
        with SafetensorsCheckpoint(target_dir) as ckpt:
            head_name = hf_checkpoint_name(arch, "lm_head.weight")
            if not ckpt.has(head_name):
                head_name = hf_checkpoint_name(arch, "model.embed_tokens.weight")
            norm = ckpt.read(hf_checkpoint_name(arch, "model.norm.weight"))
            # Gemma's final norm multiplies by (1 + w), formed in float32 as HF forms it.
            norm = (norm.float() + 1.0) if arch.zero_centered_norm else norm.to(dtype)
            start, end = _shard_range(vocab, tp_rank, tp_size)
            head = torch.zeros(end - start, hidden, dtype=dtype)
            if min(end, vocab) > start:
                head[: min(end, vocab) - start] = ckpt.read(head_name, rows=(start, min(end, vocab))).to(dtype)
            draft = None
            draft_ids = torch.nonzero(t2d).flatten()
            if draft_ids.numel() != vocab:
                d_start, d_end = _shard_range(draft_ids.numel(), tp_rank, tp_size)
                mine = draft_ids[d_start : min(d_end, draft_ids.numel())]
                draft = torch.zeros(d_end - d_start, hidden, dtype=dtype)
                draft[: len(mine)] = _read_rows(ckpt, head_name, mine, hidden, dtype)
        return cls(norm, eps, head, draft, vocab, t2d.bool(), tp_group)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.t2d.sum())

    def normed(self, final_hidden: Tensor) -> Tensor:
        x = final_hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.norm_weight.float() * x).to(self.head_shard.dtype)

    @torch.no_grad()
    def forward(self, final_hidden: Tensor) -> tuple[Tensor, Tensor]:
        """(draft-vocab logits [b, s, Vd_pad/TP], target argmax in draft vocab [b, s]) from [b, s, Ht]."""
        h = self.normed(final_hidden)
        full = h @ self.head_shard.t()
        if self.full_draft_vocab:
            return full, torch.ones(full.shape[:-1], dtype=torch.bool, device=full.device)
        argmax = vocab_parallel_argmax(full, self.vocab_size, self.tp_group)
        return h @ self.draft_shard.t(), self.t2d[argmax]
