"""Load a HF checkpoint (every family of base/arch.SUPPORTED_FAMILIES) into this rank's model stage.

Each rank reads only its own TP slice of its own PP stage's tensors, and of the
experts only its EP rank's, straight from the safetensors files: a 70B or 229B
checkpoint is never materialized whole. FP8 block-scaled tensors are dequantized
as they are read, on the device the model lives on (see safetensors_io); MXFP4
experts (gpt-oss) one expert at a time (see mxfp4).
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.convert.deepseek_v3 import deepseek_v3_rules
from megatron_osprey.convert.safetensors_io import SafetensorsCheckpoint
from megatron_osprey.convert.sharding import read_shard
from megatron_osprey.convert.weight_map import hf_checkpoint_name, match_rule_indices, rules_for


def global_layer_index(model, local_index: int) -> int:
    """The HF (0-based, global) index of this stage's `local_index`-th decoder layer."""
    return model.decoder.layers[local_index].layer_number - 1


def hf_names_for(
    model, rule, local_layer: int | None, arch: ModelArch, ckpt: SafetensorsCheckpoint, expert: int | None = None
) -> list[str]:
    """The HF tensor names that make up one Megatron parameter of this stage (`expert`: global id)."""
    layer = None if local_layer is None else global_layer_index(model, local_layer)
    names = [hf_checkpoint_name(arch, template.format(layer=layer, expert=expert)) for template in rule.hf]
    if rule.hf == ("lm_head.weight",) and arch.tie_word_embeddings and not ckpt.has(names[0]):
        # Tied checkpoints store the shared matrix once, as the embedding.
        names = [hf_checkpoint_name(arch, "model.embed_tokens.weight")]
    return names


def expert_layout(tp_rank: int, tp_size: int) -> tuple[int, int, int, int]:
    """(ep_rank, ep_size, etp_rank, etp_size) from Megatron-Core's groups, or a single EP rank."""
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():
        return 0, 1, tp_rank, tp_size
    return (
        mpu.get_expert_model_parallel_rank(),
        mpu.get_expert_model_parallel_world_size(),
        mpu.get_expert_tensor_parallel_rank(),
        mpu.get_expert_tensor_parallel_world_size(),
    )


def _tensors_to_load(model, rules):
    """(name, tensor) of every parameter, and of every buffer a rule asks for (router expert bias)."""
    yield from model.named_parameters()
    buffer_rules = [r for r in rules if r.buffer]
    if buffer_rules:
        for name, buf in model.named_buffers():
            found = match_rule_indices(name, buffer_rules)
            if found is not None:
                yield name, buf


@torch.no_grad()
def load_hf_weights(model, hf_dir: str | Path, arch: ModelArch, tp_rank: int, tp_size: int) -> list[str]:
    """Copy this rank's slices of the HF checkpoint into `model`; returns the tensor names set."""
    impl = getattr(model, "transformer_impl", "local")
    rules = rules_for(arch, impl) if arch.mla is None else deepseek_v3_rules(arch, impl)
    ep_rank, ep_size, etp_rank, etp_size = expert_layout(tp_rank, tp_size)
    experts_per_rank = arch.num_experts // ep_size if arch.is_moe else 0
    loaded = []
    # Where the model lives (the rank's GPU when there is one), in its dtype: FP8 blocks are dequantized there.
    first = next(model.parameters())
    with SafetensorsCheckpoint(hf_dir, device=first.device, dequantized_dtype=first.dtype) as ckpt:
        for name, param in _tensors_to_load(model, rules):
            found = match_rule_indices(name, rules)
            if found is None:
                raise KeyError(f"no HF weight rule for Megatron parameter {name!r} ({arch.family}).")
            rule, indices = found
            expert = None
            if rule.expert:
                expert = ep_rank * experts_per_rank + indices["expert"]
            names = hf_names_for(model, rule, indices.get("layer"), arch, ckpt, expert)
            rank, size = (etp_rank, etp_size) if rule.expert else (tp_rank, tp_size)
            shard = read_shard(ckpt, rule, names, arch, rank, size, expert)
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(
                    f"{hf_dir}: {names} gives a shard of shape {tuple(shard.shape)} for {name} "
                    f"of shape {tuple(param.shape)}: the checkpoint does not match its config.json."
                )
            param.copy_(shard.to(param.dtype))
            loaded.append(name)
    return loaded
