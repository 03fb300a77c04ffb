"""One language's text from the pinned chatterbot corpus wheel, as the pretraining text JSONL of Stage 2.

    python -m megatron_osprey.demo.monolingual --language spanish \\
        --output smollm2_runs/data/monolingual/spanish.jsonl [--exclude-eval OUT/eval/multilingual.jsonl ...]

The text of the monolingual recipes (`smollm2_cpu_monolingual_{language}_pretrain`): one `{"text": ...}` row per
dialogue of that language's folder of the wheel. A line that also occurs in another language's folder (names,
numbers, the few English lines some folders carry) is left out, so every line written is the language's own.
Dialogues holding a message of the given eval sets are left out whole, so no eval prompt is pretrained on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from megatron_osprey.data.conversations import read_conversations
from megatron_osprey.demo import corpus_sources as sources
from megatron_osprey.demo.corpora import eval_texts, leaked_texts, write_jsonl
from megatron_osprey.recipes.cpu import MONOLINGUAL_LANGUAGES


def monolingual_documents(language: str, cache_dir: Path | None = None, exclude: set[str] | None = None) -> list[str]:
    """The language's dialogues as documents (one line per utterance), without lines other languages share."""
    if language not in MONOLINGUAL_LANGUAGES:
        raise ValueError(f"--language {language!r}: expected one of {', '.join(MONOLINGUAL_LANGUAGES)}.")
    dialogues = sources.chatterbot_dialogues(cache_dir)
    shared = {line for other, ds in dialogues.items() if other != language for d in ds for line in d}
    documents = []
    for dialogue in dialogues[language]:
        lines = [line for line in dialogue if line not in shared]
        document = "\n".join(lines)
        if len(lines) < 2 or (exclude and leaked_texts(document, exclude)):
            continue
        documents.append(document)
    documents = sorted(set(documents))
    if not documents:
        raise ValueError(f"--language {language}: no {language} dialogue is left to write.")
    return documents


def write_monolingual_text(
    language: str, output: str | Path, exclude_eval: Sequence[str | Path] = (), cache_dir: Path | None = None
) -> Path:
    """Write the language's documents as text JSONL to output; the eval sets' messages are never in it."""
    rows = [c.to_json() for path in exclude_eval for c in read_conversations(path)]
    exclude = eval_texts(rows) if rows else None
    documents = monolingual_documents(language, cache_dir, exclude)
    return write_jsonl(output, ({"text": doc} for doc in documents))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_osprey.demo.monolingual", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--language", required=True, choices=MONOLINGUAL_LANGUAGES)
    parser.add_argument("--output", required=True, help="the text JSONL (the recipe's paths.pretrain_text)")
    parser.add_argument("--exclude-eval", nargs="*", default=[], help="eval sets (conversations JSONL) to keep out")
    args = parser.parse_args(argv)
    path = write_monolingual_text(args.language, args.output, args.exclude_eval)
    print(f"{args.language}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
