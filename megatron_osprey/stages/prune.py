"""Stage 1: prune a HF small LM (e.g. Qwen3-4B) to its embedding + first N blocks + final norm + LM head.

python tools/prune_backbone.py --source HF_DIR --num-layers 2 --output OUT
torchrun --nproc_per_node=2 tools/prune_backbone.py ... --tensor-model-parallel-size 2
(python -m megatron_osprey.stages.prune takes the same flags)
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path

import torch

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.base.hf_files import copy_tokenizer_files
from megatron_osprey.base.run_config import save_run_config
from megatron_osprey.convert.hf_to_megatron import load_hf_weights
from megatron_osprey.convert.megatron_to_hf import export_to_hf
from megatron_osprey.models.backbone.gpt import build_gpt_model
from megatron_osprey.models.backbone.importance import prune_by_importance
from megatron_osprey.parallel import ParallelConfig, ParallelState, parallel_context
from megatron_osprey.stages.cli import config_from_flags, exit_code, is_rank0
from megatron_osprey.training.checkpointing import save_checkpoint

STRATEGIES = ("first", "importance")


@dataclasses.dataclass
class PruneConfig:
    """Stage 1 settings (the paper keeps the first 2 of Qwen3-4B's 36 layers)."""

    source: Path
    output: Path
    num_layers: int = 2
    strategy: str = "first"
    transformer_impl: str = "auto"
    overwrite: bool = False
    calibration_data: Path | None = None  # JSONL with "text", for --strategy importance


@dataclasses.dataclass
class PruneResult:
    arch: ModelArch
    num_parameters: int
    kept_layers: list[int]
    output: Path


def validate(config: PruneConfig) -> ModelArch:
    """Check the source, N and the output before any work; returns the source architecture."""
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
    output = Path(config.output)
    if output.exists() and any(output.iterdir()) and not config.overwrite:
        raise FileExistsError(f"--output {output} exists and is not empty; pass --overwrite to replace it.")
    return arch


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


def prune_backbone(config: PruneConfig, parallel: ParallelState) -> PruneResult:
    """Run Stage 1 on this rank (collective); writes megatron/, hf/ and run_config.yaml."""
    arch = validate(config)
    if config.strategy == "importance":
        model, kept, pruned = prune_by_importance(config, arch, parallel)
        return write_pruned(config, pruned, [model], kept, parallel)
    kept = list(range(config.num_layers))
    pruned = arch.with_num_layers(config.num_layers)
    model = build_gpt_model(
        pruned,
        parallel.config,
        transformer_impl=config.transformer_impl,
        params_dtype=arch.torch_dtype_obj(),
        perform_initialization=False,
    )
    # The pruned model's layers are the source's first N: loading reads only those slices.
    load_hf_weights(model, config.source, pruned, parallel.tp_rank, parallel.config.tensor_model_parallel_size)
    return write_pruned(config, pruned, [model], kept, parallel)


def write_pruned(
    config: PruneConfig, arch: ModelArch, models: list, kept: list[int], parallel: ParallelState
) -> PruneResult:
    """Write OUT/megatron (dist checkpoint), OUT/hf (+ tokenizer files) and OUT/run_config.yaml."""
    output = Path(config.output)
    if parallel.rank == 0:
        if output.exists() and config.overwrite:
            shutil.rmtree(output)
        output.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    run_config = {
        "stage": "prune",
        "source": str(config.source),
        "strategy": config.strategy,
        "num_layers": arch.num_layers,
        "kept_layers": kept,
        "transformer_impl": models[0].transformer_impl,
        "parallel": parallel.config,
        "hf_config": arch.hf_config | {"num_hidden_layers": arch.num_layers},
    }
    sharded = models[0].sharded_state_dict()
    save_checkpoint(output / "megatron", 0, sharded, run_config)
    export_to_hf(models, arch, output / "hf")
    if parallel.rank == 0:
        copy_tokenizer_files(config.source, output / "hf", with_generation_config=True)
        save_run_config(output / "run_config.yaml", run_config)
    torch.distributed.barrier()
    return PruneResult(arch=arch, num_parameters=arch.num_parameters(), kept_layers=kept, output=output)


def run(config: PruneConfig, parallel: ParallelConfig) -> PruneResult:
    """Check the inputs before any process group exists, then prune on this rank (collective)."""
    validate(config)
    with parallel_context(parallel) as state:
        return prune_backbone(config, state)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--source", required=True, type=Path, help="HF model directory (config.json + safetensors + tokenizer)"
    )
    parser.add_argument("--num-layers", required=True, type=int, help="blocks to keep (the paper: 2)")
    parser.add_argument("--output", required=True, type=Path, help="writes OUT/megatron, OUT/hf, OUT/run_config.yaml")
    parser.add_argument(
        "--strategy",
        default="first",
        choices=STRATEGIES,
        help="first N blocks (paper), or Minitron layer importance via nvidia-modelopt (GPU)",
    )
    parser.add_argument(
        "--calibration-data", type=Path, default=None, help="JSONL with 'text' for --strategy importance"
    )
    parser.add_argument("--transformer-impl", default="auto", choices=["auto", "local", "transformer_engine"])
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Parse the flags, prune, print a summary on rank 0; returns the exit code (2: bad input, one line)."""
    args = parse_args(argv)
    config = config_from_flags(PruneConfig, args)

    def prune_and_report() -> None:
        result = run(config, config_from_flags(ParallelConfig, args))
        if is_rank0():
            arch = result.arch
            print(
                f"pruned {config.source} -> {config.output}: kept layers {result.kept_layers}, "
                f"{result.num_parameters:,} parameters "
                f"({'tied' if arch.tie_word_embeddings else 'untied'} embedding, vocab {arch.vocab_size:,}, "
                f"hidden {arch.hidden_size})"
            )

    # RuntimeError: --strategy importance refused on a machine without CUDA.
    return exit_code(prune_and_report, also=(RuntimeError,))


if __name__ == "__main__":
    sys.exit(main())
