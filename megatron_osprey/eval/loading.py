"""Load any drafter this repo writes as a ReferenceDrafter (the model the eval engine runs).

Accepted directories, detected from their contents:

* a reference drafter (``config.json`` tagged ``megatron_osprey.reference_drafter/1``, e.g. Stage 3's ``OUT/hf``);
* a Megatron drafter checkpoint root (``latest_checkpointed_iteration.txt`` + ``iter_NNNNNNN/run_config.yaml``
  naming a ``drafter``), as Stage 3 (``OUT/megatron``) and Stage 4 write it;
* a Stage 3 output directory (``OUT/`` holding ``megatron/``; its Megatron weights win over ``hf/``);
* an export from ``tools/export_checkpoint.py`` (``sglang`` or ``speculators`` layout), read back exactly;
* an n-gram drafter (``config.json`` tagged ``megatron_osprey.ngram_drafter/1``, the ngram stage's output),
  loaded as an NgramDrafter: it drafts chains from token statistics and reads no target hidden state.

And the target's shape the drafters are checked against (target_facts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from megatron_osprey.models.drafter.reference import CONFIG_NAME, FORMAT_TAG, ReferenceDrafter
from megatron_osprey.speculative.ngram import NgramDrafter, is_ngram_dir


@dataclass
class LoadedDrafter:
    """A drafter plus what its directory says about how it was made."""

    drafter: ReferenceDrafter | NgramDrafter
    source: str  # "reference", "megatron", "ngram" or an export format name
    run_config: dict = field(default_factory=dict)


def is_megatron_checkpoint(path: Path) -> bool:
    """True for a directory with a latest-iteration pointer (a Megatron checkpoint root)."""
    from megatron_osprey.training.checkpointing import LATEST_FILE

    return (Path(path) / LATEST_FILE).is_file()


def megatron_run_config(root: Path) -> dict:
    """run_config.yaml of the latest iteration of a Megatron checkpoint root."""
    from megatron_osprey.base.run_config import load_run_config
    from megatron_osprey.training.checkpointing import iteration_dir, read_latest_iteration

    iteration = read_latest_iteration(root)
    config_dir = iteration_dir(root, iteration)
    if not (config_dir / "run_config.yaml").is_file():
        raise FileNotFoundError(f"{root}: {config_dir}/run_config.yaml is missing, so the drafter shape is unknown.")
    run_config = load_run_config(config_dir)
    if not isinstance(run_config, dict) or "drafter" not in run_config:
        raise ValueError(f"{config_dir}/run_config.yaml has no 'drafter' section; is {root} a drafter checkpoint?")
    return run_config


@torch.no_grad()
def load_megatron_drafter(root: Path, verify: bool = True) -> LoadedDrafter:
    """Load a Megatron drafter checkpoint (TP=1 here; dist checkpoints reshard) into a ReferenceDrafter; its files
    are checked against the checksums its save recorded unless `verify` is False (--skip-checksum)."""
    from megatron.core import parallel_state as mpu

    from megatron_osprey.models.drafter.convert import reference_state
    from megatron_osprey.models.drafter.model import DrafterArch, build_drafter_model
    from megatron_osprey.parallel import ParallelConfig, parallel_context
    from megatron_osprey.training.checkpointing import load_model_weights

    run_config = megatron_run_config(root)
    arch = DrafterArch.from_dict(run_config["drafter"])
    with parallel_context(ParallelConfig()) as state:
        model = build_drafter_model(
            arch, state.config, params_dtype=arch.body.torch_dtype_obj(), perform_initialization=False
        )
        load_model_weights(root, model, verify=verify)
        # Its own TP group (one rank): under torchrun the default group's other ranks are replicas, not shards.
        state_dict = reference_state(model, mpu.get_tensor_model_parallel_group())
    drafter = ReferenceDrafter(arch.reference_config())
    drafter.to(state_dict["embed_tokens.weight"].dtype)
    drafter.load_state_dict(state_dict, strict=True)
    return LoadedDrafter(drafter.eval(), "megatron", run_config)


def _stage_run_config(directory: Path) -> dict:
    """run_config.yaml beside a reference dir (Stage 3 writes it one level up), or {}."""
    from megatron_osprey.base.run_config import load_run_config

    for candidate in (directory, directory.parent):
        if (candidate / "run_config.yaml").is_file():
            return load_run_config(candidate) or {}
    return {}


def load_drafter(path: str | Path, flag: str = "--drafter", verify: bool = True) -> LoadedDrafter:
    """Load a drafter from any of the layouts in the module docstring; one clear error (naming `flag`) otherwise.
    `verify` False (--skip-checksum) loads a Megatron checkpoint without checking its files' checksums."""
    from megatron_osprey.base.outputs import check_not_partial

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{flag} {path}: no such directory.")
    check_not_partial(path, flag)  # an export or n-gram table its stage stopped writing
    if is_ngram_dir(path):
        return LoadedDrafter(NgramDrafter.load(path), "ngram")
    if is_megatron_checkpoint(path):
        return load_megatron_drafter(path, verify)
    if is_megatron_checkpoint(path / "megatron"):
        loaded = load_megatron_drafter(path / "megatron", verify)
        return LoadedDrafter(loaded.drafter, loaded.source, loaded.run_config or _stage_run_config(path))
    config_path = path / CONFIG_NAME
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        if config.get("format") == FORMAT_TAG:
            return LoadedDrafter(ReferenceDrafter.from_pretrained(path).eval(), "reference", _stage_run_config(path))
        from megatron_osprey.export.formats import detect_format, read_export

        fmt = detect_format(config)
        if fmt is not None:
            return LoadedDrafter(read_export(path).eval(), fmt, config.get("megatron_osprey", {}).get("run_config", {}))
    if (path / "hf" / CONFIG_NAME).is_file():
        return load_drafter(path / "hf", flag, verify)
    raise ValueError(
        f"{flag} {path} is not a drafter directory: expected a reference drafter config.json, a Megatron "
        f"checkpoint (latest_checkpointed_iteration.txt), a Stage 3 output or an exported drafter."
    )


def target_facts(config, model) -> tuple[object, object]:
    """(the language model's config, generation config) without loading weights when the HF model is not used; a
    multimodal target's (Gemma 3) text config holds its vocabulary, width and layers."""
    from transformers import AutoConfig, GenerationConfig

    from megatron_osprey.models.target.decoding import text_config

    if model is not None:
        return text_config(model.config), model.generation_config
    try:
        generation = GenerationConfig.from_pretrained(str(config.target))
    except OSError:
        generation = None
    if config.target_backend == "megatron":
        # The shape the Megatron-Core target is built from (Kimi-K2 has no transformers config class).
        from megatron_osprey.base.arch import load_target_config

        arch = load_target_config(config.target)
        shape = SimpleNamespace(
            vocab_size=arch.vocab_size,
            hidden_size=arch.hidden_size,
            num_hidden_layers=arch.num_layers,
            max_position_embeddings=arch.max_position_embeddings,
        )
        return shape, generation
    return text_config(AutoConfig.from_pretrained(str(config.target))), generation
