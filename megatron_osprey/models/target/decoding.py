"""Target-model adapters: prefill, tree verify and KV commit behind one small interface.

Aux features are the concatenated outputs of the target layers in
``aux_layer_ids`` (0-based; HF ``hidden_states[i + 1]``), the drafter's
``fc`` input. A Megatron target plugs in by implementing ``TargetModel``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class TargetModel(ABC):
    """A target LM with a KV cache that speculative decoding can drive."""

    vocab_size: int

    @abstractmethod
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reset the cache, run ids [n]; return logits [n, V] and aux features [n, F]."""

    @abstractmethod
    def verify(self, tokens: torch.Tensor, depths: torch.Tensor, allowed: torch.Tensor):
        """Run tokens [m] after the cache at positions cache_len + depths, attending to the
        whole cache plus the new tokens where allowed [m, m] is True; return (logits, aux)."""

    @abstractmethod
    def commit(self, keep: list[int]) -> None:
        """Keep only rows `keep` (increasing) of the last verify in the cache; drop the rest."""

    @property
    @abstractmethod
    def cache_length(self) -> int:
        """Number of positions in the committed cache."""


class HFTargetModel(TargetModel):
    """Adapter for a transformers causal LM (Llama, Qwen3, ...) with a DynamicCache."""

    def __init__(self, model, aux_layer_ids: list[int]):
        config = text_config(model.config)
        num_layers = config.num_hidden_layers
        if len(aux_layer_ids) != 3 or not all(0 <= i < num_layers for i in aux_layer_ids):
            raise ValueError(f"aux_layer_ids must be 3 layer ids in 0..{num_layers - 1}, got {aux_layer_ids}.")
        self.model = model.eval()
        self.aux_layer_ids = list(aux_layer_ids)
        self.vocab_size = config.vocab_size
        self.windowed = has_sliding_window(config)
        self._cache = None
        self._pending = 0

    @property
    def cache_length(self) -> int:
        """Committed positions in the KV cache."""
        return 0 if self._cache is None else self._cache.get_seq_length() - self._pending

    def _run(self, ids: torch.Tensor, **kwargs):
        out = self.model(ids[None], cache=self._cache, use_cache=True, output_hidden_states=True, **kwargs)
        aux = torch.cat([out.hidden_states[i + 1][0] for i in self.aux_layer_ids], dim=-1)
        return out.logits[0], aux

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reset the cache and run the prompt."""
        from transformers import DynamicCache

        # A windowed model keeps every position (plain layers, cropped on commit); its masks apply the window.
        self._cache = DynamicCache() if self.windowed else DynamicCache(config=self.model.config)
        self._pending = 0
        return self._run(input_ids.to(self.model.device))

    @torch.no_grad()
    def verify(self, tokens: torch.Tensor, depths: torch.Tensor, allowed: torch.Tensor):
        """One target forward over a draft tree (tree attention mask, positions by depth)."""
        if self._pending:
            raise RuntimeError("HFTargetModel.verify called twice without commit in between.")
        device, dtype = self.model.device, self.model.dtype
        n, m = self.cache_length, tokens.numel()
        if self.windowed:
            # One explicit mask would lift every layer's window: a chain runs under the model's own masks.
            if not (
                torch.equal(depths.cpu(), torch.arange(m))
                and torch.equal(allowed.cpu(), torch.ones(m, m).tril().bool())
            ):
                raise ValueError(
                    "a target with sliding-window layers verifies chains only (--topk 1): one tree mask would "
                    "lift the layers' windows."
                )
            logits, aux = self._run(tokens.to(device))
            self._pending = m
            return logits, aux
        mask = torch.zeros(1, 1, m, n + m, dtype=dtype, device=device)
        # Additive float mask: works for both eager and sdpa attention.
        blocked = torch.full((m, m), torch.finfo(dtype).min, dtype=dtype, device=device)
        mask[0, 0, :, n:] = blocked.masked_fill(allowed.to(device), 0.0)
        positions = (n + depths.to(device))[None]
        logits, aux = self._run(tokens.to(device), attention_mask=mask, position_ids=positions)
        self._pending = m
        return logits, aux

    def commit(self, keep: list[int]) -> None:
        """Keep rows `keep` of the last verify; the cache then ends with exactly those positions."""
        from transformers.cache_utils import DynamicLayer

        n = self.cache_length
        index = torch.tensor([*range(n), *(n + k for k in keep)], dtype=torch.long)
        for layer in self._cache.layers:
            if type(layer) is not DynamicLayer:
                raise TypeError(f"HFTargetModel supports plain DynamicCache layers only, got {type(layer).__name__}.")
            layer.keys = layer.keys.index_select(2, index.to(layer.keys.device))
            layer.values = layer.values.index_select(2, index.to(layer.values.device))
        self._pending = 0


def text_config(config):
    """The language model's part of a transformers config: itself, or a multimodal one's text_config (Gemma 3)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def has_sliding_window(config) -> bool:
    """Whether a transformers config has layers that attend through a sliding window (Mistral, Gemma 3, gpt-oss)."""
    config = text_config(config)
    if getattr(config, "sliding_window", None) is None:
        return False
    layer_types = getattr(config, "layer_types", None)
    return layer_types is None or "sliding_attention" in layer_types
