"""The demo's report: Osprey against the EAGLE-3 baseline on the real target, in and out of domain.

Every figure is recomputed from the eval's results.json (per-request records), so the report can be
checked against it: `summarize_cells()` is the one place that turns requests into the table.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np

from megatron_osprey.base.atomic_io import write_bytes_atomic
from megatron_osprey.demo.engine_eval import render_vllm, vllm_report
from megatron_osprey.demo.report_arms import arms_report, render_arms
from megatron_osprey.demo.sizes import EXTRA_ARMS
from megatron_osprey.demo.statistics import bootstrap, collect, relative_gain, summarize_cells

PAPER_NOTE = "paper, Qwen3-8B: +16.1% mean, ID +12.4%, OOD +17.3%"
GOALS = {"mean_gain_at_least": 0.10, "osprey_mean_al_at_least": 2.0}
METHOD_LABELS = {
    "osprey": "Osprey (target's first 2 layers, pretrained, adapted)",
    "osprey_xtok": "Osprey cross-tokenizer (small LM with another tokenizer, pretrained, adapted)",
    "eagle3": "EAGLE-3 (1 layer from scratch, same data, tokens, TTT depth, optimizer)",
    **EXTRA_ARMS,
}


def _write_text(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def _fmt(value, pct=False):
    if value is None:
        return "-"
    return f"{100 * value:+.1f}%" if pct else f"{value:.3f}"


def speed(results: dict) -> dict:
    """Pooled tokens/s of speculative decoding per method, and of target-only decoding, on this CPU."""
    if results["config"].get("replay"):  # replayed: no verify forwards ran, so there is no decoding speed
        return {
            "batch_size": results["config"].get("batch_size", 1),
            "replayed": True,
            "speculative_tokens_per_s": {},
            "target_only_tokens_per_s": None,
            "speedup": {},
        }
    out = {}
    target_tokens = target_seconds = 0.0
    for cell in results["cells"]:
        entry = out.setdefault(cell["method"], {"tokens": 0, "seconds": 0.0})
        for r in cell["requests"]:
            entry["tokens"] += r["completion_tokens"]
            entry["seconds"] += r["seconds"]
            if r.get("target_seconds"):
                target_tokens += r["completion_tokens"]
                target_seconds += r["target_seconds"]
    speeds = {m: e["tokens"] / e["seconds"] for m, e in out.items() if e["seconds"] > 0}
    baseline = target_tokens / target_seconds if target_seconds else None
    # one cell's requests are decoded together, so a cell with fewer requests than --batch-size sets the batch
    batch = min(results["config"].get("batch_size", 1), max((len(c["requests"]) for c in results["cells"]), default=1))
    return {
        "batch_size": batch,
        "speculative_tokens_per_s": speeds,
        "target_only_tokens_per_s": baseline,
        "speedup": {m: (v / baseline if baseline else None) for m, v in speeds.items()},
    }


def draft_vocab_coverage(results: dict, drafters: list[dict]) -> dict:
    """Share of the target's eval output tokens inside each reduced-vocabulary drafter's draft vocabulary."""
    from megatron_osprey.eval.loading import load_drafter

    outputs: dict[str, list[int]] = {}
    first = results["cells"][0]["drafter"] if results["cells"] else None
    for cell in results["cells"]:
        if cell["drafter"] == first:  # greedy + lossless: every drafter's outputs are the target's own
            outputs[cell["split"]] = [t for r in cell["requests"] for t in r.get("output_ids", [])]
    coverage = {}
    for d in drafters:
        if d.get("ngram"):  # an n-gram drafter proposes from the whole vocabulary
            continue
        loaded = load_drafter(Path(d["path"])).drafter
        if loaded.config.draft_vocab_size == loaded.config.vocab_size:
            continue
        vocab = set((np.arange(loaded.config.draft_vocab_size) + loaded.d2t.cpu().numpy()).tolist())
        coverage[d["name"]] = {
            "draft_vocab_size": loaded.config.draft_vocab_size,
            "coverage": {
                split: (sum(t in vocab for t in toks) / len(toks) if toks else None) for split, toks in outputs.items()
            },
        }
    return coverage


def decoded_examples(results: dict, target: Path, per_domain: int = 2) -> dict:
    """The first prompts of each eval domain with the target's greedy reply (decoded)."""
    from transformers import AutoTokenizer

    from megatron_osprey.data.conversations import read_conversations
    from megatron_osprey.eval.prompts import prompt_messages

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    paths = {split["name"]: split["path"] for split in results["splits"]}
    first = results["cells"][0]["drafter"] if results["cells"] else None
    examples = {}
    for cell in results["cells"]:
        if cell["drafter"] != first:
            continue
        # The eval split's file, as results.json names it; evaluation prompts with its first user message.
        prompts = {c.id: prompt_messages(c.messages)[0]["content"] for c in read_conversations(paths[cell["split"]])}
        examples[cell["split"]] = [
            {
                "id": r["id"],
                "prompt": prompts.get(r["id"], ""),
                "reply": tokenizer.decode(r["output_ids"], skip_special_tokens=True),
            }
            for r in cell["requests"][:per_domain]
        ]
    return examples


