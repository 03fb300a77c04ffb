"""Checks an evaluation makes before it decodes: the engine for the flags, each drafter against --target, the
target against the device's memory, and the prompts against the target's positions (one clear error each)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from megatron_osprey.speculative.ngram import NgramDrafter, is_ngram_dir


def check_engine(config, settings: list[dict]) -> None:
    """--replay and --batch-size above 1 decode greedy chains on the HF target only (one error per bad flag)."""
    if config.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {config.batch_size}.")
    if config.replay:
        if config.verify_lossless:
            raise ValueError(
                "--replay commits the target-only output by construction, so --verify-lossless would "
                "check nothing; check live decoding without --replay."
            )
        if config.target_backend != "hf" or any(kw["topk"] != 1 or kw["temperature"] != 0 for kw in settings):
            raise ValueError("--replay covers greedy chains (--topk 1, --temperature 0) on the HF target only.")
        return
    if config.batch_size == 1:
        return
    if config.target_backend != "hf":
        raise ValueError(
            f"--batch-size {config.batch_size} needs --target-backend hf (the batched engine drives a HF "
            f"model's KV cache); use --batch-size 1 with --target-backend {config.target_backend}."
        )
    if any(kw["topk"] != 1 or kw["temperature"] != 0 for kw in settings):
        raise ValueError(
            f"--batch-size {config.batch_size} decodes greedy chains only (--topk 1, --temperature 0); "
            f"trees and sampling run with --batch-size 1."
        )


def check_ngram_drafters(config) -> None:
    """An n-gram drafter drafts chains on the reference engine: refuse trees, batches and replay, naming it."""
    for item in config.drafters:
        if not is_ngram_dir(item.path):
            continue
        if config.topk != 1:
            raise ValueError(
                f"--drafter {item.name}={item.path} is an n-gram drafter, which drafts chains only; evaluate it "
                f"with --topk 1 (got --topk {config.topk})."
            )
        if config.batch_size != 1 or config.replay:
            raise ValueError(
                f"--drafter {item.name}={item.path} is an n-gram drafter, which runs on the reference engine; "
                f"evaluate it without --batch-size above 1 and without --replay."
            )


def check_ngram_fits_target(path: Path, drafter: NgramDrafter, target: Path, tokenizer) -> None:
    """An n-gram table is over token ids: the target's tokenizer must be the one it was counted with."""
    from megatron_osprey.speculative.ngram_corpus import vocab_sha256

    recorded = drafter.metadata.get("vocab_sha256")
    if drafter.vocab_size != len(tokenizer) or (recorded and recorded != vocab_sha256(tokenizer)):
        raise ValueError(
            f"--drafter {path} was counted with tokenizer {drafter.tokenizer or '?'} ({drafter.vocab_size} tokens), "
            f"which is not --target {target}'s ({len(tokenizer)} tokens); rebuild it with --tokenizer {target}."
        )


def visible_memory(device: str) -> tuple[int, int]:
    """(bytes of `device`, bytes of host memory available now); on "cpu" both are the host's."""
    import psutil

    host = psutil.virtual_memory().available
    if not device.startswith("cuda"):
        return host, host
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    return torch.cuda.get_device_properties(index).total_memory, host


def check_target_fits(config, device: str) -> None:
    """Refuse, with the numbers, a HF target that cannot fit the device it is moved to at --dtype (families the
    plan arithmetic does not know are loaded unchecked)."""
    from megatron_osprey.base.arch import load_target_config
    from megatron_osprey.base.memory import check_eval_target_fits, estimate_eval_target_memory

    try:
        arch = load_target_config(config.target)
    except ValueError:
        return
    estimate = estimate_eval_target_memory(arch, config.dtype, config.max_new_tokens, config.batch_size)
    device_bytes, host_bytes = visible_memory(device)
    hf = config.target_backend == "hf"  # the Megatron backend reads slices straight onto the device
    check_eval_target_fits(estimate, str(config.target), config.dtype, device, device_bytes, host_bytes, hf)


