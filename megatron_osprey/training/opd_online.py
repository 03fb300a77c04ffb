"""Draft-OPD's online loop, as its authors run it: roll out a round of prompts with the drafter as the last update
left it, train on that round, repeat.

The authors' EAGLE-3 script (bingyang-lei/Draft-OPD, verl/examples/on_policy_distillation_trainer/
run_qwen_eagle3.sh, driven by verl/verl/trainer/ppo/ray_trainer.py's fit()) rolls out UPDATE_ACCUMULATION_STEPS x
TRAIN_PROMPT_BSZ = 10 x 24 prompts through SGLang's EAGLE-3 speculative decoding at temperature 0 (chains of
TTT length 7 drafts), takes one optimizer update over all of them (`_update_actor(..., effective_mini_batch_size=
len(batch))`), syncs the new drafter weights into the rollout engine, and repeats for 8 epochs of the prompts
at lr 1e-4, cosine, 1.5% warmup. Its loss is the response stream only (rejected_draft_stream_weight=0.0; the
model file verl/verl/models/transformers/eagle3_student.py keeps the rejected-draft stream off for EAGLE-3): the
SpecForge-aligned TTT loss over the rolled-out response against the target's full distribution
(eagle3_native_target_distribution), weighted 0.8**k. Here a round is global batch x --opd-round-updates prompts
(the authors' 1 update per round at global batch 240), rolled out when the training loop asks for the round's
first micro-batch, that is after the previous round's last optimizer step; the loss is the offline mode's TTT
loss on the round's response (the target's aux and final states, its full distribution through its LM head).

This module is the round schedule only; the rollout itself (`roll_out(model, prompt_indices) -> samples`, each
a hidden-state-store-shaped dict) is handed in by the stage (speculative/online_rollout.py), so that training
does not import the decoding engines.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from megatron_osprey.data.micro_batches import rank_indices


def round_prompts(global_batch_size: int, round_updates: int) -> int:
    """Prompts rolled out per round (every data-parallel rank together): one global batch per update."""
    return global_batch_size * round_updates


def online_micro_batches(
    model: list,
    roll_out: Callable[[list, list[int]], list[dict]],
    num_prompts: int,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    round_samples: int,
    collate: Callable[[list[dict]], dict[str, torch.Tensor]],
    *,
    seed: int = 0,
    shuffle: bool = True,
    device: torch.device | str = "cpu",
    on_round: Callable[[int, list[dict]], None] | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro-batches of the online loop, from consumed_samples on: each round, this rank's share of
    the round's prompts (the epoch order micro_batches() uses, so a resume continues at the same prompt) is
    rolled out by `roll_out(model, indices)` with the model as it is then, and served in micro-batches."""
    if round_samples % (micro_batch_size * dp_size):
        raise ValueError(
            f"a round of {round_samples} prompts does not split into micro-batches of {micro_batch_size} over "
            f"{dp_size} data-parallel ranks."
        )
    indices = rank_indices(num_prompts, consumed_samples, micro_batch_size, dp_rank, dp_size, seed, shuffle)
    share, index = round_samples // dp_size, 0
    while True:
        samples = roll_out(model, [next(indices) for _ in range(share)])
        if on_round is not None:
            on_round(index, samples)
        for start in range(0, share, micro_batch_size):
            batch = collate(samples[start : start + micro_batch_size])
            yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        index += 1
