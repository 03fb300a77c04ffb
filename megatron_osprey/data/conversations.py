"""Conversations JSONL: reading, validation and writing, and the forms users bring their conversations in.

One row per line: ``{"id": str, "conversations": [{"role": "system"|"user"|"assistant"|"tool",
"content": str, ...}, ...]}``. A system message may only come first; at least one user
message is required. An assistant message may also hold ``reasoning_content`` (str) and
``tool_calls`` (OpenAI's ``[{"type": "function", "function": {"name", "arguments"}}]``); a
tool message (``tool_call_id``, ``name`` optional) answers the tool calls before it. A
top-level ``tools`` list (function definitions) goes to the chat template. Other top-level
keys are kept and written back unchanged.

`from_user_row` turns the forms users have into that row: OpenAI ``messages``, ShareGPT
``conversations`` with ``from``/``value`` (human, gpt, system, function_call, observation),
or ``prompt``/``response``.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from megatron_osprey.base.atomic_io import write_lines_atomic

ROLES = ("system", "user", "assistant", "tool")
# The keys each role may carry: what the chat templates of the supported targets read.
ROLE_KEYS = {
    "system": frozenset({"role", "content"}),
    "user": frozenset({"role", "content"}),
    "assistant": frozenset({"role", "content", "reasoning_content", "tool_calls"}),
    "tool": frozenset({"role", "content", "tool_call_id", "name"}),
}


# A row's field holding the user turns sent after the first in evaluation, each after the model's answer to the one
# before (eval/suites.py writes MT-Bench's second question there; eval/prompts.py sends it).
NEXT_TURNS_KEY = "next_turns"


class ConversationFormatError(ValueError):
    """A conversations JSONL row does not follow the schema."""


@dataclass(frozen=True)
class Conversation:
    """One validated conversation; ``messages`` are plain role/content dicts."""

    id: str
    messages: tuple[dict[str, Any], ...]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tools(self) -> list[dict] | None:
        """The function definitions the chat template renders (OpenAI's top-level `tools`), if any."""
        return self.extra.get("tools")

    @property
    def has_tool_turns(self) -> bool:
        return any(m["role"] == "tool" or m.get("tool_calls") for m in self.messages)

    def to_json(self) -> dict[str, Any]:
        """Return the row as a JSON-ready dict in the input schema."""
        row: dict[str, Any] = {"id": self.id}
        row.update({k: v for k, v in self.extra.items() if k not in ("id", "conversations")})
        row["conversations"] = [dict(m) for m in self.messages]
        return row

    def to_json_line(self) -> str:
        """Return the row as one JSON line ending in a newline."""
        return json.dumps(self.to_json(), ensure_ascii=False, separators=(",", ":")) + "\n"


def validate_row(row: Any, where: str) -> Conversation:
    """Validate one decoded JSON row; ``where`` (e.g. "file.jsonl:12") prefixes errors."""
    if not isinstance(row, dict):
        raise ConversationFormatError(f"{where}: row must be a JSON object, got {type(row).__name__}.")
    row_id = row.get("id")
    if not isinstance(row_id, str) or not row_id:
        raise ConversationFormatError(f'{where}: "id" must be a non-empty string.')
    messages = row.get("conversations")
    if not isinstance(messages, list) or not messages:
        raise ConversationFormatError(f'{where}: "conversations" must be a non-empty list (id {row_id!r}).')
    clean: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        at = f"{where}: conversations[{i}] of id {row_id!r}"
        if not isinstance(message, dict):
            raise ConversationFormatError(f"{at} must be an object with role and content.")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ConversationFormatError(f"{at} has role {role!r}; expected one of {list(ROLES)}.")
        unknown = set(message) - ROLE_KEYS[role]
        if unknown:
            raise ConversationFormatError(
                f"{at} has unknown keys {sorted(unknown)}; a {role} message allows only {sorted(ROLE_KEYS[role])}."
            )
        if not isinstance(content, str):
            raise ConversationFormatError(f'{at} must have a string "content".')
        if role == "system" and i != 0:
            raise ConversationFormatError(f"{at} is a system message; only the first message may be one.")
        clean.append(_valid_message(message, at, clean[-1] if clean else None))
    if not any(m["role"] == "user" for m in clean):
        raise ConversationFormatError(f"{where}: id {row_id!r} has no user message.")
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ConversationFormatError(f'{where}: "tools" of id {row_id!r} must be a list of objects.')
    extra = {k: v for k, v in row.items() if k not in ("id", "conversations")}
    return Conversation(id=row_id, messages=tuple(clean), extra=extra)


def _valid_message(message: dict[str, Any], at: str, previous: dict[str, Any] | None) -> dict[str, Any]:
    """One message's role-specific keys checked (reasoning, tool calls, tool results); returns a clean copy."""
    clean = {"role": message["role"], "content": message["content"]}
    reasoning = message.get("reasoning_content")
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise ConversationFormatError(f'{at} must have a string "reasoning_content".')
        clean["reasoning_content"] = reasoning
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise ConversationFormatError(f'{at}: "tool_calls" must be a list.')
        clean["tool_calls"] = [_valid_tool_call(call, f"{at} tool_calls[{j}]") for j, call in enumerate(calls)]
    if message["role"] == "tool":
        if previous is None or not (previous["role"] == "tool" or previous.get("tool_calls")):
            raise ConversationFormatError(f"{at} is a tool result with no assistant tool call before it.")
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None:
                if not isinstance(message[key], str):
                    raise ConversationFormatError(f'{at} must have a string "{key}".')
                clean[key] = message[key]
    return clean


def _valid_tool_call(call: Any, at: str) -> dict[str, Any]:
    """OpenAI's tool call: {"type": "function", "function": {"name": str, "arguments": str | object}}, id kept."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ConversationFormatError(f'{at} must be {{"type": "function", "function": {{"name": str, "arguments"}}}}.')
    arguments = function.get("arguments", {})
    if not isinstance(arguments, (str, dict)):
        raise ConversationFormatError(f"{at}: arguments must be a JSON string or an object.")
    clean: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        clean["id"] = call["id"]
    return clean


# A \uD800-\uDFFF escape: a pair (high then low) encodes one character, one alone is no text at all.
_SURROGATE_ESCAPES = re.compile(
    r"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|\\u[dD][89a-fA-F][0-9a-fA-F]{2}"
)
# What a truncated or damaged gzip stream raises while it is read (EOFError and zlib.error are not OSErrors).
GZIP_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)


def load_json(text: str, where: str) -> Any:
    """json.loads, with each way a line can be unreadable as one ConversationFormatError naming WHERE (file:line):
    invalid JSON, brackets nested past Python's recursion limit, and a lone surrogate escape ("\\ud800"), which
    json accepts but no UTF-8 writer or tokenizer can encode."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConversationFormatError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}).") from None
    except RecursionError:
        raise ConversationFormatError(f"{where}: not readable JSON (brackets nested too deeply).") from None
    lone = next((m for m in _SURROGATE_ESCAPES.finditer(text) if len(m.group()) == 6), None)
    if lone is not None:
        try:
            json.dumps(row, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ConversationFormatError(
                f"{where}: {lone.group()} at column {lone.start() + 1} is a lone surrogate escape, not text; fix or "
                f"drop the row."
            ) from None
    return row


def parse_line(line: str, where: str) -> Conversation:
    """Decode and validate one JSONL line."""
    return validate_row(load_json(line, where), where)


def read_conversations(path: str | Path, unique_ids: bool = True) -> Iterator[Conversation]:
    """Yield validated conversations from a JSONL file, skipping blank lines."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Conversations file {path} does not exist.")
    seen: set[str] = set()
    # Bytes, decoded line by line: a text-mode read would fail with no line number.
    with path.open("rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConversationFormatError(
                    f"{path}:{lineno} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                    f"convert the file to UTF-8."
                ) from None
            if not line.strip():
                continue
            conversation = parse_line(line, f"{path}:{lineno}")
            if unique_ids:
                if conversation.id in seen:
                    raise ConversationFormatError(
                        f"{path}:{lineno}: duplicate id {conversation.id!r}; ids must be unique."
                    )
                seen.add(conversation.id)
            yield conversation


def write_conversations(path: str | Path, conversations: Iterable[Conversation]) -> None:
    """Write conversations to a JSONL file atomically (temp file, fsync, rename)."""
    write_lines_atomic(Path(path), (c.to_json_line() for c in conversations))


# --- The forms users have ---------------------------------------------------------------

# ShareGPT speaker names (`from`) -> roles; function_call and observation are LLaMA-Factory's tool turns.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}
ID_KEYS = ("id", "uuid", "conversation_id")
# Keys that hold the messages (or make them) and are not carried over as metadata.
_FORM_KEYS = frozenset({"messages", "conversations", "prompt", "response", "completion", "system"})


def from_user_row(row: Any, where: str, default_id: str) -> Conversation:
    """A conversation from one row in any supported form; `where` ("file:12") prefixes every error.

    The id is the row's `id`, `uuid` or `conversation_id` (else `default_id`); other top-level keys
    (metadata, `tools`) are kept; message keys the role does not use (`weight`, `loss`, a user's `name`)
    are ignored.
    """
    if not isinstance(row, dict):
        raise ConversationFormatError(f"{where}: row must be a JSON object, got {type(row).__name__}.")
    if isinstance(row.get("messages"), list):
        messages = [_openai_message(m, f"{where}: messages[{i}]") for i, m in enumerate(row["messages"])]
    elif isinstance(row.get("conversations"), list):
        messages = [_sharegpt_message(m, f"{where}: conversations[{i}]") for i, m in enumerate(row["conversations"])]
    elif isinstance(row.get("prompt"), str):
        messages = [{"role": "user", "content": row["prompt"]}]
        response = row.get("response", row.get("completion"))
        if response is not None:
            if not isinstance(response, str):
                raise ConversationFormatError(f'{where}: "response" must be a string.')
            messages.append({"role": "assistant", "content": response})
    else:
        raise ConversationFormatError(
            f'{where}: no conversation found; expected "messages" (OpenAI), "conversations" (ShareGPT: from/value, '
            f'or role/content) or "prompt" with an optional "response"; the row has keys {sorted(row)[:8]}.'
        )
    system = row.get("system")
    if isinstance(system, str) and system and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system})
    row_id = next((row[k] for k in ID_KEYS if isinstance(row.get(k), (str, int)) and str(row[k])), default_id)
    extra = {k: v for k, v in row.items() if k not in _FORM_KEYS and k not in ID_KEYS}
    return validate_row({"id": str(row_id), **extra, "conversations": messages}, where)


def _text(content: Any, at: str) -> str:
    """Message content as text: a string, None (an assistant turn holding only tool calls), or text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ConversationFormatError(f"{at}: content must be text (a string or a list of text parts).")


def _openai_message(message: Any, at: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise ConversationFormatError(f"{at} must be an object with role and content.")
    role = message.get("role")
    if role not in ROLES:
        raise ConversationFormatError(f"{at} has role {role!r}; expected one of {list(ROLES)}.")
    out = {"role": role, "content": _text(message.get("content"), at)}
    # Serving stacks write the reasoning as `reasoning_content` (SGLang, vLLM) or `reasoning` (OpenRouter).
    reasoning = message.get("reasoning_content", message.get("reasoning"))
    if role == "assistant" and reasoning is not None:
        out["reasoning_content"] = reasoning
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    if role == "tool":
        out.update({k: message[k] for k in ("tool_call_id", "name") if message.get(k) is not None})
    return out


def _sharegpt_message(message: Any, at: str) -> dict[str, Any]:
    if isinstance(message, dict) and "role" in message:
        return _openai_message(message, at)
    if not isinstance(message, dict) or "from" not in message:
        raise ConversationFormatError(f"{at} must be an object with from/value (or role/content).")
    speaker = message["from"]
    role = SHAREGPT_ROLES.get(str(speaker).lower())
    if role is None:
        raise ConversationFormatError(f"{at} has from {speaker!r}; expected one of {sorted(SHAREGPT_ROLES)}.")
    value = _text(message.get("value"), at)
    if str(speaker).lower() != "function_call":
        return {"role": role, "content": value}
    try:
        calls = json.loads(value)
    except json.JSONDecodeError:
        raise ConversationFormatError(f'{at}: a function_call value must be JSON {{"name", "arguments"}}.') from None
    calls = calls if isinstance(calls, list) else [calls]
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": c} for c in calls]}