def fit_prompts(prompts: list, path: Path, config, max_positions: int | None, draft_tokens: int) -> tuple[list, int]:
    """Refuse (or, with --truncate-prompts, left-truncate) prompts whose decode would pass the target's positions.

    A prompt plus --max-new-tokens plus one verify step's draft tokens must fit in
    max_position_embeddings; past it a RoPE model decodes without an error but
    out of its trained range, so the AL would be measured on garbage.
    """
    if not max_positions:
        return prompts, 0
    room = max_positions - config.max_new_tokens - draft_tokens
    out, cut = [], 0
    for prompt in prompts:
        n = len(prompt.input_ids)
        if n <= room:
            out.append(prompt)
            continue
        if not config.truncate_prompts or room < 1:
            raise ValueError(
                f"--data {path}: prompt {prompt.id!r} has {n} tokens; with --max-new-tokens {config.max_new_tokens} "
                f"and {draft_tokens} draft tokens it needs {n + config.max_new_tokens + draft_tokens} positions, more "
                f"than --target {config.target}'s max_position_embeddings {max_positions}. Pass --truncate-prompts "
                f"to keep its last {max(room, 0)} tokens, or lower --max-new-tokens."
            )
        if getattr(prompt, "next_turns", ()):
            raise ValueError(
                f"--data {path}: prompt {prompt.id!r} has {n} tokens and later turns; --truncate-prompts cuts a "
                f"first turn only (the next turns are rendered after the whole conversation). Pass "
                f"--first-turn-only, or lower --max-new-tokens below {max_positions - n - draft_tokens + 1}."
            )
        out.append(dataclasses.replace(prompt, input_ids=prompt.input_ids[n - room :]))
        cut += 1
    return out, cut


def recorded_target_warning(path: Path, run_config: dict, target: Path) -> str | None:
    """A warning when the drafter was trained against another target than --target (None: the same, or unknown).

    Shapes can match across targets (two fine-tunes of one base): the drafter then runs, but its
    acceptance length measures the wrong pairing. Two directories holding the same config.json and
    tokenizer count as the same target.
    """
    from megatron_osprey.base.checksums import file_sha256

    recorded = run_config.get("target")
    if not recorded or Path(recorded).resolve() == Path(target).resolve():
        return None

    def identity(directory: Path) -> list[str | None]:
        files = [directory / n for n in ("config.json", "tokenizer.json", "tokenizer_config.json")]
        return [file_sha256(f) if f.is_file() else None for f in files]

    if Path(recorded).is_dir() and Path(target).is_dir() and identity(Path(recorded)) == identity(Path(target)):
        return None
    return (
        f"--drafter {path} was trained against target {recorded}, but --target is {target}; its acceptance "
        f"length measures another pairing than the one it was trained for."
    )


def check_drafter_fits_target(path: Path, drafter_config, target: Path, target_config) -> None:
    """The drafter reads the target's hidden states: sizes and tapped layers must match, naming both models."""
    vocab = target_config.vocab_size
    if drafter_config.vocab_size != vocab:
        raise ValueError(
            f"--drafter {path}: its vocabulary ({drafter_config.vocab_size}) is not the target's "
            f"({vocab}); was it adapted to --target {target}?"
        )
    hidden = getattr(target_config, "hidden_size", None)
    if hidden is not None and drafter_config.target_hidden_size != hidden:
        raise ValueError(
            f"--drafter {path} was trained on hidden states of size {drafter_config.target_hidden_size}, "
            f"but --target {target} has hidden_size {hidden}; it belongs to another target."
        )
    layers = getattr(target_config, "num_hidden_layers", None)
    if layers is not None and max(drafter_config.aux_layer_ids) >= layers:
        raise ValueError(
            f"--drafter {path} taps target layers {list(drafter_config.aux_layer_ids)}, but --target "
            f"{target} has {layers} layers; it belongs to another target."
        )
