"""Provenance: what each stage read and wrote, by path and sha256, so that a chain of stages stays honest.

Every stage writes OUTPUT_DIR/provenance.json:

    {"stage", "recipe", "command", "config", "inputs": {name: {"path", "sha256"}}, "outputs": {name: {...}}}

(OUTPUT_DIR is the stage's output directory). A stage whose output is one file among others in a directory
(regenerate, suite) writes FILE.provenance.json beside it instead, so a second file written into the same
directory leaves the first one's record, and its check, in place. Before a stage reads an input it resolves
its path (a symbolic link is read where it points), looks for the record of the stage that made it (the
file's own record, else a provenance.json in the input or up to two directories above it) and refuses the
input when its sha256 differs from what that stage recorded, naming both: a stage rerun by hand, or an
edited file, cannot silently feed a later stage.

The sha256 of a directory is over its files in a fixed order (sorted relative paths, each with its own
sha256). Files a directory's own manifest already checksums (the shards of a hidden-state store, listed
with their sha256 in manifest.json, which its reader verifies) are counted by that record instead of being
read again, so a terabyte store costs a manifest read.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from megatron_osprey.base.atomic_io import write_text_atomic
from megatron_osprey.base.cache_dir import osprey_cache_dir
from megatron_osprey.base.checksums import file_sha256
from megatron_osprey.base.redact import redact_urls

PROVENANCE_FILE = "provenance.json"
FILE_RECORD_SUFFIX = "." + PROVENANCE_FILE  # train.jsonl -> train.jsonl.provenance.json
FORMAT = "megatron_osprey.provenance/1"
# Written first into an output a stage claims (base/outputs.py), removed when its record is written last.
WRITING_MARKER = ".osprey-writing.json"
# Left by a stage while it runs or by tools around it; never part of what a stage hands on.
_SKIPPED_PREFIXES = (".tmp_", ".old_", ".write_probe", ".lock", "events.out.tfevents", WRITING_MARKER)
_SKIPPED_DIRS = ("tensorboard", "wandb", "__pycache__")


class ProvenanceError(ValueError):
    """An input's bytes differ from what the stage that made it recorded."""


def _recorded_in_manifest(directory: Path) -> dict[str, str]:
    """relative file -> sha256 that directory/manifest.json records (a hidden-state store), else {}."""
    manifest = directory / "manifest.json"
    if not manifest.is_file():
        return {}
    try:
        shards = json.loads(manifest.read_text()).get("shards", [])
        return {str(s["file"]): str(s["sha256"]) for s in shards if "file" in s and "sha256" in s}
    except (ValueError, TypeError, AttributeError):
        return {}


# Files this large have their sha256 remembered by stat (a model's weights read as a tokenizer directory's).
REMEMBER_FROM_BYTES = 16 << 20


def remembered_sha256(file: Path) -> str:
    """file_sha256, remembered in $OSPREY_CACHE/sha256 for large files under their path, device, inode, size,
    mtime and ctime (ns): a file written since has another stat, ctime included, so it is hashed again, as make
    and git's index decide what changed."""
    st = file.stat()
    if st.st_size < REMEMBER_FROM_BYTES:
        return file_sha256(file)
    key = f"{file.resolve()}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
    entry = osprey_cache_dir("sha256") / hashlib.sha256(key.encode()).hexdigest()
    try:
        known = entry.read_text().strip()
        if len(known) == 64:
            return known
    except OSError:
        pass
    sha = file_sha256(file)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(entry, sha + "\n")
    except OSError:  # a read-only cache only costs the hash next time
        pass
    return sha


