"""What a resumable output was made from: a JSON record of its inputs and settings, kept beside it.

Extraction and regeneration resume by sample id. Without a record, a rerun with
other data, another model or another temperature would keep the stale rows and
add new ones beside them; with it, the rerun is refused (or, with --overwrite,
starts fresh).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from megatron_osprey.base.atomic_io import write_text_atomic
from megatron_osprey.base.checksums import file_sha256  # noqa: F401  (re-exported for the stages)


def model_fingerprint(directory: str | Path) -> dict:
    """A HF model directory's identity: its path, config.json and tokenizer files by hash, weight files by size.

    Weights are identified by name and size only: hashing hundreds of GB on every
    start would cost more than the run it protects.
    """
    directory = Path(directory)
    small = {}
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ):
        if (directory / name).is_file():
            small[name] = file_sha256(directory / name)
    weights = {p.name: p.stat().st_size for p in sorted(directory.glob("*.safetensors"))}
    return {"path": str(directory.resolve()), "files_sha256": small, "weights_bytes": weights}


def directory_fingerprint(directory: str | Path, small_bytes: int = 1 << 20) -> dict:
    """Any directory's identity (a drafter checkpoint, an export): its path, every file below it by size, the files
    under `small_bytes` (metadata, configs, the latest-iteration marker) also by hash."""
    directory = Path(directory)
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    sizes = {str(p.relative_to(directory)): p.stat().st_size for p in files}
    small = {name: file_sha256(directory / name) for name, size in sizes.items() if size < small_bytes}
    return {"path": str(directory.resolve()), "files_bytes": sizes, "small_files_sha256": small}


def settings_differences(record: Path, settings: dict) -> list[str]:
    """'key: recorded -> now' for every top-level setting that differs from the record (none when absent)."""
    if not record.is_file():
        return []
    try:
        recorded = json.loads(record.read_text())
    except ValueError:
        return [f"{record} is not valid JSON"]
    keys = sorted(set(recorded) | set(settings))
    return [
        f"{k}: {_short(recorded.get(k))} -> {_short(settings.get(k))}"
        for k in keys
        if recorded.get(k) != settings.get(k)
    ]


def write_settings(record: Path, settings: dict) -> None:
    """Write the record atomically (identical settings give identical bytes, so concurrent writers agree)."""
    write_text_atomic(record, json.dumps(settings, indent=1, sort_keys=True) + "\n")


def claim_output(
    output: Path,
    record: Path,
    settings: dict,
    *,
    overwrite: bool,
    holds: str,
    unrecorded: str | None,
    delete: Callable[[str], None],
) -> None:
    """Refuse an output made from other inputs or settings (with overwrite: delete it); then record ours.

    `holds` says what the output holds, for the refusal; `unrecorded` is why an output with content but no
    record cannot be trusted (None: it has no content); `delete(reasons)` empties the output. Run by one
    process per job, before any writer opens the output.
    """
    diffs = settings_differences(record, settings)
    if not record.is_file() and unrecorded:
        diffs = [unrecorded]
    if diffs and not overwrite:
        raise ValueError(
            f"--output {output} holds {holds} from other inputs or settings ({'; '.join(diffs)}); resuming "
            f"would mix them. Pass --overwrite to delete them and start fresh, or choose another --output."
        )
    if diffs:
        delete("; ".join(diffs))
    record.parent.mkdir(parents=True, exist_ok=True)
    write_settings(record, settings)


def claim_store_dir(
    store: str | Path,
    record_name: str,
    settings: dict,
    inputs: dict,
    *,
    overwrite: bool,
    stage: str,
    holds: str,
    say: Callable[[str], None] = print,
    marker: str | None = None,
) -> Path:
    """claim_output for a store directory a stage resumes into (extract, rollout): refused when it is, holds or lies
    inside one of `inputs`, or when it is not empty and has no RECORD_NAME; --overwrite empties it only where it
    carries `marker` (default: the record) and names this stage. Run by one process per job; returns the store."""
    from megatron_osprey.base.outputs import check_disjoint, prepare_output

    store = Path(store)

    def delete(reasons: str) -> None:
        say(f"{stage}: --overwrite: deleting {store} ({reasons})")
        prepare_output(store, inputs, marker or record_name, overwrite=True, stage=stage)

    check_disjoint(store, inputs)  # before any resume or deletion
    foreign = store.is_dir() and any(p.name != record_name for p in store.iterdir())
    unrecorded = f"{store} is not empty and has no {record_name} (not made by this tool)" if foreign else None
    claim_output(
        store, store / record_name, settings, overwrite=overwrite, holds=holds, unrecorded=unrecorded, delete=delete
    )
    return store


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 120 else text[:117] + "..."
