"""Claiming a stage's output directory: never delete what this project did not write, nor an input.

`--overwrite` is a promise about the stage's own earlier output, not a licence to empty any path a
user types. So an output directory is deleted only when it carries the marker file that stage writes
(its provenance.json, or its settings record), and never when it holds, is held by, or is one of the
stage's inputs: `export --checkpoint X/drafter --output X --overwrite` and `--output ~` are refused.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from megatron_osprey.base.provenance import PROVENANCE_FILE


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
        return json.loads(record.read_text()).get("stage")
    except (ValueError, AttributeError):
        return None


def check_output(
    output: str | Path,
    inputs: dict[str, str | Path | None],
    marker: str,
    overwrite: bool,
    *,
    stage: str | None = None,
    flag: str = "--output",
) -> bool:
    """Check OUTPUT against the inputs without touching it; True when it holds this stage's earlier output that
    overwrite may replace (False: it is absent or empty).

    `inputs` maps a flag or name to each path the stage reads (None: not given); `marker` is the file the
    stage writes into its output (provenance.json, a settings record) that makes the directory its own;
    `stage`, when given, must also match the stage a provenance.json in it names. Raises ValueError naming
    the directory and why, FileExistsError without overwrite.
    """
    output = Path(output).expanduser()
    resolved = output.resolve()
    check_disjoint(output, inputs, flag)
    if output.exists() and not output.is_dir():
        raise FileExistsError(f"{flag} {output} is a file, not a directory; choose another {flag}.")
    if not (output.is_dir() and any(output.iterdir())):
        return False
    if not overwrite:
        raise FileExistsError(f"{flag} {output} exists and is not empty; pass --overwrite to replace it.")
    if not (output / marker).is_file():
        raise ValueError(
            f"{flag} {output} is not empty and has no {marker}, so this stage did not write it; --overwrite "
            f"deletes only its own output. Choose another {flag}, or empty it yourself."
        )
    recorded = recorded_stage(output)
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
