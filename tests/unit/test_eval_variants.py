"""The template-perturbation and long-context eval sets: deterministic, the words kept, the token budget reached
with the real Qwen3 tokenizer, and read by the evaluate stage's prompt loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_osprey.assets import load_tokenizer
from megatron_osprey.data.chat_template import render_generation_prompt
from megatron_osprey.data.conversations import read_conversations, validate_row, write_conversations
from megatron_osprey.data.eval_variants import context_budget, main, perturb, write_variants
from megatron_osprey.eval.prompts import PROMPT_MODES, load_prompts, prompt_messages

REQUESTS = (
    "How do I reverse a list in Python?",
    "Explain why the sky is blue.\nKeep it short.",
    "Write a haiku about autumn leaves",
    "What is the capital of Australia?",
    "Summarise the plot of Hamlet in three sentences.",
    "Give me two tips for learning French vocabulary",
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("qwen3")


def _eval_set(path):
    rows = []
    for i, request in enumerate(REQUESTS):
        messages = [{"role": "user", "content": request}, {"role": "assistant", "content": f"Answer number {i}."}]
        if i == 1:
            messages.insert(0, {"role": "system", "content": "You are a helpful assistant."})
        rows.append(validate_row({"id": f"chat-{i}", "conversations": messages}, "test"))
    write_conversations(path, rows)
    return path


def test_the_variants_are_deterministic_given_the_seed(tmp_path, tokenizer):
    source = _eval_set(tmp_path / "chat.jsonl")
    first = write_variants(source, tokenizer, tmp_path / "a", seed=3, budget=300)
    again = write_variants(source, tokenizer, tmp_path / "b", seed=3, budget=300)
    other = write_variants(source, tokenizer, tmp_path / "c", seed=4, budget=300)
    assert set(first) == {"perturbed", "long_context"}
    for variant, path in first.items():
        assert path.name == f"chat.{variant}.jsonl"
        assert path.read_bytes() == again[variant].read_bytes()
        assert path.read_bytes() != other[variant].read_bytes()


def test_perturbation_changes_the_rendered_prompt_but_keeps_every_word(tmp_path, tokenizer):
    source = _eval_set(tmp_path / "chat.jsonl")
    originals = list(read_conversations(source))
    for original in originals:
        changed = perturb(original, seed=0)
        assert changed.id == original.id and changed.messages[0]["role"] == "system"
        assert changed.messages[0]["content"] != original.messages[0]["content"]
        assert changed.messages[-1] == original.messages[-1]  # the reference answer is untouched
        for mode in PROMPT_MODES:
            before = render_generation_prompt(tokenizer, prompt_messages(original.messages, mode))
            after = render_generation_prompt(tokenizer, prompt_messages(changed.messages, mode))
            assert before != after
        words = iter(next(m for m in changed.messages if m["role"] == "user")["content"].split())
        request = next(m for m in original.messages if m["role"] == "user")["content"]
        assert all(word in words for word in request.split()), (request, changed.messages)  # in order


def test_long_context_rows_fill_the_budget_as_the_evaluate_stage_counts_it(tmp_path, tokenizer):
    source = _eval_set(tmp_path / "chat.jsonl")
    budget = 700
    path = write_variants(source, tokenizer, tmp_path, ["long_context"], seed=0, budget=budget)["long_context"]
    rows = {c.id: c for c in read_conversations(path)}
    counts = {}
    for mode in PROMPT_MODES:
        for thinking in (None, False):
            for prompt in load_prompts(path, tokenizer, enable_thinking=thinking, mode=mode):
                counts[prompt.id] = max(counts.get(prompt.id, 0), len(prompt.input_ids))
    assert set(counts) == set(rows) == {f"chat-{i}" for i in range(len(REQUESTS))}
    for i, request in enumerate(REQUESTS):
        assert budget - 4 <= counts[f"chat-{i}"] <= budget, counts
        user = next(m for m in rows[f"chat-{i}"].messages if m["role"] == "user")["content"]
        assert user.endswith(request) and len(user) > 5 * len(request)
        # The preamble is the file's other conversations, never the row's own answer.
        assert f"Answer number {i}." not in user
        assert any(f"Answer number {j}." in user for j in range(len(REQUESTS)) if j != i)
    with pytest.raises(ValueError, match="--max-context-tokens 5"):
        write_variants(source, tokenizer, tmp_path / "small", ["long_context"], budget=5)


def test_the_budget_comes_from_the_target_config_and_never_passes_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    assert context_budget(tmp_path) == 8192 - 4160
    assert context_budget(tmp_path, reserve_tokens=0) == 8192
    assert context_budget(tmp_path, max_context_tokens=5000) == 5000
    with pytest.raises(ValueError, match="--max-context-tokens 9000 exceeds .* 8192"):
        context_budget(tmp_path, max_context_tokens=9000)
    empty = tmp_path / "tokenizer_only"
    empty.mkdir()
    with pytest.raises(ValueError, match="--max-context-tokens is required"):
        context_budget(empty)
    assert context_budget(empty, max_context_tokens=1234) == 1234
    with pytest.raises(FileNotFoundError, match="--target-config"):
        context_budget(empty, target_config=tmp_path / "missing")


def test_the_command_writes_both_sets_beside_each_other(tmp_path, tokenizer, capsys):
    from megatron_osprey.assets.tokenizer_cache import get_tokenizer_dir

    source = _eval_set(tmp_path / "math.jsonl")
    out = tmp_path / "eval"
    args = ["--input", str(source), "--tokenizer", str(get_tokenizer_dir("qwen3")), "--output-dir", str(out)]
    assert main([*args, "--max-context-tokens", "400", "--seed", "1"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["math.long_context.jsonl", "math.perturbed.jsonl"]
    assert "perturbed:" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--max-context-tokens is required"):
        main([*args, "--variants", "long_context"])
    with pytest.raises(ValueError, match="--variants shuffled"):
        main([*args, "--variants", "shuffled"])


def test_variant_files_are_splits_of_their_own_beside_their_source():
    from megatron_osprey.eval.run import split_names

    paths = [Path("e/chat.jsonl"), Path("e/chat.perturbed.jsonl"), Path("e/chat.long_context.jsonl"), Path("x.json")]
    assert split_names(paths) == ["chat", "chat.perturbed", "chat.long_context", "x"]
    with pytest.raises(ValueError, match="distinct"):
        split_names([Path("a/chat.jsonl"), Path("b/chat.jsonl")])
