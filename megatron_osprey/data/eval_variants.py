"""Two harder eval sets made from a held-out eval set: template perturbation and long context.

    python -m megatron_osprey.data.eval_variants --input OUT/eval/chat.jsonl --tokenizer TARGET_DIR \\
        --output-dir OUT/eval [--seed 0] [--max-context-tokens N] [--variants perturbed long_context]

writes OUTPUT_DIR/chat.perturbed.jsonl and OUTPUT_DIR/chat.long_context.jsonl, conversations JSONL that the
evaluate stage reads like the set they come from (`--data`), one row per input row, ids kept:

- perturbed: the same user request under another system prompt, with a role-play line before it and its text
  reformatted (markdown quote, bullets, a heading, extra blank lines). Every word of the request is kept. The
  evaluate stage sends only the first user message by default; `--prompt-messages before_assistant` sends the
  system prompt too.
- long_context: the request after a preamble of the file's other conversations (same domain) as transcripts,
  filled up to a token budget: the prompt as the target's chat template renders it has at most that many tokens,
  under either prompt mode. The budget defaults to the target's max_position_embeddings (its config.json) less
  `--reserve-tokens`, the room the evaluate stage needs for --max-new-tokens and a verify step's draft tokens.

Both are deterministic given --seed: each row draws from a generator seeded by (seed, row id).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from megatron_osprey.data.chat_template import render_generation_prompt
from megatron_osprey.data.conversations import Conversation, read_conversations, write_conversations

EVAL_VARIANTS = ("perturbed", "long_context")
# Room left for the evaluate stage's default --max-new-tokens (4096) and one verify step's draft tokens.
DEFAULT_RESERVE_TOKENS = 4096 + 64

SYSTEM_PROMPTS = (
    "You are a meticulous research assistant. Answer precisely and note any assumptions you make.",
    "You are a friendly tutor. Explain your reasoning step by step in plain language.",
    "You are a terse senior engineer. Reply with the essentials only.",
    "You are an assistant deployed in a customer-support console. Be polite, clear and complete.",
    "System notice: the user is on a mobile device. Keep formatting simple and answers well organised.",
)
ROLE_PLAY_PREFIXES = (
    "Let's role-play: you are a seasoned expert and I am a colleague asking for help.",
    "Pretend you are my mentor for the rest of this conversation.",
    "Imagine you are a librarian who knows a great deal about every subject.",
    "Stay in character as a patient teacher while you answer me.",
)
USER_TURN_LAYOUTS = ("quote", "bullets", "heading", "spaced")
PREAMBLE_HEAD = "Here are earlier conversations on the same subject, for context:"
PREAMBLE_TAIL = "Now the request to answer:"
_SPEAKERS = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}


def _row_rng(seed: int, conversation_id: str, variant: str) -> random.Random:
    # A string seed is hashed with SHA-512: the same (seed, id) draws the same choices in every process.
    return random.Random(f"{variant}:{seed}:{conversation_id}")


def reformat(text: str, style: str) -> str:
    """The text in another layout (markdown quote, bullets, heading, spacing); every word is kept in order."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if style == "quote":
        return "\n".join(f"> {line}" for line in lines)
    if style == "bullets":
        return "\n".join(f"- {line}" for line in lines)
    if style == "heading":
        return "### Request\n\n" + "\n".join(lines)
    if style == "spaced":
        return "\n\n  " + "\n\n".join(lines) + "  \n\n"
    raise ValueError(f"unknown format {style!r}; expected one of {', '.join(USER_TURN_LAYOUTS)}.")


def _first_user_index(conversation: Conversation) -> int:
    return next(i for i, m in enumerate(conversation.messages) if m["role"] == "user")


def _with_first_user(conversation: Conversation, content: str, system: str | None, **extra: Any) -> Conversation:
    """The conversation with its first user message's content replaced (and its system prompt, when given)."""
    messages = [dict(m) for m in conversation.messages]
    at = _first_user_index(conversation)
    messages[at]["content"] = content
    if system is not None:
        if messages[0]["role"] == "system":
            messages[0]["content"] = system
        else:
            messages.insert(0, {"role": "system", "content": system})
    return replace(conversation, messages=tuple(messages), extra={**conversation.extra, **extra})


