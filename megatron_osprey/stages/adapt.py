"""Stage 3: adapt the pretrained backbone to one target (vocabulary, QKV expansion, fusion fc).

    python -m megatron_osprey adapt --backbone BACKBONE_DIR --target TARGET_DIR --output OUT
        [--aux-layer-ids 1 15 28] [--draft-vocab-size 32000 --token-counts counts.json]

BACKBONE_DIR is the output of Stage 1 (prune) or Stage 2 (pretrain). TARGET_DIR holds the target's config.json
and tokenizer; no weights are read. Writes OUT/megatron/ (dist checkpoint), OUT/hf/ (reference drafter),
OUT/tokenizer_alignment.json, OUT/run_config.yaml and OUT/provenance.json. The surgery is models/drafter/adapt.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from megatron_osprey.base.outputs import check_not_partial, check_output
from megatron_osprey.base.provenance import PROVENANCE_FILE
from megatron_osprey.config.flags import STORE_TRUE, Flag, under
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

ALIGNMENT_POLICIES = ("reference", "bytes_and_roles")


@dataclasses.dataclass
class AdaptConfig:
    """Stage 3 settings."""

    backbone: str | None = None
    target: str | None = None
    output: str | None = None
    aux_layer_ids: list[int] | None = None  # None: [1, L//2 - 1, L - 4] of the target
    draft_vocab_size: int | None = None
    token_counts: str | None = None
    alignment_policy: str = "reference"  # or "bytes_and_roles" (models/drafter/vocab_alignment.py)
    overwrite: bool = False
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)

    def validate(self) -> None:
        """Required paths and a free output, before anything is read."""
        for flag, value in (("--backbone", self.backbone), ("--target", self.target), ("--output", self.output)):
            if not value:
                raise ValueError(f"{flag} is required.")
        if self.alignment_policy not in ALIGNMENT_POLICIES:
            raise ValueError(f"--alignment-policy must be one of {ALIGNMENT_POLICIES}, got {self.alignment_policy!r}.")
        check_not_partial(self.backbone, "--backbone")  # a prune or pretrain run stopped midway, by name
        # Every rank refuses a taken --output here, before any process group; rank 0 claims it in run().
        check_output(self.output, self.inputs(), PROVENANCE_FILE, self.overwrite, stage="adapt")

    def inputs(self) -> dict:
        return {"--backbone": self.backbone, "--target": self.target, "--token-counts": self.token_counts}


FLAGS = {
    "adapt": [
        Flag("--backbone", "backbone", {"help": "the prune or pretrain stage's output"}),
        Flag("--target", "target", {"help": "the target's HF directory (config.json + tokenizer; no weights read)"}),
        Flag("--output", "output", {}),
        Flag(
            "--aux-layer-ids",
            "aux_layer_ids",
            {
                "type": int,
                "nargs": 3,
                "help": "0-based target layers whose outputs feed fusion_fc (default [1, L//2-1, L-4])",
            },
        ),
        Flag("--draft-vocab-size", "draft_vocab_size", {"type": int, "help": "reduced draft vocabulary (top-K ids)"}),
        Flag("--token-counts", "token_counts", {"help": "JSON list/object of target-token counts"}),
        Flag(
            "--alignment-policy",
            "alignment_policy",
            {
                "choices": list(ALIGNMENT_POLICIES),
                "help": "vocabulary alignment for rows without a byte-identical backbone token: Osprey's released "
                "rule (default) or this project's byte/role rule",
            },
        ),
        Flag("--overwrite", "overwrite", STORE_TRUE),
    ],
    "distributed": under("parallel", [f for f in PARALLEL_FLAGS if f.flag == "--tensor-model-parallel-size"]),
}


def run(config: AdaptConfig, invocation: Invocation = Invocation("adapt")) -> dict:
    """Adapt on this rank, inside the job's process groups (collective); returns the alignment report."""
    from megatron_osprey.base.arch import ModelArch

    config.validate()
    backbone = Path(config.backbone)
    from megatron_osprey.models.drafter.adapt import backbone_hf_dir

    hf = backbone_hf_dir(backbone)  # a prune/pretrain output's hf/, or a released (already pruned) HF model as is
    inputs = {"backbone": hf, "backbone_config": (backbone / "run_config.yaml") if hf != backbone else None}
    inputs |= {"target_config": Path(config.target) / "config.json", "token_counts": config.token_counts}
    inputs = check_inputs(inputs) if is_rank0() else {}
    target = ModelArch.from_hf_config(config.target)  # the one parse of its config.json

    def adapt_and_write(state):
        # Marked partial from before the first file to provenance.json, written last (as prune's output).
        with claimed_by_rank0(config.output, config.inputs(), config.overwrite, "adapt") as output:
            report = _adapt_and_write(config, target, state)
            if state.rank == 0:
                names = ("megatron", "hf", "run_config.yaml", "tokenizer_alignment.json")
                invocation.record(output, config, inputs, {name.split(".")[0]: output / name for name in names})
        return report

    return in_process_groups(config.parallel, adapt_and_write)


