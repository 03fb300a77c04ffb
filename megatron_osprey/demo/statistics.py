"""The demo's statistics: per-request acceptance lengths grouped by method, seed and (train, eval) cell, their
point estimates, and 95% bootstrap intervals (prompts paired across methods, seeds resampled per method)."""

from __future__ import annotations

import numpy as np

BOOTSTRAP_ROUNDS = 2000


def relative_gain(new, old):
    return None if new is None or old in (None, 0) else (new - old) / old


def collect(results: dict) -> dict:
    """{method: {seed: {(train_domain, split): [per-request AL]}}} from results.json's cells."""
    seeds = {d["name"]: d.get("seed", 0) for d in results.get("demo_drafters", [])}
    out: dict = {}
    for cell in results["cells"]:
        seed = seeds.get(cell["drafter"], 0)
        als = [r["acceptance_length"] for r in cell["requests"]]
        out.setdefault(cell["method"], {}).setdefault(seed, {})[(cell["train_domain"], cell["split"])] = als
    return out


def _aggregate(cells: dict) -> dict:
    """mean / id / ood AL of one method from {(train, split): mean AL} (cells averaged equally)."""
    values = list(cells.values())
    ids = [v for (train, split), v in cells.items() if train == split]
    oods = [v for (train, split), v in cells.items() if train != split]
    return {
        "mean": float(np.mean(values)) if values else None,
        "id": float(np.mean(ids)) if ids else None,
        "ood": float(np.mean(oods)) if oods else None,
    }


def summarize_cells(per_method: dict) -> dict:
    """Point estimates per method: each (seed, cell) mean AL, averaged over seeds, then over cells."""
    summary = {}
    for method, by_seed in per_method.items():
        keys = sorted({k for cells in by_seed.values() for k in cells})
        cells = {k: float(np.mean([np.mean(by_seed[s][k]) for s in by_seed if k in by_seed[s]])) for k in keys}
        summary[method] = _aggregate(cells)
    return summary


def bootstrap(per_method: dict, rounds: int = BOOTSTRAP_ROUNDS, seed: int = 0) -> dict:
    """95% intervals of mean/ID/OOD AL per method and of Osprey's gains, resampling seeds and prompts.

    Prompts are resampled with the same indices for every method (a paired comparison); seeds with
    replacement within each method.
    """
    rng = np.random.default_rng(seed)
    methods = sorted(per_method)
    draws = {m: {k: [] for k in ("mean", "id", "ood")} for m in methods}
    gains = {m: {k: [] for k in ("mean", "id", "ood")} for m in methods if m != "eagle3"}
    sizes = {}
    for by_seed in per_method.values():
        for cells in by_seed.values():
            for key, als in cells.items():
                sizes[key[1]] = len(als)
    for _ in range(rounds):
        picks = {split: rng.integers(0, n, n) for split, n in sizes.items()}
        stats = {}
        for m in methods:
            seeds = sorted(per_method[m])
            chosen = rng.choice(seeds, len(seeds))
            keys = sorted({k for s in seeds for k in per_method[m][s]})
            cells = {
                k: float(
                    np.mean(
                        [np.mean(np.asarray(per_method[m][s][k])[picks[k[1]]]) for s in chosen if k in per_method[m][s]]
                    )
                )
                for k in keys
            }
            stats[m] = _aggregate(cells)
            for k in ("mean", "id", "ood"):
                if stats[m][k] is not None:
                    draws[m][k].append(stats[m][k])
        if "eagle3" in stats:
            for m in gains:
                for k in ("mean", "id", "ood"):
                    g = relative_gain(stats[m][k], stats["eagle3"][k])
                    if g is not None:
                        gains[m][k].append(g)

    def interval(values):
        return [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))] if values else None

    return {
        "al": {m: {k: interval(v) for k, v in d.items()} for m, d in draws.items()},
        "gain_over_eagle3": {m: {k: interval(v) for k, v in d.items()} for m, d in gains.items()},
        "rounds": rounds,
    }
