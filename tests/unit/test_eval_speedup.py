"""The speedup summary of an SGLang evaluation: tokens/s with the drafter over the target alone, per batch size,
from the results.json files that tools/sglang_bench.py writes; the target-only pass; the template's last step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.render import render
from megatron_osprey.eval.speedup import main as speedup_main
from megatron_osprey.eval.speedup import speedup_rows, write_speedup
from megatron_osprey.recipes import get_recipe
from tests.fake_sglang import fake_sglang_server, meta_reply
from tools.sglang_bench import main as bench_main

REPO = Path(__file__).resolve().parents[2]


def write_results(path: Path, splits: dict[str, tuple[list[tuple[int, int]], float]]) -> None:
    """A results.json as tools/sglang_bench.py writes it: per split, (completion, verify) per request and wall s."""
    cells = []
    for split, (requests, wall) in splits.items():
        records = [
            {"id": f"{split}{i}", "completion_tokens": c, "verify_count": v, "acceptance_length": c / v}
            for i, (c, v) in enumerate(requests)
        ]
        tokens = sum(c for c, _ in requests)
        summary = {"completion_tokens": tokens, "wall_seconds": wall, "throughput_tokens_per_s": tokens / wall}
        cells.append({"drafter": "d", "split": split, "batch_size": 1, "summary": summary, "requests": records})
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.json").write_text(json.dumps({"format": "megatron_osprey.eval/1", "cells": cells}))


def test_speedup_per_batch_size_and_split(tmp_path):
    # batch 1: chat AL (2.5 + 3) / 2, 160 tokens in 2 s vs 4 s alone; code AL 2, 50 tokens in 1 s vs 1.25 s alone.
    write_results(tmp_path / "batch1" / "drafter", {"chat": ([(100, 40), (60, 20)], 2.0), "code": ([(50, 25)], 1.0)})
    write_results(
        tmp_path / "batch1" / "target_only", {"chat": ([(100, 100), (60, 60)], 4.0), "code": ([(50, 50)], 1.25)}
    )
    # batch 16: 300 tokens in 1.5 s with the drafter, in 2.5 s alone.
    write_results(tmp_path / "batch16" / "drafter", {"chat": ([(150, 50), (150, 75)], 1.5)})
    write_results(tmp_path / "batch16" / "target_only", {"chat": ([(150, 150), (150, 150)], 2.5)})
    rows = write_speedup(tmp_path, [1, 16])
    got = [
        (r["batch_size"], r["split"], r["acceptance_length"], r["tokens_per_s_drafter"], r["tokens_per_s_target_only"])
        for r in rows
    ]
    assert got == [
        (1, "chat", 2.75, 80.0, 40.0),
        (1, "code", 2.0, 50.0, 40.0),
        (1, "all", 2.5, 70.0, 40.0),  # AL over all 3 requests; 210 tokens in 3 s vs 5.25 s
        (16, "chat", 2.5, 200.0, 120.0),
    ]
    assert [r["speedup"] for r in rows] == pytest.approx([2.0, 1.25, 1.75, 200 / 120])
    assert json.loads((tmp_path / "speedup.json").read_text())["rows"] == rows
    table = (tmp_path / "speedup.md").read_text()
    assert (
        "| 1 | all | 2.500 | 70.0 | 40.0 | 1.75x |" in table
        and "| 16 | chat | 2.500 | 200.0 | 120.0 | 1.67x |" in table
    )


def test_a_missing_pass_or_different_splits_are_refused_naming_the_file(tmp_path, capsys):
    write_results(tmp_path / "batch1" / "drafter", {"chat": ([(10, 5)], 1.0)})
    assert speedup_main([str(tmp_path), "--batch-sizes", "1"]) == 2
    assert f"{tmp_path}/batch1/target_only/results.json does not exist" in capsys.readouterr().err
    write_results(tmp_path / "batch1" / "target_only", {"code": ([(10, 10)], 1.0)})
    with pytest.raises(
        ValueError, match="drafter pass evaluated splits \\['chat'\\], the target-only pass \\['code'\\]"
    ):
        speedup_rows(tmp_path, [1])
    (tmp_path / "batch1" / "target_only" / "results.json").write_text("{}")
    with pytest.raises(ValueError, match="target_only/results.json is not a tools/sglang_bench.py results.json"):
        speedup_rows(tmp_path, [1])


def test_the_target_only_pass_measures_a_server_that_drafts_nothing(tmp_path):
    # SGLang 0.5.23 leaves spec_verify_ct out of meta_info when no speculative algorithm runs.
    from megatron_osprey.data.regenerate.tiny_target import build_tiny_tokenizer

    build_tiny_tokenizer("qwen3").save_pretrained(tmp_path / "target")

    def answer(body):
        return meta_reply({"completion_tokens": 12, "finish_reason": "length"})

    rows = [{"id": f"r{i}", "conversations": [{"role": "user", "content": f"hi {i}"}]} for i in range(3)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with fake_sglang_server(answer) as url:
        argv = ["--url", url, "--tokenizer", str(tmp_path / "target")]
        argv += ["--data", str(tmp_path / "chat.jsonl"), "--drafter-name", "target_only", "--method", "target"]
        assert bench_main([*argv, "--output", str(tmp_path / "spec")]) == 2  # a drafter pass needs spec_verify_ct
        assert bench_main([*argv, "--output", str(tmp_path / "alone"), "--target-only"]) == 0
    cell = json.loads((tmp_path / "alone" / "results.json").read_text())["cells"][0]
    assert [r["acceptance_length"] for r in cell["requests"]] == [1.0, 1.0, 1.0]
    assert cell["summary"]["completion_tokens"] == 36


# Stands in for tools/sglang_bench.py in the rendered job: a results.json per pass, the drafter twice as fast.
_FAKE_BENCH = """
import json, sys
from pathlib import Path
argv = sys.argv[1:]
output, batch = Path(argv[argv.index("--output") + 1]), int(argv[argv.index("--batch-size") + 1])
alone = "--target-only" in argv
requests = [{"completion_tokens": 40, "verify_count": 40 if alone else 16}]
summary = {"completion_tokens": 40, "wall_seconds": (2.0 if alone else 1.0) / batch}
splits = [Path(argv[i + 1]).stem for i, a in enumerate(argv) if a == "--data"]
output.mkdir(parents=True, exist_ok=True)
cells = [{"split": s, "batch_size": batch, "summary": summary, "requests": requests} for s in splits]
(output / "results.json").write_text(json.dumps({"cells": cells}))
"""


def test_the_rendered_eval_job_ends_with_the_speedup_table(tmp_path):
    name = "qwen3_8b_osprey_distill_2gpu_h100_bf16"
    script_path = tmp_path / "eval.sbatch"
    script_path.write_text(render(get_recipe(name), name, "evaluate", str(tmp_path / "run")))
    assert subprocess.run(["bash", "-n", str(script_path)]).returncode == 0
    (tmp_path / "fake_bench.py").write_text(_FAKE_BENCH)
    python = tmp_path / "python"
    python.write_text(
        f'#!/bin/bash\nif [[ "$1" == tools/sglang_bench.py ]]; then shift; exec {sys.executable} '
        f'{tmp_path / "fake_bench.py"} "$@"; fi\nexec {sys.executable} "$@"\n'
    )
    sglang = tmp_path / "sglang_python"
    sglang.write_text("#!/bin/bash\nexec sleep 60\n")
    for stub in (python, sglang):
        stub.chmod(0o755)
    output = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "7", "PYTHON": str(python), "SGLANG_PYTHON": str(sglang)}
    env |= {"OSPREY_REPO": str(REPO), "OUTPUT": str(output), "BATCH_SIZES": "1 4"}
    done = subprocess.run(["bash", str(script_path)], env=env, capture_output=True, text=True, timeout=120)
    logs = "".join(p.read_text() for p in (tmp_path / "run").rglob("*.log"))
    assert done.returncode == 0, logs[-3000:]
    rows = json.loads((output / "speedup.json").read_text())["rows"]
    domains = get_recipe(name).eval_domains
    assert [(r["batch_size"], r["split"]) for r in rows] == [(b, s) for b in (1, 4) for s in [*domains, "all"]]
    assert {r["speedup"] for r in rows} == {2.0} and {r["acceptance_length"] for r in rows} == {2.5}
    assert "| 4 | all | 2.500 | 160.0 | 80.0 | 2.00x |" in logs
