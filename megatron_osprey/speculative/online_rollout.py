"""The rollout of Draft-OPD's online loop (training/opd_online.py): the live Megatron drafter, copied into the
reference drafter, drafts greedy chains against the target, whose verified output becomes the round's training
samples (the prompt plus the target's continuation, its aux and final hidden states).

The target is a decoding adapter (models/target/decoding.py's TargetModel): the HF model whole on this rank, or the
Megatron-Core target sharded over the job's tensor- and expert-parallel groups (megatron_decoding.py, the rollout
stage's engine). Sharded, the ranks of one decoding replica (parallel/replicas.py) run every forward together:
where an expert-parallel group links data-parallel ranks, they roll out the union of their prompts in step and
each keeps its own."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from megatron_osprey.models.drafter.convert import reference_state
from megatron_osprey.models.drafter.reference import ReferenceDrafter
from megatron_osprey.speculative.config import SpecConfig, acceptance_summary
from megatron_osprey.speculative.draft_session import ReferenceDraftSession
from megatron_osprey.speculative.rollout import rollout


@torch.no_grad()
def live_reference_drafter(model, tp_group=None) -> ReferenceDrafter:
    """The reference drafter with the weights `model` (an unwrapped Megatron drafter) holds now; collective
    over its tensor-parallel group."""
    state = reference_state(model, tp_group)
    drafter = ReferenceDrafter(model.arch.reference_config())
    drafter.to(state["embed_tokens.weight"].dtype)
    drafter.load_state_dict(state, strict=True)
    return drafter.eval()


def replica_indices(indices: list[int], replica) -> list[int]:
    """Collective over the world: the prompts this rank's decoding replica rolls out, every member's `indices`
    in rank order, each once (a tensor-parallel group's ranks hold the same ones)."""
    if replica is None or len(replica.ranks) == 1:
        return list(indices)
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, list(indices))
    return list(dict.fromkeys(i for rank in replica.ranks for i in gathered[rank]))


@dataclasses.dataclass
class OnlineRollout:
    """roll_out(model, indices) for online_micro_batches: prompts[i] for i in indices, rolled out by `target`
    (a TargetModel over the drafter's aux layers) and the drafter as `model` holds it now; `states(ids)` is the
    target's fresh forward, (aux [T, 3Ht], final pre-norm hidden [T, Ht]). The acceptance summary of each round is
    kept."""

    target: object  # a TargetModel: HFTargetModel or MegatronTargetModel
    states: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    prompts: list  # each with .id and .input_ids [T]
    spec: SpecConfig  # greedy chains: the authors roll out at temperature 0
    device: torch.device | str = "cpu"
    dtype: torch.dtype = torch.float32
    tp_group: object = None
    replica: object = None  # parallel/replicas.py's Replica for the Megatron-Core target; None: this rank alone
    summaries: list = dataclasses.field(default_factory=list)

    @torch.no_grad()
    def __call__(self, model: list, indices: list[int]) -> list[dict]:
        from megatron.core.utils import unwrap_model

        drafter = live_reference_drafter(unwrap_model(model[0]), self.tp_group).to(self.device, self.dtype)
        session = ReferenceDraftSession(drafter)
        by_index, results = {}, []
        for i in replica_indices(indices, self.replica):
            prompt = self.prompts[i]
            # top_k 1: the rounds are not trained (the rejected-draft stream's weight is 0); only their counts are.
            done = rollout(self.target, session, prompt.input_ids, self.spec, top_k=1, replay=False)
            aux, final = self.states(done.input_ids)
            by_index[i] = {
                "sample_id": prompt.id,
                "input_ids": done.input_ids,
                "loss_mask": done.loss_mask,
                "aux_hidden": aux.float().cpu(),
                "final_hidden": final.float().cpu(),
            }
            results.append(done.result)
        self.summaries.append(acceptance_summary(results))
        return [by_index[i] for i in indices]