def _adapt_and_write(config: AdaptConfig, target, state) -> dict:
    """The adapted reference drafter, written as OUT/hf and OUT/megatron with the report (collective)."""
    import torch

    from megatron_osprey.base.atomic_io import write_text_atomic
    from megatron_osprey.base.hf_files import copy_tokenizer_files
    from megatron_osprey.base.run_config import save_run_config
    from megatron_osprey.models.drafter.adapt import adapt_reference_drafter
    from megatron_osprey.models.drafter.convert import load_reference_state
    from megatron_osprey.models.drafter.model import build_drafter_model
    from megatron_osprey.training.checkpointing import save_checkpoint

    parallel = state.config
    adapted = adapt_reference_drafter(
        config, target, parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    )
    output, arch = Path(config.output), adapted.arch
    run_config = {
        "stage": "adapt",
        "backbone": str(config.backbone),
        "target": str(config.target),
        "drafter": arch.to_dict(),
        "alignment_counts": adapted.report["counts"],
        "parallel": parallel,
    }
    if state.rank == 0:  # rank 0 has claimed OUT (run)
        (output / "hf").mkdir(parents=True, exist_ok=True)
        adapted.drafter.save_pretrained(output / "hf")
        copy_tokenizer_files(config.target, output / "hf")
        report = json.dumps(adapted.report, indent=2, ensure_ascii=False)
        write_text_atomic(output / "tokenizer_alignment.json", report)
        save_run_config(output / "run_config.yaml", run_config)
    torch.distributed.barrier()
    model = build_drafter_model(arch, parallel, params_dtype=arch.body.torch_dtype_obj(), perform_initialization=False)
    load_reference_state(model, adapted.drafter.state_dict(), state.tp_rank, parallel.tensor_model_parallel_size)
    save_checkpoint(output / "megatron", 0, model.sharded_state_dict(), run_config)
    return adapted.report


def main(argv: list[str] | None = None, recipes=None) -> int:
    """Parse the flags, adapt, print the alignment counts on rank 0; returns the exit code (2: bad input)."""
    config, invocation = parse_config(argv, "adapt", AdaptConfig, FLAGS, __doc__, recipes)

    def adapt_and_report() -> None:
        report = run(config, invocation)
        if is_rank0():
            counts = report["counts"]
            summary = {key: report[key] for key in ("policy", "counts", "draft_vocab_size", "aux_layer_ids")}
            print(json.dumps(summary))
            rows = ", ".join(f"{count:,} {kind}" for kind, count in counts.items())
            where = f"{config.backbone} -> {config.output} for {config.target}"
            print(f"adapted {where} ({report['policy']} alignment): {rows}")

    return exit_code(adapt_and_report)


if __name__ == "__main__":
    # Deprecated for one release: hands over to the job door (`python -m megatron_osprey adapt`) by exec,
    # so the job never imports this file twice; the recipe registry above the stages is the door's to import.
    from megatron_osprey.stages.cli import deprecated_module_door

    deprecated_module_door("adapt")
