"""The package's import graph: layers point downward and no module cycle exists.

Read from the source with ast (imports inside functions count too), so the test needs
no GPU and imports nothing it checks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_osprey

PACKAGE = "megatron_osprey"
ROOT = Path(megatron_osprey.__file__).resolve().parent
REPO = ROOT.parent

# Bottom to top; a package may import only packages on lower rows. New packages must be placed here.
LAYERS = (
    ("base", "config"),  # atomic I/O, run-config files, architecture descriptions; flag tables and --set overrides
    ("parallel", "assets"),  # process groups + CPU compat; tokenizer/corpus cache
    ("losses", "convert"),  # the TTT loss; HF <-> Megatron weight tables and I/O
    ("models",),  # Megatron-Core modules, grouped by model: backbone, drafter, target
    ("data",),  # datasets, preprocessing, hidden-state store, regeneration
    ("training", "speculative"),  # the shared training loop; draft/verify decoding
    ("export",),  # serving formats
    ("eval",),  # acceptance-length evaluation
    ("stages",),  # one module per pipeline stage, each with its Config, flag table, run() and main()
    ("recipes",),  # named recipes: the stages' own configs plus a launch section
    ("demo",),  # the CPU demo
    ("testing",),  # tiny models and data for tests and benchmarks
    ("__main__",),  # the job door, `python -m megatron_osprey STAGE`: the registry resolves the recipe, runs the stage
)
LEVEL = {name: level for level, row in enumerate(LAYERS) for name in row}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = (PACKAGE,) + path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (a `from pkg import mod` names mod, not pkg)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            targets.update(t for t in (_resolve(n, modules) for n in names if n.startswith(PACKAGE)) if t)
        graph[module] = targets - {module}
    return graph


def _package(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def _level(module: str) -> int:
    return LEVEL[_package(module)]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_package_has_a_layer():
    packages = {_package(m) for m in import_graph() if _package(m)}
    assert packages - set(LEVEL) == set(), "place the new package in LAYERS"


def test_imports_point_downward():
    upward = sorted(
        f"{a} -> {b}"
        for a, targets in import_graph().items()
        for b in targets
        if _package(a) and _package(b) and _package(a) != _package(b) and _level(b) >= _level(a)
    )
    assert upward == []


def test_config_modules_import_only_configs():
    # A component's config module (X/config.py) is plain dataclasses and flag tables: recipes and `osprey plan` read
    # them without torch, so they import only the flag tables, other config modules and torch-free base modules.
    graph = import_graph()
    allowed_base = {f"{PACKAGE}.base.{m}" for m in ("arch", "memory", "run_config", "hardware")}
    configs = [m for m in graph if m.endswith(".config") and _package(m) != "config"]
    assert len(configs) >= 8
    offenders = {
        f"{a} -> {b}"
        for a in configs
        for b in graph[a]
        if not (b.endswith(".config") or _package(b) == "config" or b in allowed_base)
    }
    assert offenders == set()


def test_no_stage_imports_the_recipe_registry_not_even_in_its_main_block():
    # The job door above both resolves recipes; a stage importing the registry (which imports every stage) was
    # the recipes <-> stages cycle, and run as a program it imported the stage's own file a second time.
    graph = import_graph()
    stages = [m for m in graph if _package(m) == "stages"]
    assert len(stages) >= 13
    assert sorted(f"{a} -> {b}" for a in stages for b in graph[a] if _package(b) == "recipes") == []
    assert f"{PACKAGE}.recipes" in graph[f"{PACKAGE}.__main__"]  # the door is seen as a module like any other


def test_every_stage_is_one_module_with_config_run_and_main():
    # The stages are visible in the layout: prune, pretrain, adapt, regenerate, extract, distill, evaluate, export.
    stages = {"prune", "pretrain", "adapt", "regenerate", "extract", "distill", "evaluate", "export"}
    graph = import_graph()
    assert {m.split(".")[2] for m in graph if m.startswith(f"{PACKAGE}.stages.")} >= stages
    for stage in sorted(stages):
        tree = ast.parse((ROOT / "stages" / f"{stage}.py").read_text())
        names = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        names |= {
            alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom) for alias in node.names
        }
        assert {"run", "main"} <= names and any(n.endswith("Config") for n in names), stage


def test_no_import_cycles():
    assert _cycles(import_graph()) == []


def _top_level_imports(path: Path) -> set[str]:
    """The first name of every absolute import in `path` (`from tests.x import y` -> tests)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_nothing_outside_tests_imports_tests():
    # Benchmarks and tools get their tiny models from megatron_osprey.testing, never from tests/.
    offenders = sorted(
        str(path.relative_to(REPO))
        for folder in (PACKAGE, "launcher", "tools", "benchmarks")
        for path in (REPO / folder).rglob("*.py")
        if "tests" in _top_level_imports(path)
    )
    assert offenders == []


def test_the_checker_sees_an_upward_import_and_a_cycle():
    graph = import_graph()
    assert f"{PACKAGE}.base.atomic_io" in graph[f"{PACKAGE}.data.hidden_state_store.writer"]  # it reads imports
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "tests" in _top_level_imports(REPO / "tests" / "unit" / "test_smollm2_stages.py")


MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 80


def test_library_files_and_functions_stay_small():
    """No library file (the package, the launcher) over 500 lines; no function over 80, `def` to last line."""
    too_long = []
    for path in sorted([*ROOT.rglob("*.py"), *(REPO / "launcher").rglob("*.py")]):
        text = path.read_text(encoding="utf-8")
        name = str(path.relative_to(REPO))
        if text.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert too_long == []
