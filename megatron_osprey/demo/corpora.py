"""The five text domains of the toy-scale demo, as chat conversations and as pretraining text, all seeded.

The conversations are the demo's user files: `osprey data` splits them into training prompts and held-out eval
conversations; `pretraining_text` leaves every held-out message out of the general mix."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Iterable, Iterator

from megatron_osprey.base.atomic_io import write_bytes_atomic

from . import corpus_sources as sources
from .corpus_sources import default_cache_dir  # noqa: F401  (re-exported: the cache root of the corpora)

DOMAINS = ("chat", "code", "math", "prose", "multilingual")
MULTILINGUAL_LANGUAGES = ("spanish", "french", "german", "italian", "portuguese")
MAX_TURNS = 3
MAX_PROSE_CHARS = 1200

Messages = list[dict[str, str]]


def _check_domain(domain: str) -> None:
    if domain not in DOMAINS:
        raise ValueError(f"Unknown demo domain {domain!r}; expected one of {', '.join(DOMAINS)}.")


def _normalize(text: str) -> str:
    return " ".join(text.split()).casefold()


def _messages(turns: Iterable[tuple[str, str]]) -> Messages:
    out: Messages = []
    for user, assistant in turns:
        out += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return out


def _dialogue_windows(dialogue: list[str]) -> list[Messages]:
    """A dialogue's lines as alternating user/assistant conversations of at most MAX_TURNS turns each."""
    width = 2 * MAX_TURNS
    windows = []
    for start in range(0, len(dialogue), width):
        lines = dialogue[start : start + width]
        lines = lines[: len(lines) - len(lines) % 2]
        if lines:
            windows.append(_messages(zip(lines[0::2], lines[1::2])))
    return windows


def _trim_paragraphs(paragraphs: list[str], limit: int = MAX_PROSE_CHARS) -> tuple[str, list[str]]:
    """Whole leading paragraphs up to limit characters (the first cut at a sentence end), and the rest."""
    kept: list[str] = []
    for i, paragraph in enumerate(paragraphs):
        if kept and sum(len(p) + 2 for p in kept) + len(paragraph) > limit:
            return "\n\n".join(kept), paragraphs[i:]
        if not kept and len(paragraph) > limit:
            cut = paragraph.rfind(". ", 0, limit)
            return (paragraph[: cut + 1] if cut > 0 else paragraph[:limit]), paragraphs[i + 1 :]
        kept.append(paragraph)
    return "\n\n".join(kept), []


def _explanation(prompt: str, text: str) -> Messages | None:
    """One or two turns explaining a text's prose paragraphs; None if it has too little prose."""
    first, rest = _trim_paragraphs(sources.prose_paragraphs(text))
    if len(first) < 80:
        return None
    turns = [(prompt, first)]
    more, _ = _trim_paragraphs(rest)
    if len(more) >= 80:
        turns.append(("Tell me more.", more))
    return _messages(turns)


def _topic_phrase(title: str) -> str:
    """A section title as it reads after "Explain": 'The "if" statement' -> 'the "if" statement'."""
    words = title.split()
    if title.startswith('"'):
        return f"the {title}"
    capitalized = words[0][:1].isupper() and words[0][1:].islower()
    plain = len(words) > 1 and capitalized and not any(w[:1].isupper() for w in words[1:])
    return title[0].lower() + title[1:] if plain else title


def _chat_pool(languages: tuple[str, ...], cache_dir: Path | None) -> list[Messages]:
    dialogues = sources.chatterbot_dialogues(cache_dir)
    return [w for lang in languages for d in dialogues[lang] for w in _dialogue_windows(d)]


def _code_pool() -> list[Messages]:
    return [
        _messages([(f"Write the Python function `{name}` from the `{module}` module.", source)])
        for module, name, source in sources.stdlib_functions()
    ]


def _prose_pool() -> list[Messages]:
    items = [(f"Explain {_topic_phrase(title)}.", body) for title, body in sources.help_topic_sections()]
    items += [(f"Explain the Python `{module}` module.", doc) for module, doc in sources.module_docstrings()]
    pool = [m for m in (_explanation(prompt, text) for prompt, text in items) if m is not None]
    return pool + [_messages([("What is the Zen of Python?", sources.zen_of_python())])]


def _finite_pool(domain: str, cache_dir: Path | None) -> list[Messages]:
    """Every conversation of a finite domain, in source order, one per distinct first prompt."""
    if domain == "chat":
        pool = _chat_pool(("english",), cache_dir)
    elif domain == "multilingual":
        pool = _chat_pool(MULTILINGUAL_LANGUAGES, cache_dir)
    elif domain == "code":
        pool = _code_pool()
    else:
        pool = _prose_pool()
    seen: set[str] = set()
    unique = []
    for messages in pool:
        key = _normalize(messages[0]["content"])
        if key not in seen:
            seen.add(key)
            unique.append(messages)
    return unique


