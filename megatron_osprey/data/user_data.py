"""`osprey data`: every input a recipe reads, built from the conversations users have.

Input: per domain (a name the user picks: `code=a.jsonl`), local JSONL (plain or gzip), a JSON array,
Parquet, or a `datasets` directory written by `save_to_disk`, each row in OpenAI-messages, ShareGPT or
prompt/response form (data/conversations.py). Output, in one directory:

    prompts/{domain}.jsonl        the training prompts regenerate answers with the target
    eval/{domain}.jsonl           the held-out conversations evaluate prompts with (first user message)
    conversations/{domain}.jsonl  the training conversations, when the rows hold replies
    token_counts.json             target-token counts over the assistant tokens of those conversations
                                  (a list indexed by token id: the reduced draft vocabulary's input)
    data_summary.json             what was read, kept and left out, per domain

The eval split is drawn per domain with the seed, after duplicates (the same normalized first prompt)
are removed; a training conversation any of whose user turns equals an eval prompt of any domain is left
out, so no eval prompt is ever trained on or regenerated. The result is checked before it is written, into an
output claimed for this stage (base/outputs.py: one writer at a time; --overwrite empties only a directory whose
provenance.json names the data stage, or that the data stage left partial) and recorded in provenance.json last.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from megatron_osprey.base.arch import hf_config_file, load_target_config, looks_like_hub_id
from megatron_osprey.base.atomic_io import write_json_atomic
from megatron_osprey.base.outputs import check_output, claimed_output
from megatron_osprey.base.provenance import PROVENANCE_FILE, write_provenance
from megatron_osprey.data.chat_template import (
    REASONING_MODES,
    TOOL_MODES,
    ChatTemplateConfig,
    ChatTokenizer,
    apply_reasoning,
    split_reasoning,
    template_defaults,
)
from megatron_osprey.data.conversations import (
    GZIP_ERRORS,
    Conversation,
    ConversationFormatError,
    from_user_row,
    load_json,
    write_conversations,
)
from megatron_osprey.data.splits import (  # noqa: F401  (first_prompt, normalize_prompt: this module's API)
    SPLIT_RULES,
    DomainSplit,
    first_prompt,
    normalize_prompt,
    split_domains,
    user_prompts,
)

SUMMARY_FILE = "data_summary.json"
TOKEN_COUNTS_FILE = "token_counts.json"
PROMPT_TURNS = ("all", "first")
# A domain names files (prompts/{domain}.jsonl), job names and log paths: no separator, no leading dot.
DOMAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Held-out conversations per domain: the paper's 512 (the release's data/*_eval_512_*.jsonl, LeanModels/Osprey
# README.md). 64, this project's earlier default, stays a flag value: cheaper, noisier, not comparable cell for cell.
PAPER_EVAL_SIZE = 512
EARLIER_EVAL_SIZE = 64
_PARQUET_MAGIC = b"PAR1"
_GZIP_MAGIC = b"\x1f\x8b"


@dataclasses.dataclass
class UserDataConfig:
    """What `osprey data` reads and how it splits and renders it."""

    inputs: list[str] = dataclasses.field(default_factory=list)  # DOMAIN=PATH, repeatable (a domain may repeat)
    target: str | None = None  # the target's HF directory: its tokenizer (and config.json, when there)
    output: str | None = None
    eval_size: int = PAPER_EVAL_SIZE  # held-out conversations per domain
    max_train: int | None = None  # at most this many training conversations per domain (the first, in input order)
    seed: int = 0
    split_rule: str = "seeded"  # SPLIT_RULES
    reasoning: str | None = None  # template | drop | inline; None: what the target's template does
    tools: str | None = None  # template | drop; None: what the target's template does
    prompt_turns: str = "all"  # all: every user turn up to the first tool turn; first: the first user turn
    seq_length: int = 4096  # tokens per conversation counted, as in training
    overwrite: bool = False

    def validate(self) -> None:
        """Required flags and allowed values, before anything is read."""
        if not self.inputs:
            raise ValueError("--input DOMAIN=PATH is required (repeat it for more domains or files).")
        for flag, value in (("--target", self.target), ("--output", self.output)):
            if not value:
                raise ValueError(f"{flag} is required.")
        if self.reasoning is not None and self.reasoning not in REASONING_MODES:
            raise ValueError(f"--reasoning must be one of {REASONING_MODES}, got {self.reasoning!r}.")
        if self.tools is not None and self.tools not in TOOL_MODES:
            raise ValueError(f"--tools must be one of {TOOL_MODES}, got {self.tools!r}.")
        if self.prompt_turns not in PROMPT_TURNS:
            raise ValueError(f"--prompt-turns must be one of {PROMPT_TURNS}, got {self.prompt_turns!r}.")
        if self.split_rule not in SPLIT_RULES:
            raise ValueError(f"--split-rule must be one of {SPLIT_RULES}, got {self.split_rule!r}.")
        if self.split_rule == "shuffle" and self.max_train is None:
            raise ValueError("--split-rule shuffle takes the first --max-train rows of the shuffle as train: pass it.")
        if self.eval_size < 0 or self.seq_length < 1 or (self.max_train is not None and self.max_train < 1):
            raise ValueError("--eval-size must be at least 0, --seq-length and --max-train at least 1.")


def parse_inputs(specs: Iterable[str]) -> dict[str, list[Path]]:
    """{domain: [paths]} from `DOMAIN=PATH` words, in the order given."""
    domains: dict[str, list[Path]] = {}
    for spec in specs:
        name, sep, path = str(spec).partition("=")
        if not sep or not path or not DOMAIN_NAME.match(name):
            raise ValueError(
                f"--input {spec!r} must be DOMAIN=PATH, the domain a name of letters, digits, '_', '-' or '.' "
                f"(e.g. --input code=code.jsonl)."
            )
        domains.setdefault(name, []).append(Path(path))
    return domains


# --- Reading the files users have ------------------------------------------------------


def read_rows(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of a JSONL / JSON-array / Parquet file or a save_to_disk directory."""
    path = Path(path)
    if not path.exists():
        if looks_like_hub_id(str(path)):
            raise ValueError(
                f"--input {path} looks like a Hugging Face Hub dataset id; nothing is downloaded here: download "
                f"it first (e.g. `huggingface-cli download --repo-type dataset {path} --local-dir DIR`) and pass "
                f"its JSONL or Parquet files, or a directory saved with datasets' save_to_disk."
            )
        raise FileNotFoundError(f"--input {path} does not exist.")
    if path.is_dir():
        yield from _dataset_rows(path)
        return
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic == _PARQUET_MAGIC:
        yield from _parquet_rows(path)
    else:
        yield from _json_rows(path, gzip.open if magic[:2] == _GZIP_MAGIC else open)


