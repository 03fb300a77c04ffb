"""The demo's real-engine step: vLLM serves the target alone and with the Osprey and EAGLE-3 drafters on the eval
prompts (`evaluate --engine vllm`, reading the reference engine's results of the same requests), and the report's
table of AL in both engines, lossless mismatches, tokens/s and speedup per concurrency.

Without an engine the demo says so in one line and keeps its other tables."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_osprey.demo.commands import eval_argv
from megatron_osprey.demo.sizes import DemoConfig
from megatron_osprey.demo.step_runner import ROOT, StepRunner

RESULTS = "eval_vllm"


def drafter_refusal(path: Path) -> str | None:
    """Why vLLM cannot serve the demo drafter at `path` with this checkout's exports, or None."""
    from megatron_osprey.eval.loading import is_megatron_checkpoint, load_drafter, megatron_run_config
    from megatron_osprey.export.layouts import vllm_refusal

    if is_megatron_checkpoint(path):  # its config from run_config.yaml: no weights loaded
        from megatron_osprey.models.drafter.arch import DrafterArch

        config = DrafterArch.from_dict(megatron_run_config(path)["drafter"]).reference_config()
    else:
        config = load_drafter(path).drafter.config
    return vllm_refusal(config)


def vllm_eval_argv(cfg: DemoConfig, target: Path, out: Path, drafters: list[dict], data: dict, python: str, ref: Path):
    """The eval step's command (same prompts, steps and budget) served in vLLM, beside the reference's results, at
    cfg.vllm_concurrency (else the engine's levels)."""
    argv = eval_argv(cfg, target, out, drafters, data)
    levels = ["--vllm-concurrency", *map(str, cfg.vllm_concurrency)] if cfg.vllm_concurrency else []
    return argv + ["--engine", "vllm", "--vllm-python", python, "--reference-results", ref, *levels]


def serve_in_vllm(
    steps: StepRunner,
    cfg: DemoConfig,
    target: Path,
    eval_dir: Path,
    drafters: list[dict],
    data: dict,
    output: Path,
    python: str | None,
    lookup: bool,
) -> dict:
    """Serve seed 0's drafters in vLLM beside the reference engine's results in `eval_dir`; returns what the report
    says: {"results": path, "not_served": {name: reason}} or {"skipped": the one sentence why}."""
    from megatron_osprey.eval.vllm_engine import engine_or_reason

    if not lookup:
        return {"skipped": "not run (the demo was called without looking for a serving engine)."}
    python, reason = engine_or_reason(python, {}, ROOT)
    if python is None:
        return {"skipped": reason}
    served, not_served = [], {}
    for d in drafters:
        if d["seed"] != cfg.seeds[0]:
            continue
        refusal = drafter_refusal(Path(d["path"]))
        if refusal:
            not_served[d["name"]] = refusal
        else:
            served.append(d)
    if not served:
        return {"skipped": "no drafter of this run can be served: " + "; ".join(not_served.values()) + "."}
    out = output / RESULTS
    steps.run(RESULTS, vllm_eval_argv(cfg, target, out, served, data, python, eval_dir / "results.json"))
    return {"results": str(out / "results.json"), "not_served": not_served}


def vllm_report(info: dict | None) -> dict | None:
    """report.json's "vllm": the engine section of the step's results.json, or why there is none."""
    if info is None or "skipped" in info:
        return info
    section = json.loads(Path(info["results"]).read_text())["vllm"]
    return {**section, "not_served": info["not_served"]}


def render_vllm(report: dict | None) -> list[str]:
    """report.md's real-engine section: the table, or one line saying why there is none."""
    from megatron_osprey.eval.vllm_metrics import vllm_markdown

    if report is None:
        return []
    if "skipped" in report:
        return ["", f"Real serving engine (vLLM): {report['skipped']}"]
    lines = ["", "## In a real serving engine: vLLM beside the reference engine", "", vllm_markdown(report).rstrip()]
    for name, reason in report.get("not_served", {}).items():
        lines += ["", f"Not served in vLLM: {name} ({reason})."]
    return lines
