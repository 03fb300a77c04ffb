"""The stages' entry points: one main() per stage module, reached the same way from every command.

The job door `python -m megatron_osprey X` and the documented tools/*.py scripts (each calls
megatron_osprey.recipes.run_stage(X)) all run the stage module's main(), importing the stage module once;
`python -m megatron_osprey.stages.X` (deprecated, one release) hands over to the door.
"""

from __future__ import annotations

import ast
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_osprey.__main__ import main as door
from megatron_osprey.stages.cli import exit_code

REPO = Path(__file__).resolve().parents[2]
STAGES = (
    "data",
    "prune",
    "preprocess",
    "pretrain",
    "adapt",
    "regenerate",
    "extract",
    "distill",
    "evaluate",
    "export",
    "ngram",
    "rollout",
    "suite",
)
TOOLS = {
    "prune": "prune_backbone",
    "preprocess": "preprocess_data",
    "adapt": "adapt_drafter",
    "regenerate": "regenerate",
    "extract": "extract_hidden_states",
    "export": "export_checkpoint",
}
SHIMS = TOOLS


def _help(run, argv0: str, monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", [argv0, "--help"])
    with pytest.raises(SystemExit) as exited:
        run()
    assert exited.value.code in (0, None)
    return capsys.readouterr().out


def _options(text: str) -> str:
    return text[text.index("options:") :]


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_runs_through_the_door_and_its_other_commands_show_the_same_flags(stage, monkeypatch, capsys):
    own = _help(lambda: door([stage, "--help"]), "megatron_osprey", monkeypatch, capsys)
    assert own.startswith(f"usage: python -m megatron_osprey {stage} ")
    if stage in TOOLS:
        tool = _help(
            lambda: runpy.run_path(str(REPO / "tools" / f"{TOOLS[stage]}.py"), run_name="__main__"),
            f"{TOOLS[stage]}.py",
            monkeypatch,
            capsys,
        )
        assert _options(tool) == _options(own)


def test_preprocess_runs_through_the_door_with_the_tools_flags(monkeypatch, capsys):
    own = _help(lambda: door(["preprocess", "--help"]), "megatron_osprey", monkeypatch, capsys)
    tool = _help(
        lambda: runpy.run_path(str(REPO / "tools" / "preprocess_data.py"), run_name="__main__"),
        "preprocess_data.py",
        monkeypatch,
        capsys,
    )
    assert "--output-prefix" in own and _options(tool) == _options(own)


@pytest.mark.parametrize("stage", sorted(TOOLS))
def test_a_tool_script_is_the_job_door_of_its_stage(stage):
    """Each tools/*.py script runs `megatron_osprey.recipes.run_stage(STAGE)` (so --recipe works from it too)."""
    tree = ast.parse((REPO / "tools" / f"{TOOLS[stage]}.py").read_text())
    imports = [
        (node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names
    ]
    assert ("megatron_osprey.recipes", "run_stage") in imports
    calls = [
        [arg.value for arg in node.args if isinstance(arg, ast.Constant)]
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "run_stage"
    ]
    assert calls == [[stage]]


def test_every_stage_module_is_listed():
    """Every module of megatron_osprey/stages/ but the shared ones is a stage this file runs."""
    shared = {"__init__", "cli"}
    modules = {p.stem for p in (REPO / "megatron_osprey" / "stages").glob("*.py")} - shared
    assert modules == set(STAGES)


@pytest.mark.parametrize("stage", sorted(SHIMS))
def test_a_tool_script_runs_its_own_checkout_not_an_installed_copy(stage, tmp_path):
    # Run as a script, Python puts tools/ on sys.path, not the checkout; an installed megatron_osprey
    # (here a decoy on PYTHONPATH) would be imported unless the script puts its checkout first.
    decoy = tmp_path / "decoy" / "megatron_osprey"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the decoy megatron_osprey was imported')\n")
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / f"{SHIMS[stage]}.py"), "--help"],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(decoy.parent), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]


def test_errors_become_one_line_and_an_exit_code(capsys):
    def raise_(error):
        raise error

    assert exit_code(lambda: None) == 0 and exit_code(lambda: 1) == 1
    assert exit_code(lambda: raise_(FileNotFoundError("--data x: missing"))) == 2
    assert exit_code(lambda: raise_(FloatingPointError("loss is nan at iteration 3"))) == 1
    assert exit_code(lambda: raise_(KeyError("k")), also=(KeyError,), describe=lambda m: m.replace("k", "*")) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --data x: missing",
        "error: loss is nan at iteration 3",
        "error: '*'",
    ]
    with pytest.raises(KeyError):  # anything else is a bug: it keeps its traceback
        exit_code(lambda: raise_(KeyError("k")))


