"""Raw text sources of the demo corpora: a pinned chatterbot-corpus wheel and the Python standard library."""

from __future__ import annotations

import ast
import codecs
import importlib.util
import inspect
import io
import json
import os
import re
import tempfile
import textwrap
import tokenize
import zipfile
from pathlib import Path
from typing import Callable

import yaml

from megatron_osprey.assets.download import osprey_cache_dir, pip_download, resolve_cache_dir, verify_sha256
from megatron_osprey.assets.sources import pure_wheel
from megatron_osprey.base.atomic_io import write_json_atomic

# English dialogues and those of 27 other languages, as YAML under chatterbot_corpus/data/<language>/.
CHATTERBOT_CORPUS = pure_wheel(
    "chatterbot-corpus", "1.3.3", "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154", "py2.py3-none-any"
)
CHATTERBOT_LANGUAGES = ("english", "spanish", "french", "german", "italian", "portuguese")

# Pure-Python standard-library modules whose functions make the code domain (missing ones are skipped).
CODE_MODULES = (
    "textwrap", "heapq", "bisect", "fractions", "statistics", "colorsys", "string", "shlex", "difflib",
    "calendar", "fnmatch", "posixpath", "pprint", "reprlib", "base64", "html", "graphlib", "ipaddress",
    "random", "copy", "functools", "operator", "dataclasses", "glob", "gettext", "csv", "quopri",
)  # fmt: skip
# Standard-library modules whose docstrings are English prose (besides pydoc's help topics).
PROSE_MODULES = (
    "argparse", "ast", "bisect", "calendar", "cmd", "codecs", "collections", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "decimal", "difflib", "doctest", "enum", "fnmatch", "fractions", "ftplib",
    "functools", "getopt", "gettext", "glob", "heapq", "hmac", "imaplib", "inspect", "ipaddress", "locale",
    "logging", "mailbox", "mimetypes", "optparse", "pickle", "pickletools", "pprint", "pydoc", "queue",
    "quopri", "random", "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib", "socket",
    "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "token",
    "tokenize", "traceback", "typing", "unittest", "uuid", "warnings", "weakref", "zipfile",
)  # fmt: skip
MAX_FUNCTION_CHARS = 2400
MAX_FUNCTION_LINES = 60
_RULE = re.compile(r"(^|\s)[-=~*^+]{3,}(\s|$)")  # reST underlines and table rules


def default_cache_dir() -> Path:
    """$OSPREY_CACHE/corpora if OSPREY_CACHE is set, else ~/.cache/megatron_osprey/corpora."""
    return osprey_cache_dir("corpora")


def _chatterbot_cache_file(cache_dir: Path) -> Path:
    dist = CHATTERBOT_CORPUS
    return cache_dir / f"{dist.package}-{dist.version}-{dist.sha256[:12]}.json"


def _dialogue(entry: object) -> list[str] | None:
    """One YAML conversation as a list of stripped lines, or None if it is malformed."""
    if not isinstance(entry, list):
        return None
    lines = [str(x).strip() for x in entry if isinstance(x, (str, int, float)) and not isinstance(x, bool)]
    lines = [x for x in lines if x]
    return lines if len(lines) == len(entry) and len(lines) >= 2 else None


def parse_chatterbot_wheel(wheel: Path) -> dict[str, list[list[str]]]:
    """Dialogues (lists of lines) per language of CHATTERBOT_LANGUAGES, read straight from the wheel."""
    by_language: dict[str, list[list[str]]] = {lang: [] for lang in CHATTERBOT_LANGUAGES}
    with zipfile.ZipFile(wheel) as zf:
        for name in sorted(zf.namelist()):
            parts = name.split("/")
            if len(parts) != 4 or parts[:2] != ["chatterbot_corpus", "data"] or not name.endswith(".yml"):
                continue
            if parts[2] not in by_language:
                continue
            data = yaml.safe_load(zf.read(name).decode("utf-8")) or {}
            for entry in data.get("conversations") or []:
                lines = _dialogue(entry)
                if lines is not None:
                    by_language[parts[2]].append(lines)
    empty = [lang for lang, dialogues in by_language.items() if not dialogues]
    if empty:
        raise ValueError(f"{wheel.name} has no dialogues for {empty}; the chatterbot source pin is wrong.")
    return by_language