def live_check(replayed: dict, path: Path) -> dict | None:
    """A replayed evaluation checked against live decoding of the same requests (None without a live check).

    Counts the live requests, how many of them matched target-only greedy decoding (lossless), and how
    many got the same tokens and accept lengths from the replay."""
    if not replayed["config"].get("replay") or not path.is_file():
        return None
    live = json.loads(path.read_text())
    replay = {(c["drafter"], c["split"], r["id"]): r for c in replayed["cells"] for r in c["requests"]}
    requests = [(c["drafter"], c["split"], r) for c in live["cells"] for r in c["requests"]]
    same = sum(
        1
        for d, s, r in requests
        if (d, s, r["id"]) in replay
        and replay[(d, s, r["id"])]["accept_lengths"] == r["accept_lengths"]
        and replay[(d, s, r["id"])]["output_ids"] == r["output_ids"]
    )
    return {
        "requests": len(requests),
        "lossless_mismatches": len(live["lossless"]["mismatches"]),
        "same_as_replay": same,
        "speed": speed(live),
    }


def _speed_lines(sp: dict) -> list[str]:
    """The report's speed section (none when AL was replayed: no verify forwards ran)."""
    if sp.get("replayed"):
        return [
            "",
            "## Speed",
            "",
            "Not measured: AL was measured by replaying the target's greedy output "
            "(`--replay`), which runs no verify forwards; `make demo` measures decoding speed.",
        ]
    batch = sp.get("batch_size", 1)
    engine = "reference engine, batch 1" if batch == 1 else f"batched engine, {batch} requests per forward"
    lines = [
        "",
        f"## Speed on this CPU (float32 target, {engine})",
        "",
        f"Target-only greedy decoding: {sp['target_only_tokens_per_s'] or 0:.1f} tokens/s.",
        "",
        "| method | speculative tokens/s | vs target-only |",
        "| --- | --- | --- |",
    ]
    for m, v in sp["speculative_tokens_per_s"].items():
        lines.append(f"| {m} | {v:.1f} | {sp['speedup'][m] or 0:.2f}x |")
    return lines + [
        "",
        "A 135M target on 2 CPU cores is not the GPU serving regime: the CPU is compute-bound, so a "
        "verify of 6 tokens costs several 1-token steps (batch 1: the drafter's own forwards are a large "
        "share too); these figures are reported, not targeted.",
    ]


def _time_line(report: dict) -> str:
    def listed(seconds: dict) -> str:
        return ", ".join(f"{k} {v:.0f}s" for k, v in seconds.items())

    line = f"Total time {report['seconds'] / 60:.1f} min; per step: {listed(report['step_seconds'])}"
    earlier = report.get("earlier_step_seconds") or {}
    if earlier:
        steps = sum(report["step_seconds"].values()) + sum(earlier.values())
        line += (
            f". Resumed: {len(earlier)} steps finished in earlier runs and were skipped ({listed(earlier)}); "
            f"all steps together took {steps / 60:.1f} min"
        )
    return line