def _gzip_damaged(path: Path, error: Exception, lineno: int) -> ConversationFormatError:
    return ConversationFormatError(
        f"{path}: the gzip stream is truncated or damaged after line {lineno} ({error}); compress it again."
    )


def _lines(path: Path, opener) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of a plain or gzip file; a gzip stream that ends early or is damaged is one error
    naming the file and the last whole line."""
    lineno = 0
    try:
        with opener(path, "rb") as handle:
            for lineno, raw in enumerate(handle, start=1):
                yield lineno, raw
    except GZIP_ERRORS as error:
        raise _gzip_damaged(path, error, lineno) from None


def _json_rows(path: Path, opener) -> Iterator[tuple[str, Any]]:
    try:
        with opener(path, "rb") as handle:
            head = handle.read(4096).lstrip()
    except GZIP_ERRORS as error:
        raise _gzip_damaged(path, error, 0) from None
    if head.startswith(b"["):  # one JSON array (ShareGPT dumps often are), not JSON Lines
        text = b"".join(raw for _, raw in _lines(path, opener))
        try:
            decoded = text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ConversationFormatError(f"{path}: not a valid JSON array ({error}).") from None
        rows = load_json(decoded, str(path))
        for index, row in enumerate(rows):
            yield f"{path} item {index}", row
        return
    for lineno, raw in _lines(path, opener):
        where = f"{path}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ConversationFormatError(
                f"{where} is not UTF-8 text (byte 0x{raw[error.start]:02x} at column {error.start + 1})."
            ) from None
        if not line.strip():
            continue
        yield where, load_json(line, where)


def is_saved_dataset(path: Path) -> bool:
    """A `datasets` save_to_disk directory: a Dataset (state.json) or a DatasetDict (dataset_dict.json)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield f"{path} row {index}", row
            index += 1


