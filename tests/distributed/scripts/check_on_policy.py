"""Run under `torchrun --nproc_per_node=2`: Draft-OPD's on-policy distillation (`distill --mode on-policy`) at TP=2,
TP=2 + SP and DP=2 from the same SFT checkpoint and rollout store as the single-process run of the pytest side;
and its online form (the authors' loop: each rank rolls out its half of every round) at DP=2.

argv: WORK RESULT TARGET SFT DATA STORE. Rank 0 writes each layout's per-iteration losses, gradient norms and
its final drafter weights' digest path to RESULT.
"""

import json
from pathlib import Path

import torch

from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.testing.distill_setup import tiny_distill_config
from megatron_osprey.training.distillation import run_distill
from tests.distributed.scripts.ranks import run_script

ITERS, STEPS = 4, 3
LAYOUTS = {
    "tp2": ParallelConfig(tensor_model_parallel_size=2),
    "tp2_sp": ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
    "dp2": ParallelConfig(),
}


def on_policy_config(target: str, sft: str, data: str, store: str, save: Path, parallel: ParallelConfig):
    """The on-policy run of every layout: the tiny recipe's optimizer, 4 updates of 4 samples, TTT 3."""
    setup = {"target": target, "drafter": sft, "data": data}
    cfg = tiny_distill_config(
        setup,
        data__mode="on-policy",
        data__opd_form="offline",
        data__hidden_states=store,
        drafter__drafter_init=sft,
        ttt__ttt_steps=STEPS,
        training__train_iters=ITERS,
        checkpoint__save=str(save),
        checkpoint__save_interval=ITERS,
    )
    cfg.parallel = parallel
    return cfg


# The online form at DP=2: each round's 4 prompts split 2 per rank, each rank rolling out with its own HF target.
ONLINE_LAYOUTS = {"online_dp2": ParallelConfig()}
ONLINE_ITERS = 2


def online_config(target: str, sft: str, data: str, save: Path, parallel: ParallelConfig):
    """The online run of every layout: 2 rounds of 4 greedy rollouts of 12 new tokens, one update each, TTT 3."""
    setup = {"target": target, "drafter": sft, "data": data}
    cfg = tiny_distill_config(
        setup,
        data__mode="on-policy",
        data__opd_max_new_tokens=12,
        drafter__drafter_init=sft,
        ttt__ttt_steps=STEPS,
        training__train_iters=ONLINE_ITERS,
        checkpoint__save=str(save),
        checkpoint__save_interval=ONLINE_ITERS,
    )
    cfg.parallel = parallel
    return cfg


def run_online(cfg):
    """run_distill with the stage's online rollout, as `distill --mode on-policy` runs it."""
    from megatron_osprey.stages.distill import online_rollout

    with parallel_context(cfg.parallel) as state:
        return run_distill(cfg, state, online_rollout(cfg, state))


def history(result) -> dict:
    return {key: [entry[key] for entry in result.history] for key in ("loss/train", "optim/grad_norm", "acc/0")}


def main(work: Path, result_path: Path, target: str, sft: str, data: str, store: str) -> None:
    results = {}
    for label, layout in LAYOUTS.items():
        cfg = on_policy_config(target, sft, data, store, work / label, layout)
        with parallel_context(cfg.parallel) as state:
            result = run_distill(cfg, state)
        if torch.distributed.get_rank() == 0:
            results[label] = history(result) | {"save": str(work / label)}
    for label, layout in ONLINE_LAYOUTS.items():
        result = run_online(online_config(target, sft, data, work / label, layout))
        if torch.distributed.get_rank() == 0:
            results[label] = history(result)
    if torch.distributed.get_rank() == 0:
        result_path.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    run_script(main, timeout_s=300)
