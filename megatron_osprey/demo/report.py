"""The demo's report: Osprey against the EAGLE-3 baseline, in and out of domain."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from megatron_osprey.base.atomic_io import write_text_atomic


def _gain(new, old):
    return None if new is None or old in (None, 0) else (new - old) / old


def summarize(matrices: dict) -> dict:
    """Mean / ID / OOD AL per method and Osprey's relative gains over EAGLE-3."""
    methods = {name: {"mean": m["mean"], "id": m["id_mean"], "ood": m["ood_mean"],
                      "id_cells": m["id_cells"], "ood_cells": m["ood_cells"]} for name, m in matrices.items()}
    gains = {}
    if "osprey" in methods and "eagle3" in methods:
        gains = {key: _gain(methods["osprey"][key], methods["eagle3"][key]) for key in ("mean", "id", "ood")}
    return {"methods": methods, "osprey_gain_over_eagle3": gains}


def _fmt(value, pct=False):
    if value is None:
        return "-"
    return f"{100 * value:+.1f}%" if pct else f"{value:.3f}"


def write_report(output: Path, eval_dir: Path, cfg, timings: dict, seconds: float) -> dict:
    """report.json, report.md and heatmap.png under `output` from the eval results."""
    results = json.loads((eval_dir / "results.json").read_text())
    matrices = results["matrices"]
    summary = summarize(matrices)
    report = {
        "matrix": {name: {"drafters": m["drafters"], "train_domains": m["train_domains"], "eval_domains": m["splits"],
                          "acceptance_length": m["acceptance_length"],
                          "pooled_acceptance_length": m["pooled_acceptance_length"]}
                   for name, m in matrices.items()},
        **summary,
        "config": dataclasses.asdict(cfg),
        "eval": results["config"],
        "seconds": round(seconds, 1),
        "step_seconds": {k: round(v, 1) for k, v in timings.items()},
    }
    write_text_atomic(output / "report.json", json.dumps(report, indent=2) + "\n")
    if (eval_dir / "matrix.png").is_file():
        shutil.copy2(eval_dir / "matrix.png", output / "heatmap.png")

    lines = ["# Osprey toy-scale replication (CPU)", "",
             f"Acceptance length (AL = completion tokens / verify steps, mean over requests) at steps "
             f"{results['config']['steps']}, topk {results['config']['topk']}, draft tokens "
             f"{results['config']['draft_tokens']}, greedy; {cfg.n_eval} eval prompts per domain, "
             f"{results['config']['max_new_tokens']} new tokens.", "",
             "| method | mean AL | in-domain AL | out-of-domain AL |", "| --- | --- | --- | --- |"]
    for name, m in summary["methods"].items():
        lines.append(f"| {name} | {_fmt(m['mean'])} | {_fmt(m['id'])} | {_fmt(m['ood'])} |")
    gains = summary["osprey_gain_over_eagle3"]
    if gains:
        lines += ["", f"Osprey vs EAGLE-3: mean {_fmt(gains['mean'], True)}, in-domain {_fmt(gains['id'], True)}, "
                      f"out-of-domain {_fmt(gains['ood'], True)} (paper, Qwen3-8B: +16.1% mean, OOD +17.3%)."]
    for name, m in matrices.items():
        lines += ["", f"## {name}: train domain x eval domain", "",
                  "| trained on | " + " | ".join(m["splits"]) + " |", "|" + " --- |" * (len(m["splits"]) + 1)]
        for domain, row in zip(m["train_domains"], m["acceptance_length"]):
            lines.append(f"| {domain} | " + " | ".join(_fmt(v) for v in row) + " |")
    lines += ["", "![AL matrix](heatmap.png)", "",
              f"Total time {seconds / 60:.1f} min; per step: " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()),
              "", "Reproduce: `make demo` (or `make demo-full` for the 5x5 matrix)."]
    write_text_atomic(output / "report.md", "\n".join(lines) + "\n")
    return report