def _dataset_rows(path: Path) -> Iterator[tuple[str, Any]]:
    from datasets import DatasetDict, load_from_disk

    try:
        dataset = load_from_disk(str(path))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"--input {path} is a directory but not a dataset saved with datasets' save_to_disk."
        ) from None
    if isinstance(dataset, DatasetDict):
        if "train" not in dataset:
            raise ValueError(f"--input {path} holds splits {sorted(dataset)} but no 'train'; save one split.")
        dataset = dataset["train"]
    for index, row in enumerate(dataset):
        yield f"{path} row {index}", row


def _json_safe(row: Any) -> Any:
    """The row without the metadata values JSON cannot hold (timestamps, bytes from Parquet): those are ignored."""
    if not isinstance(row, dict):
        return row
    safe = {}
    for key, value in row.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        safe[key] = value
    return safe


def load_domain(domain: str, paths: list[Path]) -> list[Conversation]:
    """Every row of a domain's files as a conversation; ids unique within the domain."""
    conversations, seen = [], {}
    for path in paths:
        for where, row in read_rows(path):
            conversation = from_user_row(_json_safe(row), where, default_id=f"{domain}-{len(conversations)}")
            if conversation.id in seen:
                raise ConversationFormatError(
                    f"{where}: duplicate id {conversation.id!r} in domain {domain!r} "
                    f"(first at {seen[conversation.id]})."
                )
            seen[conversation.id] = where
            conversations.append(conversation)
    if not conversations:
        raise ValueError(f"--input {domain}=...: no rows in {', '.join(map(str, paths))}.")
    return conversations


# --- Splitting ------------------------------------------------------------------------


def with_reasoning(conversation: Conversation, mode: str) -> Conversation:
    """The conversation as it will be rendered: reasoning kept for the template, dropped or inlined."""
    return dataclasses.replace(conversation, messages=tuple(apply_reasoning(conversation.messages, mode)))


def prompt_conversation(conversation: Conversation, turns: str) -> Conversation | None:
    """What regenerate answers: the messages before the first tool turn (before the first reply for "first"); None
    when no user message comes before the first tool turn, so there is nothing to answer (the row is left out).

    Assistant turns stay, answer text only, to keep the turn structure; regenerate replaces every one. An assistant
    turn before the first user message answers nothing here and is dropped, as regeneration drops it. A tool
    result answers a call the target may not make again, so nothing from the first tool call on is kept.
    """
    messages: list[dict[str, Any]] = []
    asked = False  # a user message has been kept
    for message in conversation.messages:
        if message["role"] == "tool" or message.get("tool_calls"):
            break
        if message["role"] == "assistant":
            if not asked:
                continue
            if turns == "first":
                break
            messages.append({"role": "assistant", "content": split_reasoning(message["content"])[1]})
        else:
            asked = asked or message["role"] == "user"
            messages.append(dict(message))
    if not asked:
        return None
    while messages[-1]["role"] == "assistant":
        messages.pop()
    extra = {k: v for k, v in conversation.extra.items() if k != "tools"}
    return Conversation(id=conversation.id, messages=tuple(messages), extra=extra)


def has_reply(conversation: Conversation) -> bool:
    return any(m["role"] == "assistant" for m in conversation.messages)


def count_assistant_tokens(conversations: Iterable[Conversation], chat: ChatTokenizer, size: int) -> np.ndarray:
    """Counts per target token id of the tokens the loss is taken on (the assistant mask, as in training)."""
    counts = np.zeros(size, dtype=np.int64)
    for conversation in conversations:
        tokenized = chat.tokenize(conversation)
        counts += np.bincount(tokenized.input_ids[tokenized.loss_mask], minlength=size)[:size]
    return counts


def _load_tokenizer(target: str):
    from transformers import AutoTokenizer

    hf_config_file(target, "--target", missing_ok=True)  # a Hub id is refused here, before transformers tries
    if not Path(target).is_dir():
        raise FileNotFoundError(f"--target {target}: not a directory (the target's HF directory, with its tokenizer).")
    return AutoTokenizer.from_pretrained(target)


