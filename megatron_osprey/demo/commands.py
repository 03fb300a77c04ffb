"""The command lines of the demo's data, training and evaluation steps (`osprey data`, Stage 2 pretraining,
Stage 4 distillation, the acceptance-length evaluation)."""

from __future__ import annotations

import math
from pathlib import Path

from megatron_osprey.demo.sizes import DemoConfig


def user_data_argv(cfg: DemoConfig, files: dict[str, Path], target: Path, output: Path) -> list:
    """`osprey data` on the user's files: one held-out eval split of n_eval conversations per domain."""
    inputs = [word for domain, path in files.items() for word in ("--input", f"{domain}={path}")]
    return [
        "-m",
        "megatron_osprey",
        "data",
        *inputs,
        "--target",
        target,
        "--output",
        output,
        "--eval-size",
        str(cfg.n_eval),
        "--seed",
        str(cfg.seed),
        "--seq-length",
        str(cfg.seq_length),
        "--overwrite",
    ]


def _local_and_saved(save: Path, iters: int, log_every: int) -> list:
    """The flags every demo training shares: the local (non-TE) spec, one save at the end, its log interval (often
    enough that the step runner's throttled progress lines, with their ETA, come on the slowest CPU too)."""
    saving = ["--save", save, "--save-interval", str(iters), "--log-interval", str(log_every)]
    return ["--transformer-impl", "local", *saving]


def pretrain_argv(
    cfg: DemoConfig, source_flag: str, source: Path, data_prefix: Path, save: Path, iters: int, lr: float
) -> list:
    argv = [
        "-m",
        "megatron_osprey",
        "pretrain",
        source_flag,
        source,
        "--data-path",
        data_prefix,
        "--split",
        "100,0,0",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "8",
        "--seq-length",
        str(cfg.seq_length),
        "--train-iters",
        str(iters),
        "--lr",
        str(lr),
        "--min-lr",
        str(lr / 10),
        "--lr-warmup-iters",
        str(max(1, iters // 20)),
        "--lr-decay-style",
        "cosine",
        "--weight-decay",
        "0.01",
        "--clip-grad",
        "1.0",
        *_local_and_saved(save, iters, log_every=max(1, iters // 24)),
        "--eval-iters",
        "0",
        "--no-progress-bar",
        "--seed",
        str(cfg.seed),
    ]
    return argv + (["--bf16"] if cfg.bf16 else [])


def _count_rows(path: Path) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def distill_argv(
    cfg: DemoConfig,
    method: str,
    init: Path | None,
    target: Path,
    domain: str,
    data: Path,
    store: Path,
    save: Path,
    seed: int,
    draft_vocab: int,
    extra: tuple = (),
) -> list:
    """Stage 4 offline from `store`: the Osprey init `init`, or EAGLE-3 from scratch (`init` None); `extra`
    flags name what an extra arm changes."""
    samples = _count_rows(data)
    iters = max(1, math.ceil(cfg.distill_epochs * samples / cfg.distill_batch))
    flags = (
        ["--drafter-init", init]
        if init is not None
        else ["--baseline", "eagle3", "--draft-vocab-size", str(draft_vocab)]
    )
    argv = [
        "-m",
        "megatron_osprey",
        "distill",
        *flags,
        "--target",
        target,
        "--mode",
        "offline",
        "--hidden-states",
        store,
        "--data-path",
        data,
        "--domain",
        domain,
        "--train-iters",
        str(iters),
        "--micro-batch-size",
        str(cfg.distill_batch),
        "--global-batch-size",
        str(cfg.distill_batch),
        "--seq-length",
        str(cfg.seq_length),
        "--lr",
        str(cfg.distill_lr),
        "--min-lr",
        str(cfg.distill_lr / 10),
        *(["--ttt-steps", str(cfg.ttt_steps)] if cfg.ttt_steps is not None else []),
        *_local_and_saved(save, iters, log_every=max(1, iters // 12)),
        "--no-progress-bar",
        "--seed",
        str(seed),
        *extra,
    ]
    return argv + (["--bf16"] if cfg.bf16 else [])


def on_policy_argv(cfg: DemoConfig, sft: Path, target: Path, domain: str, store: Path, save: Path, seed: int) -> list:
    """Draft-OPD's training: `distill --mode on-policy` from the SFT checkpoint `sft` on the rollout `store`, two
    epochs of cfg.opd_prompts at a tenth of the SFT lr (its final one; chosen before any eval)."""
    iters = max(1, math.ceil(cfg.distill_epochs * cfg.opd_prompts / cfg.distill_batch))
    lr = cfg.distill_lr / 10
    argv = ["-m", "megatron_osprey", "distill", "--drafter-init", sft, "--target", target, "--mode", "on-policy"]
    argv += ["--hidden-states", store, "--domain", domain, "--train-iters", str(iters)]
    argv += ["--micro-batch-size", str(cfg.distill_batch), "--global-batch-size", str(cfg.distill_batch)]
    argv += ["--seq-length", str(cfg.seq_length), "--lr", str(lr), "--min-lr", str(lr / 10)]
    argv += [*_local_and_saved(save, iters, log_every=max(1, iters // 12)), "--no-progress-bar", "--seed", str(seed)]
    argv += ["--ttt-steps", str(cfg.ttt_steps)] if cfg.ttt_steps is not None else []
    return argv + (["--bf16"] if cfg.bf16 else [])


def eval_argv(
    cfg: DemoConfig,
    target: Path,
    eval_dir: Path,
    drafters: list[dict],
    data: dict,
    replay: bool = False,
    limit: int | None = None,
    splits: list[Path] | None = None,
    prompt_messages: str | None = None,
) -> list:
    """An eval step's command: every drafter on every eval domain (or on `splits`), greedy chains, decoded live
    and lossless-checked, or (`replay`) measured by replaying the target's greedy output."""
    argv = [
        "-m",
        "megatron_osprey",
        "evaluate",
        "--target",
        target,
        "--output",
        eval_dir,
        "--steps",
        "5",
        "--topk",
        "1",
        "--draft-tokens",
        "6",
        "--max-new-tokens",
        str(cfg.eval_tokens),
        "--replay" if replay else "--verify-lossless",
        "--no-progress",
        "--batch-size",
        str(cfg.eval_batch),
        "--overwrite",
    ]  # reruns only when its command changed
    if limit is not None:
        argv += ["--limit", str(limit)]
    for d in drafters:
        argv += ["--drafter", f"{d['name']}={d['path']}"]
    argv += ["--train-domain", *[d["domain"] for d in drafters]]
    argv += ["--method", *[f"{d['name']}={d['method']}" for d in drafters]]
    if prompt_messages is not None:
        argv += ["--prompt-messages", prompt_messages]
    for path in splits if splits is not None else [data["splits"][d]["eval"] for d in cfg.eval_domains]:
        argv += ["--data", path]
    return argv
