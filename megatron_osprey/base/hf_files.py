"""The files of a Hugging Face model directory that travel with its weights."""

from __future__ import annotations

import shutil
from pathlib import Path

# A tokenizer in any of the layouts transformers reads (fast JSON, SentencePiece, BPE
# vocab+merges), plus the chat template a serving engine needs.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
# Sampling defaults of a language model; a backbone keeps them, a drafter has none of its own.
GENERATION_CONFIG = "generation_config.json"


def copy_tokenizer_files(
    source: str | Path, dest: str | Path, *, with_generation_config: bool = False, keep_existing: bool = False
) -> list[str]:
    """Copy the tokenizer files source has into dest; returns the names copied."""
    source, dest = Path(source), Path(dest)
    names = TOKENIZER_FILES + ((GENERATION_CONFIG,) if with_generation_config else ())
    copied = []
    for name in names:
        if (source / name).is_file() and not (keep_existing and (dest / name).exists()):
            shutil.copy2(source / name, dest / name)
            copied.append(name)
    return copied
