"""Stage 1: prune a HF small LM (e.g. Qwen3-4B) to its embedding + first N blocks + final norm + LM head.

    python -m megatron_osprey prune --source HF_DIR --num-layers 2 --output OUT
    torchrun --nproc_per_node=2 -m megatron_osprey prune ... --tensor-model-parallel-size 2

Writes OUT/megatron (dist checkpoint, loadable at any TP/PP), OUT/hf (safetensors + tokenizer),
OUT/run_config.yaml and OUT/provenance.json. The surgery is models/backbone/prune.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_osprey.base.outputs import check_output
from megatron_osprey.base.provenance import PROVENANCE_FILE
from megatron_osprey.config.flags import STORE_TRUE, Flag, under
from megatron_osprey.models.backbone.config import PRUNE_STRATEGIES, TRANSFORMER_IMPLS
from megatron_osprey.parallel.config import PARALLEL_FLAGS, ParallelConfig
from megatron_osprey.stages.cli import (
    Invocation,
    check_inputs,
    claimed_by_rank0,
    exit_code,
    in_process_groups,
    is_rank0,
    parse_config,
)


@dataclasses.dataclass
class PruneConfig:
    """Stage 1 settings (the paper keeps the first 2 of Qwen3-4B's 36 layers)."""

    source: str | None = None  # HF model directory: config.json, safetensors, tokenizer
    output: str | None = None
    num_layers: int = 2
    strategy: str = "first"
    transformer_impl: str = "auto"
    calibration_data: str | None = None  # JSONL with "text", for --strategy importance
    overwrite: bool = False
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)

    def validate(self) -> None:
        """The inputs and the output, before any process group exists."""
        from megatron_osprey.models.backbone.prune import validate

        for flag, value in (("--source", self.source), ("--output", self.output)):
            if not value:
                raise ValueError(f"{flag} is required.")
        # Every rank refuses a taken --output here, before any process group; rank 0 claims it in run().
        check_output(self.output, self.inputs(), PROVENANCE_FILE, self.overwrite, stage="prune")
        validate(self)

    def inputs(self) -> dict:
        return {"--source": self.source, "--calibration-data": self.calibration_data}


FLAGS = {
    "prune": [
        Flag("--source", "source", {"help": "HF model directory (config.json + safetensors + tokenizer)"}),
        Flag("--num-layers", "num_layers", {"type": int, "help": "blocks to keep (the paper: 2)"}),
        Flag("--output", "output", {"help": "writes OUT/megatron, OUT/hf, OUT/run_config.yaml"}),
        Flag(
            "--strategy",
            "strategy",
            {
                "choices": list(PRUNE_STRATEGIES),
                "help": "first N blocks (paper), or Minitron layer importance via nvidia-modelopt (GPU)",
            },
        ),
        Flag("--calibration-data", "calibration_data", {"help": "JSONL with 'text' for --strategy importance"}),
        Flag("--transformer-impl", "transformer_impl", {"choices": list(TRANSFORMER_IMPLS)}),
        Flag("--overwrite", "overwrite", {**STORE_TRUE, "help": "replace a non-empty --output"}),
    ],
    "distributed": under(
        "parallel",
        [f for f in PARALLEL_FLAGS if f.flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size")],
    ),
}


def run(config: PruneConfig, invocation: Invocation = Invocation("prune")):
    """Check the inputs before any process group exists, then prune and write on every rank (collective)."""
    from megatron_osprey.models.backbone.prune import prune_backbone

    config.validate()
    inputs = check_inputs({"source": config.source}) if is_rank0() else {}

    def prune_and_write(state):
        pruned = prune_backbone(config, state)
        # Marked partial (WRITING_MARKER) from before the first file to provenance.json, written last: a run
        # stopped in between leaves an output the next stage refuses and `prune --overwrite` empties.
        with claimed_by_rank0(config.output, config.inputs(), config.overwrite, "prune") as output:
            _write(config, pruned, state)
            if state.rank == 0:
                outputs = {
                    "megatron": output / "megatron",
                    "hf": output / "hf",
                    "run_config": output / "run_config.yaml",
                }
                invocation.record(output, config, inputs, outputs)
        return pruned

    return in_process_groups(config.parallel, prune_and_write)


def _write(config: PruneConfig, pruned, state):
    """OUT/megatron (dist checkpoint), OUT/hf (+ tokenizer files) and OUT/run_config.yaml (collective)."""
    import torch

    from megatron_osprey.base.hf_files import copy_tokenizer_files
    from megatron_osprey.base.run_config import save_run_config
    from megatron_osprey.convert.megatron_to_hf import export_to_hf
    from megatron_osprey.training.checkpointing import save_checkpoint

    output, arch = Path(config.output), pruned.arch
    torch.distributed.barrier()  # every rank has pruned, and rank 0 has claimed OUT
    run_config = {
        "stage": "prune",
        "source": str(config.source),
        "strategy": config.strategy,
        "num_layers": arch.num_layers,
        "kept_layers": pruned.kept_layers,
        "transformer_impl": pruned.models[0].transformer_impl,
        "parallel": state.config,
        "hf_config": arch.hf_config | {"num_hidden_layers": arch.num_layers},
    }
    save_checkpoint(output / "megatron", 0, pruned.models[0].sharded_state_dict(), run_config)
    export_to_hf(pruned.models, arch, output / "hf")
    if state.rank == 0:
        copy_tokenizer_files(config.source, output / "hf", with_generation_config=True)
        save_run_config(output / "run_config.yaml", run_config)
    torch.distributed.barrier()
    return pruned


def main(argv: list[str] | None = None, recipes=None) -> int:
    """Parse the flags, prune, print a summary on rank 0; returns the exit code (2: bad input, one line)."""
    config, invocation = parse_config(argv, "prune", PruneConfig, FLAGS, __doc__, recipes)

    def prune_and_report() -> None:
        pruned = run(config, invocation)
        if is_rank0():
            arch = pruned.arch
            print(
                f"pruned {config.source} -> {config.output}: kept layers {pruned.kept_layers}, "
                f"{arch.num_parameters():,} parameters "
                f"({'tied' if arch.tie_word_embeddings else 'untied'} embedding, vocab {arch.vocab_size:,}, "
                f"hidden {arch.hidden_size})"
            )

    # RuntimeError: --strategy importance refused on a machine without CUDA.
    return exit_code(prune_and_report, also=(RuntimeError,))


if __name__ == "__main__":
    # Deprecated for one release: hands over to the job door (`python -m megatron_osprey prune`) by exec,
    # so the job never imports this file twice; the recipe registry above the stages is the door's to import.
    from megatron_osprey.stages.cli import deprecated_module_door

    deprecated_module_door("prune")