def digest(path: str | Path) -> str:
    """sha256 of a file, or of a directory's files in sorted order (see the module docstring)."""
    path = Path(path)
    if path.is_file():
        return file_sha256(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist.")
    recorded = _recorded_in_manifest(path)
    lines = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith(_SKIPPED_PREFIXES))
        for name in sorted(files):
            if name == PROVENANCE_FILE or name.endswith(FILE_RECORD_SUFFIX) or name.startswith(_SKIPPED_PREFIXES):
                continue
            file = Path(root) / name
            relative = file.relative_to(path).as_posix()
            lines.append(f"{relative}\t{recorded.get(relative) or remembered_sha256(file)}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def file_record(path: str | Path) -> Path:
    """Where the record of one output file lives: FILE.provenance.json beside it."""
    path = Path(path)
    return path.with_name(path.name + FILE_RECORD_SUFFIX)


def writing_stage(directory: Path) -> str | None:
    """The stage whose WRITING_MARKER DIRECTORY holds (it has not finished writing there), else None."""
    marker = Path(directory) / WRITING_MARKER
    if not marker.is_file():
        return None
    try:
        stage = json.loads(marker.read_text()).get("stage")
    except (ValueError, AttributeError, OSError):
        stage = None
    return stage if isinstance(stage, str) else "unknown"


def _producer(path: Path) -> tuple[dict, Path, dict] | None:
    """(record, its directory, the entry naming `path`) of the stage that wrote `path`: the file's own record, else
    a provenance.json in it or up to two levels up. The path is resolved first: a link is checked where it points."""
    resolved = path.resolve()
    # The file's own record, then the per-output records beside it (a preprocessed PREFIX's records its .bin and
    # .idx), then the directory records above it.
    beside = sorted(resolved.parent.glob("*" + FILE_RECORD_SUFFIX)) if resolved.parent.is_dir() else []
    candidates = [file_record(resolved), *beside] + [d / PROVENANCE_FILE for d in [resolved, *resolved.parents][:3]]
    for record_path in candidates:
        if not record_path.is_file():
            continue
        try:
            record = json.loads(record_path.read_text())
        except ValueError:
            continue
        directory = record_path.parent
        for entry in record.get("outputs", {}).values():
            if (directory / entry["path"]).resolve() == resolved:
                return record, record_path, entry
    return None


def check_input(name: str, path: str | Path) -> dict[str, str]:
    """{"path", "sha256"} of an input, refused when its producer recorded other bytes."""
    path = Path(path)
    for directory in [path.resolve(), *path.resolve().parents][:3]:
        stage = writing_stage(directory)
        if stage is not None:  # its files may be whole, but not all of them are there
            raise ProvenanceError(
                f"input {name} {path} lies in {directory}, a partial {stage} output: that stage stopped before it "
                f"finished writing it ({WRITING_MARKER} is still there). Run the {stage} stage again with --overwrite."
            )
    found = _producer(path)
    sha = digest(path)
    if found is not None:
        record, record_path, recorded = found
        if recorded["sha256"] != sha:
            raise ProvenanceError(
                f"input {name} {path} has sha256 {sha[:12]}..., but the {record.get('stage')} stage that wrote it "
                f"recorded {recorded['sha256'][:12]}... in {record_path}: it changed since. Rerun "
                f"the {record.get('stage')} stage, or every stage after it, so the chain reads what it recorded."
            )
    return {"path": str(path.resolve()), "sha256": sha}


def write_provenance(
    directory: str | Path,
    stage: str,
    inputs: dict[str, dict[str, str]],
    outputs: dict[str, str | Path],
    *,
    config: Any = None,
    recipe: str | None = None,
    command: list[str] | None = None,
    record_name: str = PROVENANCE_FILE,
) -> Path:
    """Write DIRECTORY/provenance.json (or DIRECTORY/RECORD_NAME); outputs are hashed now and recorded relative to
    DIRECTORY. The record is written last: a WRITING_MARKER of this stage there is removed after it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    recorded = {}
    for name, path in outputs.items():
        path = Path(path)
        relative = os.path.relpath(path.resolve(), directory.resolve())
        recorded[name] = {"path": Path(relative).as_posix(), "sha256": digest(path)}
    from megatron_osprey.base.run_config import to_plain

    record = {
        "format": FORMAT,
        "stage": stage,
        "recipe": recipe,
        "command": command,
        "config": to_plain(config),
        "inputs": inputs,
        "outputs": recorded,
    }
    target = directory / record_name
    # A --server-url may carry a token (user:password@, ?token=...): the record keeps no secret.
    write_text_atomic(target, redact_urls(json.dumps(record, indent=2, sort_keys=False)) + "\n")
    if writing_stage(directory) == stage:
        (directory / WRITING_MARKER).unlink()
    return target


def write_file_provenance(
    file: str | Path, stage: str, inputs: dict[str, dict[str, str]], outputs: str | dict[str, str | Path], **record
) -> Path:
    """write_provenance for one output among others in its directory: FILE.provenance.json beside it, recording FILE
    under the name `outputs` (or the files `outputs` maps, such as a PREFIX's .bin and .idx)."""
    file = Path(file)
    outputs = {outputs: file} if isinstance(outputs, str) else outputs
    return write_provenance(file.parent, stage, inputs, outputs, record_name=file_record(file).name, **record)


def records_unchanged(
    directory: str | Path,
    inputs: dict[str, str | Path],
    outputs: dict[str, str | Path],
    record_name: str = PROVENANCE_FILE,
) -> bool:
    """Whether DIRECTORY/provenance.json (or DIRECTORY/RECORD_NAME) records each named input at its path with the
    sha256 it has now, and each named output with the bytes it holds now: the work that record describes is done and
    need not run again (a requeued array task goes on from there). False without a readable record."""
    directory = Path(directory)
    try:
        record = read_provenance(directory, record_name)
    except ValueError:
        return False
    if record is None:
        return False
    checks = [(record.get("inputs", {}).get(n) or {}, Path(p), False) for n, p in inputs.items()]
    checks += [(record.get("outputs", {}).get(n) or {}, Path(p), True) for n, p in outputs.items()]

    def unmoved(entry: dict, path: Path, output: bool) -> bool:  # inputs are recorded absolute, outputs relative
        if "path" not in entry or not (path.is_file() if output else path.exists()):
            return False
        return (directory / entry["path"] if output else Path(entry["path"])).resolve() == path.resolve()

    # Paths first, then bytes: a lost or moved file answers before anything is hashed (a shard can be gigabytes).
    if not all(unmoved(*check) for check in checks):
        return False
    return all(entry.get("sha256") == digest(path) for entry, path, _ in checks)


def read_provenance(directory: str | Path, record_name: str = PROVENANCE_FILE) -> dict | None:
    """DIRECTORY/provenance.json (or DIRECTORY/RECORD_NAME), or None when the directory holds none."""
    path = Path(directory) / record_name
    return json.loads(path.read_text()) if path.is_file() else None
