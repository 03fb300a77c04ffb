"""`osprey` from an installed wheel, not a checkout: every command it renders is a module in the wheel,
the sbatch templates are in the wheel, and relative paths and jobs land in the user's directory.

The wheel is built offline (--no-build-isolation: the venv's setuptools) from a copy of the sources, so
the checkout gets no build/ or egg-info, and is unpacked (a pure-Python wheel installs by unzipping) far
from the checkout; PYTHONPATH puts it before the checkout's editable install.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# A recipe whose chain has both stages this test runs (export locally, preprocess as a job).
RECIPE = "smollm2_cpu_smoke"
RUN_DIR = "smollm2_runs/smollm2_cpu_smoke_chat"  # the recipe's own run directory, relative to the work directory

# Runs inside the unpacked wheel: the `osprey` console script is launcher.cli:main.
PROBE = """
import json, sys
import launcher, megatron_osprey
from launcher import cli
from launcher.commands import stage_module, work_dir
from launcher.render import template_dir
from megatron_osprey.recipes import STAGES

recipe = sys.argv[1]
out = {"launcher": launcher.__file__, "package": megatron_osprey.__file__, "work_dir": str(work_dir()),
       "template_dir": str(template_dir()), "modules": {s: stage_module(s) for s in (*STAGES, "data")}}
ran = []
cli.subprocess.run = lambda argv, cwd, check: ran.append((argv, str(cwd))) or type("Done", (), {"returncode": 0})()
out["export_rc"] = cli.main(["export", recipe])
out["export_argv"], out["export_cwd"] = ran[0]
print("=====")
out["plan_rc"] = cli.main(["plan", recipe, "--stage", "export"])
print("=====")
out["submit_rc"] = cli.main(["submit", recipe, "--stage", "preprocess", "--run-dir", "runs/x", "--dry-run"])
print("=====")
print(json.dumps(out))
"""


def _build_and_unpack(tmp_path: Path) -> tuple[Path, Path]:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    # launcher/slurm is a link to the top-level slurm/ (the templates), as in the checkout.
    for name in ("megatron_osprey", "launcher", "slurm"):
        shutil.copytree(REPO / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("megatron_osprey-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return wheel, site


def test_osprey_from_an_installed_wheel_renders_modules_and_templates_under_the_current_directory(tmp_path):
    _, site = _build_and_unpack(tmp_path)
    (entry_points,) = site.glob("megatron_osprey-*.dist-info/entry_points.txt")
    assert "osprey = launcher.cli:main" in entry_points.read_text()

    cwd = tmp_path / "user"
    cwd.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", PROBE, RECIPE],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    export_out, plan_out, sbatch, result = done.stdout.split("=====\n")
    out = json.loads(result)

    # The wheel's copy ran, not the checkout's, and it knows it is not in a checkout.
    assert Path(out["launcher"]).is_relative_to(site) and Path(out["package"]).is_relative_to(site)
    assert out["work_dir"] == str(cwd)
    assert Path(out["template_dir"]) == site / "launcher" / "slurm"
    shipped = {p.name for p in (site / "launcher" / "slurm").glob("*.sbatch")}
    assert shipped == {p.name for p in (REPO / "slurm").glob("*.sbatch")}  # every template of the checkout
    assert shipped >= {"distributed.sbatch", "stage.sbatch", "regenerate.sbatch", "eval_sglang.sbatch"}
    # Every command the launcher runs is a module the wheel holds (no tools/*.py: the wheel has none): the job door
    # and the stage modules it imports.
    assert (site / "megatron_osprey" / "__main__.py").is_file()
    for stage, module in out["modules"].items():
        where = site / Path(*module.split("."))
        assert where.with_suffix(".py").is_file() or (where / "__main__.py").is_file(), (stage, module)
    assert not (site / "tools").exists()

    # A local run: a module, started in the user's directory, where its relative paths then resolve. The job
    # resolves the recipe itself: it receives --recipe and the run directory every path derives from.
    assert out["export_rc"] == 0 and out["export_cwd"] == str(cwd)
    assert out["export_argv"][1:] == ["-m", "megatron_osprey", "export", "--recipe", RECIPE, "--run-dir", RUN_DIR]
    assert f"-m megatron_osprey export --recipe {RECIPE} --run-dir {RUN_DIR}" in export_out
    assert out["plan_rc"] == 0 and f"recipe   {RECIPE}_chat (stage export, cpu, fp32)" in plan_out

    # An sbatch script from the wheel's template: the job runs the module from the user's directory.
    assert out["submit_rc"] == 0 and sbatch.startswith("# --- preprocess ---\n#!/bin/bash")  # a dry run's header
    assert f'OSPREY_REPO="${{OSPREY_REPO:-{cwd}}}"' in sbatch
    assert f"{cwd}:{cwd}" in sbatch  # the default container mount
    assert f"ENTRY=(-m megatron_osprey preprocess --recipe {RECIPE} --run-dir {cwd / 'runs' / 'x'})" in sbatch
    # The jobs' interpreter defaults to the one `osprey` ran on (this venv's, which happens to live in the
    # checkout); nothing else points into the checkout.
    assert f'PYTHON="${{PYTHON:-{sys.executable}}}"' in sbatch
    assert "tools/" not in sbatch
    assert str(REPO) not in sbatch.replace(sys.executable, "PYTHON")