def chatterbot_dialogues(cache_dir: Path | None = None) -> dict[str, list[list[str]]]:
    """Dialogues per language from the pinned chatterbot-corpus wheel, downloaded once and cached as JSON."""
    cache_dir = resolve_cache_dir(cache_dir, "corpora")
    path = _chatterbot_cache_file(cache_dir)
    if path.is_file():
        cached = json.loads(path.read_text(encoding="utf-8"))
        if cached.get("sha256") == CHATTERBOT_CORPUS.sha256:
            return cached["dialogues"]
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download.", dir=cache_dir) as tmp:
        wheel = pip_download(CHATTERBOT_CORPUS, Path(tmp))
        verify_sha256(wheel, CHATTERBOT_CORPUS)
        dialogues = parse_chatterbot_wheel(wheel)
    record = {
        "package": CHATTERBOT_CORPUS.package,
        "version": CHATTERBOT_CORPUS.version,
        "filename": CHATTERBOT_CORPUS.filename,
        "sha256": CHATTERBOT_CORPUS.sha256,
        "dialogues": dialogues,
    }
    write_json_atomic(path, record)
    return dialogues


def stdlib_source(module: str) -> str | None:
    """Source text of a standard-library module's .py file, without importing it; None if it has none."""
    spec = importlib.util.find_spec(module)
    origin = getattr(spec, "origin", None) if spec is not None else None
    if not origin or not origin.endswith(".py") or not os.path.isfile(origin):
        return None
    return Path(origin).read_text(encoding="utf-8")