def write_report(
    output: Path,
    eval_dir: Path,
    cfg,
    drafters: list[dict],
    timings: dict,
    seconds: float,
    target: Path,
    earlier: dict | None = None,
    arms_dir: Path | None = None,
    vllm: dict | None = None,
) -> dict:
    """report.json, report.md and heatmap.png under `output` from the eval results. `timings` are this run's
    step seconds, `earlier` those of the steps an earlier run finished (a resumed run skips them); `vllm` is the
    real-engine step's outcome (engine_eval.serve_in_vllm)."""
    results = json.loads((eval_dir / "results.json").read_text())
    results["demo_drafters"] = [{**d, "path": str(d["path"])} for d in drafters]
    per_method = collect(results)
    summary = summarize_cells(per_method)
    gains = {
        m: {k: relative_gain(summary[m][k], summary["eagle3"][k]) for k in ("mean", "id", "ood")}
        for m in summary
        if m != "eagle3" and "eagle3" in summary
    }
    intervals = bootstrap(per_method)
    osprey, main_gain = summary.get("osprey", {}), gains.get("osprey", {})
    goals = {
        "mean_gain_at_least_10pct": main_gain.get("mean") is not None
        and main_gain["mean"] >= GOALS["mean_gain_at_least"],
        "ood_gain_at_least_id_gain": (
            main_gain.get("ood") is not None and main_gain.get("id") is not None and main_gain["ood"] >= main_gain["id"]
        ),
        "osprey_mean_al_at_least_2": osprey.get("mean") is not None
        and osprey["mean"] >= GOALS["osprey_mean_al_at_least"],
    }
    report = {
        "target": str(target),
        "methods": summary,
        "gains_over_eagle3": gains,
        "osprey_gain_over_eagle3": main_gain,
        "confidence_95": intervals,
        "goals": goals,
        "matrix": {
            name: {
                "drafters": m["drafters"],
                "train_domains": m["train_domains"],
                "eval_domains": m["splits"],
                "acceptance_length": m["acceptance_length"],
                "pooled_acceptance_length": m["pooled_acceptance_length"],
            }
            for name, m in results["matrices"].items()
        },
        "speed": speed(results),
        "draft_vocab_coverage": draft_vocab_coverage(results, drafters),
        "examples": decoded_examples(results, target),
        "lossless": {"checked": results["lossless"]["checked"], "mismatches": len(results["lossless"]["mismatches"])},
        "live_check": live_check(results, eval_dir / "live_check" / "results.json"),
        "vllm": vllm_report(vllm),
        "arms": arms_report(arms_dir, results, drafters, speed) if arms_dir else None,
        "alignment": _alignment_reports(output),
        "config": dataclasses.asdict(cfg),
        "eval": results["config"],
        "seconds": round(seconds, 1),
        "step_seconds": {k: round(v, 1) for k, v in timings.items()},
        "earlier_step_seconds": {k: round(v, 1) for k, v in (earlier or {}).items()},
    }
    _write_text(output / "report.json", json.dumps(report, indent=2) + "\n")
    if (eval_dir / "matrix.png").is_file():
        shutil.copy2(eval_dir / "matrix.png", output / "heatmap.png")
    _write_text(output / "report.md", render_markdown(report, cfg))
    return report


def _alignment_reports(output: Path) -> dict:
    reports = {}
    for path in sorted(output.glob("drafter_init_*/tokenizer_alignment.json")):
        data = json.loads(path.read_text())
        reports[path.parent.name] = {"counts": data.get("counts"), "policy": data.get("policy")}
    return reports


def _ci(interval, pct=False):
    if not interval:
        return ""
    lo, hi = interval
    return f" [{_fmt(lo, pct)}, {_fmt(hi, pct)}]"


def _regeneration(temperature: float) -> str:
    if temperature == 0:
        return "greedily"
    release = ", the release's setting" if temperature == 1 else ""
    return f"at temperature {temperature:g} (seeded sampling{release})"


