"""benchmarks/gpu_check.requirements.txt is the whole of what the device check needs beyond torch: its dry run
passes in a fresh venv that can import torch (with its own dependencies) and exactly the listed wheels.

Installing torch into a new venv costs minutes, so the venv reaches this environment's installed torch through
a .pth file naming a folder of symlinks to the files of torch's distribution and its dependency closure only;
the listed wheels are installed offline with --no-deps from a cached folder (fetched once with pip download)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from megatron_osprey.assets.download import SOURCES_SUBDIR, osprey_cache_dir

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "benchmarks" / "gpu_check.requirements.txt"
CHECKS = [
    "init", "placement", "train_steps", "checkpoint", "ttt_loss", "te_spec", "drafter_te", "target_path",
    "ttt_memory", "throughput",
]  # fmt: skip


def _pins() -> dict[str, str]:
    pins = {}
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{line}: the list must pin exact versions"
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def _closure(name: str) -> list[importlib.metadata.Distribution]:
    """The installed distribution `name` and everything it requires (no extras), each once."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = [name]
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        key = canonicalize_name(dist.metadata["Name"])
        if key in seen:
            continue
        seen[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _link_torch(folder: Path) -> set[str]:
    """Symlink the top-level files and packages that torch's closure installed; return the distribution names."""
    folder.mkdir()
    names = set()
    for dist in _closure("torch"):
        names.add(canonicalize_name(dist.metadata["Name"]))
        tops = {f.parts[0] for f in dist.files or [] if f.parts[0] != ".." and not f.parts[0].endswith(".pth")}
        for top in tops - {"__pycache__"}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (folder / top).exists():
                (folder / top).symlink_to(source)
    return names


def _wheels(pins: dict[str, str]) -> Path:
    """The pinned wheels for this interpreter, downloaded into the cache once."""
    cache = osprey_cache_dir("gpu_check") / SOURCES_SUBDIR
    cache.mkdir(parents=True, exist_ok=True)
    present = set()
    for wheel in cache.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        present.add((name, str(version)))
    if any((name, version) not in present for name, version in pins.items()):
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet"]
            + ["--dest", str(cache), "-r", str(REQUIREMENTS)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:  # no cached copy and no route to the package registry
            pytest.skip(f"the pinned wheels could not be downloaded: {done.stderr.strip()[-500:]}")
    return cache


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    pins = _pins()
    wheels = _wheels(pins)
    root = tmp_path_factory.mktemp("bare")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    torch_names = _link_torch(root / "torch_only")
    assert not torch_names & set(pins), "the list must not repeat what torch brings"
    (site_packages,) = venv.glob("lib/python*/site-packages")
    (site_packages / "torch_only.pth").write_text(f"{root / 'torch_only'}\n")
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "--quiet"]
        + ["--disable-pip-version-check", "--find-links", str(wheels), "-r", str(REQUIREMENTS)],
        check=True,
    )
    return python


def _bare_env() -> dict[str, str]:
    """This process's environment less what would put another environment's packages on the bare venv's path."""
    return {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _json_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith('{"check"')]


def test_the_list_pins_what_the_lock_pins_within_pyprojects_ranges_and_this_environment_runs():
    from launcher import lock

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ranges = {canonicalize_name(r.name): r.specifier for r in map(Requirement, project)}
    pins, locked = _pins(), lock.read_lock()
    assert {name: version for name, version in pins.items() if name in locked} == {
        name: locked[name] for name in pins if name in locked
    }
    for name, version in pins.items():
        assert name not in ranges or ranges[name].contains(version, prereleases=True), f"{name}=={version}"
    assert pins == {name: importlib.metadata.version(name) for name in pins}


def test_the_bare_venv_holds_torch_and_the_list_only(bare_python):
    probe = (
        "import importlib.util, json, torch; "
        "print(json.dumps({m: importlib.util.find_spec(m) is not None for m in "
        "['torch', 'megatron.core', 'safetensors', 'yaml', 'psutil', 'numpy', 'einops', 'transformers', "
        "'megatron_osprey']}))"
    )
    done = subprocess.run(
        [str(bare_python), "-c", probe], cwd="/", env=_bare_env(), capture_output=True, text=True, check=True
    )
    found = json.loads(done.stdout)
    # Not even the project itself: gpu_check.py puts the checkout on sys.path, as on the GPU image. transformers is
    # listed: target_path writes a tiny HF checkpoint and compares the HF forward.
    assert found == {
        "torch": True, "megatron.core": True, "safetensors": True, "yaml": True, "psutil": True, "numpy": True,
        "einops": False, "transformers": True, "megatron_osprey": False,
    }  # fmt: skip


def test_the_dry_run_passes_with_torch_and_the_list_only(bare_python):
    done = subprocess.run(
        [str(bare_python), str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--check-timeout", "120"],
        cwd="/",
        env=dict(_bare_env(), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = {line["check"]: line for line in map(json.loads, _json_lines(done.stdout))}
    assert list(lines) == CHECKS, done.stderr[-3000:]
    failed = {name: line.get("error") for name, line in lines.items() if not line["ok"]}
    assert done.returncode == 0 and not failed, failed


def test_a_checkpoint_save_without_psutil_refuses_before_megatron_forks_its_writers(monkeypatch):
    import importlib.util

    from megatron_osprey.training import checkpointing

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "psutil" else real_find_spec(name, *a)
    )
    with pytest.raises(ModuleNotFoundError, match="needs psutil"):
        checkpointing.save_checkpoint("/nonexistent/never-written", 1, {}, {})
    monkeypatch.undo()
    checkpointing.require_psutil()  # this environment has it
