"""Aggregate per-request results into AL summaries, the train x eval matrix, and its table and heatmap."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_osprey.base.atomic_io import atomic_path
from megatron_osprey.eval.prompts import conversation_of


@dataclass(frozen=True)
class Cell:
    """One drafter on one eval split."""

    drafter: str
    method: str
    train_domain: str | None
    split: str
    summary: dict


def summarize(requests: list[dict]) -> dict:
    """Mean AL (the paper's figure), pooled AL, and tokens/s, from request dicts.

    The mean is over conversations, each one's AL pooled over its turns (its tokens over its verifies), as the
    Osprey release's benchmarker computes it (benchmarks/benchmarker/utils.py, compute_metrics: MT-Bench's two
    answers are one request there); a single-turn set has one request per conversation, so the mean is per
    request. `turn_mean_acceptance_length` keeps the mean over every turn as its own request.
    """
    if not requests:
        raise ValueError("cannot summarize an eval split with no requests.")
    tokens = sum(r["completion_tokens"] for r in requests)
    verifies = sum(r["verify_count"] for r in requests)
    seconds = sum(r["seconds"] for r in requests)
    per_request = [r["completion_tokens"] / max(r["verify_count"], 1) for r in requests]
    conversations: dict = {}
    for index, r in enumerate(requests):
        key = conversation_of(r["id"]) if "id" in r else index
        pooled = conversations.setdefault(key, [0, 0])
        pooled[0] += r["completion_tokens"]
        pooled[1] += r["verify_count"]
    per_conversation = [t / max(v, 1) for t, v in conversations.values()]
    timed = [r for r in requests if r.get("drafted_tokens")]
    drafted = sum(r["drafted_tokens"] for r in timed)
    return {
        "requests": len(requests),
        "conversations": len(conversations),
        "mean_acceptance_length": sum(per_conversation) / len(per_conversation),
        "turn_mean_acceptance_length": sum(per_request) / len(per_request),
        "pooled_acceptance_length": tokens / max(verifies, 1),
        "completion_tokens": tokens,
        "verify_count": verifies,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        # Drafting cost: drafter wall time over the tokens it proposed, pooled (None when not measured).
        "drafted_tokens": drafted,
        "draft_seconds_per_token": sum(r["draft_seconds"] for r in timed) / drafted if drafted else None,
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def build_matrices(cells: list[Cell], splits: list[str]) -> dict:
    """Per method: rows = drafters (in order), cols = splits; ID = train domain == split, OOD = the rest."""
    out: dict = {}
    for cell in cells:
        method = out.setdefault(cell.method, {"drafters": [], "train_domains": [], "splits": list(splits)})
        if cell.drafter not in method["drafters"]:
            method["drafters"].append(cell.drafter)
            method["train_domains"].append(cell.train_domain)
    lookup = {(c.drafter, c.split): c for c in cells}
    for method in out.values():
        al, pooled, speed, ident, other, drafting = [], [], [], [], [], []
        for drafter, domain in zip(method["drafters"], method["train_domains"]):
            row_al, row_pooled, row_speed = [], [], []
            for split in splits:
                cell = lookup.get((drafter, split))
                value = None if cell is None else cell.summary["mean_acceptance_length"]
                row_al.append(value)
                row_pooled.append(None if cell is None else cell.summary["pooled_acceptance_length"])
                row_speed.append(None if cell is None else cell.summary["tokens_per_s"])
                if cell is not None and cell.summary.get("draft_seconds_per_token") is not None:
                    drafting.append(cell.summary["draft_seconds_per_token"])
                if value is not None and domain is not None:
                    (ident if domain == split else other).append(value)
            al.append(row_al)
            pooled.append(row_pooled)
            speed.append(row_speed)
        values = [v for row in al for v in row if v is not None]
        method.update(
            acceptance_length=al,
            pooled_acceptance_length=pooled,
            tokens_per_s=speed,
            mean=_mean(values),
            id_mean=_mean(ident),
            ood_mean=_mean(other),
            id_cells=len(ident),
            ood_cells=len(other),
            draft_seconds_per_token=_mean(drafting),  # the mean over cells of each cell's pooled figure
        )
    return out


def _fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _row_label(drafter: str, domain: str | None) -> str:
    return drafter if domain in (None, drafter) else f"{domain} ({drafter})"


def matrix_markdown(matrices: dict, header: str = "") -> str:
    """matrix.md: one train x eval table per method (diagonal in bold) and a mean / ID / OOD summary."""
    lines = ["# Acceptance length: train domain x eval domain", ""]
    if header:
        lines += [header, ""]
    lines += [
        "AL = per-request mean of completion_tokens / verify_count (SGLang's definition); ID = diagonal "
        "(drafter trained on the eval domain), OOD = off-diagonal, mean = all cells. Drafting: the drafter's wall "
        "time (prefill, commits, drafting) per proposed token, averaged over cells.",
        "",
        "| method | mean AL | ID AL | OOD AL | cells (ID/OOD) | drafting us/token |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, m in matrices.items():
        per_token = m.get("draft_seconds_per_token")
        drafting = "-" if per_token is None else f"{per_token * 1e6:.1f}"
        lines.append(
            f"| {name} | {_fmt(m['mean'])} | {_fmt(m['id_mean'])} | {_fmt(m['ood_mean'])} | "
            f"{m['id_cells']}/{m['ood_cells']} | {drafting} |"
        )
    for name, m in matrices.items():
        lines += [
            "",
            f"## {name}",
            "",
            "| train \\ eval | " + " | ".join(m["splits"]) + " |",
            "| --- |" + " ---: |" * len(m["splits"]),
        ]
        for drafter, domain, row, pooled in zip(
            m["drafters"], m["train_domains"], m["acceptance_length"], m["pooled_acceptance_length"]
        ):
            cells = []
            for split, value, pool in zip(m["splits"], row, pooled):
                text = f"{_fmt(value)} ({_fmt(pool)})"
                cells.append(f"**{text}**" if domain == split and value is not None else text)
            lines.append(f"| {_row_label(drafter, domain)} | " + " | ".join(cells) + " |")
        lines += ["", "Cells: mean AL (pooled AL)."]
    return "\n".join(lines) + "\n"


def plot_matrices(matrices: dict, path: str | Path) -> None:
    """Heatmap per method (rows train domain, cols eval domain, annotated AL), written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    path = Path(path)
    names = list(matrices)
    grids = [
        np.array([[np.nan if v is None else v for v in row] for row in matrices[n]["acceptance_length"]], dtype=float)
        for n in names
    ]
    finite = np.concatenate([g[np.isfinite(g)] for g in grids]) if grids else np.array([])
    vmin, vmax = (float(finite.min()), float(finite.max())) if finite.size else (1.0, 2.0)
    fig, axes = plt.subplots(
        1,
        len(names),
        figsize=(
            1.2 + 1.1 * max(len(matrices[n]["splits"]) for n in names) * len(names) + 1.5,
            1.0 + 0.9 * max(len(g) for g in grids),
        ),
        squeeze=False,
    )
    for ax, name, grid in zip(axes[0], names, grids):
        m = matrices[name]
        image = ax.imshow(grid, cmap="viridis", vmin=vmin, vmax=vmax if vmax > vmin else vmin + 1e-6)
        ax.set_xticks(range(len(m["splits"])), m["splits"], rotation=30, ha="right")
        ax.set_yticks(range(len(m["drafters"])), [_row_label(d, t) for d, t in zip(m["drafters"], m["train_domains"])])
        ax.set_xlabel("eval domain")
        ax.set_ylabel("train domain")
        ax.set_title(
            f"{name}: mean {_fmt(m['mean'], 2)}, ID {_fmt(m['id_mean'], 2)}, OOD {_fmt(m['ood_mean'], 2)}", fontsize=9
        )
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                if np.isfinite(grid[i, j]):
                    bold = m["train_domains"][i] == m["splits"][j]
                    light = (grid[i, j] - vmin) / max(vmax - vmin, 1e-6) > 0.6  # dark text on the bright end
                    ax.text(
                        j,
                        i,
                        f"{grid[i, j]:.2f}",
                        ha="center",
                        va="center",
                        color="black" if light else "white",
                        fontweight="bold" if bold else "normal",
                        fontsize=8,
                    )
    fig.subplots_adjust(wspace=0.55)  # room for the next panel's row labels
    fig.colorbar(image, ax=list(axes[0]), shrink=0.8, label="acceptance length")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=150, bbox_inches="tight")
    plt.close(fig)
