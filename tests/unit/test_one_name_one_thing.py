"""A public name is defined once in the package: twins drift apart (two `ModelShape`s, two
`validate_aux_layer_ids` with different id counts, two `TOKENIZER_FILES` lists did)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import megatron_osprey

ROOT = Path(megatron_osprey.__file__).resolve().parent

# Names that are one contract per owner, on purpose; each with the reason.
ALLOWED = {
    "main": "every entry module has one",
    "run": "every stage module (megatron_osprey/stages/) runs its Config with it",
    "default_cache_dir": "each cache (tokenizers, corpora) names its root; both call assets.download.osprey_cache_dir",
    "FLAGS": "every stage module's flag table, composed from its components' tables",
    "config_from_args": "the training stages' (pretrain, distill) parse without running, for tests and tools",
}

# Known twins still to be renamed (none now): a name listed here must be a twin, and every twin listed.
TO_RENAME: dict[str, str] = {}


def public_definitions() -> dict[str, list[str]]:
    """name -> the modules that define it at top level (functions, classes, UPPER_CASE constants)."""
    where = defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper()]
            else:
                continue
            for name in names:
                if not name.startswith("_"):
                    where[name].append(str(path.relative_to(ROOT.parent)))
    return where


def test_no_public_name_is_defined_twice():
    twins = {name for name, files in public_definitions().items() if len(files) > 1 and name not in ALLOWED}
    assert twins == set(TO_RENAME)


def test_the_scan_sees_definitions():
    found = public_definitions()
    assert found["write_json_atomic"] == ["megatron_osprey/base/atomic_io.py"]
    assert "megatron_osprey/models/drafter/reference.py" in found["DrafterConfig"]
