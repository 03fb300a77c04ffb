"""A frozen target model stage (dense or MoE) loaded from HF safetensors, with hidden-state capture.

Each rank builds only its own pipeline stage and reads only its TP / EP slices
(see convert.hf_to_megatron). `prefill_capture` runs one prefill forward and
returns the outputs of the requested decoder layers, full-sequence and in
[batch, seq, hidden] order, on the rank that writes them: the last pipeline
stage's tensor-parallel rank 0. Other stages send the layers they own to that
rank point to point, so that a sample's hidden states always land in one shard
file (the store keeps a sample whole, and one writer per data-parallel replica
keeps resume simple).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.convert.hf_to_megatron import load_hf_weights
from megatron_osprey.models.backbone.gpt import build_gpt_model
from megatron_osprey.parallel import ParallelConfig, loading_window

# Weight bytes the fingerprint reads per safetensors file: SAMPLES windows of WINDOW bytes spread
# over the file, so a fine-tune of the same shape (new values in every layer) changes it.
_FINGERPRINT_SAMPLES = 16
_FINGERPRINT_WINDOW = 4096


def _weights_fingerprint(target_dir: Path, digest) -> None:
    for path in sorted(target_dir.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as handle:
            for k in range(_FINGERPRINT_SAMPLES):
                handle.seek(size * k // _FINGERPRINT_SAMPLES)
                digest.update(handle.read(_FINGERPRINT_WINDOW))


def target_identity(arch: ModelArch, target_dir: str | Path) -> tuple[str, str]:
    """(target_id, config_hash): the name a store records, and a hash that identifies the target.

    The hash covers config.json (less its name and transformers version) and a sample of
    the weight files' bytes, so a store extracted from another target of the same shape
    does not match; it reads a few KiB per file, not the model.
    """
    config = {k: v for k, v in arch.hf_config.items() if k not in ("_name_or_path", "transformers_version")}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    _weights_fingerprint(Path(target_dir), digest)
    name = arch.hf_config.get("_name_or_path") or Path(target_dir).resolve().name
    return f"{arch.family}:{name}", digest.hexdigest()[:16]


@dataclasses.dataclass
class TargetStage:
    """This rank's stage of the target, with what the capture and the writer need to know."""

    arch: ModelArch
    model: torch.nn.Module
    parallel: ParallelConfig
    device: torch.device
    dtype: torch.dtype

    @property
    def owned_layers(self) -> list[int]:
        """Global (0-based) ids of this stage's decoder layers."""
        return [layer.layer_number - 1 for layer in self.model.decoder.layers]


def load_target(
    target_dir: str | Path,
    parallel: ParallelConfig,
    device: torch.device,
    *,
    params_dtype: torch.dtype = torch.float32,
    transformer_impl: str = "auto",
    with_lm_head: bool = False,
    arch: ModelArch | None = None,
) -> TargetStage:
    """Build this rank's stage and load its slices (needs initialized model-parallel state); `arch` is the
    target's parsed config.json when the caller has it already."""
    from megatron.core import parallel_state as mpu

    arch = arch or ModelArch.from_hf_config(target_dir)
    last = mpu.is_pipeline_last_stage()
    # Each rank reads (and, for FP8 block-scaled checkpoints, dequantizes on its device) its own slice only, at
    # its own pace; the ranks then wait for the slowest under --loading-timeout-minutes, not the collective timeout.
    with loading_window(parallel):
        # Without the LM head the last stage returns the pre-norm hidden state, which
        # is all extraction needs: no vocab-sized logits, no final norm or LM head to load.
        # Without the LM head nothing is tied: a pipelined first stage would otherwise wait to sum its embedding
        # with the output layer of a last stage that has none (a tied target, e.g. Gemma 3, hung at PP > 1).
        built = arch if with_lm_head else dataclasses.replace(arch, tie_word_embeddings=False)
        model = build_gpt_model(
            built,
            parallel,
            transformer_impl=transformer_impl,
            params_dtype=params_dtype,
            post_process=last and with_lm_head,
            perform_initialization=False,
        )
        model = model.to(device).eval()
        for param in model.parameters():
            param.requires_grad_(False)
        tp_rank, tp_size = mpu.get_tensor_model_parallel_rank(), parallel.tensor_model_parallel_size
        load_hf_weights(model, target_dir, built, tp_rank, tp_size)
    return TargetStage(arch, model, parallel, device, params_dtype)


