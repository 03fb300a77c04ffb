"""Evaluate: acceptance length of drafters x eval splits against a HF target.

    python -m megatron_osprey.eval --target TARGET --drafter [NAME=]PATH [--drafter ...] \
        --data SPLIT.jsonl [--data ...] --output DIR [--steps 5 --topk 1 --draft-tokens 6 [8 ...] \
        --temperature 0 [1 ...] --max-new-tokens 4096 --prompt-messages first_user --limit N --verify-lossless] \
        [--names A B ...] [--train-domain [NAME=]DOMAIN ...] [--method [NAME=]METHOD ...]
    (python -m megatron_osprey.stages.evaluate takes the same flags)

Each split is named by its file stem; each drafter by NAME=, --names, or its directory. A drafter's
training domain comes from --train-domain or its run_config.yaml (train_domain); its method
(matrix group) from --method or its variant (osprey / eagle3). Writes DIR/results.json,
DIR/matrix.md and DIR/matrix.png (an existing results.json needs --overwrite). Exit status: 0 ok, 1 --verify-lossless
found a mismatch, 2 bad input.

Defaults are the paper's benchmark protocol: the first user message of each conversation, up to 4096 new
tokens, steps 5 / topk 1 / 6 draft tokens, greedy. `--temperature` and `--draft-tokens` take lists and
every combination is one sweep row in results.json and matrix.md (with topk 1, d draft tokens means
d - 1 steps); sampling rows use lossless rejection sampling and report their --seed.

Trust: a Megatron drafter checkpoint is torch distributed-checkpoint data, which torch unpickles; its
.metadata is checked against an allow-list first, but evaluate only checkpoints you trust. Exported
drafters (safetensors + JSON, tools/export_checkpoint.py) hold no code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_osprey.eval.run import DTYPES, DrafterSpec, EvalConfig
from megatron_osprey.stages.cli import exit_code


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_osprey.eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", required=True, type=Path, help="HF model directory of the target")
    parser.add_argument("--drafter", required=True, action="append", help="[NAME=]PATH, repeatable")
    parser.add_argument("--data", required=True, action="append", type=Path, help="conversations JSONL, repeatable")
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--names", nargs="+", default=None, help="drafter names, in --drafter order")
    parser.add_argument(
        "--train-domain", action="extend", nargs="+", default=[], help="[NAME=]DOMAIN, in --drafter order"
    )
    parser.add_argument("--method", action="extend", nargs="+", default=[], help="[NAME=]METHOD, in --drafter order")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--topk", type=int, default=1)
    parser.add_argument(
        "--draft-tokens",
        type=int,
        nargs="+",
        default=None,
        help="one or more; default steps + 1 (6 at steps 5); with topk 1 each sets steps = value - 1",
    )
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0], help="one or more (a sweep)")
    parser.add_argument("--max-new-tokens", type=int, default=4096, help="the paper's benchmark: 4096")
    parser.add_argument(
        "--prompt-messages",
        choices=("first_user", "before_assistant"),
        default="first_user",
        help="the first user message (the paper's benchmark) or every message before the first assistant turn",
    )
    parser.add_argument("--limit", type=int, default=None, help="only the first N prompts of each split")
    parser.add_argument("--verify-lossless", action="store_true", help="also decode with the target alone and compare")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--enable-thinking", choices=("true", "false"), default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--target-backend",
        choices=("hf", "megatron"),
        default="hf",
        help="run the target as a HF model (default) or as a Megatron-Core model (exact recompute per verify)",
    )
    parser.add_argument(
        "--truncate-prompts",
        action="store_true",
        help="keep the last tokens of a prompt too long for the target's max_position_embeddings (default: refuse it)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="requests decoded together (default 1: the reference engine, one request at a time); "
        "above 1, greedy chains (--topk 1, --temperature 0) on the HF target share each forward",
    )
    parser.add_argument(
        "--replay",
        action="store_true",
        help="measure AL by replaying the target's greedy output: each round accepts the drafter's "
        "chain as far as it equals the target-only output, so the target runs one forward per "
        "prompt for every drafter (greedy chains; the same AL as live decoding up to "
        "floating-point order; no decoding speed)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUTPUT/results.json")
    return parser.parse_args(argv)


def _keyed(values: list[str], names: list[str], flag: str) -> dict[str, str]:
    """NAME=VALUE items by name, bare items by position."""
    out, bare = {}, []
    for value in values:
        key, sep, rest = value.partition("=")
        if sep and key in names:
            out[key] = rest
        elif sep:
            raise ValueError(f"{flag} {value}: {key!r} is not a drafter name (names: {names}).")
        else:
            bare.append(value)
    if bare and len(bare) != len(names):
        raise ValueError(f"{flag} given {len(bare)} bare values for {len(names)} drafters; use NAME=VALUE.")
    out.update({n: v for n, v in zip(names, bare) if n not in out})
    return out


def _default_name(path: Path) -> str:
    # OUT/hf, OUT/megatron: the run directory names the drafter.
    return path.parent.name if path.name in ("hf", "megatron") else path.name


def build_config(args: argparse.Namespace) -> EvalConfig:
    """EvalConfig from parsed flags (one clear error per bad flag)."""
    paths, names = [], []
    for item in args.drafter:
        name, sep, path = item.partition("=")
        paths.append(Path(path if sep else item))
        names.append(name if sep else None)
    if args.names is not None:
        if len(args.names) != len(paths):
            raise ValueError(f"--names has {len(args.names)} names for {len(paths)} --drafter entries.")
        names = list(args.names)
    names = [n or _default_name(p) for n, p in zip(names, paths)]
    domains = _keyed(args.train_domain, names, "--train-domain")
    methods = _keyed(args.method, names, "--method")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}.")
    return EvalConfig(
        target=args.target,
        data=list(args.data),
        output=args.output,
        drafters=[DrafterSpec(n, p, domains.get(n), methods.get(n)) for n, p in zip(names, paths)],
        steps=args.steps,
        topk=args.topk,
        draft_tokens=args.draft_tokens[0] if args.draft_tokens and len(args.draft_tokens) == 1 else args.draft_tokens,
        temperature=args.temperature[0] if len(args.temperature) == 1 else args.temperature,
        max_new_tokens=args.max_new_tokens,
        prompt_messages=args.prompt_messages,
        limit=args.limit,
        verify_lossless=args.verify_lossless,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        progress=not args.no_progress,
        target_backend=args.target_backend,
        truncate_prompts=args.truncate_prompts,
        overwrite=args.overwrite,
        batch_size=args.batch_size,
        replay=args.replay,
        enable_thinking=None if args.enable_thinking is None else args.enable_thinking == "true",
    )


def run(config: EvalConfig) -> dict:
    """Decode every prompt of every split with every drafter; write and return results.json's content."""
    from megatron_osprey.eval.run import run_eval

    return run_eval(config)