def _write_rows(path: Path, rows: Iterable[Conversation]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_conversations(path, rows)


def data_outputs(output: Path) -> dict[str, Path]:
    """Every file `osprey data` wrote into OUTPUT, by the name its provenance.json records it under."""
    outputs = {"summary": output / SUMMARY_FILE}
    for kind in ("prompts", "eval", "conversations"):
        outputs |= {f"{kind}/{p.stem}": p for p in sorted((output / kind).glob("*.jsonl"))}
    if (output / TOKEN_COUNTS_FILE).is_file():
        outputs["token_counts"] = output / TOKEN_COUNTS_FILE
    return outputs


def build_user_data(config: UserDataConfig, tokenizer=None, record: Callable[[Path], None] | None = None) -> dict:
    """Read, split, render and write every file (module docstring); returns the summary it wrote.

    `tokenizer`: the target's, already loaded from config.target (a caller that holds it saves the load).
    `record(output)` writes OUTPUT/provenance.json once every file is written (the stage records its checked
    inputs and command); by default a record of the outputs alone.
    """
    config.validate()
    domains_in = parse_inputs(config.inputs)
    output = Path(config.output)
    inputs = {f"--input {p}": p for paths in domains_in.values() for p in paths} | {"--target": config.target}
    check_output(output, inputs, PROVENANCE_FILE, config.overwrite, stage="data")  # again when claimed, below
    tokenizer = tokenizer or _load_tokenizer(config.target)
    template_reasoning, template_tools = template_defaults(tokenizer)
    reasoning, tools = config.reasoning or template_reasoning, config.tools or template_tools
    target: dict[str, Any] = {"path": str(config.target), "tokenizer_size": len(tokenizer)}
    if hf_config_file(config.target, "--target", missing_ok=True) is not None:
        arch = load_target_config(config.target)
        if len(tokenizer) > arch.vocab_size:
            raise ValueError(
                f"--target {config.target}: its tokenizer has {len(tokenizer)} tokens, more than config.json's "
                f"vocab_size {arch.vocab_size}; the tokenizer is not this model's."
            )
        target |= {"shape": arch.shape(), "aux_layer_ids": arch.default_aux_layer_ids}

    domains = {d: [with_reasoning(c, reasoning) for c in load_domain(d, paths)] for d, paths in domains_in.items()}
    splits = split_domains(domains, config.eval_size, config.seed, tools == "drop", config.max_train, config.split_rule)
    # Rendering every conversation once here also proves the template and the mask can follow each of them.
    chat = ChatTokenizer(tokenizer, ChatTemplateConfig(max_length=config.seq_length))
    trained = [c for split in splits.values() for c in split.train if has_reply(c)]
    counts = count_assistant_tokens(trained, chat, len(tokenizer)) if trained else None

    # Claimed only now, after every input is read and checked: until here an earlier output stays whole.
    with claimed_output(output, inputs, config.overwrite, stage="data") as output:
        summary = _write_all(output, splits, counts, config, reasoning, tools, target, domains_in)
        if record is None:
            write_provenance(output, "data", {}, data_outputs(output), config=config)
        else:
            record(output)
    return summary


def _write_all(output, splits, counts, config, reasoning, tools, target, domains_in) -> dict:
    per_domain = {}
    for domain, split in splits.items():
        prompts = [prompt_conversation(c, config.prompt_turns) for c in split.train]
        _write_rows(output / "prompts" / f"{domain}.jsonl", (p for p in prompts if p is not None))
        if split.eval:
            _write_rows(output / "eval" / f"{domain}.jsonl", split.eval)
        replies = [c for c in split.train if has_reply(c)]
        if replies:
            _write_rows(output / "conversations" / f"{domain}.jsonl", replies)
        per_domain[domain] = {
            "inputs": [str(p) for p in domains_in[domain]],
            "rows": split.rows,
            "duplicates_removed": split.duplicates,
            "tool_conversations_dropped": split.tool_conversations_dropped,
            "eval": len(split.eval),
            "train": len(split.train),
            "train_with_eval_prompt_removed": split.leaks_removed,
            "prompts_without_user_turn": prompts.count(None),  # a tool call before any user message
            "conversations": len(replies),
        }
    if counts is not None:
        write_json_atomic(output / TOKEN_COUNTS_FILE, counts.tolist(), indent=None)
    summary = {
        "seed": config.seed,
        "eval_size": config.eval_size,
        "reasoning": reasoning,
        "tools": tools,
        "prompt_turns": config.prompt_turns,
        "seq_length": config.seq_length,
        "target": target,
        "assistant_tokens": None if counts is None else int(counts.sum()),
        "domains": per_domain,
    }
    write_json_atomic(output / SUMMARY_FILE, summary)
    return summary