def _first_paragraph_docstring(source: str, func: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """Function source (dedented) with its docstring cut, in the source text, after its first paragraph."""
    body = func.body[0] if func.body else None
    if not (isinstance(body, ast.Expr) and isinstance(body.value, ast.Constant) and isinstance(body.value.value, str)):
        return source
    lines = source.splitlines()
    doc = lines[body.lineno - 1 : body.end_lineno]
    quote = re.match(r"\s*[rRuU]?(\"\"\"|''')", doc[0])
    blank = next((i for i, line in enumerate(doc) if i and not line.strip()), None)
    if quote is None or blank is None or body.lineno == func.lineno:
        return source
    closing = " " * body.col_offset + quote.group(1)
    return "\n".join(lines[: body.lineno - 1] + doc[:blank] + [closing] + lines[body.end_lineno :])


def stdlib_functions(modules: tuple[str, ...] = CODE_MODULES) -> list[tuple[str, str, str]]:
    """(module, qualified name, source) of every function and method short enough to quote whole."""
    found = []
    for module in modules:
        source = stdlib_source(module)
        if source is None:
            continue
        lines = source.splitlines()
        tree = ast.parse(source)
        scopes: list[tuple[str, list[ast.stmt]]] = [("", tree.body)]
        while scopes:
            prefix, body = scopes.pop(0)
            for node in body:
                if isinstance(node, ast.ClassDef):
                    scopes.append((f"{prefix}{node.name}.", node.body))
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                text = textwrap.dedent("\n".join(lines[start - 1 : node.end_lineno]))
                try:
                    trimmed = _first_paragraph_docstring(text, ast.parse(text).body[0])
                    if trimmed != text:
                        text = trimmed
                        ast.parse(text)
                except SyntaxError:
                    continue
                if len(text) <= MAX_FUNCTION_CHARS and text.count("\n") < MAX_FUNCTION_LINES:
                    found.append((module, prefix + node.name, text))
    return found


def _is_underline(line: str) -> bool:
    return len(line) >= 3 and len(set(line)) == 1 and line[0] in "*=-^~"


def help_topic_sections() -> list[tuple[str, str]]:
    """(title, body) of every section of pydoc's help topics (the Python language reference)."""
    from pydoc_data.topics import topics

    sections = []
    for key in sorted(topics):
        lines = topics[key].splitlines()
        title, body = key, []
        for i, line in enumerate(lines):
            if i + 1 < len(lines) and _is_underline(lines[i + 1]) and line.strip() and not line.startswith(" "):
                if body:
                    sections.append((title, "\n".join(body).strip("\n")))
                title, body = line.strip(), []
            elif not _is_underline(line):
                body.append(line)
        if body:
            sections.append((title, "\n".join(body).strip("\n")))
    return sections


def prose_paragraphs(text: str) -> list[str]:
    """Paragraphs of running prose (no indented grammar or code, headings or tables), each on one line."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = [x for x in block.splitlines() if x.strip()]
        if not lines or lines[0].startswith((" ", "\t", ">>>")) or any(_RULE.search(x) for x in lines):
            continue
        paragraph = " ".join(x.strip() for x in lines)
        if "::=" not in paragraph and not (paragraph.endswith(":") and len(paragraph) < 40):
            paragraphs.append(paragraph)
    return paragraphs


def _leading_docstring(source: str) -> str | None:
    """The module docstring of source, read from its first tokens (parsing whole modules is slow)."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENCODING)
    try:
        first = next(t for t in tokens if t.type not in skip)
    except (StopIteration, tokenize.TokenError):
        return None
    if first.type != tokenize.STRING:
        return None
    value = ast.literal_eval(first.string)
    return inspect.cleandoc(value) if isinstance(value, str) else None


def module_docstrings(modules: tuple[str, ...] = PROSE_MODULES) -> list[tuple[str, str]]:
    """(module, docstring) of standard-library modules with a docstring, read without importing them."""
    found = []
    for module in modules:
        source = stdlib_source(module)
        doc = _leading_docstring(source) if source is not None else None
        if doc:
            found.append((module, doc))
    return found


def zen_of_python() -> str:
    """The Zen of Python, decoded from the rot13 text of the `this` module (which prints it when imported)."""
    source = stdlib_source("this")
    if source is None:
        raise FileNotFoundError("The standard library of this interpreter has no this.py.")
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return codecs.decode(node.value.value, "rot13")
    raise ValueError("this.py holds no encoded Zen text.")


_NAMES = ("Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Kemi", "Liam", "Mia")
_ITEMS = ("apples", "books", "marbles", "pencils", "stickers", "cookies", "stamps", "shells", "cards", "coins")
_GOODS = ("jacket", "bicycle", "lamp", "backpack", "chair", "kettle", "guitar", "clock", "tent", "camera")


def _money(value: float) -> str:
    return f"${value:.2f}" if value != int(value) else f"${int(value)}"


# A math problem is its first turn plus, for some kinds, a follow-up about the same numbers (asked
# at this rate); the follow-up draws its own numbers only when it is asked.
_FOLLOW_UP_PROBABILITY = 0.4
Turn = tuple[str, str]
Problem = tuple[Turn, Callable[[], Turn] | None]


def _addition(rng) -> Problem:
    name, items = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(3, 250), rng.randint(2, 150)
    total = a + b
    first = (
        f"{name} has {a} {items} and then gets {b} more. How many {items} does {name} have now?",
        f"{name} starts with {a} {items} and gets {b} more, so we add them.\n{a} + {b} = {total}\n"
        f"{name} has {total} {items} now.",
    )

    def give_away() -> Turn:
        given = rng.randint(1, total - 1)
        return (
            f"{name} then gives away {given} of them. How many are left?",
            f"We subtract the {given} given away from {total}.\n{total} - {given} = {total - given}\n"
            f"{name} has {total - given} {items} left.",
        )

    return first, give_away


def _multiplication(rng) -> Problem:
    items = rng.choice(_ITEMS)
    per, boxes = rng.randint(2, 48), rng.randint(2, 36)
    total = per * boxes
    first = (
        f"A box holds {per} {items}. How many {items} are there in {boxes} boxes?",
        f"Each of the {boxes} boxes holds {per} {items}, so we multiply.\n{boxes} * {per} = {total}\n"
        f"There are {total} {items} in {boxes} boxes.",
    )

    def share() -> Turn:
        people = rng.choice([d for d in range(2, 13) if total % d == 0] or [1])
        return (
            f"If they are shared equally among {people} people, how many does each person get?",
            f"We divide the {total} {items} by {people}.\n{total} / {people} = {total // people}\n"
            f"Each person gets {total // people} {items}.",
        )

    return first, share


def _percentage(rng) -> Problem:
    good = rng.choice(_GOODS)
    price, percent = rng.randint(2, 60) * 5, rng.choice([5, 10, 15, 20, 25, 30, 40, 50, 75])
    discount = price * percent / 100
    sale = price - discount
    first = (
        f"A {good} costs {_money(price)}. It is on sale for {percent}% off. What is the sale price?",
        f"First find the discount: {percent}% of {_money(price)} is {price} * {percent} / 100 = {_money(discount)}.\n"
        f"Then subtract it from the price: {_money(price)} - {_money(discount)} = {_money(sale)}.\n"
        f"The sale price is {_money(sale)}.",
    )
    return first, None


def _equation(rng) -> Problem:
    a, x, b = rng.randint(2, 12), rng.randint(-20, 30), rng.randint(-40, 60)
    c = a * x + b
    sign, magnitude = ("+", b) if b >= 0 else ("-", -b)
    move = f"Subtract {b} from both sides" if b >= 0 else f"Add {-b} to both sides"
    first = (
        f"Solve for x: {a}x {sign} {magnitude} = {c}",
        f"{move}: {a}x = {c} {'-' if b >= 0 else '+'} {magnitude} = {c - b}.\n"
        f"Divide both sides by {a}: x = {c - b} / {a} = {x}.\nThe solution is x = {x}.",
    )
    check = (
        "Can you check that answer?",
        f"Substitute x = {x}: {a} * {x} {sign} {magnitude} = {a * x} {sign} {magnitude} = {c}.\n"
        f"That equals the right-hand side, {c}, so x = {x} is correct.",
    )
    return first, lambda: check


def math_turns(rng) -> list[Turn]:
    """One to two (question, worked answer) turns of a random arithmetic word problem or equation."""
    kind = rng.choice((_addition, _multiplication, _percentage, _equation))
    first, follow_up = kind(rng)
    if follow_up is not None and rng.random() < _FOLLOW_UP_PROBABILITY:
        return [first, follow_up()]
    return [first]
