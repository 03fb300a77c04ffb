"""The stages' entry points: one main() per stage module, reached the same way from every command.

`python -m megatron_osprey.stages.X` and the documented tools/*.py scripts (each calls
megatron_osprey.recipes.run_stage(X)) all run the stage module's main().
"""

from __future__ import annotations

import ast
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

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


# runpy warns when the module was imported before (by another test); running it again as __main__ is the point.
@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of package:RuntimeWarning")
@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_runs_as_a_module_and_its_other_commands_show_the_same_flags(stage, monkeypatch, capsys):
    module = f"megatron_osprey.stages.{stage}"
    own = _help(lambda: runpy.run_module(module, run_name="__main__"), stage, monkeypatch, capsys)
    assert "usage:" in own
    if stage in TOOLS:
        tool = _help(
            lambda: runpy.run_path(str(REPO / "tools" / f"{TOOLS[stage]}.py"), run_name="__main__"),
            f"{TOOLS[stage]}.py",
            monkeypatch,
            capsys,
        )
        assert _options(tool) == _options(own)


@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of package:RuntimeWarning")
def test_preprocess_runs_as_a_module_with_the_tools_flags(monkeypatch, capsys):
    own = _help(
        lambda: runpy.run_module("megatron_osprey.stages.preprocess", run_name="__main__"),
        "preprocess",
        monkeypatch,
        capsys,
    )
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
