"""Run under `torchrun --nproc_per_node=2`: the Draft-OPD rollout on the Megatron target at TP=2 and at DP=2 (two
writers) against the single-process HF rollout (REFERENCE, written by the pytest process with the same settings);
then a mixture-of-experts target (MOE_TARGET, its drafter MOE_DRAFTER) at TP=2 + SP (experts tensor-parallel), TP=2
+ SP + EP=2, and EP=2 across the two data-parallel ranks (one replica), against its HF rollout MOE_REFERENCE;
a sampled rollout (temperature 1, seed 7) at DP=2 against the single-process one, SAMPLED_REFERENCE; and the HF
target under torchrun (one replica per rank) against REFERENCE.

argv: WORK RESULT TARGET DRAFTER DATA REFERENCE MOE_TARGET MOE_DRAFTER MOE_REFERENCE SAMPLED_REFERENCE. Rank 0
writes a JSON of measured figures to RESULT.
"""

import json
from pathlib import Path

import torch

from megatron_osprey.data.hidden_state_store import HiddenStateStore
from megatron_osprey.parallel import ParallelConfig
from megatron_osprey.stages.rollout import RolloutConfig, run
from tests.distributed.scripts.ranks import merged_on_rank0, run_script
from tests.store_quanta import error_in_quanta

STEPS, TOP_K, LIMIT = 3, 16, 6
LAYOUTS = {"tp2": ParallelConfig(tensor_model_parallel_size=2), "dp2": ParallelConfig()}
SAMPLING = {"temperature": 1.0, "seed": 7}
MOE_LAYOUTS = {
    "moe_tp2_sp": ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
    "moe_tp2_sp_ep2": ParallelConfig(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
    ),
    "moe_ep2": ParallelConfig(expert_model_parallel_size=2),
}


def compare(reference: HiddenStateStore, store: HiddenStateStore, label: str) -> dict:
    """Equal tokens and rounds (ids, drafts, accepted counts, top-k ids); the largest float differences."""
    figures = {f"{label}_samples": len(store), f"{label}_writers": len(store.manifest["writers"])}
    exact, rounds, probs, states = True, 0, 0.0, 0.0
    by_id = {store[i]["sample_id"]: store[i] for i in range(len(store))}
    for i in range(len(reference)):
        want = reference[i]
        got = by_id[want["sample_id"]]
        a, b = want["rollout"], got["rollout"]
        exact &= torch.equal(want["input_ids"], got["input_ids"]) and len(a) == len(b)
        if not exact:
            break
        for name in ("root_rows", "accepted", "draft_tokens", "topk_ids"):
            exact &= torch.equal(getattr(a, name), getattr(b, name))
        probs = max(probs, float((a.topk_probs - b.topk_probs).abs().max()))
        groups = len(reference.header.aux_layer_ids)
        for name, k in (("aux_hidden", groups), ("final_hidden", 1)):  # both stores round to bf16
            states = max(states, error_in_quanta(got[name], want[name], reference.header.encoding, k))
        rounds += len(a)
    figures |= {f"{label}_exact": bool(exact), f"{label}_rounds": rounds}
    figures |= {f"{label}_probs_max_abs": probs, f"{label}_states_quanta": states}
    return figures


def rollout_config(target: str, drafter: str, data: str, output: Path, **changes) -> RolloutConfig:
    """The settings of both the HF reference and the Megatron rollouts."""
    return RolloutConfig(
        target=target,
        drafter=drafter,
        data_path=data,
        output=str(output),
        steps=STEPS,
        top_k=TOP_K,
        max_new_tokens=20,
        limit=LIMIT,
        samples_per_shard=2,
        **changes,
    )


def main(work: Path, result_path: Path, target: str, drafter: str, data: str, reference: str, *more: str) -> None:
    rank, results = torch.distributed.get_rank(), {}
    moe_target, moe_drafter, moe_reference, sampled_reference = more
    runs = [(label, layout, target, drafter, {}) for label, layout in LAYOUTS.items()]
    runs += [(label, layout, moe_target, moe_drafter, {}) for label, layout in MOE_LAYOUTS.items()]
    runs += [("dp2_sampled", ParallelConfig(), target, drafter, SAMPLING)]
    runs += [("hf_dp2", ParallelConfig(), target, drafter, {"target_backend": "hf"})]
    for label, layout, model, draft, changes in runs:
        changes = {"target_backend": "megatron", **changes}
        config = rollout_config(model, draft, data, work / label, parallel=layout, **changes)
        results[f"{label}_rank{rank}_prompts"] = len(run(config).results)
    merged = merged_on_rank0(results)
    if merged is not None:
        reference = HiddenStateStore(reference, dtype=torch.float32)
        merged["hf_samples"] = len(reference)
        merged["hf_rounds"] = sum(len(reference[i]["rollout"]) for i in range(len(reference)))
        merged["hf_rejected_after_accepting"] = sum(
            int(((s["rollout"].accepted > 0) & (s["rollout"].accepted < STEPS)).sum()) for s in reference
        )
        for label in LAYOUTS:
            merged |= compare(reference, HiddenStateStore(work / label, dtype=torch.float32), label)
        moe_reference = HiddenStateStore(moe_reference, dtype=torch.float32)
        merged["moe_hf_rounds"] = sum(len(moe_reference[i]["rollout"]) for i in range(len(moe_reference)))
        merged["moe_hf_accepted"] = sum(int(s["rollout"].accepted.sum()) for s in moe_reference)
        # odd lengths under sequence parallelism at TP=2: the prefills that need padding rows
        merged["moe_odd_prompts"] = sum(int((~s["loss_mask"]).sum()) % 2 for s in moe_reference)
        for label in MOE_LAYOUTS:
            merged |= compare(moe_reference, HiddenStateStore(work / label, dtype=torch.float32), label)
        sampled_reference = HiddenStateStore(sampled_reference, dtype=torch.float32)
        merged["sampled_hf_rounds"] = sum(len(sampled_reference[i]["rollout"]) for i in range(len(sampled_reference)))
        merged["sampled_differs_from_greedy"] = any(
            not torch.equal(sampled_reference[i]["input_ids"], reference[i]["input_ids"]) for i in range(len(reference))
        )
        merged |= compare(sampled_reference, HiddenStateStore(work / "dp2_sampled", dtype=torch.float32), "dp2_sampled")
        merged |= compare(reference, HiddenStateStore(work / "hf_dp2", dtype=torch.float32), "hf_dp2")
        result_path.write_text(json.dumps(merged, indent=2))


if __name__ == "__main__":
    run_script(main, timeout_s=300)
