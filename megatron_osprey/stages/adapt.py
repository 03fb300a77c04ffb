"""Stage 3: adapt the pretrained backbone to one target (vocabulary, QKV expansion, fusion fc).

    python tools/adapt_drafter.py --backbone BACKBONE_DIR --target TARGET_DIR --output OUT
        [--aux-layer-ids 1 15 28] [--draft-vocab-size 32000 --token-counts counts.json]
    (python -m megatron_osprey.stages.adapt takes the same flags)

BACKBONE_DIR is the --output of Stage 1 (tools/prune_backbone.py) or Stage 2.
TARGET_DIR holds the target's config.json and tokenizer; no weights are read.
Writes OUT/megatron/ (dist checkpoint), OUT/hf/ (reference drafter) and
OUT/tokenizer_alignment.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import torch

from megatron_osprey.base.arch import ModelArch, resolve_aux_layer_ids
from megatron_osprey.base.atomic_io import write_text_atomic
from megatron_osprey.base.hf_files import copy_tokenizer_files
from megatron_osprey.base.run_config import load_run_config, save_run_config
from megatron_osprey.convert.safetensors_io import SafetensorsCheckpoint
from megatron_osprey.models.drafter.arch import DrafterArch
from megatron_osprey.models.drafter.vocab_alignment import align_vocabularies, aligned_rows, alignment_report, view_of
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.stages.cli import config_from_flags, exit_code, is_rank0

BACKBONE_STAGES = ("prune", "pretrain")


@dataclasses.dataclass
class AdaptConfig:
    """Stage 3 settings."""

    backbone: Path
    target: Path
    output: Path
    aux_layer_ids: list[int] | None = None
    draft_vocab_size: int | None = None
    token_counts: Path | None = None
    variant: str = "osprey"
    overwrite: bool = False
    alignment_policy: str = "reference"  # or "bytes_and_roles" (models/drafter/vocab_alignment.py)


@dataclasses.dataclass
class TargetInfo:
    hidden_size: int
    num_layers: int
    vocab_size: int
    config: dict


def read_target(target_dir: Path) -> TargetInfo:
    """The target's config.json facts the drafter needs (no weights are read)."""
    path = Path(target_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--target {target_dir}: no config.json there (a HF model directory is expected).")
    config = json.loads(path.read_text())
    text = config.get("text_config", config)  # multimodal wrappers nest the LM config
    for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
        if key not in text:
            raise ValueError(f"--target {path}: config has no {key!r}.")
    return TargetInfo(int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"]), config)


def backbone_hf_dir(backbone_dir: Path) -> Path:
    """The HF export of a Stage 1/2 backbone; refuses directories that are not one."""
    backbone_dir = Path(backbone_dir)
    try:
        run_config = load_run_config(backbone_dir)
    except FileNotFoundError:
        raise ValueError(
            f"--backbone {backbone_dir} is not a pruned backbone: it has no run_config.yaml "
            f"(pass the --output of tools/prune_backbone.py or of Stage 2 pretraining)."
        ) from None
    if run_config.get("stage") not in BACKBONE_STAGES:
        raise ValueError(
            f"--backbone {backbone_dir} is not a pruned backbone: its run_config.yaml says "
            f"stage={run_config.get('stage')!r}, expected one of {BACKBONE_STAGES}."
        )
    hf_dir = backbone_dir / "hf"
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"--backbone {backbone_dir}: {hf_dir}/config.json is missing.")
    return hf_dir


def load_token_counts(path: Path, vocab_size: int) -> torch.Tensor:
    """Counts per target id from JSON: a list indexed by id, or an {id: count} object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--token-counts {path}: cannot read a JSON list or object of counts ({error}).") from None
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    items = enumerate(data) if isinstance(data, list) else ((int(k), v) for k, v in data.items())
    for token_id, count in items:
        if not 0 <= token_id < vocab_size:
            raise ValueError(
                f"--token-counts {path}: id {token_id} is outside the target vocabulary (0..{vocab_size - 1})."
            )
        counts[token_id] = float(count)
    return counts


def draft_vocab_ids(config: AdaptConfig, vocab_size: int) -> torch.Tensor:
    """Target ids of the draft vocabulary: all of them, or the top-K by frequency (ties by id)."""
    if config.draft_vocab_size is None or config.draft_vocab_size == vocab_size:
        return torch.arange(vocab_size)
    if config.token_counts is None:
        raise ValueError(
            "--draft-vocab-size needs --token-counts FILE (target-token frequencies in the training data)."
        )
    if not 0 < config.draft_vocab_size <= vocab_size:
        raise ValueError(f"--draft-vocab-size {config.draft_vocab_size} must be in 1..{vocab_size}.")
    counts = load_token_counts(config.token_counts, vocab_size)
    # Stable sort by descending count keeps lower ids first among ties.
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(order[: config.draft_vocab_size]).values


@torch.no_grad()
def adapted_reference_state(
    backbone_hf: Path, arch: DrafterArch, embed: torch.Tensor, head: torch.Tensor, draft_ids: torch.Tensor
):
    """The reference drafter's initial state: backbone layers with [0 | W] QKV, aligned vocab, identity fc."""
    from megatron_osprey.models.drafter.reference import ReferenceDrafter

    drafter = ReferenceDrafter(arch.reference_config())
    state = {}
    with SafetensorsCheckpoint(backbone_hf) as ckpt:
        for name in ckpt.weight_map:
            if name.startswith("model.layers."):
                state[name[len("model.") :]] = ckpt.read(name)
        state["norm.weight"] = ckpt.read("model.norm.weight")
    for index in range(arch.body.num_layers):
        prefix = f"layers.{index}"
        for proj in ("q_proj", "k_proj", "v_proj"):
            weight = state[f"{prefix}.self_attn.{proj}.weight"]
            state[f"{prefix}.self_attn.{proj}.weight"] = torch.cat([torch.zeros_like(weight), weight], dim=1)
        state[f"{prefix}.hidden_norm.weight"] = state[f"{prefix}.input_layernorm.weight"].clone()
    state["embed_tokens.weight"] = embed
    state["lm_head.weight"] = head[draft_ids]
    missing = set(drafter.state_dict()) - set(state) - {"fc.weight", "d2t", "t2d"}
    if missing:
        raise ValueError(f"--backbone {backbone_hf}: weights missing for {sorted(missing)[:4]}...")
    dtype = state["embed_tokens.weight"].dtype
    drafter.to(dtype)
    drafter.load_state_dict({**drafter.state_dict(), **state}, strict=True)
    drafter.init_osprey_side_path()
    drafter.set_draft_vocab(draft_ids)
    return drafter


def adapt_drafter(config: AdaptConfig, parallel) -> dict:
    """Run Stage 3 (collective over `parallel`); returns the alignment report."""
    from transformers import AutoTokenizer

    from megatron_osprey.models.drafter.convert import load_reference_state
    from megatron_osprey.models.drafter.model import build_drafter_model
    from megatron_osprey.training.checkpointing import save_checkpoint

    output = Path(config.output)
    if output.exists() and any(output.iterdir()) and not config.overwrite:
        raise FileExistsError(f"--output {output} exists and is not empty; pass --overwrite to replace it.")
    if config.variant != "osprey":
        raise ValueError("tools/adapt_drafter.py adapts the Osprey drafter; the EAGLE-3 baseline starts from scratch.")
    hf_dir = backbone_hf_dir(config.backbone)
    body = ModelArch.from_hf_config(hf_dir)
    # Before any work: Megatron would stop on a bare assertion deep in the attention layer.
    body.validate_parallel(parallel.config.tensor_model_parallel_size, parallel.config.pipeline_model_parallel_size)
    target = read_target(config.target)
    aux = resolve_aux_layer_ids(config.aux_layer_ids, target.num_layers)
    try:
        target_tok = AutoTokenizer.from_pretrained(str(config.target))
    except (OSError, ValueError) as error:
        raise ValueError(f"--target {config.target}: cannot load its tokenizer ({error}).") from None
    backbone_tok = AutoTokenizer.from_pretrained(str(hf_dir))
    backbone_view = view_of(backbone_tok, f"--backbone {hf_dir}")
    target_view = view_of(target_tok, f"--target {config.target}")
    if target_view.size > target.vocab_size:
        raise ValueError(
            f"--target {config.target}: the tokenizer has ids up to {target_view.size - 1} but config.json "
            f"says vocab_size={target.vocab_size}."
        )
    alignment = align_vocabularies(backbone_view, target_view, target.vocab_size, config.alignment_policy)
    report = alignment_report(alignment, backbone_view, target_view)

    with SafetensorsCheckpoint(hf_dir) as ckpt:
        backbone_embed = ckpt.read("model.embed_tokens.weight")
        backbone_head = ckpt.read("lm_head.weight") if ckpt.has("lm_head.weight") else backbone_embed
    embed = aligned_rows(backbone_embed, alignment)
    head = aligned_rows(backbone_head, alignment)
    draft_ids = draft_vocab_ids(config, target.vocab_size)
    arch = DrafterArch(
        body=body,
        target_hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        draft_vocab_size=int(draft_ids.numel()),
        aux_layer_ids=tuple(aux),
        variant=config.variant,
    )
    drafter = adapted_reference_state(hf_dir, arch, embed, head, draft_ids)
    report["draft_vocab_size"] = arch.draft_vocab_size
    report["aux_layer_ids"] = aux

    run_config = {
        "stage": "adapt",
        "backbone": str(config.backbone),
        "target": str(config.target),
        "drafter": arch.to_dict(),
        "alignment_counts": report["counts"],
        "parallel": parallel.config,
    }
    if parallel.rank == 0:
        if output.exists() and config.overwrite:
            shutil.rmtree(output)
        (output / "hf").mkdir(parents=True, exist_ok=True)
        drafter.save_pretrained(output / "hf")
        copy_tokenizer_files(config.target, output / "hf")
        write_text_atomic(output / "tokenizer_alignment.json", json.dumps(report, indent=2, ensure_ascii=False))
        save_run_config(output / "run_config.yaml", run_config)
    torch.distributed.barrier()
    model = build_drafter_model(
        arch, parallel.config, params_dtype=body.torch_dtype_obj(), perform_initialization=False
    )
    load_reference_state(model, drafter.state_dict(), parallel.tp_rank, parallel.config.tensor_model_parallel_size)
    save_checkpoint(output / "megatron", 0, model.sharded_state_dict(), run_config)
    return report


def run(config: AdaptConfig, parallel: ParallelConfig) -> dict:
    """Adapt on this rank, inside the job's process groups (collective); returns the alignment report."""
    with parallel_context(parallel) as state:
        return adapt_drafter(config, state)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", required=True, type=Path)
    parser.add_argument("--target", required=True, type=Path)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument(
        "--aux-layer-ids",
        type=int,
        nargs=3,
        default=None,
        help="0-based target layers whose outputs feed fusion_fc (default [1, L//2-1, L-4])",
    )
    parser.add_argument("--draft-vocab-size", type=int, default=None, help="reduced draft vocabulary (top-K ids)")
    parser.add_argument("--token-counts", type=Path, default=None, help="JSON list/object of target-token counts")
    parser.add_argument(
        "--alignment-policy",
        choices=["reference", "bytes_and_roles"],
        default="reference",
        help="vocabulary alignment for rows without a byte-identical backbone token: Osprey's "
        "released rule (default) or this project's byte/role rule",
    )
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--overwrite", action="store_true")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Parse the flags, adapt, print the alignment counts on rank 0; returns the exit code (2: bad input)."""
    args = parse_args(argv)

    def adapt_and_report() -> None:
        report = run(config_from_flags(AdaptConfig, args), config_from_flags(ParallelConfig, args))
        if is_rank0():
            counts = report["counts"]
            print(
                json.dumps(
                    {
                        "policy": report["policy"],
                        "counts": counts,
                        "draft_vocab_size": report["draft_vocab_size"],
                        "aux_layer_ids": report["aux_layer_ids"],
                    }
                )
            )
            rows = ", ".join(f"{count:,} {kind}" for kind, count in counts.items())
            print(f"adapted {args.backbone} -> {args.output} for {args.target} ({report['policy']} alignment): {rows}")

    return exit_code(adapt_and_report)


if __name__ == "__main__":
    sys.exit(main())