def _resized_lines(cfg) -> list[str]:
    """The warning a run shortened by the time budget carries (demo/budget.py), or nothing."""
    if not getattr(cfg, "resized", None):
        return []
    sweep = ""
    if getattr(cfg, "vllm_concurrency", None):
        sweep = f", vLLM was measured at concurrency {' '.join(map(str, cfg.vllm_concurrency))} only"
    return [
        f"**Resized to fit the time budget**: Stage 2 ran {cfg.backbone_iters} iterations and distillation "
        f"{cfg.distill_epochs:g} epochs{sweep}; the measurement below says what is fewer than this size's own; "
        f"compare these figures only with runs of the same sizes. The measurement: "
        f"{cfg.resized.removeprefix('budget: ')}",
        "",
    ]


def _results_lines(report: dict, cfg) -> list[str]:
    """The title, the setting, the AL table with gains over EAGLE-3, the goals and the caveat."""
    ev = report["eval"]
    seeds = len(cfg.seeds)
    lines = [
        "# Osprey on a real target: SmolLM2-135M-Instruct (CPU)",
        "",
        f"Target `{Path(report['target']).name}` (30 layers, hidden 576, vocab 49,152). Acceptance length (AL = "
        f"completion tokens / verify steps, averaged over requests) at steps {ev['steps']}, topk {ev['topk']}, draft "
        f"tokens {ev['draft_tokens']}, greedy, {ev['max_new_tokens']} new tokens; {cfg.n_eval} held-out prompts per "
        f"eval domain (first user message), every drafter on every prompt; {seeds} seed(s) per arm. Training "
        f"data: {cfg.n_train} conversations per training domain, held out by `osprey data`, regenerated by the target "
        f"{_regeneration(cfg.regenerate_temperature)}. "
        f"Brackets: 95% bootstrap interval over prompts" + (" and seeds." if seeds > 1 else "."),
        "",
        *_resized_lines(cfg),
        "| method | mean AL | in-domain AL | out-of-domain AL |",
        "| --- | --- | --- | --- |",
    ]
    al_ci = report["confidence_95"]["al"]
    for name, m in report["methods"].items():
        ci = al_ci.get(name, {})
        lines.append(
            f"| {METHOD_LABELS.get(name, name)} | {_fmt(m['mean'])}{_ci(ci.get('mean'))} | "
            f"{_fmt(m['id'])}{_ci(ci.get('id'))} | {_fmt(m['ood'])}{_ci(ci.get('ood'))} |"
        )
    for name, g in report["gains_over_eagle3"].items():
        ci = report["confidence_95"]["gain_over_eagle3"].get(name, {})
        lines.append(
            f"| {name} gain over EAGLE-3 | {_fmt(g['mean'], True)}{_ci(ci.get('mean'), True)} | "
            f"{_fmt(g['id'], True)}{_ci(ci.get('id'), True)} | {_fmt(g['ood'], True)}{_ci(ci.get('ood'), True)} |"
        )
    lines += ["", f"For comparison, {PAPER_NOTE}.", ""]
    goals = report["goals"]
    lines += [
        "Goals: " + "; ".join(f"{k.replace('_', ' ')}: {'met' if v else 'MISSED'}" for k, v in goals.items()) + ".",
        "",
        "**Read with care.** The Osprey arm's backbone is the target's own first two layers (the "
        "same-family case, like Qwen3-4B -> Qwen3-8B), so it starts from the target's weights: closer to "
        "self-drafting than the paper's setup. The cross-tokenizer arm (`--cross-tokenizer`; always in "
        "`make demo-full`) is the target-agnostic case.",
    ]
    return lines


