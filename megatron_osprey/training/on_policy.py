"""Draft-OPD's on-policy distillation step: the drafter re-drafts every recorded verify round of a rollout store.

A rollout sample (data/hidden_state_store/rollout.py) is the verified sequence x plus its rounds. Round r with
root row t (x_0..x_{t+1} verified) drafted d_1..d_K. The TTT unroll over x gives row t exactly the drafter's
chain of that round when step k >= 1 reads d_k instead of x_{t+1+k}: TTT attention lets row t see the step-0
keys of rows <= t (the verified prefix with the target's aux states) and its own keys of earlier steps only.
So one unroll re-drafts every round of a sample at once, and step k of root row t is trained, by the soft
cross-entropy, toward the target's recorded distribution after x_0..x_{t+1}, d_1..d_k (restricted to the draft
vocabulary and renormalised, as the offline loss restricts the target's logits), with the TTT weights decay**k.
A row counts where the target's most probable token lies in the draft vocabulary (the offline mode's rule).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_osprey.data.distill_data import pad_samples
from megatron_osprey.losses.ttt import shift_rows, soft_ce_terms


def pad_rollout_samples(
    samples: list[dict], seq_length: int, pad_id: int, multiple: int | None, steps: int
) -> dict[str, Tensor]:
    """pad_samples plus the rounds whose root token survives the cut: rollout_roots [b, s] bool, and in
    (b, s) order of its True rows, rollout_drafts [n, steps], rollout_topk_ids / rollout_topk_probs [n, steps, k]."""
    batch = pad_samples(samples, seq_length, pad_id, multiple)
    roots = torch.zeros(batch["input_ids"].shape, dtype=torch.bool)
    drafts, ids, probs = [], [], []
    for i, sample in enumerate(samples):
        rounds = sample["rollout"]
        keep = rounds.root_rows + 1 < batch["lengths"][i]  # the root reads x_{t+1}: it must be in the cut sample
        roots[i, rounds.root_rows[keep]] = True
        drafts.append(rounds.draft_tokens[keep, :steps].long())
        ids.append(rounds.topk_ids[keep, :steps].long())
        probs.append(rounds.topk_probs[keep, :steps].float())
    batch |= {
        "rollout_roots": roots,
        "rollout_drafts": torch.cat(drafts),
        "rollout_topk_ids": torch.cat(ids),
        "rollout_topk_probs": torch.cat(probs),
    }
    return batch


def draft_step_ids(inputs: Tensor, roots: Tensor, drafts: Tensor, steps: int) -> list[Tensor]:
    """Each TTT step's input ids: the teacher-forced shift, with step k >= 1 of a root row reading draft d_k."""
    out = [inputs]
    for k in range(1, steps):
        ids = shift_rows(inputs, k)
        ids[roots] = drafts[:, k - 1]
        out.append(ids)
    return out


def target_to_draft(d2t: Tensor, vocab_size: int) -> Tensor:
    """[V] the draft id of each target id, -1 outside the draft vocabulary (draft id j is target id j + d2t[j])."""
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    draft = torch.arange(d2t.numel(), device=d2t.device)
    index[draft + d2t.long()] = draft
    return index


def _tp_rank(group) -> int:
    if group is None or not torch.distributed.is_initialized():
        return 0
    return torch.distributed.get_rank(group)


def recorded_target_logits(ids: Tensor, probs: Tensor, to_draft: Tensor, local: int, group=None):
    """(log-probabilities [n, local] on this TP rank's draft-vocabulary shard, rows that count [n]).

    The softmax of the returned logits is the recorded top-k distribution restricted to the draft vocabulary and
    renormalised (columns without recorded mass are -inf); rows that do not count get zeros (finite, unused).
    """
    draft = to_draft[ids]  # [n, k], -1 outside the draft vocabulary
    valid = draft[:, 0] >= 0  # the target's most probable token is draftable
    column = draft - _tp_rank(group) * local
    here = (draft >= 0) & (column >= 0) & (column < local)
    dense = probs.new_zeros(ids.shape[0], local)
    dense.scatter_add_(1, column.clamp(0, local - 1), probs * here)
    logits = torch.where(dense > 0, dense.log(), torch.full_like(dense, float("-inf")))
    return logits.masked_fill(~valid[:, None], 0.0), valid


def on_policy_step_terms(logits: list[Tensor], batch: dict, d2t: Tensor, vocab_size: int, draft_vocab: int, group):
    """TTTStepTerms of each step over the root rows (logits[k]: [n, Vd/TP], the root rows in (b, s) order)."""
    roots = batch["rollout_roots"]
    sample = torch.arange(roots.shape[0], device=roots.device)[:, None].expand_as(roots)[roots]
    to_draft = target_to_draft(d2t, vocab_size)
    terms = []
    for k, logits_k in enumerate(logits):
        target_k, valid = recorded_target_logits(
            batch["rollout_topk_ids"][:, k], batch["rollout_topk_probs"][:, k], to_draft, logits_k.shape[-1], group
        )
        terms.append(soft_ce_terms(logits_k, target_k, valid, sample, roots.shape[0], draft_vocab, group))
    return terms
