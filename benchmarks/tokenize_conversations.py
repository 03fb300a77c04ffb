#!/usr/bin/env python
"""How long online distillation's counting pass tokenizes conversations before step 1, per rank.

Before its first step, distillation counts the loss tokens that survive --seq-length (and, for the EAGLE-3
baseline, the draft vocabulary) over every conversation: each rank tokenizes its own share through the
target's chat template (megatron_osprey/data/distill_data.py). This times that pass on one process and
prints conversations/s, tokens/s and the extrapolated seconds per million conversations per rank.

    python benchmarks/tokenize_conversations.py [--tokenizer qwen3] [--conversations 2000] [--turn-words 150]

Conversations are made from this Python's standard-library docstrings (real English text), two turns each.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _docstring_words() -> list[str]:
    words: list[str] = []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py"))[:200]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                words += (ast.get_docstring(node) or "").split()
    return words


def write_conversations(path: Path, count: int, turn_words: int) -> Path:
    words = _docstring_words()
    with path.open("w", encoding="utf-8") as out:
        for i in range(count):
            start = (i * 2 * turn_words) % max(1, len(words) - 2 * turn_words)
            user = " ".join(words[start : start + turn_words // 3])
            reply = " ".join(words[start + turn_words // 3 : start + turn_words])
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
            out.write(json.dumps({"id": f"c{i}", "conversations": messages}) + "\n")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default="qwen3", help="a pinned registry tokenizer (qwen3, llama3, ...)")
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--turn-words", type=int, default=150, help="words per conversation (user + assistant)")
    parser.add_argument("--seq-length", type=int, default=4096)
    args = parser.parse_args(argv)

    from megatron_osprey.assets import load_tokenizer
    from megatron_osprey.data.distill_data import ConversationSamples, loss_token_survivors

    tokenizer = load_tokenizer(args.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        data = write_conversations(Path(tmp) / "conversations.jsonl", args.conversations, args.turn_words)
        samples = ConversationSamples([str(data)], tokenizer, max_length=args.seq_length)
        start = time.perf_counter()
        tokens = sum(int(ids.numel()) for ids, _ in samples.iter_tokens())
        seconds = time.perf_counter() - start
        loss_token_survivors(samples, args.seq_length)  # the pass distillation runs (same work, checked to run)
    per_million = seconds / args.conversations * 1e6
    print(
        json.dumps(
            {
                "tokenizer": args.tokenizer,
                "conversations": args.conversations,
                "tokens": tokens,
                "seconds": round(seconds, 3),
                "conversations_per_s": round(args.conversations / seconds, 1),
                "tokens_per_s": round(tokens / seconds),
                "seconds_per_million_conversations_per_rank": round(per_million),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
