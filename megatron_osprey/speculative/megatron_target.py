"""A Megatron-Core target for the reference speculative decoder (chain drafting).

The Megatron-Core model runs without an inference KV cache here: every prefill or
verify recomputes the committed sequence plus the new tokens under the causal
mask and returns the new rows. That is exact (the logits of a causal LM at a
position depend only on the prefix) and keeps the adapter small; it costs
O(length) work per verify, so it is for checking a Megatron target's acceptance
length, not for speed. Megatron's rotary embedding follows sequence order, so
draft trees (whose positions follow depth) are refused: use topk 1.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from megatron_osprey.speculative.target import TargetModel


class MegatronTargetModel(TargetModel):
    """TargetModel over a single-rank Megatron-Core GPTModel (with its LM head) and layer hooks."""

    def __init__(self, model, aux_layer_ids: list[int], vocab_size: int):
        from megatron_osprey.models.targets.target import LayerCapture

        self.model = model
        self.aux_layer_ids = list(aux_layer_ids)
        self.vocab_size = vocab_size
        self.capture = LayerCapture(model, self.aux_layer_ids)
        self._committed = torch.zeros(0, dtype=torch.long)
        self._pending: torch.Tensor | None = None

    @classmethod
    @contextlib.contextmanager
    def open(cls, target_dir: str | Path, aux_layer_ids: list[int]) -> Iterator["MegatronTargetModel"]:
        """Build the target from its HF directory in a one-rank Megatron-Core context."""
        from megatron_osprey.models.targets.target import load_target
        from megatron_osprey.parallel import ParallelConfig, parallel_context

        with parallel_context(ParallelConfig()) as state:
            stage = load_target(target_dir, state.config, state.device, with_lm_head=True, transformer_impl="local")
            target = cls(stage.model, aux_layer_ids, stage.arch.vocab_size)
            try:
                yield target
            finally:
                target.capture.remove()

    @property
    def cache_length(self) -> int:
        return int(self._committed.numel())

    @torch.no_grad()
    def _run(self, ids: torch.Tensor, new: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(ids.numel())[None]
        self.capture.clear()
        logits = self.model(ids[None], positions, attention_mask=None)[0, -new:, : self.vocab_size]
        aux = torch.cat([self.capture.outputs[i][-new:, 0] for i in self.aux_layer_ids], dim=-1)
        self.capture.clear()
        return logits.float(), aux.float()

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._committed = input_ids.detach().cpu().long()
        self._pending = None
        return self._run(self._committed, self._committed.numel())

    def verify(self, tokens: torch.Tensor, depths: torch.Tensor, allowed: torch.Tensor):
        m = tokens.numel()
        chain = torch.equal(depths.cpu(), torch.arange(m)) and torch.equal(
            allowed.cpu().bool(), torch.ones(m, m, dtype=torch.bool).tril())
        if not chain:
            raise ValueError("the Megatron target verifies chains only (topk 1); use the HF target for draft trees.")
        if self._pending is not None:
            raise RuntimeError("MegatronTargetModel.verify called twice without commit in between.")
        self._pending = tokens.detach().cpu().long()
        return self._run(torch.cat([self._committed, self._pending]), m)

    def commit(self, keep: list[int]) -> None:
        if keep != list(range(len(keep))):
            raise ValueError(f"a chain keeps a prefix of its rows, got {keep}.")
        self._committed = torch.cat([self._committed, self._pending[: len(keep)]])
        self._pending = None
