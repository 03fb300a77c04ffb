"""Depth pruning by layer importance (Minitron, through nvidia-modelopt).

The paper keeps the first N layers; this is the comparison it did not run. It
needs a GPU: Minitron scores layers with calibration forwards of the full model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.convert.hf_to_megatron import load_hf_weights
from megatron_osprey.models.backbone.gpt import build_gpt_model


def _calibration_batches(path: Path, tokenizer_dir: Path, seq_length: int = 512, limit: int = 64):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    with open(path) as handle:
        for line_no, line in enumerate(handle, 1):
            if line_no > limit:
                break
            text = json.loads(line).get("text")
            if not isinstance(text, str) or not text:
                raise ValueError(f"--calibration-data {path}: line {line_no} has no 'text' string.")
            ids = tokenizer(text, truncation=True, max_length=seq_length)["input_ids"]
            yield torch.tensor([ids], device="cuda")


def load_source(config, arch: ModelArch, parallel):
    """The source model (or its first layers: `arch` says how many) built on this rank and loaded from HF."""
    model = build_gpt_model(
        arch,
        parallel.config,
        transformer_impl=config.transformer_impl,
        params_dtype=arch.torch_dtype_obj(),
        perform_initialization=False,
    )
    load_hf_weights(model, config.source, arch, parallel.tp_rank, parallel.config.tensor_model_parallel_size)
    return model


def prune_by_importance(config, arch: ModelArch, parallel) -> tuple[torch.nn.Module, list[int], ModelArch]:
    """Score layers on calibration text with Minitron and keep the N most important.

    Returns the pruned model (on CPU), the source indices of the kept layers and the pruned architecture.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "--strategy importance scores layers with nvidia-modelopt's Minitron on a GPU and this "
            "machine has no CUDA; use --strategy first (the paper's choice) on CPU."
        )
    if config.calibration_data is None or not Path(config.calibration_data).is_file():
        raise FileNotFoundError(
            f"--strategy importance needs --calibration-data JSONL with a 'text' field (got {config.calibration_data})."
        )
    import modelopt.torch.prune as mtp

    model = load_source(config, arch, parallel)
    model.cuda().eval()
    batches = list(_calibration_batches(Path(config.calibration_data), Path(config.source)))

    def forward_loop(m):
        with torch.no_grad():
            for ids in batches:
                positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
                m(ids, positions, attention_mask=None)

    for layer in model.decoder.layers:
        layer.osprey_source_layer = layer.layer_number - 1  # Minitron renumbers the survivors
    model, _ = mtp.prune(
        model,
        mode="mcore_minitron",
        constraints={"export_config": {"num_layers": config.num_layers}},
        dummy_input=None,
        config={"forward_loop": forward_loop},
    )
    kept = [layer.osprey_source_layer for layer in model.decoder.layers]
    pruned = arch.with_num_layers(config.num_layers)
    model.osprey_arch = pruned
    return model.cpu(), kept, pruned