def _matrix_lines(report: dict) -> list[str]:
    """One train domain x eval domain AL table per method (in-domain cells in bold)."""
    lines = []
    for name, m in report["matrix"].items():
        lines += [
            "",
            f"## {METHOD_LABELS.get(name, name)}: train domain x eval domain",
            "",
            "| drafter (trained on) | " + " | ".join(m["eval_domains"]) + " |",
            "|" + " --- |" * (len(m["eval_domains"]) + 1),
        ]
        for drafter, domain, row in zip(m["drafters"], m["train_domains"], m["acceptance_length"]):
            lines.append(
                f"| {drafter} ({domain}) | "
                + " | ".join(
                    f"**{_fmt(v)}**" if split == domain else _fmt(v) for split, v in zip(m["eval_domains"], row)
                )
                + " |"
            )
    return lines


def _coverage_lines(report: dict, cfg) -> list[str]:
    """The EAGLE-3 draft vocabulary's coverage of the target's eval output tokens (none without EAGLE-3 arms)."""
    cov = report["draft_vocab_coverage"]
    if not cov:
        return []
    splits = list(next(iter(cov.values()))["coverage"])
    lines = [
        "",
        "## EAGLE-3 draft vocabulary: share of the target's eval output tokens it can propose",
        "",
        f"Top {next(iter(cov.values()))['draft_vocab_size']:,} target tokens of each training domain "
        f"({100 * cfg.draft_vocab_fraction:.0f}% of 49,152, EAGLE-3's 32k/128k ratio); Osprey keeps the "
        "full vocabulary.",
        "",
        "| drafter | " + " | ".join(splits) + " |",
        "|" + " --- |" * (len(splits) + 1),
    ]
    for name, c in cov.items():
        lines.append(f"| {name} | " + " | ".join(_fmt(c["coverage"][s]) for s in splits) + " |")
    return lines


def _checks_lines(report: dict, check: dict | None, cfg) -> list[str]:
    """The live check against the replayed AL, Stage 3's vocabulary alignment, and the lossless check."""
    lines = []
    if check:
        lines += [
            "",
            f"Live check of the replayed AL: seed {cfg.seeds[0]}'s drafters decoded live on the first "
            f"{cfg.live_check_prompts} prompts of each eval domain ({check['requests']} requests): "
            f"{check['same_as_replay']} got the same tokens and accept lengths as replayed, "
            f"{check['lossless_mismatches']} differed from target-only greedy decoding.",
        ]
    if report["alignment"]:
        lines += ["", "## Vocabulary alignment (Stage 3)", ""]
        for name, a in report["alignment"].items():
            lines.append(f"- `{name}`: {a['counts']}" + (f" (policy {a['policy']})" if a.get("policy") else ""))
    if check:
        lossless = (
            f"Lossless check (live decoding, above): {check['lossless_mismatches']} of {check['requests']} "
            f"requests differed from target-only greedy decoding; the replayed AL commits that output by "
            f"construction."
        )
    else:
        lossless = (
            f"Lossless check: {report['lossless']['mismatches']} mismatching requests "
            f"({'checked' if report['lossless']['checked'] else 'not checked'} against target-only greedy "
            f"decoding)."
        )
    return lines + ["", lossless]


def render_markdown(report: dict, cfg) -> str:
    """report.md: the results table, the per-method matrices, speed, the checks, examples and timing."""
    check = report.get("live_check")
    lines = _results_lines(report, cfg) + _matrix_lines(report) + _coverage_lines(report, cfg)
    lines += _speed_lines(check["speed"] if check else report["speed"]) + _checks_lines(report, check, cfg)
    lines += render_vllm(report.get("vllm"))
    lines += render_arms(report.get("arms"))
    lines += ["", "## The target's own replies (greedy), first prompts of each eval domain", ""]
    for split, items in report["examples"].items():
        for item in items:
            reply = item["reply"].strip().replace("\n", " ")
            lines.append(f"- **{split}** — *{item['prompt'][:160]}* → {reply[:400]}")
    lines += [
        "",
        "![AL matrix](heatmap.png)",
        "",
        _time_line(report),
        "",
        "Reproduce: `make demo` (or `make demo-full` for two training domains, 3 seeds and the cross-tokenizer arm).",
    ]
    return "\n".join(lines) + "\n"