class LayerCapture:
    """Forward hooks that keep the outputs of this stage's decoder layers listed in `layer_ids`."""

    def __init__(self, model, layer_ids) -> None:
        self.outputs: dict[int, torch.Tensor] = {}
        self._handles = []
        wanted = set(layer_ids)
        for layer in model.decoder.layers:
            global_id = layer.layer_number - 1
            if global_id in wanted:
                self._handles.append(layer.register_forward_hook(self._hook(global_id)))

    def _hook(self, global_id: int):
        def hook(module, inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            self.outputs[global_id] = hidden.detach()

        return hook

    def clear(self) -> None:
        self.outputs.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def gather_sequence(hidden: torch.Tensor) -> torch.Tensor:
    """[s/TP, b, h] sequence-parallel shards -> the full [s, b, h] on every TP rank (forward only)."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)


def _stage_forward(model, input_ids: torch.Tensor, position_ids: torch.Tensor, pipeline_size: int):
    """One forward of this stage (through Megatron's forward-only schedule when pipelined)."""
    if pipeline_size == 1:
        return model(input_ids, position_ids, attention_mask=None)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        ids, pos = next(data_iterator)
        output = model(ids, pos, attention_mask=None)
        return output, lambda out: (out.sum() * 0, {})

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([(input_ids, position_ids)]),
        model=[model],
        num_microbatches=1,
        seq_length=input_ids.shape[1],
        micro_batch_size=input_ids.shape[0],
        forward_only=True,
    )
    return None


class PrefillCapture:
    """Runs prefill forwards of a TargetStage and collects chosen layers' outputs on the writer rank."""

    def __init__(self, stage: TargetStage, layer_ids) -> None:
        from megatron.core import parallel_state as mpu

        self.stage = stage
        self.layer_ids = sorted(set(layer_ids))
        self.capture = LayerCapture(stage.model, self.layer_ids)
        self.tp_size = stage.parallel.tensor_model_parallel_size
        self.pp_size = stage.parallel.pipeline_model_parallel_size
        self.tp_rank = mpu.get_tensor_model_parallel_rank()
        self.pp_rank = mpu.get_pipeline_model_parallel_rank()
        self.is_writer = self.tp_rank == 0 and mpu.is_pipeline_last_stage()
        self.owner: dict[int, int] = {}
        self.pp_ranks: list[int] = []
        if self.pp_size > 1:
            group = mpu.get_pipeline_model_parallel_group()
            self.pp_ranks = torch.distributed.get_process_group_ranks(group)
            owned = [None] * self.pp_size
            torch.distributed.all_gather_object(owned, stage.owned_layers, group=group)
            self.owner = {layer: s for s, layers in enumerate(owned) for layer in layers}
        else:
            self.owner = {layer: 0 for layer in stage.owned_layers}

    @property
    def sequence_multiple(self) -> int:
        """Inputs are padded to a multiple of this (sequence parallel splits the sequence over TP)."""
        return self.tp_size if self.stage.parallel.sequence_parallel else 1

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> dict[int, torch.Tensor] | None:
        """Outputs [b, s, h] of `layer_ids` for right-padded `input_ids` [b, s]; None off the writer rank."""
        if input_ids.shape[1] % self.sequence_multiple:
            raise ValueError(
                f"sequence length {input_ids.shape[1]} must be a multiple of {self.sequence_multiple} "
                f"under --sequence-parallel; pad the batch."
            )
        input_ids = input_ids.to(self.stage.device)
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        self.capture.clear()
        _stage_forward(self.stage.model, input_ids, position_ids, self.pp_size)
        local = {}
        for layer, hidden in self.capture.outputs.items():
            if self.stage.parallel.sequence_parallel:
                hidden = gather_sequence(hidden)
            local[layer] = hidden
        self.capture.clear()
        if self.pp_size > 1:
            local = self._collect_on_last_stage(local, input_ids.shape)
        if not self.is_writer:
            return None
        return {layer: local[layer].transpose(0, 1) for layer in self.layer_ids}

    def _collect_on_last_stage(self, local: dict[int, torch.Tensor], shape) -> dict[int, torch.Tensor]:
        # Only TP rank 0's pipeline group moves tensors: after the SP gather every TP
        # rank holds the same full sequence, and rank 0 of the last stage writes.
        if self.tp_rank != 0:
            return local
        last = self.pp_size - 1
        hidden = self.stage.arch.hidden_size
        for layer in self.layer_ids:
            owner = self.owner[layer]
            if owner == last:
                continue
            if self.pp_rank == owner:
                torch.distributed.send(local[layer].contiguous(), self.pp_ranks[last], tag=layer)
            elif self.pp_rank == last:
                buffer = torch.empty(shape[1], shape[0], hidden, dtype=self.stage.dtype, device=self.stage.device)
                torch.distributed.recv(buffer, self.pp_ranks[owner], tag=layer)
                local[layer] = buffer
        return local

    def close(self) -> None:
        self.capture.remove()
