"""Run under `torchrun --nproc_per_node=2`: Draft-OPD's on-policy distillation (`distill --mode on-policy`) at TP=2,
TP=2 + SP and DP=2 from the same SFT checkpoint and rollout store as the single-process run of the pytest side;
and its online form (the authors' loop) at DP=2 with the HF target (each rank rolls out its half of every round),
at TP=2 with the Megatron-Core target sharded over the tensor-parallel group, and on a mixture-of-experts target
at EP=2 with its experts over both ranks (one decoding replica: both roll out the round's prompts in step, each
trains on its half).

argv: WORK RESULT TARGET SFT DATA STORE MOE_TARGET MOE_SFT. Rank 0 writes each layout's per-iteration losses,
gradient norms and its final drafter weights' digest path to RESULT, and the online layouts' rounds (the drafter
each rolled out with, every sample) to WORK/LABEL/rounds.pt.
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


# The online form: DP=2 with the HF target, each round's 4 prompts split 2 per rank, each rank rolling out with its
# own copy; TP=2 with the Megatron-Core target over the tensor-parallel group; the MoE target at EP=2.
ONLINE_LAYOUTS = {
    "online_dp2": (ParallelConfig(), "hf"),
    "online_tp2_megatron": (ParallelConfig(tensor_model_parallel_size=2), "megatron"),
}
ONLINE_MOE_LAYOUTS = {"online_moe_ep2_megatron": (ParallelConfig(expert_model_parallel_size=2), "megatron")}
ONLINE_ITERS = 2


def online_config(target: str, sft: str, data: str, save: Path, parallel: ParallelConfig, backend: str = "hf"):
    """The online run of every layout: 2 rounds of 4 greedy rollouts of 12 new tokens, one update each, TTT 3,
    a checkpoint after each."""
    setup = {"target": target, "drafter": sft, "data": data}
    cfg = tiny_distill_config(
        setup,
        data__mode="on-policy",
        data__opd_max_new_tokens=12,
        data__opd_target_backend=backend,
        drafter__drafter_init=sft,
        ttt__ttt_steps=STEPS,
        training__train_iters=ONLINE_ITERS,
        checkpoint__save=str(save),
        checkpoint__save_interval=1,
    )
    cfg.parallel = parallel
    return cfg


class RecordingRollout:
    """The stage's OnlineRollout, recording each round: the reference drafter it rolled out with (collective
    over the tensor-parallel group) and this rank's samples by id."""

    def __init__(self, inner):
        self.inner, self.prompts, self.rounds = inner, inner.prompts, []

    def __call__(self, model, indices):
        from megatron.core.utils import unwrap_model

        from megatron_osprey.speculative.online_rollout import live_reference_drafter

        drafter = live_reference_drafter(unwrap_model(model[0]), self.inner.tp_group)
        samples = self.inner(model, indices)
        self.rounds.append(
            {
                "drafter": {k: v.clone() for k, v in drafter.state_dict().items()},
                "samples": {s["sample_id"]: {k: v for k, v in s.items() if k != "sample_id"} for s in samples},
            }
        )
        return samples


def run_online(cfg):
    """run_distill with the stage's online rollout, as `distill --mode on-policy` runs it; (result, recorder)."""
    from megatron_osprey.stages.distill import online_rollout

    with parallel_context(cfg.parallel) as state:
        recorder = RecordingRollout(online_rollout(cfg, state))
        return run_distill(cfg, state, recorder), recorder


def merged_rounds(rounds: list[dict]) -> list[dict] | None:
    """Collective: every rank's rounds, their samples merged by id (a tensor-parallel peer's are the same ones),
    on rank 0; None elsewhere."""
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, rounds)
    if torch.distributed.get_rank() != 0:
        return None
    merged = [{"drafter": r["drafter"], "samples": dict(r["samples"])} for r in gathered[0]]
    for part in gathered[1:]:
        for mine, theirs in zip(merged, part):
            mine["samples"].update(theirs["samples"])
    return merged


def checkpoint_reference_state(root, iteration: int | None) -> dict:
    """The reference drafter's weights in the distill checkpoint ROOT at `iteration` (None: the latest), loaded
    into one process (resharded from whatever layout saved it)."""
    from megatron_osprey.models.drafter.convert import reference_state
    from megatron_osprey.models.drafter.model import build_drafter_model
    from megatron_osprey.training.checkpointing import load_model_weights
    from megatron_osprey.training.distillation import distilled_arch

    with parallel_context(ParallelConfig()) as state:
        model = build_drafter_model(distilled_arch(str(root)), state.config, transformer_impl="local")
        load_model_weights(str(root), model, iteration)
        return reference_state(model)


def history(result) -> dict:
    return {key: [entry[key] for entry in result.history] for key in ("loss/train", "optim/grad_norm", "acc/0")}


def main(
    work: Path, result_path: Path, target: str, sft: str, data: str, store: str, moe_target: str, moe_sft: str
) -> None:
    results = {}
    for label, layout in LAYOUTS.items():
        cfg = on_policy_config(target, sft, data, store, work / label, layout)
        with parallel_context(cfg.parallel) as state:
            result = run_distill(cfg, state)
        if torch.distributed.get_rank() == 0:
            results[label] = history(result) | {"save": str(work / label)}
    online = [(label, *run, target, sft) for label, run in ONLINE_LAYOUTS.items()]
    online += [(label, *run, moe_target, moe_sft) for label, run in ONLINE_MOE_LAYOUTS.items()]
    for label, layout, backend, model, drafter in online:
        result, recorder = run_online(online_config(model, drafter, data, work / label, layout, backend))
        rounds = merged_rounds(recorder.rounds)
        if rounds is not None:
            torch.save(rounds, work / label / "rounds.pt")
            results[label] = history(result) | {"save": str(work / label), "rounds": str(work / label / "rounds.pt")}
    if torch.distributed.get_rank() == 0:
        result_path.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    run_script(main, timeout_s=300)
