"""Load a HF Qwen3 / Llama checkpoint into this rank's Megatron-Core model stage.

Each rank reads only its own TP slice of its own PP stage's tensors, straight
from the safetensors files: a 70B checkpoint is never materialized whole.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_osprey.convert.safetensors_io import SafetensorsCheckpoint
from megatron_osprey.convert.sharding import read_shard
from megatron_osprey.convert.weight_map import match_rule, rules_for
from megatron_osprey.models.arch import ModelArch


def global_layer_index(model, local_index: int) -> int:
    """The HF (0-based, global) index of this stage's `local_index`-th decoder layer."""
    return model.decoder.layers[local_index].layer_number - 1


def hf_names_for(model, rule, local_layer: int | None, arch: ModelArch, ckpt: SafetensorsCheckpoint) -> list[str]:
    """The HF tensor names that make up one Megatron parameter of this stage."""
    layer = None if local_layer is None else global_layer_index(model, local_layer)
    names = [template.format(layer=layer) for template in rule.hf]
    if names == ["lm_head.weight"] and arch.tie_word_embeddings and not ckpt.has("lm_head.weight"):
        # Tied checkpoints store the shared matrix once, as the embedding.
        names = ["model.embed_tokens.weight"]
    return names


@torch.no_grad()
def load_hf_weights(model, hf_dir: str | Path, arch: ModelArch, tp_rank: int, tp_size: int) -> list[str]:
    """Copy this rank's slices of the HF checkpoint into `model`; returns the parameter names set."""
    rules = rules_for(arch, getattr(model, "transformer_impl", "local"))
    loaded = []
    with SafetensorsCheckpoint(hf_dir) as ckpt:
        for name, param in model.named_parameters():
            found = match_rule(name, rules)
            if found is None:
                raise KeyError(f"no HF weight rule for Megatron parameter {name!r} ({arch.family}).")
            rule, local_layer = found
            names = hf_names_for(model, rule, local_layer, arch, ckpt)
            shard = read_shard(ckpt, rule, names, arch, tp_rank, tp_size)
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(
                    f"{hf_dir}: {names} gives a shard of shape {tuple(shard.shape)} for {name} "
                    f"of shape {tuple(param.shape)}: the checkpoint does not match its config.json."
                )
            param.copy_(shard.to(param.dtype))
            loaded.append(name)
    return loaded
