"""Tests for megatron_osprey.assets: real tokenizers built from pinned PyPI files.

The first test to need a tokenizer downloads llama-cpp-python's sdist (50.7 MB) once per session into
pytest's temp dir, or reuses $OSPREY_CACHE when it is set.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from megatron_osprey.assets import (
    ChecksumError,
    available_tokenizers,
    default_cache_dir,
    download,
    get_tokenizer_dir,
    load_tokenizer,
    reference_cases,
    tokenizer_source,
)
from megatron_osprey.assets.gguf_reader import read_gguf_metadata
from megatron_osprey.assets.tokenizer_cache import INFO_FILE, parse_reference_cases
from megatron_osprey.base.atomic_io import make_staging_dir, publish_dir


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    if os.environ.get("OSPREY_CACHE"):
        return default_cache_dir()
    return tmp_path_factory.mktemp("osprey_tokenizers")


@pytest.fixture(scope="session")
def tokenizers(cache_dir):
    return {name: load_tokenizer(name, cache_dir) for name in available_tokenizers()}


def _no_network(dist, dest):
    raise AssertionError(f"unexpected download of {dist.requirement}")


@pytest.mark.parametrize("name", ["qwen3", "llama3", "llama2", "gpt2"])
def test_reproduces_reference_ids_of_original_tokenizer(name, tokenizers, cache_dir):
    cases = reference_cases(name, cache_dir)
    assert len(cases) == 46  # every llama.cpp test string, none excluded
    tok = tokenizers[name]
    for text, ids in cases:
        assert tok.encode(text, add_special_tokens=False) == ids, text
        assert tok.decode(ids) == text


def test_vocab_sizes(tokenizers, cache_dir):
    sizes = {name: len(tok) for name, tok in tokenizers.items()}
    assert sizes == {"qwen3": 151669, "llama3": 128256, "llama2": 32000, "gpt2": 50257}
    assert tokenizer_source("qwen3").padded_vocab_size == 151936


def test_qwen3_special_tokens_have_published_ids(tokenizers):
    tok = tokenizers["qwen3"]
    expected = {
        "<|endoftext|>": 151643,
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<|vision_pad|>": 151654,
        "<tool_call>": 151657,
        "<|fim_prefix|>": 151659,
        "<|file_sep|>": 151664,
        "<tool_response>": 151665,
        "<think>": 151667,
        "</think>": 151668,
    }
    assert {t: tok.convert_tokens_to_ids(t) for t in expected} == expected
    assert tok.encode("<|im_start|>user", add_special_tokens=False) == [151644, 872]
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    # <think> is an ordinary added token in Qwen3: skip_special_tokens keeps it, drops <|im_end|>.
    assert tok.decode([151667, 9707, 151645], skip_special_tokens=True) == "<think>Hello"
    assert tok.convert_ids_to_tokens(tok.encode(" Hello", add_special_tokens=False)) == ["ĠHello"]


def test_llama3_special_tokens_and_bos(tokenizers):
    tok = tokenizers["llama3"]
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
             "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
             "<|reserved_special_token_3|>", "<|reserved_special_token_247|>"]  # fmt: skip
    assert tok.convert_tokens_to_ids(names) == [128000, 128001, 128004, 128006, 128007, 128008, 128009, 128010,
                                                128011, 128255]  # fmt: skip
    assert tok.encode("Hello world") == [128000, 9906, 1917]
    assert tok.eos_token == "<|eot_id|>"


def test_llama2_sentencepiece_markers_and_byte_fallback(tokenizers):
    tok = tokenizers["llama2"]
    assert tok.encode("Hello world") == [1, 15043, 3186]
    assert tok.convert_ids_to_tokens([15043, 29871, 243]) == ["▁Hello", "▁", "<0xF0>"]
    assert tok.decode(tok.encode("🦙 x", add_special_tokens=False)) == "🦙 x"


def test_qwen3_chat_template_renders_official_format(tokenizers):
    tok = tokenizers["qwen3"]
    conversation = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nR1\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
    ]
    # Earlier turns lose their reasoning; the generation prompt opens the assistant turn.
    assert tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n"
    )
    # The final assistant turn keeps its reasoning block.
    assert tok.apply_chat_template(conversation[:2], tokenize=False) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n<think>\nR1\n</think>\n\nA1<|im_end|>\n"
    )
    no_think = tok.apply_chat_template(
        conversation[:1], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_think == "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_llama3_chat_template_renders_official_format(tokenizers):
    tok = tokenizers["llama3"]
    conversation = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:4] == [128000, 128006, 9125, 128007] and ids.count(128000) == 1


def test_cache_hit_needs_no_download_and_does_not_rebuild(cache_dir, tokenizers, monkeypatch):
    before = {n: (get_tokenizer_dir(n, cache_dir) / "tokenizer.json").stat().st_mtime_ns for n in tokenizers}
    monkeypatch.setattr(download, "pip_download", _no_network)
    after = {n: (get_tokenizer_dir(n, cache_dir) / "tokenizer.json").stat().st_mtime_ns for n in tokenizers}
    assert after == before


def test_rebuild_from_cached_source_files_needs_no_download(cache_dir, tokenizers, tmp_path, monkeypatch):
    import shutil

    shutil.copytree(cache_dir / "_sources", tmp_path / "_sources")
    # A copy left by an older conversion must be replaced, not trusted.
    stale = tmp_path / "llama2"
    shutil.copytree(cache_dir / "gpt2", stale)
    info = json.loads((stale / INFO_FILE).read_text())
    (stale / INFO_FILE).write_text(json.dumps({**info, "build_version": info["build_version"] - 1}))
    monkeypatch.setattr(download, "pip_download", _no_network)
    tok = load_tokenizer("llama2", tmp_path)
    assert tok.encode("Hello world", add_special_tokens=False) == [15043, 3186]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_sources", "llama2"]  # no staging left behind


def test_publish_dir_keeps_a_valid_concurrent_copy_and_replaces_a_stale_one(tmp_path):
    final = tmp_path / "tok"
    final.mkdir()
    (final / "f").write_text("theirs")
    staging = make_staging_dir(tmp_path, "tok")
    (staging / "f").write_text("ours")
    publish_dir(staging, final, is_valid=lambda d: True)
    assert (final / "f").read_text() == "theirs" and not staging.exists()
    staging = make_staging_dir(tmp_path, "tok")
    (staging / "f").write_text("ours")
    publish_dir(staging, final, is_valid=lambda d: False)
    assert (final / "f").read_text() == "ours"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]


def test_sha256_mismatch_refuses_and_caches_nothing(tmp_path, monkeypatch):
    def tampered(dist, dest):
        path = Path(dest) / dist.filename
        path.write_bytes(b"not the pinned sdist")
        return path

    monkeypatch.setattr(download, "pip_download", tampered)
    with pytest.raises(ChecksumError, match="refusing to use it"):
        get_tokenizer_dir("gpt2", tmp_path)
    assert list(tmp_path.rglob("*.json")) == []
    assert not (tmp_path / "gpt2").exists()


def test_unknown_name_lists_available():
    with pytest.raises(KeyError, match="available: qwen3, llama3, llama2, gpt2"):
        tokenizer_source("llama4")


def test_default_cache_dir_follows_osprey_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("OSPREY_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "tokenizers"
    monkeypatch.delenv("OSPREY_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "megatron_osprey" / "tokenizers"


def test_parse_reference_cases_keeps_whitespace_texts():
    inputs = "a b\n__ggml_vocab_test__\n\n__ggml_vocab_test__\n\n\n__ggml_vocab_test__\n"
    outputs = " 1 2\n\n 3\n"
    assert parse_reference_cases(inputs, outputs) == [("a b", [1, 2]), ("", []), ("\n", [3])]
    with pytest.raises(ValueError, match="2 inputs but 3 output lines"):
        parse_reference_cases("a\n__ggml_vocab_test__\nb\n__ggml_vocab_test__\n", "1\n2\n3\n")


def _gguf_string(s: str) -> bytes:
    data = s.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def test_gguf_reader_parses_scalars_and_arrays(tmp_path):
    kvs = [
        _gguf_string("general.architecture") + struct.pack("<I", 8) + _gguf_string("llama"),
        _gguf_string("llama.block_count") + struct.pack("<II", 4, 32),
        _gguf_string("tokenizer.ggml.add_bos_token") + struct.pack("<I?", 7, True),
        _gguf_string("tokenizer.ggml.scores") + struct.pack("<IIQff", 9, 6, 2, -1.5, 0.25),
        _gguf_string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2)
        + _gguf_string("▁a") + _gguf_string("<0x0A>"),
    ]  # fmt: skip
    path = tmp_path / "v.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs))
    assert read_gguf_metadata(path) == {
        "general.architecture": "llama",
        "llama.block_count": 32,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.scores": [-1.5, 0.25],
        "tokenizer.ggml.tokens": ["▁a", "<0x0A>"],
    }
    path.write_bytes(b"GGML" + path.read_bytes()[4:])
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_metadata(path)


def _fetch_tool():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "tools" / "fetch_tokenizers.py"
    spec = importlib.util.spec_from_file_location("fetch_tokenizers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fetch_tool_verifies_and_fails_on_mismatch(cache_dir, tokenizers, monkeypatch, capsys):
    from megatron_osprey.assets import tokenizer_cache

    tool = _fetch_tool()
    assert tool.main(["gpt2", "--cache-dir", str(cache_dir), "--verify"]) == 0
    assert "reference ids 46/46" in capsys.readouterr().out
    monkeypatch.setattr(tokenizer_cache, "reference_cases", lambda name, cache_dir=None: [("Hello", [0])])
    assert tool.main(["gpt2", "--cache-dir", str(cache_dir), "--verify"]) == 1
    assert "expected [0], got [15496]" in capsys.readouterr().err
