"""Stage 1's surgery: a HF small LM cut to its embedding + first N blocks + final norm + LM head (written by
the prune stage).

`config` is the prune stage's PruneConfig (stages/prune.py): source, output, num_layers, strategy,
transformer_impl, calibration_data, overwrite.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.models.backbone.config import PRUNE_STRATEGIES as STRATEGIES
from megatron_osprey.models.backbone.importance import load_source, prune_by_importance
from megatron_osprey.parallel import ParallelState


@dataclasses.dataclass
class PrunedBackbone:
    """The pruned model on this rank, its architecture and which source layers it kept."""

    arch: ModelArch
    models: list
    kept_layers: list[int]


def validate(config) -> ModelArch:
    """Check the source and N before any work; returns the source architecture."""
    source = Path(config.source)
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"--source {source}: no config.json there (expected a HF model directory).")
    if not any(source.glob("*.safetensors")):
        raise FileNotFoundError(f"--source {source}: no *.safetensors weights there.")
    arch = ModelArch.from_hf_config(source / "config.json")
    if not 1 <= config.num_layers <= arch.num_layers:
        raise ValueError(f"--num-layers {config.num_layers} is out of range: {source} has {arch.num_layers} layers.")
    check_vocab_fits(source, arch.vocab_size)
    if config.strategy not in STRATEGIES:
        raise ValueError(f"--strategy must be one of {STRATEGIES}, got {config.strategy!r}.")
    return arch  # --output: the stage checks it (check_output) and claims it before this runs


def check_vocab_fits(source: Path, vocab_size: int) -> None:
    """config.json's vocab_size covers the embedding's rows and the tokenizer's ids.

    A smaller vocab_size would silently cut the embedding on load, and the
    tokenizer's high ids would index past it later (Stage 3 fails with an IndexError).
    """
    from megatron_osprey.convert.safetensors_io import SafetensorsCheckpoint

    with SafetensorsCheckpoint(source) as checkpoint:
        name = "model.embed_tokens.weight"
        rows = checkpoint.shape(name)[0] if checkpoint.has(name) else 0
    if rows > vocab_size:
        raise ValueError(
            f"--source {source}: config.json's vocab_size {vocab_size} is smaller than the "
            f"embedding's {rows} rows; fix vocab_size (pruning would cut the embedding)."
        )
    tokenizer_file = source / "tokenizer.json"
    if tokenizer_file.is_file():
        from tokenizers import Tokenizer

        tokens = Tokenizer.from_file(str(tokenizer_file)).get_vocab_size(with_added_tokens=True)
        if tokens > vocab_size:
            raise ValueError(
                f"--source {source}: config.json's vocab_size {vocab_size} is smaller than the "
                f"tokenizer's {tokens} tokens ({tokenizer_file}); the model cannot embed its ids."
            )


def prune_backbone(config, parallel: ParallelState) -> PrunedBackbone:
    """Build the pruned model on this rank and load the kept layers' weights (collective)."""
    arch = validate(config)
    if config.strategy == "importance":
        model, kept, pruned = prune_by_importance(config, arch, parallel)
        return PrunedBackbone(pruned, [model], kept)
    pruned = arch.with_num_layers(config.num_layers)
    # The pruned model's layers are the source's first N: loading reads only those slices.
    model = load_source(config, pruned, parallel)
    return PrunedBackbone(pruned, [model], list(range(config.num_layers)))