def perturb(conversation: Conversation, seed: int = 0) -> Conversation:
    """The conversation under another system prompt, a role-play line and another layout of its first request."""
    rng = _row_rng(seed, conversation.id, "perturbed")
    current = conversation.messages[0]["content"] if conversation.messages[0]["role"] == "system" else None
    system = rng.choice([s for s in SYSTEM_PROMPTS if s != current])
    prefix, style = rng.choice(ROLE_PLAY_PREFIXES), rng.choice(USER_TURN_LAYOUTS)
    request = conversation.messages[_first_user_index(conversation)]["content"]
    content = f"{prefix}\n\n{reformat(request, style)}"
    return _with_first_user(conversation, content, system, variant="perturbed", perturbation={"format": style})


def transcript(conversation: Conversation) -> str:
    """A conversation as plain text, one `Speaker: text` paragraph per message."""
    return "\n".join(f"{_SPEAKERS[m['role']]}: {m['content'].strip()}" for m in conversation.messages)


def _prompt_message_lists(messages: Sequence[dict]) -> list[list[dict]]:
    """What the evaluate stage sends under its two prompt modes (eval/prompts.py): the first user message alone,
    and every message before the first assistant turn."""
    first_user = [dict(m) for m in messages if m["role"] == "user"][:1]
    before = []
    for message in messages:
        if message["role"] == "assistant":
            break
        before.append(dict(message))
    return [first_user, before]


class PromptLength:
    """Tokens of a conversation's eval prompt: the longest over the evaluate stage's prompt modes, thinking on or
    off (a template such as Qwen3's adds an empty think block when it is off)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def tokens(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def __call__(self, conversation: Conversation) -> int:
        texts = {
            render_generation_prompt(self.tokenizer, messages, thinking)
            for messages in _prompt_message_lists(conversation.messages)
            for thinking in (None, False)
        }
        return max(len(self.tokens(text)) for text in texts)


def _normalized(text: str) -> str:
    return " ".join(text.split()).casefold()


def _preamble_order(conversation: Conversation, others: Sequence[Conversation], rng: random.Random):
    """The other conversations' transcripts, endlessly, each pass in a new seeded order; never the row's own
    conversation nor one that asks the same request (its answer would be in the context)."""
    request = _normalized(conversation.messages[_first_user_index(conversation)]["content"])
    pool = [
        transcript(c)
        for c in others
        if c.id != conversation.id and _normalized(c.messages[_first_user_index(c)]["content"]) != request
    ]
    if not pool:
        raise ValueError(f"conversation {conversation.id!r}: the file has no other conversation to make a preamble of.")
    while True:
        rng.shuffle(pool)
        yield from pool


def long_context(
    conversation: Conversation, others: Sequence[Conversation], length: PromptLength, budget: int, seed: int = 0
) -> Conversation:
    """The conversation with a preamble of `others` before its first request, the prompt filled to `budget` tokens."""
    request = conversation.messages[_first_user_index(conversation)]["content"]

    def build(blocks: list[str], partial: str = "") -> Conversation:
        context = "\n\n".join(blocks + ([partial] if partial else []))
        content = f"{PREAMBLE_HEAD}\n\n{context}\n\n{PREAMBLE_TAIL}\n\n{request}"
        return _with_first_user(conversation, content, None, variant="long_context", context_conversations=len(blocks))

    used = length(build([]))
    if used > budget:
        raise ValueError(
            f"--max-context-tokens {budget}: conversation {conversation.id!r} already needs {used} tokens without a "
            f"preamble; raise the budget."
        )
    order = _preamble_order(conversation, others, _row_rng(seed, conversation.id, "long_context"))
    blocks: list[str] = []
    pending, cost = None, 0
    # Whole transcripts while their summed token counts fit (a separator is about one token); the exact count
    # then corrects the estimate, and more whole transcripts go in while the exact count leaves room.
    while True:
        if pending is None:
            pending = next(order)
            cost = len(length.tokens(pending)) + 1
        if used + cost <= budget:
            blocks.append(pending)
            used, pending = used + cost, None
            continue
        exact = length(build(blocks))
        if exact + cost > budget:
            break
        used = exact
    while exact > budget and blocks:
        pending = blocks.pop()
        exact = length(build(blocks))
    best, ids, room = build(blocks), length.tokens(pending), budget - exact - 2
    while room > 0:
        candidate = build(blocks, length.tokenizer.decode(ids[:room]).rstrip("\ufffd").strip())
        n = length(candidate)
        if n <= budget:
            best = candidate
            break
        room -= n - budget
    return replace(best, extra={**best.extra, "prompt_tokens": length(best)})


def context_budget(
    tokenizer_dir: str | Path,
    target_config: str | Path | None = None,
    max_context_tokens: int | None = None,
    reserve_tokens: int = DEFAULT_RESERVE_TOKENS,
) -> int:
    """Prompt tokens of a long-context row: --max-context-tokens, else the target's max_position_embeddings less
    --reserve-tokens; never above max_position_embeddings when the target's config.json is known."""
    config = Path(target_config) if target_config else Path(tokenizer_dir) / "config.json"
    if config.is_dir():
        config = config / "config.json"
    limit = None
    if config.is_file():
        limit = json.loads(config.read_text()).get("max_position_embeddings")
    elif target_config:
        raise FileNotFoundError(f"--target-config {target_config}: no config.json there.")
    if max_context_tokens is None:
        if limit is None:
            raise ValueError(
                f"--max-context-tokens is required: {config} gives no max_position_embeddings (pass --target-config "
                f"TARGET_DIR or the budget itself)."
            )
        max_context_tokens = int(limit) - reserve_tokens
    if max_context_tokens < 1:
        raise ValueError(f"--max-context-tokens must be positive, got {max_context_tokens}.")
    if limit is not None and max_context_tokens > int(limit):
        raise ValueError(
            f"--max-context-tokens {max_context_tokens} exceeds the target's max_position_embeddings {limit} "
            f"({config})."
        )
    return max_context_tokens