def main(argv=None) -> int:
    """Parse the flags, evaluate, print each matrix's means; 0 ok, 1 a lossless mismatch, 2 bad input."""
    args = parse_args(argv)

    def evaluate_and_report() -> int:
        results = run(build_config(args))
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        for row in results["sweep"]:
            setting = f"T={row['temperature']:g} draft tokens {row['draft_tokens']}" + (
                f" seed {row['seed']}" if row["temperature"] else ""
            )
            for name, m in row["matrices"].items():
                print(f"{setting} {name}: mean AL {fmt(m['mean'])}, ID {fmt(m['id_mean'])}, OOD {fmt(m['ood_mean'])}")
        mismatches = results["lossless"]["mismatches"]
        if mismatches:
            for m in mismatches[:10]:
                print(
                    f"LOSSLESS MISMATCH: drafter {m['drafter']} split {m['split']} request {m['id']} "
                    f"differs from target-only greedy at token {m['index']}",
                    file=sys.stderr,
                )
            print(f"error: {len(mismatches)} request(s) differ from target-only greedy decoding.", file=sys.stderr)
            return 1
        if args.verify_lossless:
            print("lossless: every request matched target-only greedy decoding token for token")
        print(f"wrote {args.output}/results.json, matrix.md, matrix.png")
        return 0

    return exit_code(evaluate_and_report)


if __name__ == "__main__":
    sys.exit(main())
