"""How `osprey data` splits a domain's conversations into train and eval, by its --split-rule.

seeded (the default): duplicates (the same normalized first prompt) removed, then a seeded sample of --eval-size
held out per domain. shuffle: the release's rule (LeanModels/Osprey examples/llama33-70b/README.md, its PerfectBlend
split): the rows numbered in file order, shuffled as Python's `random.seed(seed); random.shuffle(rows)` does, the
first --max-train train and the next --eval-size eval. Under both, no training conversation holds any domain's eval
prompt as a user turn (such a row is left out and counted).
"""

from __future__ import annotations

import dataclasses
import random

from megatron_osprey.data.conversations import Conversation

SPLIT_RULES = ("seeded", "shuffle")  # --split-rule


def normalize_prompt(text: str) -> str:
    """A prompt as compared for duplicates and leaks: whitespace collapsed, case folded."""
    return " ".join(text.split()).casefold()


def first_prompt(conversation: Conversation) -> str:
    """The normalized first user message: what evaluation sends."""
    return normalize_prompt(next(m["content"] for m in conversation.messages if m["role"] == "user"))


def user_prompts(conversation: Conversation) -> set[str]:
    return {normalize_prompt(m["content"]) for m in conversation.messages if m["role"] == "user"}


@dataclasses.dataclass
class DomainSplit:
    """One domain's training and eval conversations, and what was left out on the way."""

    train: list[Conversation]
    eval: list[Conversation]
    rows: int
    duplicates: int
    tool_conversations_dropped: int
    leaks_removed: int


def split_domains(
    domains: dict[str, list[Conversation]],
    eval_size: int,
    seed: int,
    drop_tools: bool = False,
    max_train: int | None = None,
    rule: str = "seeded",
) -> dict[str, DomainSplit]:
    """Seeded per-domain eval splits; no training conversation holds any domain's eval prompt as a user turn."""
    if rule == "shuffle":
        return shuffle_split(domains, eval_size, seed, drop_tools, max_train)
    kept: dict[str, tuple[list[Conversation], int, int]] = {}
    for domain, conversations in domains.items():
        usable = [c for c in conversations if not (drop_tools and c.has_tool_turns)]
        unique, seen = [], set()
        for conversation in usable:
            key = first_prompt(conversation)
            if key not in seen:
                seen.add(key)
                unique.append(conversation)
        if len(unique) <= eval_size:
            raise ValueError(
                f"domain {domain!r} has {len(unique)} distinct prompts; --eval-size {eval_size} would leave none to "
                f"train on: pass a smaller --eval-size."
            )
        kept[domain] = (unique, len(conversations) - len(usable), len(usable) - len(unique))
    evals = {}
    for domain, (unique, _, _) in kept.items():
        chosen = set(random.Random(f"{seed}:{domain}").sample(range(len(unique)), eval_size))
        evals[domain] = [c for i, c in enumerate(unique) if i in chosen]
    held_out = {first_prompt(c) for rows in evals.values() for c in rows}
    splits = {}
    for domain, (unique, tool_dropped, duplicates) in kept.items():
        chosen_ids = {c.id for c in evals[domain]}
        rest = [c for c in unique if c.id not in chosen_ids]
        train = [c for c in rest if not (user_prompts(c) & held_out)]
        leaks = len(rest) - len(train)
        train = train[:max_train]
        if not train:
            raise ValueError(f"domain {domain!r}: every training conversation repeats an eval prompt.")
        splits[domain] = DomainSplit(train, evals[domain], len(domains[domain]), duplicates, tool_dropped, leaks)
    check_splits_disjoint(splits)
    return splits


def check_splits_disjoint(splits: dict[str, DomainSplit]) -> None:
    """Raise when any training conversation has a user turn equal to an eval prompt (of any domain)."""
    held_out = {first_prompt(c): (domain, c.id) for domain, split in splits.items() for c in split.eval}
    for domain, split in splits.items():
        for conversation in split.train:
            for prompt in user_prompts(conversation) & set(held_out):
                eval_domain, eval_id = held_out[prompt]
                raise ValueError(
                    f"training conversation {conversation.id!r} of {domain!r} repeats eval prompt {eval_id!r} of "
                    f"{eval_domain!r}."
                )


# --- What is written ------------------------------------------------------------------


def shuffled_order(rows: int, seed: int) -> list[int]:
    """Row numbers in file order, shuffled as `random.seed(seed); random.shuffle(rows)` does (the release's rule)."""
    order = list(range(rows))
    random.Random(seed).shuffle(order)
    return order


def shuffle_split(domains, eval_size: int, seed: int, drop_tools: bool, max_train: int) -> dict[str, DomainSplit]:
    """The release's split: per domain, the first max_train rows of the seeded shuffle train, the next eval_size are
    eval (no duplicate removal). A training row that repeats an eval prompt is still left out, and counted."""
    evals, trains = {}, {}
    for domain, conversations in domains.items():
        order = shuffled_order(len(conversations), seed)
        if len(order) < max_train + eval_size:
            raise ValueError(
                f"domain {domain!r} has {len(order)} rows; --split-rule shuffle takes --max-train {max_train} then "
                f"--eval-size {eval_size}: pass smaller ones."
            )
        trains[domain] = [conversations[i] for i in order[:max_train]]
        evals[domain] = [conversations[i] for i in order[max_train : max_train + eval_size]]
    held_out = {first_prompt(c) for rows in evals.values() for c in rows}
    splits = {}
    for domain, picked in trains.items():
        usable = [c for c in picked if not (drop_tools and c.has_tool_turns)]
        train = [c for c in usable if not (user_prompts(c) & held_out)]
        leaks = len(usable) - len(train)
        splits[domain] = DomainSplit(train, evals[domain], len(domains[domain]), 0, len(picked) - len(usable), leaks)
    check_splits_disjoint(splits)
    return splits