def test_the_door_lists_its_stages_and_refuses_an_unknown_one(capsys):
    assert door(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(stage in listed for stage in STAGES) and "cli" not in listed.split("stages:")[1]
    assert door(["distil", "--recipe", "x"]) == 2 and door([]) == 2
    err = capsys.readouterr().err
    assert "unknown stage 'distil'" in err and err.count("usage: python -m megatron_osprey STAGE") == 2


# Loaded first (sitecustomize) in the job's process: at exit it counts, for each stage file, the module objects
# alive in the process that were made from it (the one a double import makes too, whatever its name).
COUNTER = """
import atexit, gc, json, os, types
from pathlib import Path

def _count():
    stages = Path(os.environ["COUNT_STAGES"])
    seen = {}
    for obj in gc.get_objects():
        if isinstance(obj, types.ModuleType) and getattr(obj, "__file__", None):
            path = Path(obj.__file__).resolve()
            if path.parent == stages:
                seen.setdefault(path.stem, []).append(obj.__name__)
    Path(os.environ["COUNT_OUT"]).write_text(json.dumps(seen))

atexit.register(_count)
"""


def _job_modules(tmp_path: Path, argv: list[str]) -> tuple[subprocess.CompletedProcess, dict[str, list[str]]]:
    """Run `python ARGV` as a job would, with the counter loaded; (the process, stage -> its module objects)."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(COUNTER)
    out = tmp_path / "modules.json"
    env = dict(os.environ, PYTHONPATH=f"{hook}{os.pathsep}{REPO}", OMP_NUM_THREADS="1")
    env.update(COUNT_STAGES=str(REPO / "megatron_osprey" / "stages"), COUNT_OUT=str(out))
    done = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return done, json.loads(out.read_text())


def test_a_job_imports_each_stage_module_once(tmp_path):
    # A recipe job as the sbatch templates run it (`osprey submit` renders this argv), ending in the stage's own
    # one-line input error: the registry resolved the recipe (it imports every stage module) and ran export.
    argv = ["-m", "megatron_osprey", "export", "--recipe", "smollm2_cpu_smoke", "--run-dir", str(tmp_path / "run")]
    done, modules = _job_modules(tmp_path, argv)
    assert done.returncode == 2 and "error: --checkpoint" in done.stderr, done.stderr[-2000:]
    assert {"export", "cli"} <= set(modules) and len(modules) >= 3, modules  # the registry imports stages too
    assert {stage: names for stage, names in modules.items() if len(names) != 1} == {}
    assert modules["export"] == ["megatron_osprey.stages.export"]


def test_the_deprecated_module_path_hands_over_to_the_door_without_a_second_import(tmp_path):
    # `python -m megatron_osprey.stages.X` is documented in the last release: it still runs, for one release,
    # by exec'ing the door (the process that ran the stage file as __main__ is replaced, not joined).
    argv = ["-m", "megatron_osprey.stages.export", "--recipe", "smollm2_cpu_smoke", "--run-dir", str(tmp_path / "r")]
    done, modules = _job_modules(tmp_path, argv)
    assert done.returncode == 2 and "error: --checkpoint" in done.stderr, done.stderr[-2000:]
    assert "`python -m megatron_osprey.stages.export` is deprecated" in done.stderr
    assert "run `python -m megatron_osprey export` (same flags)" in done.stderr
    assert modules["export"] == ["megatron_osprey.stages.export"]


def test_the_counter_sees_a_stage_file_imported_twice(tmp_path):
    # What the stage modules' old `__main__` blocks did: the file ran as __main__ and the registry imported it again
    # under its real name. Here a second module object is made from the same file; the counter sees both.
    twice = (
        "import importlib.util, sys, megatron_osprey.stages.export as export\n"
        "spec = importlib.util.spec_from_file_location('__main_twin__', export.__file__)\n"
        "sys.modules['__main_twin__'] = twin = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(twin)\n"
    )
    done, modules = _job_modules(tmp_path, ["-c", twice])
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(modules["export"]) == ["__main_twin__", "megatron_osprey.stages.export"]
