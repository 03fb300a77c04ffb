"""Export Megatron-Core model stages back to a HF safetensors checkpoint + config.

TP shards are gathered within each stage's TP group; each PP stage writes its
own safetensors file, so no process ever holds the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.base.atomic_io import write_text_atomic
from megatron_osprey.convert.safetensors_io import INDEX_NAME, write_safetensors_atomic
from megatron_osprey.convert.sharding import merge_shards
from megatron_osprey.convert.weight_map import Split, match_rule, rules_for


def _gather_tp(tensor: torch.Tensor, tp_group) -> list[torch.Tensor]:
    size = torch.distributed.get_world_size(tp_group)
    if size == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=tp_group)
    return parts


@torch.no_grad()
def stage_to_hf_tensors(
    models: list, arch: ModelArch, tp_group=None, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """This PP stage's parameters as full HF tensors (collective over the TP group)."""
    from megatron_osprey.convert.hf_to_megatron import global_layer_index

    out: dict[str, torch.Tensor] = {}
    for model in models:
        rules = rules_for(arch, getattr(model, "transformer_impl", "local"))
        for name, param in model.named_parameters():
            found = match_rule(name, rules)
            if found is None:
                raise KeyError(f"no HF weight rule for Megatron parameter {name!r}.")
            rule, local_layer = found
            if name == "output_layer.weight" and arch.tie_word_embeddings:
                continue  # the last stage's copy of the tied embedding
            layer = None if local_layer is None else global_layer_index(model, local_layer)
            names = [t.format(layer=layer) for t in rule.hf]
            shards = [param.detach()] if rule.split is Split.REPLICATED else _gather_tp(param.detach(), tp_group)
            for hf_name, tensor in merge_shards(rule, shards, names, arch).items():
                out[hf_name] = tensor.to(dtype or arch.torch_dtype_obj()).contiguous().clone()
    return out


def hf_config_dict(arch: ModelArch) -> dict:
    """config.json for the exported model: the source config with this arch's layer count."""
    config = dict(arch.hf_config)
    config["num_hidden_layers"] = arch.num_layers
    config["architectures"] = [arch.hf_architecture]
    config["torch_dtype"] = arch.torch_dtype
    config.pop("dtype", None)
    return config


def export_to_hf(models: list, arch: ModelArch, output_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write `output_dir/` as a HF checkpoint; call on every rank (collective)."""
    from megatron.core import parallel_state as mpu

    if arch.is_moe:
        raise NotImplementedError(
            f"export of {arch.family} (mixture of experts) is not supported: MoE models are "
            f"read-only targets here; export the drafter instead."
        )
    output_dir = Path(output_dir)
    tp_group = mpu.get_tensor_model_parallel_group()
    tensors = stage_to_hf_tensors(models, arch, tp_group, dtype)
    pp_rank, pp_size = mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size()
    writer = mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0
    file_name = "model.safetensors" if pp_size == 1 else f"model-{pp_rank + 1:05d}-of-{pp_size:05d}.safetensors"
    if writer:
        output_dir.mkdir(parents=True, exist_ok=True)
        write_safetensors_atomic(output_dir / file_name, tensors)
    entries = {name: (file_name, t.numel() * t.element_size()) for name, t in tensors.items()} if writer else {}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, entries)
    if torch.distributed.get_rank() == 0:
        weight_map = {k: v[0] for part in gathered for k, v in part.items()}
        if pp_size > 1:
            total = sum(v[1] for part in gathered for v in part.values())
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            write_text_atomic(output_dir / INDEX_NAME, json.dumps(index, indent=2))
        write_text_atomic(output_dir / "config.json", json.dumps(hf_config_dict(arch), indent=2))
    torch.distributed.barrier()
    return output_dir
