"""The frozen target inside the distillation job: aux-layer and final hidden states from layer hooks."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_osprey.models.target.pipeline_stage import LayerCapture, gather_sequence, load_target
from megatron_osprey.parallel import ParallelConfig


class OnlineTarget:
    """This rank's (TP / EP-sharded, unpipelined) target; `__call__` returns full-sequence states on every rank."""

    def __init__(
        self,
        target_dir: str | Path,
        parallel: ParallelConfig,
        device: torch.device,
        aux_layer_ids,
        params_dtype: torch.dtype = torch.float32,
        transformer_impl: str = "auto",
        arch=None,
    ):
        self.stage = load_target(
            target_dir,
            parallel,
            device,
            params_dtype=params_dtype,
            transformer_impl=transformer_impl,
            with_lm_head=False,
            arch=arch,
        )
        self.aux_layer_ids = list(aux_layer_ids)
        self.final_layer = self.stage.arch.num_layers - 1
        self.capture = LayerCapture(self.stage.model, sorted(set(self.aux_layer_ids + [self.final_layer])))
        self.sequence_parallel = parallel.sequence_parallel

    def _full(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_sequence(hidden) if self.sequence_parallel else hidden

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [b, s, 3*Ht] = cat of the aux layers' outputs, final pre-norm hidden [b, s, Ht])."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        self.capture.clear()
        self.stage.model(input_ids, positions, attention_mask=None)
        states = {k: self._full(v).transpose(0, 1).float() for k, v in self.capture.outputs.items()}
        self.capture.clear()
        aux = torch.cat([states[i] for i in self.aux_layer_ids], dim=-1)
        return aux, states[self.final_layer]
