"""Stage 3's surgery: the pretrained backbone adapted to one target (vocabulary, QKV expansion, fusion fc).

`config` is the adapt stage's AdaptConfig (stages/adapt.py): backbone, target, aux_layer_ids,
draft_vocab_size, token_counts, alignment_policy. Only the target's config.json (parsed once, as a
ModelArch) and tokenizer are read, never its weights. The adapt stage writes the result.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from megatron_osprey.base.arch import ModelArch, resolve_aux_layer_ids
from megatron_osprey.base.run_config import load_run_config
from megatron_osprey.convert.safetensors_io import SafetensorsCheckpoint
from megatron_osprey.models.drafter.arch import DrafterArch
from megatron_osprey.models.drafter.vocab_alignment import align_vocabularies, aligned_rows, alignment_report, view_of

BACKBONE_STAGES = ("prune", "pretrain")


@dataclasses.dataclass
class AdaptedDrafter:
    """The reference drafter at its Osprey initialization, its architecture and the alignment report."""

    drafter: torch.nn.Module
    arch: DrafterArch
    report: dict
    backbone_hf: Path


def is_plain_hf_model(directory: Path) -> bool:
    """An HF model directory as published (config.json and safetensors weights), not a stage's output."""
    directory = Path(directory)
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def backbone_hf_dir(backbone_dir: Path) -> Path:
    """The HF weights of a backbone; refuses directories that are not one.

    A prune or pretrain stage's output holds them in hf/ beside its run_config.yaml. A plain HF model
    directory (config.json, safetensors, tokenizer), such as the released Osprey backbone, already pruned to
    its layers, is taken as it is: its num_hidden_layers are the drafter's.
    """
    backbone_dir = Path(backbone_dir)
    try:
        run_config = load_run_config(backbone_dir)
    except FileNotFoundError:
        if is_plain_hf_model(backbone_dir):
            return backbone_dir
        raise ValueError(
            f"--backbone {backbone_dir} is not a pruned backbone: it has no run_config.yaml "
            f"(pass the --output of tools/prune_backbone.py or of Stage 2 pretraining) and no HF config.json with "
            f"safetensors weights (a pruned HF model such as the released Osprey backbone)."
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
    """Counts per target id from JSON: a list indexed by id (no longer than the target's vocabulary; the ids past
    its end count 0, as a padded vocabulary's do), or an {id: count} object; counts are integers >= 0."""

    def refuse(why: str) -> ValueError:
        return ValueError(f"--token-counts {path}: {why}; write a JSON list or {{id: count}} object of counts.")

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise refuse(f"cannot be read ({error})") from None
    if isinstance(data, list):
        if len(data) > vocab_size:
            raise refuse(f"holds {len(data)} counts, more than the target's vocabulary of {vocab_size}")
        items = list(enumerate(data))
    elif isinstance(data, dict):
        try:
            items = [(int(key), count) for key, count in data.items()]
        except ValueError:
            raise refuse(f"its keys must be token ids, got {list(data)[:3]}") from None
    else:
        raise refuse(f"holds a JSON {type(data).__name__}")
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for token_id, count in items:
        if not 0 <= token_id < vocab_size:
            raise refuse(f"id {token_id} is outside the target vocabulary (0..{vocab_size - 1})")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise refuse(f"the count of id {token_id} is {count!r}, not an integer >= 0")
        counts[token_id] = float(count)
    if not counts.any():
        raise refuse("every count is 0, so no token is more frequent than another")
    return counts


def draft_vocab_ids(config, vocab_size: int) -> torch.Tensor:
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


def adapt_reference_drafter(config, target: ModelArch, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1):
    """Align the vocabularies and build the Osprey-initialized reference drafter for `target` (no weights read)."""
    from transformers import AutoTokenizer

    hf_dir = backbone_hf_dir(config.backbone)
    body = ModelArch.from_hf_config(hf_dir)
    # Before any work: Megatron would stop on a bare assertion deep in the attention layer.
    body.validate_parallel(tensor_parallel_size, pipeline_parallel_size)
    aux = resolve_aux_layer_ids(config.aux_layer_ids, target.num_layers)
    try:
        target_tok = AutoTokenizer.from_pretrained(str(config.target))
    except (OSError, ValueError) as error:
        raise ValueError(f"--target {config.target}: cannot load its tokenizer ({error}).") from None
    backbone_view = view_of(AutoTokenizer.from_pretrained(str(hf_dir)), f"--backbone {hf_dir}")
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
    draft_ids = draft_vocab_ids(config, target.vocab_size)
    arch = DrafterArch(
        body=body,
        target_hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        draft_vocab_size=int(draft_ids.numel()),
        aux_layer_ids=tuple(aux),
        variant="osprey",
    )
    embed, head = aligned_rows(backbone_embed, alignment), aligned_rows(backbone_head, alignment)
    drafter = adapted_reference_state(hf_dir, arch, embed, head, draft_ids)
    report["draft_vocab_size"] = arch.draft_vocab_size
    report["aux_layer_ids"] = aux
    return AdaptedDrafter(drafter, arch, report, hf_dir)
