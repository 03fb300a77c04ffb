"""Eval prompts: each conversation up to its first assistant turn, in the target's chat template."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_osprey.data.chat_template import render_generation_prompt
from megatron_osprey.data.conversations import read_conversations


@dataclass(frozen=True)
class EvalPrompt:
    """One request of an eval split."""

    id: str
    input_ids: torch.Tensor


def prompt_messages(messages) -> list[dict]:
    """The messages before the first assistant turn (the whole conversation when it has none)."""
    out = []
    for message in messages:
        if message["role"] == "assistant":
            break
        out.append(dict(message))
    return out


def load_prompts(path: str | Path, tokenizer, limit: int | None = None, enable_thinking: bool | None = None) -> list[EvalPrompt]:
    """All prompts of a conversations JSONL in file order (the first `limit` only when asked)."""
    prompts = []
    for conversation in read_conversations(path):
        if limit is not None and len(prompts) >= limit:
            break
        text = render_generation_prompt(tokenizer, prompt_messages(conversation.messages), enable_thinking)
        # The template already holds BOS and every special token; adding them again would double BOS.
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"--data {path}: conversation {conversation.id!r} renders to an empty prompt.")
        prompts.append(EvalPrompt(conversation.id, torch.tensor(ids, dtype=torch.long)))
    if not prompts:
        raise ValueError(f"--data {path}: no conversations in the file.")
    return prompts
