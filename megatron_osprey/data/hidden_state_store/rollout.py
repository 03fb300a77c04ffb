"""The store's rollout feature: a sample's verify rounds beside its tokens and hidden states (Draft-OPD).

A rollout store is a hidden-state store (same shards, manifest and reader) whose header has
`rollout_steps` K > 0 and `rollout_top_k` k > 0. Each sample is one target-verified rollout: its
input_ids are the prompt plus the verified continuation, aux_hidden / final_hidden the target's
states over them (as the extract stage stores them), and its rounds are:

* root_rows [R]: round r started with the verified tokens x_0..x_n; its root row is n - 1, the drafter
  row that reads x_n (the last verified token) and drafts the first token of the round;
* accepted [R]: how many of the round's drafts the target accepted (the rejection position; K: none rejected);
* draft_tokens [R, K]: the tokens the drafter proposed (target ids), d_1..d_K;
* topk_ids / topk_probs [R, K, k]: the target's distribution at each drafted position j = 0..K-1, i.e. after
  x_0..x_n, d_1..d_j, as its k most probable tokens and their (full-vocabulary, not renormalised) probabilities.

In a shard the rounds of its samples are concatenated, `rollout.round_offsets` [samples + 1] cutting them.
"""

from __future__ import annotations

import dataclasses

import torch

ROUND_FIELDS = ("root_rows", "accepted", "draft_tokens", "topk_ids", "topk_probs")
ROUND_DTYPES = {
    "root_rows": torch.int32,
    "accepted": torch.int32,
    "draft_tokens": torch.int32,
    "topk_ids": torch.int32,
    "topk_probs": torch.float32,
}


@dataclasses.dataclass
class RolloutRounds:
    """One sample's verify rounds (the module docstring gives each field)."""

    root_rows: torch.Tensor
    accepted: torch.Tensor
    draft_tokens: torch.Tensor
    topk_ids: torch.Tensor
    topk_probs: torch.Tensor

    def __len__(self) -> int:
        return int(self.root_rows.shape[0])

    def checked(self, sample_id: str, num_tokens: int, steps: int, top_k: int) -> "RolloutRounds":
        """A CPU copy in the stored dtypes, or one clear error on a shape or value the format does not hold."""
        rounds = len(self)
        expect = {
            "root_rows": (rounds,),
            "accepted": (rounds,),
            "draft_tokens": (rounds, steps),
            "topk_ids": (rounds, steps, top_k),
            "topk_probs": (rounds, steps, top_k),
        }
        out = {}
        for name in ROUND_FIELDS:
            tensor = getattr(self, name)
            if tuple(tensor.shape) != expect[name]:
                raise ValueError(
                    f"sample {sample_id!r}: rollout {name} has shape {tuple(tensor.shape)}, expected {expect[name]}."
                )
            out[name] = tensor.detach().to(device="cpu", dtype=ROUND_DTYPES[name], copy=True).contiguous()
        rows = out["root_rows"]
        if rounds and (rows.min() < 0 or rows.max() >= num_tokens - 1 or (rows[1:] <= rows[:-1]).any()):
            raise ValueError(f"sample {sample_id!r}: rollout root_rows must increase within [0, {num_tokens - 1}).")
        if rounds and (out["accepted"].min() < 0 or out["accepted"].max() > steps):
            raise ValueError(f"sample {sample_id!r}: rollout accepted counts must be in [0, {steps}].")
        probs = out["topk_probs"]
        if not bool(torch.isfinite(probs).all()) or probs.min() < 0 or (probs.sum(-1) > 1 + 1e-4).any():
            raise ValueError(f"sample {sample_id!r}: rollout topk_probs must be probabilities summing to <= 1.")
        return RolloutRounds(**out)


def rollout_entries(rounds: list[RolloutRounds], steps: int, top_k: int) -> list[tuple]:
    """The shard tensors (write_safetensors_streamed's entries) of the samples' rounds, in sample order."""
    counts = [len(r) for r in rounds]
    total = sum(counts)
    offsets = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0)
    shapes = {
        "root_rows": (total,),
        "accepted": (total,),
        "draft_tokens": (total, steps),
        "topk_ids": (total, steps, top_k),
        "topk_probs": (total, steps, top_k),
    }
    entries = [("rollout.round_offsets", torch.int64, (len(rounds) + 1,), [offsets])]
    for name in ROUND_FIELDS:
        entries.append((f"rollout.{name}", ROUND_DTYPES[name], shapes[name], [getattr(r, name) for r in rounds]))
    return entries


def read_rounds(handle, offsets: list[int], j: int) -> RolloutRounds:
    """Sample j's rounds from an open shard (`offsets`: its rollout.round_offsets), ids as int64."""
    a, b = offsets[j], offsets[j + 1]
    fields = {name: handle.get_slice(f"rollout.{name}")[a:b] for name in ROUND_FIELDS}
    return RolloutRounds(
        **{name: t.to(torch.int64) if name != "topk_probs" else t.clone() for name, t in fields.items()}
    )
