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
    extra_iters: int = 0,
) -> list:
    """Stage 4 offline from `store`: the Osprey init `init`, or EAGLE-3 from scratch (`init` None); `extra`
    flags name what an extra arm changes; `extra_iters` more updates than the epochs give (an equal-compute
    control), on the same schedule stretched over them."""
    samples = _count_rows(data)
    iters = max(1, math.ceil(cfg.distill_epochs * samples / cfg.distill_batch)) + extra_iters
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


# Draft-OPD as its authors run it (bingyang-lei/Draft-OPD, verl/examples/on_policy_distillation_trainer/
# run_qwen_eagle3.sh): TTT length 7 (also each rollout chain's length), lr_warmup_steps_ratio 0.015 and a cosine, at
# the SFT's learning rate (their LR=1e-4 is Osprey's adaptation lr too).
OPD_TTT_STEPS, OPD_WARMUP_FRACTION = 7, 0.015


def opd_updates(cfg: DemoConfig) -> int:
    """Draft-OPD's updates: opd_epochs passes over opd_prompts, one update per round of distill_batch rollouts;
    also the number of extra updates its equal-compute SFT control (osprey_sft_more) takes."""
    return max(1, math.ceil(cfg.opd_epochs * cfg.opd_prompts / cfg.distill_batch))


def on_policy_argv(cfg: DemoConfig, sft: Path, target: Path, domain: str, prompts: Path, save: Path, seed: int) -> list:
    """Draft-OPD's online loop: `distill --mode on-policy` from the SFT checkpoint `sft`, each round rolling out
    distill_batch of the first cfg.opd_prompts of `prompts` (greedy, with the drafter as the last update left it)
    and taking one update on them, for opd_updates(cfg) updates."""
    iters, lr = opd_updates(cfg), cfg.distill_lr
    argv = ["-m", "megatron_osprey", "distill", "--drafter-init", sft, "--target", target, "--mode", "on-policy"]
    argv += ["--data-path", prompts, "--opd-limit", str(cfg.opd_prompts), "--opd-max-new-tokens"]
    argv += [str(cfg.regenerate_tokens), "--domain", domain, "--train-iters", str(iters)]
    argv += ["--micro-batch-size", str(cfg.distill_batch), "--global-batch-size", str(cfg.distill_batch)]
    argv += ["--seq-length", str(cfg.seq_length), "--lr", str(lr), "--min-lr", str(lr / 10)]
    argv += ["--lr-warmup-fraction", str(OPD_WARMUP_FRACTION), "--ttt-steps", str(OPD_TTT_STEPS)]
    argv += [*_local_and_saved(save, iters, log_every=max(1, iters // 12)), "--no-progress-bar", "--seed", str(seed)]
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
