"""Tests for megatron_osprey.demo.corpora: the five demo domains from pinned registry text and the stdlib.

The chat and multilingual domains download chatterbot-corpus 1.3.3 (346 kB) once per session into pytest's
temp dir, or reuse $OSPREY_CACHE when it is set.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
from pathlib import Path

import pytest

from megatron_osprey.assets.download import ChecksumError
from megatron_osprey.demo import corpora, corpus_sources


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    if os.environ.get("OSPREY_CACHE"):
        return corpus_sources.default_cache_dir()
    return tmp_path_factory.mktemp("osprey_corpora")


def _check_row(row: dict, domain: str) -> None:
    assert set(row) == {"id", "conversations"} and row["id"].startswith(f"{domain}-")
    messages = row["conversations"]
    assert 2 <= len(messages) <= 2 * corpora.MAX_TURNS and len(messages) % 2 == 0
    for i, message in enumerate(messages):
        assert set(message) == {"role", "content"}
        assert message["role"] == ("user" if i % 2 == 0 else "assistant")
        assert isinstance(message["content"], str) and message["content"].strip()


@pytest.mark.parametrize("domain", corpora.DOMAINS)
def test_domain_count_schema_and_determinism(domain, cache_dir):
    rows = corpora.domain_conversations(domain, 40, seed=3, cache_dir=cache_dir)
    assert len(rows) == 40 and len({r["id"] for r in rows}) == 40
    for row in rows:
        _check_row(row, domain)
    assert len({r["conversations"][0]["content"] for r in rows}) == 40
    assert corpora.domain_conversations(domain, 40, seed=3, cache_dir=cache_dir) == rows
    assert corpora.domain_conversations(domain, 40, seed=4, cache_dir=cache_dir) != rows
    json.dumps(rows)


def test_available_and_too_many(cache_dir):
    sizes = {d: corpora.available_conversations(d, cache_dir) for d in corpora.DOMAINS}
    assert sizes["math"] is None
    assert all(sizes[d] >= 150 for d in ("chat", "code", "prose", "multilingual"))
    with pytest.raises(ValueError, match="only"):
        corpora.domain_conversations("prose", sizes["prose"] + 1, cache_dir=cache_dir)
    with pytest.raises(ValueError, match="Unknown demo domain"):
        corpora.domain_conversations("poetry", 1, cache_dir=cache_dir)


def test_multilingual_is_not_english(cache_dir):
    rows = corpora.domain_conversations("multilingual", 200, cache_dir=cache_dir)
    text = " ".join(m["content"] for r in rows for m in r["conversations"])
    assert re.search(r"[ñéèüäöàçãõ¿¡]", text)
    words = set(re.findall(r"\w+", text.lower()))
    assert {"você", "je", "ich", "sono", "qué"} & words
    english = corpora.domain_conversations("chat", 200, cache_dir=cache_dir)
    assert not {r["conversations"][0]["content"] for r in rows} & {r["conversations"][0]["content"] for r in english}


def test_code_turns_are_python(cache_dir):
    rows = corpora.domain_conversations("code", 150, seed=2, cache_dir=cache_dir)
    for row in rows:
        user, assistant = row["conversations"]
        name = re.search(r"`([\w.]+)`", user["content"]).group(1).split(".")[-1]
        tree = ast.parse(assistant["content"])
        assert isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) and tree.body[0].name == name
        assert len(assistant["content"]) <= corpus_sources.MAX_FUNCTION_CHARS


def test_math_answers_are_worked(cache_dir):
    for row in corpora.domain_conversations("math", 100, cache_dir=cache_dir):
        for message in row["conversations"][1::2]:
            assert "=" in message["content"] and "\n" in message["content"]


def test_pretraining_text_budget_and_mix(cache_dir):
    docs = corpora.pretraining_text(corpora.DOMAINS, 20_000, seed=5, cache_dir=cache_dir)
    assert docs == corpora.pretraining_text(corpora.DOMAINS, 20_000, seed=5, cache_dir=cache_dir)
    assert sum(map(len, docs)) == 5 * 20_000
    for domain in corpora.DOMAINS:
        part = corpora.pretraining_text([domain], 5_000, seed=5, cache_dir=cache_dir)
        assert sum(map(len, part)) == 5_000 and all(doc for doc in part)
    assert any("def " in d for d in docs) and any("Answer:" in d for d in docs)


def test_write_jsonl_roundtrip(tmp_path, cache_dir):
    rows = corpora.domain_conversations("math", 5, cache_dir=cache_dir)
    path = corpora.write_jsonl(tmp_path / "sub" / "math.jsonl", rows)
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == rows
    assert [p.name for p in path.parent.iterdir()] == ["math.jsonl"]


def test_wrong_pin_is_refused_and_nothing_cached(tmp_path, monkeypatch):
    wrong = dataclasses.replace(corpus_sources.CHATTERBOT_CORPUS, sha256="0" * 64)
    monkeypatch.setattr(corpus_sources, "CHATTERBOT_CORPUS", wrong)
    with pytest.raises(ChecksumError, match="sha256"):
        corpora.domain_conversations("chat", 1, cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_cache_is_reused_without_download(cache_dir, monkeypatch):
    corpus_sources.chatterbot_dialogues(cache_dir)

    def no_download(*args, **kwargs):
        raise AssertionError("the cached corpus should have been used")

    monkeypatch.setattr(corpus_sources, "pip_download", no_download)
    assert corpora.available_conversations("chat", cache_dir) > 0


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("OSPREY_CACHE", str(tmp_path))
    assert corpus_sources.default_cache_dir() == tmp_path / "corpora"
    monkeypatch.delenv("OSPREY_CACHE")
    assert corpus_sources.default_cache_dir() == Path.home() / ".cache" / "megatron_osprey" / "corpora"


def test_the_corpus_cache_expands_home_as_the_tokenizer_cache_does(monkeypatch, tmp_path):
    from megatron_osprey.assets import default_cache_dir as tokenizer_cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("OSPREY_CACHE", "~/cache")
    assert corpus_sources.default_cache_dir() == tmp_path / "cache" / "corpora"
    assert tokenizer_cache_dir() == tmp_path / "cache" / "tokenizers"


def _norm(text: str) -> str:
    return " ".join(text.split()).casefold()


def test_no_eval_text_in_the_pretraining_mix(cache_dir):
    """Held-out prompts and answers never appear in the pretraining mix that excludes them (the training
    conversations' split is osprey data's, tested in test_user_data.py).

    Checked independently of corpora.leaked_texts: every eval message of 20+ normalised characters must not be a
    substring of any normalised pretraining document; shorter ones must not be a whole line of it.
    """
    evaluation = [row for d in corpora.DOMAINS for row in corpora.domain_conversations(d, 16, 0, cache_dir)]
    held_out = corpora.eval_texts(evaluation)
    corpus = corpora.pretraining_text(corpora.DOMAINS, 60_000, seed=0, cache_dir=cache_dir, exclude=held_out)
    texts = {_norm(m["content"]) for row in evaluation for m in row["conversations"]}
    long_texts = [t for t in texts if len(t) >= 20]
    assert len(long_texts) > 100  # the check covers real prompts and answers of every domain
    for doc in corpus:
        normed = _norm(doc)
        lines = {_norm(line) for line in doc.splitlines()}
        assert not [t for t in long_texts if t in normed], doc[:200]
        assert not [t for t in texts if len(t) < 20 and t in lines], doc[:200]
    # Without the exclusion the mix does hold eval answers verbatim (the leak the exclusion removes).
    leaky = corpora.pretraining_text(corpora.DOMAINS, 60_000, seed=0, cache_dir=cache_dir)
    assert any(t in _norm(doc) for doc in leaky for t in long_texts)
