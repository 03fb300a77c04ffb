"""The speedup of an SGLang evaluation: the drafter's tokens/s over the target alone's, per batch size.

slurm/eval_sglang.sbatch measures each batch size B twice with tools/sglang_bench.py, writing
OUTPUT/batchB/drafter/results.json and OUTPUT/batchB/target_only/results.json. This reads both and writes
OUTPUT/speedup.json and OUTPUT/speedup.md: per batch size and per eval split (and all splits together),
acceptance length, tokens/s with the drafter, tokens/s of the target alone, and speedup = their ratio.

    python -m megatron_osprey.eval.speedup OUTPUT --batch-sizes 1 16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_osprey.base.atomic_io import write_json_atomic, write_text_atomic

ARMS = ("drafter", "target_only")
ALL_SPLITS = "all"


def _read(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: the {path.parent.name} pass of that batch size did not finish."
        )
    try:
        results = json.loads(path.read_text())
        return {cell["split"]: cell for cell in results["cells"]}
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a tools/sglang_bench.py results.json ({error}).") from None


def _figures(cells: list[dict]) -> tuple[float, float, float]:
    """(mean acceptance length over all requests, completion tokens, wall seconds) of some splits' cells."""
    requests = [request for cell in cells for request in cell["requests"]]
    if not requests:
        raise ValueError("an evaluation pass recorded no requests.")
    al = sum(r["completion_tokens"] / max(r["verify_count"], 1) for r in requests) / len(requests)
    tokens = sum(cell["summary"]["completion_tokens"] for cell in cells)
    return al, tokens, sum(cell["summary"]["wall_seconds"] for cell in cells)


def speedup_rows(output: str | Path, batch_sizes: list[int]) -> list[dict]:
    """One row per batch size and split (then `all`): AL, tokens/s with the drafter and alone, and their ratio."""
    rows = []
    for batch in batch_sizes:
        drafter, alone = (_read(Path(output) / f"batch{batch}" / arm / "results.json") for arm in ARMS)
        if set(drafter) != set(alone):
            raise ValueError(
                f"{output}/batch{batch}: the drafter pass evaluated splits {sorted(drafter)}, "
                f"the target-only pass {sorted(alone)}; rerun both on the same --data."
            )
        groups = [(split, [split]) for split in drafter]
        if len(drafter) > 1:
            groups.append((ALL_SPLITS, list(drafter)))
        for split, names in groups:
            al, tokens, seconds = _figures([drafter[n] for n in names])
            _, base_tokens, base_seconds = _figures([alone[n] for n in names])
            with_drafter, target_only = tokens / seconds, base_tokens / base_seconds
            rows.append(
                {
                    "batch_size": batch,
                    "split": split,
                    "acceptance_length": al,
                    "tokens_per_s_drafter": with_drafter,
                    "tokens_per_s_target_only": target_only,
                    "speedup": with_drafter / target_only,
                }
            )
    return rows


def speedup_markdown(rows: list[dict]) -> str:
    lines = [
        "| batch | split | AL | tok/s drafter | tok/s target-only | speedup |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch_size']} | {r['split']} | {r['acceptance_length']:.3f} | {r['tokens_per_s_drafter']:.1f} "
            f"| {r['tokens_per_s_target_only']:.1f} | {r['speedup']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def write_speedup(output: str | Path, batch_sizes: list[int]) -> list[dict]:
    """speedup.json and speedup.md under `output`; returns the rows."""
    rows = speedup_rows(output, batch_sizes)
    write_json_atomic(Path(output) / "speedup.json", {"rows": rows})
    write_text_atomic(Path(output) / "speedup.md", speedup_markdown(rows))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path, help="the evaluation's OUTPUT (holds batchB/{drafter,target_only})")
    parser.add_argument("--batch-sizes", type=int, nargs="+", required=True)
    args = parser.parse_args(argv)
    try:
        rows = write_speedup(args.output, args.batch_sizes)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(speedup_markdown(rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