def _math_stream(seed: int) -> Iterator[Messages]:
    rng = random.Random(f"math:{seed}")
    seen: set[str] = set()
    while True:
        messages = _messages(sources.math_turns(rng))
        key = _normalize(messages[0]["content"])
        if key not in seen:
            seen.add(key)
            yield messages


def _ordered(domain: str, seed: int, cache_dir: Path | None) -> Iterator[tuple[int, Messages]]:
    """(index, conversation) of a domain in its seeded order; the index names the conversation."""
    _check_domain(domain)
    if domain == "math":
        return enumerate(_math_stream(seed))
    pool = _finite_pool(domain, cache_dir)
    random.Random(f"{domain}:{seed}").shuffle(pool)
    return enumerate(pool)


def _row(domain: str, index: int, messages: Messages) -> dict:
    return {"id": f"{domain}-{index}", "conversations": messages}


def available_conversations(domain: str, cache_dir: Path | None = None) -> int | None:
    """How many distinct conversations a domain has (distinct first prompts); None for math (unbounded)."""
    _check_domain(domain)
    return None if domain == "math" else len(_finite_pool(domain, cache_dir))


def domain_conversations(domain: str, count: int, seed: int = 0, cache_dir: Path | None = None) -> list[dict]:
    """The first count conversations of a domain in its seeded order, as conversations-JSONL rows."""
    if count < 0:
        raise ValueError(f"count must be non-negative, got {count}.")
    rows = [_row(domain, i, m) for i, m in itertools.islice(_ordered(domain, seed, cache_dir), count)]
    if len(rows) < count:
        raise ValueError(f"Domain {domain!r} has only {len(rows)} distinct conversations; {count} were asked for.")
    return rows


# Eval messages shorter than this (normalised) are matched as whole lines, not as substrings: a short
# reply such as "yes." occurs inside almost any document without being a copy of the eval answer.
MIN_SUBSTRING_CHARS = 20


def eval_texts(eval_rows: Iterable[dict]) -> set[str]:
    """Every message (prompt and answer) of the eval conversations, normalised (whitespace, case)."""
    return {_normalize(m["content"]) for row in eval_rows for m in row["conversations"] if m["content"].strip()}


def leaked_texts(document: str, texts: set[str]) -> list[str]:
    """The eval texts that appear in a document: long ones as substrings, short ones as whole lines."""
    doc = _normalize(document)
    lines = {_normalize(line) for line in document.splitlines()}
    return [t for t in texts if (t in doc if len(t) >= MIN_SUBSTRING_CHARS else t in lines)]


def _math_documents(seed: int) -> Iterator[str]:
    for messages in _math_stream(seed):
        yield "\n\n".join(f"{'Question' if m['role'] == 'user' else 'Answer'}: {m['content']}" for m in messages)


def _documents(domain: str, seed: int, cache_dir: Path | None) -> Iterator[str]:
    """Plain-text pretraining documents of one domain in seeded order (math: an endless stream)."""
    _check_domain(domain)
    if domain == "math":
        return _math_documents(seed)
    if domain in ("chat", "multilingual"):
        languages = ("english",) if domain == "chat" else MULTILINGUAL_LANGUAGES
        dialogues = sources.chatterbot_dialogues(cache_dir)
        docs = ["\n".join(d) for lang in languages for d in dialogues[lang]]
    elif domain == "code":
        docs = [s for s in (sources.stdlib_source(m) for m in sources.CODE_MODULES) if s]
    else:
        from pydoc_data.topics import topics

        docs = [topics[key].strip() for key in sorted(topics)]
        docs += [doc for _, doc in sources.module_docstrings()] + [sources.zen_of_python()]
    docs = sorted(set(docs))
    random.Random(f"{domain}:text:{seed}").shuffle(docs)
    return iter(docs)


def pretraining_text(
    domains: Iterable[str],
    max_chars_per_domain: int,
    seed: int = 0,
    cache_dir: Path | None = None,
    exclude: set[str] | None = None,
) -> list[str]:
    """Plain-text documents of each domain up to max_chars_per_domain characters, mixed in seeded order.

    Documents holding any of the normalised texts in `exclude` (the eval conversations' messages, see
    eval_texts) are left out whole, so no eval prompt or answer is ever pretrained on.
    """
    if max_chars_per_domain <= 0:
        raise ValueError(f"max_chars_per_domain must be positive, got {max_chars_per_domain}.")
    exclude = exclude or set()
    mix: list[str] = []
    for domain in domains:
        budget = max_chars_per_domain
        for doc in _documents(domain, seed, cache_dir):
            if budget <= 0:
                break
            if exclude and leaked_texts(doc, exclude):
                continue
            mix.append(doc[:budget])
            budget -= len(mix[-1])
    random.Random(f"mix:{seed}").shuffle(mix)
    return mix


def write_jsonl(path: Path | str, rows: Iterable[dict]) -> Path:
    """Write rows as UTF-8 JSON lines to path atomically."""
    path = Path(path)
    data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    write_bytes_atomic(path, data.encode("utf-8"))
    return path
