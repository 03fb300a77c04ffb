"""sglang.srt.model_loader.weight_utils stand-in: default_weight_loader."""

import torch


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    if param.size() != loaded_weight.size():
        raise ValueError(f"Attempted to load weight ({loaded_weight.size()}) into parameter ({param.size()})")
    param.data.copy_(loaded_weight)
