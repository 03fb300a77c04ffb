"""launcher/locks/cpu.txt is what `make venv` and CI install: it pins exactly the installed closure of
megatron_osprey[test], and `osprey lock --check` reports each disagreement."""

from __future__ import annotations

import subprocess
import sys

import pytest

from launcher import lock

ROOT = lock.LOCK.parents[2]


def test_this_environment_is_the_lock():
    # CI builds the venv with the lock as constraints; a dependency the lock misses, or a stale pin, shows here.
    assert lock.differences() == []


def test_the_lock_pins_what_pyproject_pins():
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(text) for text in project["dependencies"] + project["optional-dependencies"]["test"]]
    pins = lock.read_lock()
    for req in requirements:
        assert canonicalize_name(req.name) in pins, f"{req.name} is a dependency the lock does not pin"
        assert req.specifier.contains(pins[canonicalize_name(req.name)], prereleases=True), req


def test_check_lists_a_changed_pin_and_exits_1(tmp_path):
    changed = tmp_path / "cpu.txt"
    changed.write_text(lock.LOCK.read_text().replace("\ntyper==", "\ntyper==0.0.1\n# was typer==", 1))
    done = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "lock", "--check", "--lock", str(changed)],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "typer: installed" in done.stdout and "lock 0.0.1" in done.stdout


def test_a_line_that_is_not_an_exact_pin_names_the_file_and_line(tmp_path):
    loose = tmp_path / "cpu.txt"
    loose.write_text("# header\nnumpy>=2\n")
    with pytest.raises(SystemExit, match=r"cpu.txt:2: a lock line pins one exact version"):
        lock.read_lock(loose)


def test_the_newest_lock_is_the_high_end_of_pyprojects_ranges():
    # `make test-newest` installs cpu-newest.txt: every pin inside pyproject's ranges, and for each ranged package a
    # release above cpu.txt's, so the two locks test both ends.
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(text) for text in project["dependencies"] + project["optional-dependencies"]["test"]]
    low, high = lock.read_lock(), lock.read_lock(lock.NEWEST)
    ranged = [req for req in requirements if not str(req.specifier).startswith("==")]
    assert {canonicalize_name(req.name) for req in ranged} == {"torch", "megatron-core", "transformers"}
    for req in requirements:
        assert req.specifier.contains(high[canonicalize_name(req.name)], prereleases=True), req
    for req in ranged:
        name = canonicalize_name(req.name)
        assert Version(high[name]) > Version(low[name]), name
    assert lock.NEWEST.read_text().startswith(lock.NEWEST_HEADER)
