"""Eval prompts in the target's chat template: by default the first user message of each conversation.

The paper's benchmark (Osprey's custom eval benchmarker) sends only the first user message of each held-out
conversation; `before_assistant` keeps every message before the first assistant turn (a system prompt
included), this project's earlier protocol. A multi-turn row (MT-Bench) is one request per turn, the next user
turn rendered after the model's answer (follow_up); the served engines (vLLM, the SGLang client) drive such a
conversation with converse(), its turns in sequence and conversations side by side.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_osprey.data.chat_template import render_generation_prompt
from megatron_osprey.data.conversations import NEXT_TURNS_KEY, read_conversations


@dataclass(frozen=True)
class EvalPrompt:
    """One request of an eval split; a multi-turn benchmark row (MT-Bench) also carries its messages and the user
    turns still to send, each after the answer to the one before (follow_up)."""

    id: str
    input_ids: torch.Tensor
    messages: tuple[dict, ...] = ()
    next_turns: tuple[str, ...] = ()


PROMPT_MODES = ("first_user", "before_assistant")


def prompt_messages(messages, mode: str = "first_user") -> list[dict]:
    """first_user: the first user message alone; before_assistant: every message before the first assistant turn."""
    if mode not in PROMPT_MODES:
        raise ValueError(f"--prompt-messages must be one of {PROMPT_MODES}, got {mode!r}.")
    if mode == "first_user":
        return [dict(m) for m in messages if m["role"] == "user"][:1]
    out = []
    for message in messages:
        if message["role"] == "assistant":
            break
        out.append(dict(message))
    return out


def load_prompts(
    path: str | Path, tokenizer, limit: int | None = None, enable_thinking: bool | None = None, mode: str = "first_user"
) -> list[EvalPrompt]:
    """All prompts of a conversations JSONL in file order (the first `limit` only when asked)."""
    prompts = []
    for conversation in read_conversations(path):
        if limit is not None and len(prompts) >= limit:
            break
        next_turns = tuple(conversation.extra.get(NEXT_TURNS_KEY) or ())
        # A multi-turn benchmark row states its own protocol: its system prompt and first turn, then the next turns.
        messages = prompt_messages(conversation.messages, "before_assistant" if next_turns else mode)
        if not messages:
            raise ValueError(f"--data {path}: conversation {conversation.id!r} has no user message to prompt with.")
        text = render_generation_prompt(tokenizer, messages, enable_thinking)
        # The template already holds BOS and every special token; adding them again would double BOS.
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"--data {path}: conversation {conversation.id!r} renders to an empty prompt.")
        prompt = EvalPrompt(conversation.id, torch.tensor(ids, dtype=torch.long))
        if next_turns:
            prompt = EvalPrompt(prompt.id, prompt.input_ids, tuple(messages), next_turns)
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"--data {path}: no conversations in the file.")
    return prompts


def follow_up(prompt: EvalPrompt, output_ids: list[int], tokenizer, enable_thinking: bool | None = None) -> EvalPrompt:
    """The next turn of a multi-turn prompt: its messages, the answer decoded from `output_ids`, the next user turn
    (as the release's MT-Bench sends its second question after the model's first answer)."""
    answer = tokenizer.decode(output_ids, skip_special_tokens=True)
    messages = (
        *prompt.messages,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": prompt.next_turns[0]},
    )
    text = render_generation_prompt(tokenizer, list(messages), enable_thinking)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    turn = len([m for m in messages if m["role"] == "user"])
    return EvalPrompt(turn_id(prompt.id, turn), torch.tensor(ids, dtype=torch.long), messages, prompt.next_turns[1:])


TURN_MARK = "#turn"  # ID#turnN: a conversation's later turn


def turn_id(conversation_id: str, turn: int) -> str:
    """The request id of a conversation's turn (1-based): the conversation's own id for the first, ID#turnN after."""
    return conversation_id if turn == 1 else f"{conversation_id}{TURN_MARK}{turn}"


def conversation_of(request_id: str) -> str:
    """The conversation a request id belongs to (turn_id's inverse)."""
    return request_id.split(TURN_MARK)[0]


def converse(prompt: EvalPrompt, ask, next_turn) -> list:
    """Every turn of one conversation, in sequence: ask(turn's prompt) -> (record, output ids), and
    next_turn(prompt, output ids) -> the next turn's prompt (follow_up with the tokenizer bound); one record a turn."""
    records = []
    while True:
        record, output_ids = ask(prompt)
        records.append(record)
        if not prompt.next_turns:
            return records
        if next_turn is None:
            raise ValueError(f"conversation {prompt.id!r} has turns to follow and no tokenizer to render them with.")
        prompt = next_turn(prompt, output_ids)


def by_turn(conversations: list[list]) -> list:
    """Per-turn records of conversations in the reference evaluator's order: every first turn, then every second..."""
    longest = max((len(c) for c in conversations), default=0)
    return [c[turn] for turn in range(longest) for c in conversations if turn < len(c)]


def turn_ids(prompts: list[EvalPrompt]) -> list[str]:
    """The request ids a split's conversations make, in the order of by_turn."""
    return by_turn([[turn_id(p.id, t) for t in range(1, 2 + len(p.next_turns))] for p in prompts])
