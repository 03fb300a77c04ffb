"""Conversations JSONL: reading, validation and writing.

One row per line: ``{"id": str, "conversations": [{"role": "system"|"user"|"assistant",
"content": str}, ...]}``. A system message may only come first; at least one user
message is required. Other top-level keys are kept and written back unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from megatron_osprey.base.atomic_io import write_lines_atomic

ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = frozenset({"role", "content"})


class ConversationFormatError(ValueError):
    """A conversations JSONL row does not follow the schema."""


@dataclass(frozen=True)
class Conversation:
    """One validated conversation; ``messages`` are plain role/content dicts."""

    id: str
    messages: tuple[dict[str, str], ...]
    extra: dict[str, Any] = field(default_factory=dict)

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
    clean = []
    for i, message in enumerate(messages):
        at = f"{where}: conversations[{i}] of id {row_id!r}"
        if not isinstance(message, dict):
            raise ConversationFormatError(f"{at} must be an object with role and content.")
        unknown = set(message) - MESSAGE_KEYS
        if unknown:
            raise ConversationFormatError(
                f"{at} has unknown keys {sorted(unknown)}; only role and content are allowed."
            )
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ConversationFormatError(f"{at} has role {role!r}; expected one of {list(ROLES)}.")
        if not isinstance(content, str):
            raise ConversationFormatError(f'{at} must have a string "content".')
        if role == "system" and i != 0:
            raise ConversationFormatError(f"{at} is a system message; only the first message may be one.")
        clean.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in clean):
        raise ConversationFormatError(f"{where}: id {row_id!r} has no user message.")
    extra = {k: v for k, v in row.items() if k not in ("id", "conversations")}
    return Conversation(id=row_id, messages=tuple(clean), extra=extra)


def parse_line(line: str, where: str) -> Conversation:
    """Decode and validate one JSONL line."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConversationFormatError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}).") from None
    return validate_row(row, where)


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