def write_variants(
    input_path: str | Path,
    tokenizer: Any,
    output_dir: str | Path,
    variants: Sequence[str] = EVAL_VARIANTS,
    seed: int = 0,
    budget: int | None = None,
) -> dict[str, Path]:
    """OUTPUT_DIR/{stem}.{variant}.jsonl of each variant of the eval set at input_path; variant -> path."""
    unknown = [v for v in variants if v not in EVAL_VARIANTS]
    if unknown:
        raise ValueError(f"--variants {' '.join(unknown)}: expected any of {', '.join(EVAL_VARIANTS)}.")
    if "long_context" in variants and budget is None:
        raise ValueError("--max-context-tokens: the long_context variant needs a token budget.")
    conversations = list(read_conversations(input_path))
    if not conversations:
        raise ValueError(f"--input {input_path}: no conversations in the file.")
    stem = Path(input_path).name.removesuffix(".jsonl")
    written = {}
    for variant in variants:
        if variant == "perturbed":
            rows = [perturb(c, seed) for c in conversations]
        else:
            length = PromptLength(tokenizer)
            rows = [long_context(c, conversations, length, budget, seed) for c in conversations]
        written[variant] = Path(output_dir) / f"{stem}.{variant}.jsonl"
        write_conversations(written[variant], rows)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_osprey.data.eval_variants", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--input", required=True, help="a held-out eval set (conversations JSONL), e.g. OUT/eval/chat.jsonl"
    )
    parser.add_argument("--tokenizer", required=True, help="the target's HF directory (or its tokenizer's)")
    parser.add_argument("--output-dir", required=True, help="where {stem}.perturbed.jsonl / .long_context.jsonl go")
    parser.add_argument("--variants", nargs="+", default=list(EVAL_VARIANTS), help=f"any of {', '.join(EVAL_VARIANTS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-context-tokens", type=int, default=None, help="long_context: prompt tokens per row")
    parser.add_argument("--target-config", default=None, help="the target's config.json (default: --tokenizer's)")
    parser.add_argument(
        "--reserve-tokens", type=int, default=DEFAULT_RESERVE_TOKENS,
        help="without --max-context-tokens: max_position_embeddings less this (evaluate's --max-new-tokens + drafts)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer  # noqa: PLC0415  (the heavy import only when run)

    if not Path(args.tokenizer).is_dir():
        parser.error(f"--tokenizer {args.tokenizer} is not a directory.")
    budget = None
    if "long_context" in args.variants:
        budget = context_budget(args.tokenizer, args.target_config, args.max_context_tokens, args.reserve_tokens)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    written = write_variants(args.input, tokenizer, args.output_dir, args.variants, args.seed, budget)
    for variant, path in written.items():
        print(f"{variant}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
