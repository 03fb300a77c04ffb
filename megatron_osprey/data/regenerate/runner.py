"""Regenerate every assistant turn of a conversations JSONL with the target, resumably.

Turn j is generated from the conversation up to user turn j, where earlier assistant
turns are the target's own regenerated replies; original assistant contents are dropped.
A reply follows every run of consecutive user messages (so a prompt ending in a user
message gets one too).

Output contract:
- OUT holds complete rows in the input schema. Rows are appended as they finish, each
  with flush + fsync, so a kill leaves only complete lines plus at most one unterminated
  tail, which the next run detects and cuts off.
- A rerun skips ids already in OUT and processes the rest.
- When a run ends, OUT is rewritten atomically in input order, so an interrupted and
  resumed run yields the same file as one uninterrupted run.
- Rows that fail are appended to ``OUT.failures.jsonl`` (id, error, time) as they fail;
  at the end of a run that file is rewritten to list only the ids still missing, and
  removed when none are.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Iterator

from megatron_osprey.base.atomic_io import write_lines_atomic
from megatron_osprey.data.conversations import (
    Conversation,
    ConversationFormatError,
    parse_line,
    read_conversations,
)
from megatron_osprey.data.regenerate.backends import ChatBackend, SamplingParams, redact_credentials

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegenerationRun:
    """Files, sampling and parallelism of one regeneration run."""

    input_path: Path
    output_path: Path
    sampling: SamplingParams = field(default_factory=SamplingParams)
    concurrency: int = 8
    progress: bool = True
    overwrite: bool = False  # an output made from other inputs or settings is deleted instead of refused


@dataclass(frozen=True)
class RegenerateSummary:
    """Counts of one run."""

    total: int
    already_done: int
    succeeded: int
    failed: int
    output_path: Path
    failures_path: Path


def failures_path_for(output_path: Path) -> Path:
    """Return OUT.failures.jsonl for OUT.jsonl (or OUT.failures.jsonl beside any other name)."""
    output_path = Path(output_path)
    stem = output_path.name[: -len(".jsonl")] if output_path.name.endswith(".jsonl") else output_path.name
    return output_path.with_name(stem + ".failures.jsonl")


def settings_path_for(output_path: Path) -> Path:
    """OUT.settings.json: what OUT's rows were made from (input, model, sampling)."""
    return failures_path_for(output_path).with_name(
        failures_path_for(output_path).name[: -len(".failures.jsonl")] + ".settings.json"
    )


def regenerate_settings(config: RegenerationRun, backend: ChatBackend) -> dict:
    """Everything a regenerated row depends on besides its id."""
    from dataclasses import asdict

    from megatron_osprey.data.fingerprint import file_sha256

    identity = backend.identity() if hasattr(backend, "identity") else {"backend": type(backend).__name__}
    return {"input_sha256": file_sha256(config.input_path), "model": identity, "sampling": asdict(config.sampling)}


def check_output_settings(config: RegenerationRun, settings: dict) -> None:
    """Refuse an output made from other inputs or settings (--overwrite: delete it); then record ours."""
    from megatron_osprey.data.fingerprint import claim_output

    output_path = Path(config.output_path)
    record = settings_path_for(output_path)

    def delete(reasons: str) -> None:
        logger.warning("--overwrite: deleting %s (%s)", output_path, reasons)
        for path in (output_path, failures_path_for(output_path)):
            path.unlink(missing_ok=True)

    written = output_path.is_file() and output_path.stat().st_size
    claim_output(
        output_path,
        record,
        settings,
        overwrite=config.overwrite,
        holds="rows regenerated",
        unrecorded=f"{record.name} is missing, so what {output_path.name} was made from is unknown"
        if written
        else None,
        delete=delete,
    )


