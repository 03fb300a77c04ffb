"""Every command README.md and docs/ show as runnable parses against the real command line, and the docs' links hold.

The convention: a fenced block whose info string holds the word `runnable` (```` ```bash runnable ````) is checked
line by line (a trailing backslash continues a line, `#` starts a comment). Each line must be one of

    osprey SUBCOMMAND [...] [-- STAGE FLAGS]       (launcher/cli.py's parser; data/ngram/suite/demo: the module's own)
    python -m megatron_osprey STAGE ...            (the job door: the stage's parser)
    python -m MODULE ...                           (any other module of the package with an argparse main)
    python tools/X.py ... | python benchmarks/X.py ...
    torchrun [TORCHRUN OPTIONS] (-m MODULE | SCRIPT.py) ...
    make TARGET ...                                (a target of the Makefile)
    bash SCRIPT.sh ...                             (the script exists)
    export VAR=VALUE

optionally after `VAR=VALUE` assignments. The subcommand (or stage) must exist, and every token that looks like a
flag (`--name`, `-x`, also inside `[...]` or before `=`) must be an option string of the parser that reads it.
Placeholders (`RECIPE`, `DIR`, `N`, `a|b`, `...`) are fine where a value goes; `STAGE` where a stage goes means every
stage. The parsers are the real ones, caught at their parse call: nothing is run. `python -m
megatron_osprey.stages.X` (deprecated) is refused: docs show the job door. Shell pipes are not supported (a lone
`|` separates alternatives). A block without `runnable` (a synopsis, output) is not checked.
"""

from __future__ import annotations

import argparse
import functools
import re
import runpy
import shlex
import sys
import warnings
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Pages other teams own: linked from here, written there.
RESERVED_PAGES = {REPO / "docs" / "vllm.md"}
FLAG = re.compile(r"^--?[A-Za-z][\w-]*")
FENCE = re.compile(r"^\s*```+\s*(.*)$")


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__(parser.prog)
        self.parser = parser


def _caught(self, args=None, namespace=None):
    raise _Parsed(self)


def capture_parser(run, argv0: str) -> argparse.ArgumentParser:
    """The first argparse parser `run()` parses with (the program stops there: nothing past parsing runs)."""
    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", _caught),
        mock.patch.object(argparse.ArgumentParser, "parse_known_args", _caught),
        mock.patch.object(sys, "argv", [argv0]),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: a module already imported, run as __main__
        try:
            run()
        except _Parsed as parsed:
            return parsed.parser
    raise AssertionError(f"{argv0} never parsed a command line")


@functools.cache
def osprey_parser() -> argparse.ArgumentParser:
    from launcher.cli import build_parser

    return build_parser()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


@functools.cache
def door_stages() -> tuple[str, ...]:
    from megatron_osprey.__main__ import stages

    return tuple(stages())


@functools.cache
def stage_parser(stage: str) -> argparse.ArgumentParser:
    from megatron_osprey.__main__ import main as door

    return capture_parser(lambda: door([stage]), "megatron_osprey")


@functools.cache
def module_parser(module: str) -> argparse.ArgumentParser:
    return capture_parser(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True), module)


@functools.cache
def script_parser(path: str) -> argparse.ArgumentParser:
    return capture_parser(lambda: runpy.run_path(str(REPO / path), run_name="__main__"), path)


@functools.cache
def make_targets() -> frozenset[str]:
    text = (REPO / "Makefile").read_text()
    return frozenset(m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+):", text, re.M))


def flags_in(words: list[str]) -> list[str]:
    """The flags among `words`: `[--seed` -> --seed, `--nproc_per_node=2` -> --nproc_per_node."""
    found = []
    for word in words:
        match = FLAG.match(word.strip("[]()"))
        if match:
            found.append(match.group(0))
    return found


def unknown_flags(parser: argparse.ArgumentParser, words: list[str]) -> list[str]:
    return [flag for flag in flags_in(words) if flag not in parser._option_string_actions]


def _check_flags(what: str, parser: argparse.ArgumentParser, words: list[str]) -> list[str]:
    return [f"{what}: no flag {flag}" for flag in unknown_flags(parser, words)]


def _check_python(args: list[str], what: str) -> list[str]:
    """`python ARGS` or torchrun's program: `-m MODULE ...` or `SCRIPT.py ...`."""
    if args[:1] == ["-m"]:
        if len(args) < 2:
            return [f"{what}: -m without a module"]
        module, rest = args[1], args[2:]
        if module == "megatron_osprey":
            return _check_stage_words(rest, f"{what}: python -m megatron_osprey")
        if module.startswith("megatron_osprey.stages."):
            stage = module.rsplit(".", 1)[1]
            return [f"{what}: `python -m {module}` is deprecated; show `python -m megatron_osprey {stage}`"]
        if not module.startswith("megatron_osprey"):
            return [f"{what}: python -m {module} is not a module of this project"]
        try:
            parser = module_parser(module)
        except (ImportError, AssertionError) as error:
            return [f"{what}: python -m {module}: {error}"]
        return _check_flags(f"{what}: python -m {module}", parser, rest)
    if not args or not args[0].endswith(".py"):
        return [f"{what}: python needs -m MODULE or SCRIPT.py"]
    script, rest = args[0], args[1:]
    if not (REPO / script).is_file() or script.split("/")[0] not in ("tools", "benchmarks"):
        return [f"{what}: no script {script} under tools/ or benchmarks/"]
    return _check_flags(f"{what}: {script}", script_parser(script), rest)


