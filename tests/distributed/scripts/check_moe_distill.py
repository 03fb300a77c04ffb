"""Run under `torchrun --nproc_per_node=2`: distillation of the dense drafter on a mixture-of-experts target in a
job laid out with expert parallelism (EP=2, as the MiniMax recipes set it for the whole job) and at EP=1 (DP=2).

argv: WORK RESULT MODE TARGET DRAFTER DATA [STORE]. MODE "online": the online MoE target, the drafter adapted to
it; "on-policy": Draft-OPD's step on a rollout STORE from the SFT-distilled DRAFTER. Rank 0 writes each layout's
per-iteration losses and gradient norms to RESULT.
"""

import json
from pathlib import Path

import torch

from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.testing.distill_setup import tiny_distill_config
from megatron_osprey.training.distillation import run_distill
from tests.distributed.scripts.ranks import run_script

ITERS, STEPS = 2, 3
LAYOUTS = {
    "ep2": ParallelConfig(expert_model_parallel_size=2),
    "dp2": ParallelConfig(),
}


def moe_distill_config(mode: str, target: str, drafter: str, data: str, save: Path, parallel, store: str | None):
    """Two updates of 4 samples, TTT 3, the tiny recipe's optimizer; saved at the end (the OPD step starts there)."""
    setup = {"target": target, "drafter": drafter, "data": data}
    changes = dict(
        ttt__ttt_steps=STEPS,
        training__train_iters=ITERS,
        checkpoint__save=str(save),
        checkpoint__save_interval=ITERS,
    )
    if mode == "on-policy":
        changes |= dict(data__mode="on-policy", data__opd_form="offline", data__hidden_states=store)
    cfg = tiny_distill_config(setup, **changes)
    cfg.parallel = parallel
    return cfg


def main(work: Path, result_path: Path, mode: str, target: str, drafter: str, data: str, *store: str) -> None:
    results = {}
    for label, layout in LAYOUTS.items():
        cfg = moe_distill_config(mode, target, drafter, data, work / label, layout, store[0] if store else None)
        with parallel_context(cfg.parallel) as state:
            result = run_distill(cfg, state)
        if torch.distributed.get_rank() == 0:
            results[label] = {
                key: [entry[key] for entry in result.history] for key in ("loss/train", "optim/grad_norm", "acc/0")
            }
            results[label]["save"] = str(work / label)
    if torch.distributed.get_rank() == 0:
        result_path.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    run_script(main, timeout_s=300)