def turn_seed(seed: int, conversation_id: str, turn: int) -> int:
    """Derive a per-turn seed so sampled output does not depend on scheduling order."""
    digest = hashlib.sha256(f"{seed}\0{conversation_id}\0{turn}".encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def regenerate_conversation(conversation: Conversation, backend: ChatBackend, sampling: SamplingParams) -> Conversation:
    """Replace every assistant turn by the target's reply on its own history."""
    source = conversation.messages
    history: list[dict[str, str]] = []
    turn = 0
    for index, message in enumerate(source):
        if message["role"] == "assistant":
            continue
        history.append(dict(message))
        next_role = source[index + 1]["role"] if index + 1 < len(source) else None
        if message["role"] == "user" and next_role != "user":
            params = (
                sampling
                if sampling.seed is None
                else replace(sampling, seed=turn_seed(sampling.seed, conversation.id, turn))
            )
            history.append({"role": "assistant", "content": backend.complete(history, params)})
            turn += 1
    return Conversation(id=conversation.id, messages=tuple(history), extra=dict(conversation.extra))


def _iter_lines_with_offsets(handle: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    offset = 0
    for line in handle:
        yield offset, line
        offset += len(line)


def recover_output(output_path: Path, known_ids: set[str]) -> list[str]:
    """Return ids already in OUT, in file order, after cutting off an unterminated last line."""
    if not output_path.exists():
        return []
    ids: list[str] = []
    seen: set[str] = set()
    cut_at = None
    with output_path.open("rb") as handle:
        for lineno, (offset, line) in enumerate(_iter_lines_with_offsets(handle), start=1):
            if not line.endswith(b"\n"):
                cut_at = offset  # a write interrupted by a kill: the row will be regenerated
                break
            try:
                row = parse_line(line.decode("utf-8"), f"{output_path}:{lineno}")
            except (ConversationFormatError, UnicodeDecodeError) as exc:
                raise ConversationFormatError(
                    f"{output_path}:{lineno} is corrupt ({exc}); only an unterminated last line can be repaired. "
                    "Fix or remove that line, or choose a new --output."
                ) from None
            if row.id not in known_ids:
                raise ConversationFormatError(
                    f"{output_path}:{lineno} has id {row.id!r}, which is not in --input; use a fresh --output."
                )
            if row.id in seen:
                raise ConversationFormatError(
                    f"{output_path}:{lineno} repeats id {row.id!r}; the output file is corrupt."
                )
            seen.add(row.id)
            ids.append(row.id)
    if cut_at is not None:
        logger.warning(
            "Dropping an unterminated last line of %s (interrupted write); its row will be redone.", output_path
        )
        with output_path.open("rb+") as handle:
            handle.truncate(cut_at)
            handle.flush()
            os.fsync(handle.fileno())
    return ids


def _append_line(handle: IO[bytes], line: str) -> None:
    handle.write(line.encode("utf-8"))
    handle.flush()
    os.fsync(handle.fileno())


def sort_output(output_path: Path, order: list[str]) -> bool:
    """Rewrite OUT atomically in input order; return whether it had to change."""
    rank = {row_id: i for i, row_id in enumerate(order)}
    entries: list[tuple[int, int, int]] = []
    with output_path.open("rb") as handle:
        for offset, line in _iter_lines_with_offsets(handle):
            entries.append((rank[json.loads(line)["id"]], offset, len(line)))
    if all(a[0] < b[0] for a, b in zip(entries, entries[1:])):
        return False
    entries.sort()

    def lines() -> Iterator[str]:
        with output_path.open("rb") as source:
            for _, offset, length in entries:
                source.seek(offset)
                yield source.read(length).decode("utf-8")

    write_lines_atomic(output_path, lines())
    return True


def _scan_input(input_path: Path) -> list[str]:
    return [c.id for c in read_conversations(input_path)]


def regenerate_file(config: RegenerationRun, backend: ChatBackend) -> RegenerateSummary:
    """Regenerate all rows of ``config.input_path`` not yet in ``config.output_path``."""
    from tqdm import tqdm

    if config.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {config.concurrency}.")
    input_path, output_path = Path(config.input_path), Path(config.output_path)
    if input_path.resolve() == output_path.resolve():
        raise ValueError("--output must differ from --input.")
    failures_path = failures_path_for(output_path)
    order = _scan_input(input_path)
    check_output_settings(config, regenerate_settings(config, backend))
    done = set(recover_output(output_path, set(order)))
    todo = len(order) - len(done)
    logger.info("%d conversations in %s; %d already done, %d to regenerate.", len(order), input_path, len(done), todo)
    output_path.parent.mkdir(parents=True, exist_ok=True)

    failures: dict[str, dict] = {}
    succeeded = 0
    window = 4 * config.concurrency  # bounded look-ahead keeps memory flat on huge inputs
    with (
        output_path.open("ab") as out,
        failures_path.open("ab") as failed_out,
        cf.ThreadPoolExecutor(max_workers=config.concurrency, thread_name_prefix="regenerate") as pool,
        tqdm(total=todo, disable=not config.progress, unit="conv", desc="regenerate") as bar,
    ):
        in_flight: dict[cf.Future, str] = {}

        def drain(block_until_below: int) -> None:
            nonlocal succeeded
            while len(in_flight) >= block_until_below and in_flight:
                finished, _ = cf.wait(in_flight, return_when=cf.FIRST_COMPLETED)
                for future in finished:
                    row_id = in_flight.pop(future)
                    error = future.exception()
                    if error is None:
                        _append_line(out, future.result().to_json_line())
                        succeeded += 1
                    else:
                        # Backends keep credentials out of their errors; this is the last line of defence.
                        message = redact_credentials(f"{type(error).__name__}: {error}")
                        record = {"id": row_id, "error": message, "time": time.time()}
                        failures[row_id] = record
                        logger.warning("Conversation %r failed: %s", row_id, record["error"])
                        _append_line(failed_out, json.dumps(record, ensure_ascii=False) + "\n")
                    bar.update(1)

        try:
            for conversation in read_conversations(input_path):
                if conversation.id in done:
                    continue
                drain(window)
                future = pool.submit(regenerate_conversation, conversation, backend, config.sampling)
                in_flight[future] = conversation.id
            drain(1)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise

    if output_path.exists() and output_path.stat().st_size:
        sort_output(output_path, order)
    if failures:
        rank = {row_id: i for i, row_id in enumerate(order)}
        records = sorted(failures.values(), key=lambda r: rank[r["id"]])
        write_lines_atomic(failures_path, (json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    else:
        failures_path.unlink(missing_ok=True)
    return RegenerateSummary(
        total=len(order),
        already_done=len(done),
        succeeded=succeeded,
        failed=len(failures),
        output_path=output_path,
        failures_path=failures_path,
    )
