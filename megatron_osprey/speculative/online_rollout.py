"""The rollout of Draft-OPD's online loop (training/opd_online.py): the live Megatron drafter, copied into the
reference drafter, drafts greedy chains against the HF target, whose verified output becomes the round's
training samples (the prompt plus the target's continuation, its aux and final hidden states)."""

from __future__ import annotations

import dataclasses

import torch

from megatron_osprey.models.drafter.convert import reference_state
from megatron_osprey.models.drafter.reference import ReferenceDrafter
from megatron_osprey.models.target.decoding import HFTargetModel
from megatron_osprey.speculative.config import SpecConfig, acceptance_summary
from megatron_osprey.speculative.draft_session import ReferenceDraftSession
from megatron_osprey.speculative.rollout import rollout, target_states


@torch.no_grad()
def live_reference_drafter(model, tp_group=None) -> ReferenceDrafter:
    """The reference drafter with the weights `model` (an unwrapped Megatron drafter) holds now; collective
    over its tensor-parallel group."""
    state = reference_state(model, tp_group)
    drafter = ReferenceDrafter(model.arch.reference_config())
    drafter.to(state["embed_tokens.weight"].dtype)
    drafter.load_state_dict(state, strict=True)
    return drafter.eval()


@dataclasses.dataclass
class OnlineRollout:
    """roll_out(model, indices) for online_micro_batches: prompts[i] for i in indices, rolled out by the HF
    target `target_model` and the drafter as `model` holds it now; the acceptance summary of each round is kept."""

    target_model: object  # a transformers causal LM, eval mode
    prompts: list  # each with .id and .input_ids [T]
    spec: SpecConfig  # greedy chains: the authors roll out at temperature 0
    tp_group: object = None
    summaries: list = dataclasses.field(default_factory=list)

    @torch.no_grad()
    def __call__(self, model: list, indices: list[int]) -> list[dict]:
        from megatron.core.utils import unwrap_model

        device = next(self.target_model.parameters()).device
        dtype = next(self.target_model.parameters()).dtype
        drafter = live_reference_drafter(unwrap_model(model[0]), self.tp_group).to(device=device, dtype=dtype)
        aux_ids = list(drafter.config.aux_layer_ids)
        target, session = HFTargetModel(self.target_model, aux_ids), ReferenceDraftSession(drafter)
        samples, results = [], []
        for i in indices:
            prompt = self.prompts[i]
            # top_k 1: the rounds are not trained (the rejected-draft stream's weight is 0); only their counts are.
            done = rollout(target, session, prompt.input_ids, self.spec, top_k=1, replay=False)
            aux, final = target_states(self.target_model, done.input_ids, aux_ids)
            samples.append(
                {
                    "sample_id": prompt.id,
                    "input_ids": done.input_ids,
                    "loss_mask": done.loss_mask,
                    "aux_hidden": aux.float().cpu(),
                    "final_hidden": final.float().cpu(),
                }
            )
            results.append(done.result)
        self.summaries.append(acceptance_summary(results))
        return samples
