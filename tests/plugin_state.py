"""What the SGLang plugin's parameters hold once its loader has fused the exported tensors."""

from __future__ import annotations

import torch

from megatron_osprey.export.sglang_plugin.weight_names import plugin_param_name


def fused_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the plugin's parameters hold after loading at TP=1 (shards concatenated in loader order)."""
    order = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1}
    parts: dict[str, list] = {}
    out = {}
    for name, tensor in tensors.items():
        mapped = plugin_param_name(name)
        if mapped is None:
            continue
        param, shard = mapped
        if shard is None:
            out[param] = tensor
        else:
            parts.setdefault(param, []).append((order[shard], tensor))
    for param, pieces in parts.items():
        out[param] = torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])], dim=0)
    return out
