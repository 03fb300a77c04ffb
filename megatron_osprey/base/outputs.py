"""Claiming a stage's output directory: never delete what this project did not write, nor an input.

`--overwrite` is a promise about the stage's own earlier output, not a licence to empty any path a
user types. So an output directory is deleted only when it carries the marker file that stage writes
(its provenance.json, or its settings record), and never when it holds, is held by, or is one of the
stage's inputs: `export --checkpoint X/drafter --output X --overwrite` and `--output ~` are refused.

A stage that writes its whole output in one run claims it (`claimed_output`): one writer at a time (a flock,
base/locks.py, as for `--save`), and WRITING_MARKER naming the stage written before anything else, removed by
write_provenance once the record is written last. A directory that still holds the marker is a partial output:
readers refuse it by name, and --overwrite of the same stage may empty it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from megatron_osprey.base.atomic_io import write_json_atomic
from megatron_osprey.base.locks import acquire_writer_lock, lock_is_held
from megatron_osprey.base.provenance import PROVENANCE_FILE, WRITING_MARKER, writing_stage

# The lock a claimed output's writer holds (the name --save's lock has; provenance digests skip it).
WRITER_LOCK = ".lock-writer"


def _overlap(output: Path, name: str, path: Path) -> str | None:
    """Why output cannot be written when `path` is an input (None: they are disjoint)."""
    if output == path:
        return f"is the input {name} ({path})"
    if output in path.parents:
        return f"contains the input {name} ({path})"
    if path in output.parents:
        return f"lies inside the input {name} ({path})"
    return None


def check_disjoint(output: str | Path, inputs: dict[str, str | Path | None], flag: str = "--output") -> None:
    """Refuse an output that is, contains or lies inside any input (symbolic links resolved)."""
    resolved = Path(output).expanduser().resolve()
    for name, path in inputs.items():
        if path is None or str(path) == "":
            continue
        why = _overlap(resolved, name, Path(path).expanduser().resolve())
        if why:
            raise ValueError(
                f"{flag} {output} {why}; writing there would destroy what this run reads. Choose another {flag}."
            )


def check_output_writable(output: str | Path, flag: str = "--output") -> Path:
    """Refuse, before any long work, an output directory this process cannot create or write into: creates it and
    a temporary file in it (removed after); returns it."""
    output = Path(output).expanduser()
    try:
        output.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output, prefix=".write_probe."):  # provenance hashes skip it
            pass
    except OSError as error:
        raise ValueError(
            f"{flag} {output} cannot be written ({error.strerror or error}); choose a {flag} this user can create."
        ) from None
    return output


def recorded_stage(directory: Path) -> str | None:
    """The stage DIRECTORY/provenance.json names, or None (no record, or an unreadable one)."""
    record = directory / PROVENANCE_FILE
    if not record.is_file():
        return None
    try:
        stage = json.loads(record.read_text()).get("stage")
    except (ValueError, AttributeError):
        return None
    return stage if isinstance(stage, str) else None


def check_not_partial(directory: str | Path, flag: str) -> None:
    """Refuse a directory a stage was stopped while writing (it still holds WRITING_MARKER), naming the stage."""
    stage = writing_stage(Path(directory))
    if stage is not None:
        raise ValueError(
            f"{flag} {directory} is a partial {stage} output: that stage stopped before it finished writing it "
            f"({WRITING_MARKER} is still there). Run the {stage} stage again with --overwrite."
        )


def check_output(
    output: str | Path,
    inputs: dict[str, str | Path | None],
    marker: str,
    overwrite: bool,
    *,
    stage: str | None = None,
    flag: str = "--output",
    holding_lock: bool = False,
) -> bool:
    """Check OUTPUT against the inputs without touching it; True when it holds this stage's earlier output that
    overwrite may replace (False: it is absent or empty).

    `inputs` maps a flag or name to each path the stage reads (None: not given); `marker` is the file the
    stage writes into its output (provenance.json, a settings record) that makes the directory its own;
    `stage`, when given, must also match the stage a provenance.json in it names (or its WRITING_MARKER: a partial
    output of this stage is its own). A directory whose writer lock a live run holds is refused (`holding_lock`:
    the caller holds it, claimed_output). Raises ValueError naming the directory and why, FileExistsError without
    overwrite.
    """
    output = Path(output).expanduser()
    resolved = output.resolve()
    check_disjoint(output, inputs, flag)
    if output.is_symlink():
        # Emptying or replacing it would act on the link, not on the directory it names: fail here, by name.
        raise ValueError(
            f"{flag} {output} is a symbolic link (to {os.readlink(output)}); give the directory itself "
            f"({resolved}) as {flag}."
        )
    if output.exists() and not output.is_dir():
        raise FileExistsError(f"{flag} {output} is a file, not a directory; choose another {flag}.")
    holder = None if holding_lock or not output.is_dir() else lock_is_held(output / WRITER_LOCK)
    if holder is not None:
        raise FileExistsError(
            f"{flag} {output} is being written by {holder} (lock {output / WRITER_LOCK}); this run does not wait. "
            f"Let that run finish or stop it, or choose another {flag}."
        )
    if not (output.is_dir() and any(p.name != WRITER_LOCK for p in output.iterdir())):
        return False
    if not overwrite:
        raise FileExistsError(f"{flag} {output} exists and is not empty; pass --overwrite to replace it.")
    partial = writing_stage(output)
    if not (output / marker).is_file() and partial is None:
        raise ValueError(
            f"{flag} {output} is not empty and has no {marker}, so this stage did not write it; --overwrite "
            f"deletes only its own output. Choose another {flag}, or empty it yourself."
        )
    recorded = recorded_stage(output) if (output / PROVENANCE_FILE).is_file() else partial
    if stage is not None and marker == PROVENANCE_FILE and recorded is None:
        raise ValueError(
            f"{flag} {output}/{PROVENANCE_FILE} names no stage (unreadable, or not this project's record), so "
            f"--overwrite cannot tell that {stage} wrote it. Choose another {flag}, or empty it yourself."
        )
    if stage is not None and recorded is not None and recorded != stage:
        raise ValueError(
            f"{flag} {output} holds the output of the {recorded} stage, not of {stage}; --overwrite deletes only "
            f"this stage's own output. Choose another {flag}."
        )
    if resolved == Path.home().resolve() or resolved == Path(resolved.anchor):
        raise ValueError(f"{flag} {output} is a home or root directory; choose a directory of its own.")
    return True


def prepare_output(output: str | Path, *checked, **keywords) -> Path:
    """check_output(output, *checked, **keywords), then empty OUTPUT if it holds this stage's earlier output;
    returns it, created. All checks run before anything is deleted."""
    output = Path(output).expanduser()
    if check_output(output, *checked, **keywords):
        shutil.rmtree(output)
    output.mkdir(parents=True, exist_ok=True)
    return output


@contextlib.contextmanager
def claimed_output(
    output: str | Path, inputs: dict[str, str | Path | None], overwrite: bool, *, stage: str, flag: str = "--output"
) -> Iterator[Path]:
    """OUTPUT, held by this run of `stage` for the block (see the module docstring): refused as check_output refuses
    (and while another live run writes it), this stage's earlier or partial output emptied under the lock, and
    WRITING_MARKER written before the block writes anything. The block ends by writing provenance.json
    (write_provenance), which removes the marker; a block that fails after writing leaves it, so the output reads
    as partial (one that fails before writing anything leaves the output free)."""
    output = Path(output).expanduser()
    check_output(output, inputs, PROVENANCE_FILE, overwrite, stage=stage, flag=flag)  # before anything is created
    output.mkdir(parents=True, exist_ok=True)
    with acquire_writer_lock(output / WRITER_LOCK, f"{flag} {output}"):
        # Again under the lock: a run that finished since the first check has left its output.
        if check_output(output, inputs, PROVENANCE_FILE, overwrite, stage=stage, flag=flag, holding_lock=True):
            for child in output.iterdir():
                if child.name == WRITER_LOCK:
                    continue
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        write_json_atomic(output / WRITING_MARKER, {"stage": stage, "pid": os.getpid()})
        try:
            yield output
        except BaseException:
            # Refused before writing anything (a bad input): nothing partial to mark, the output stays free.
            if {p.name for p in output.iterdir()} <= {WRITER_LOCK, WRITING_MARKER}:
                (output / WRITING_MARKER).unlink(missing_ok=True)
            raise