def _check_stage_words(words: list[str], what: str) -> list[str]:
    if not words:
        return [f"{what}: no stage"]
    stage, rest = words[0], words[1:]
    stages = door_stages() if stage == "STAGE" else (stage,)
    if stage != "STAGE" and stage not in door_stages():
        return [f"{what}: no stage {stage!r} (stages: {', '.join(door_stages())})"]
    return [error for s in stages for error in _check_flags(f"{what} {s}", stage_parser(s), rest)]


def _check_osprey(words: list[str], what: str) -> list[str]:
    from launcher.cli import FLAG_DOORS

    if not words:
        return [f"{what}: osprey without a subcommand"]
    command, rest = words[0], words[1:]
    own, passed = (rest[: rest.index("--")], rest[rest.index("--") + 1 :]) if "--" in rest else (rest, [])
    subs = _subparsers(osprey_parser())
    if command in FLAG_DOORS:
        return _check_stage_words([command, *rest], f"{what}: osprey")
    if command == "demo":
        return _check_flags(f"{what}: osprey demo", module_parser("megatron_osprey.demo"), rest)
    from megatron_osprey.recipes import STAGES

    commands = list(STAGES) if command == "STAGE" else [command]
    errors = []
    for name in commands:
        if name not in subs:
            return [f"{what}: osprey has no subcommand {name!r}"]
        parser = subs[name]
        nested = _subparsers(parser)
        if nested:  # osprey cluster up|status|down
            if not own or own[0] not in nested:
                return [f"{what}: osprey {name} needs one of {', '.join(nested)}"]
            errors += _check_flags(f"{what}: osprey {name} {own[0]}", nested[own[0]], own[1:])
            continue
        errors += _check_flags(f"{what}: osprey {name}", parser, own)
        if passed and name not in STAGES:
            errors.append(f"{what}: osprey {name} passes nothing after --")
        elif passed:
            errors += _check_flags(f"{what}: osprey {name} -- (the stage's flags)", stage_parser(name), passed)
    return errors


def _torchrun_program(words: list[str]) -> list[str]:
    """torchrun's own options dropped: what follows is `-m MODULE ...` or `SCRIPT.py ...`."""
    for i, word in enumerate(words):
        if word == "-m" or word.endswith(".py"):
            return words[i:]
    return []


def check_line(line: str, what: str) -> list[str]:
    """The errors of one logical command line (empty: it parses)."""
    words = shlex.split(line, comments=True)
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # VAR=VALUE before a command
        words = words[1:]
    if not words:
        return []
    command, rest = words[0], words[1:]
    if command == "osprey":
        return _check_osprey(rest, what)
    if command in ("python", "python3"):
        return _check_python(rest, what)
    if command == "torchrun":
        program = _torchrun_program(rest)
        return _check_python(program, f"{what}: torchrun") if program else [f"{what}: torchrun runs no program"]
    if command == "make":
        targets = [w for w in rest if not w.startswith("-") and "=" not in w]
        return [f"{what}: no make target {t!r}" for t in targets if t not in make_targets()] or (
            [] if targets else [f"{what}: make without a target"]
        )
    if command == "bash":
        return [] if rest and (REPO / rest[0]).is_file() else [f"{what}: bash runs no script of this repository"]
    if command == "export":
        return []
    return [f"{what}: {command!r} is not a command this test knows (see the module docstring)"]


def runnable_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, the block's lines) of every fenced block marked `runnable`."""
    blocks, inside, lines, start = [], False, None, 0
    for number, line in enumerate(text.splitlines(), start=1):
        fence = FENCE.match(line)
        if fence and not inside:
            inside, start = True, number + 1
            lines = [] if "runnable" in fence.group(1).split() else None  # None: an unmarked block
        elif fence:
            if lines is not None:
                blocks.append((start, lines))
            inside, lines = False, None
        elif lines is not None:
            lines.append(line)
    return blocks


def logical_lines(block: list[str], start: int) -> list[tuple[int, str]]:
    """Lines joined over trailing backslashes, each with its first line number."""
    out, pending, first = [], "", start
    for number, line in enumerate(block, start=start):
        if not pending:
            first = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((first, pending + line))
        pending = ""
    if pending:
        out.append((first, pending))
    return out


def check_markdown(text: str, name: str) -> tuple[int, list[str]]:
    """(how many command lines were checked, the errors) for one Markdown text."""
    checked, errors = 0, []
    for start, block in runnable_blocks(text):
        for number, line in logical_lines(block, start):
            if shlex.split(line, comments=True):
                checked += 1
            errors += check_line(line, f"{name}:{number}")
    return checked, errors


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_runnable_command_of_the_docs_parses_against_the_real_cli(path):
    _, errors = check_markdown(path.read_text(), str(path.relative_to(REPO)))
    assert errors == []


def test_the_docs_mark_their_commands_runnable():
    # The check cannot pass by having nothing to check: the README and most pages hold runnable blocks.
    counts = {p.name: check_markdown(p.read_text(), p.name)[0] for p in DOCS}
    assert counts["README.md"] >= 8
    assert sum(counts.values()) >= 40, counts
    assert sum(1 for n in counts.values() if n) >= 8, counts


def test_a_flag_that_does_not_exist_fails_the_check():
    doc = """Some text.

```bash runnable
osprey plan qwen3_8b_osprey_distill_2gpu_h100_bf16:code --stage distill --no-such-flag
python -m megatron_osprey distill --recipe R --ttt-steps 3 \\
    [--lr-warmup-fraction 0.04] [--ttt-stepz 5]
python tools/prune_backbone.py --source DIR --num-layer 2 --output OUT
osprey pipeline R --run-dir DIR -- --also-not-a-flag
```

```bash
osprey plan R --not-checked-here
```
"""
    checked, errors = check_markdown(doc, "doc.md")
    assert checked == 4
    assert errors == [
        "doc.md:4: osprey plan: no flag --no-such-flag",
        "doc.md:5: python -m megatron_osprey distill: no flag --ttt-stepz",
        "doc.md:7: tools/prune_backbone.py: no flag --num-layer",  # argparse's abbreviations are not accepted
        "doc.md:8: osprey pipeline passes nothing after --",  # osprey would drop them silently
    ], errors
    # After `--`, `osprey STAGE` hands the flags to the stage: they are checked against the stage's parser.
    assert check_line("osprey distill R -- --ttt-stepz 5", "x") == [
        "x: osprey distill -- (the stage's flags): no flag --ttt-stepz"
    ]


def test_a_missing_command_script_module_or_target_fails_the_check():
    assert check_line("osprey deploy R", "x") == ["x: osprey has no subcommand 'deploy'"]
    assert check_line("osprey cluster start", "x") == ["x: osprey cluster needs one of up, status, down"]
    assert check_line("python -m megatron_osprey distil --recipe R", "x")[0].startswith(
        "x: python -m megatron_osprey: no stage 'distil'"
    )
    assert check_line("python -m megatron_osprey.stages.distill --recipe R", "x") == [
        "x: `python -m megatron_osprey.stages.distill` is deprecated; show `python -m megatron_osprey distill`"
    ]
    assert check_line("python tools/no_such_tool.py --x", "x") == [
        "x: no script tools/no_such_tool.py under tools/ or benchmarks/"
    ]
    assert check_line("make demo-fulll", "x") == ["x: no make target 'demo-fulll'"]
    assert check_line("squeue -u me", "x") == [
        "x: 'squeue' is not a command this test knows (see the module docstring)"
    ]
    # What does parse: placeholders, STAGE for every stage, torchrun, env assignments, the cluster subcommands.
    assert (
        check_line("OMP_NUM_THREADS=1 torchrun --nproc_per_node=N -m megatron_osprey STAGE --recipe R --set k=v", "x")
        == []
    )
    assert check_line("osprey STAGE RECIPE [--run-dir DIR] [--set ...] [-- stage flags]", "x") == []
    assert check_line("osprey cluster up --dir DIR", "x") == []
    assert check_line("make demo-full", "x") == []


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    anchors = set()
    for heading in re.findall(r"^#+\s+(.*)$", text, re.M):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


def test_every_relative_link_of_the_docs_reaches_a_page_and_a_heading():
    broken = []
    for path in DOCS:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            page = (path.parent / file).resolve() if file else path
            if page in RESERVED_PAGES:
                continue
            if not page.exists():
                broken.append(f"{path.name}: {target}")
            elif anchor and anchor not in _anchors(page.read_text()):
                broken.append(f"{path.name}: {target} (no heading)")
    assert broken == []


def test_each_result_table_lives_in_one_file():
    # A table row holding figures appears in one page only: a figure is updated in one place.
    seen: dict[str, str] = {}
    repeated = []
    for path in DOCS:
        for row in {line.strip() for line in path.read_text().splitlines() if line.startswith("|")}:
            if re.search(r"\d\.\d", row):
                if row in seen and seen[row] != path.name:
                    repeated.append(f"{path.name} and {seen[row]}: {row[:80]}")
                seen.setdefault(row, path.name)
    assert repeated == []


def test_the_readme_is_a_front_page_that_maps_every_docs_page():
    readme = (REPO / "README.md").read_text()
    assert readme.count("\n") <= 300  # what it is, install, the two commands, the cluster path, the maps
    pages = {p.name for p in (REPO / "docs").glob("*.md")} | {p.name for p in RESERVED_PAGES}
    assert {page for page in pages if f"(docs/{page})" not in readme} == set()
