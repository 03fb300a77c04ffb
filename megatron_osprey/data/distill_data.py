"""Stage 4 samples: tokenized conversations (online) or the hidden-state store (offline).

Both sources index samples 0..N-1 (data/micro_batches.py orders and batches them)
and give the tokens alone through `iter_tokens`, which the stage counts before step 1
(loss tokens that survive --seq-length; the EAGLE-3 baseline's draft vocabulary). Each
rank counts its own share (`rank`, `ranks`) and the counts are summed, so no rank waits
in a collective while another tokenizes the whole data set.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Iterator

import torch


class ConversationSamples:
    """Conversations JSONL files tokenized lazily through the target's chat template."""

    def __init__(self, paths: list[str], tokenizer, max_length: int, enable_thinking: bool | None = None):
        from megatron_osprey.data.chat_template import ChatTemplateConfig, ChatTokenizer
        from megatron_osprey.data.conversations import read_conversations

        self.conversations = [c for path in paths for c in read_conversations(path)]
        if not self.conversations:
            raise ValueError(f"--data-path {' '.join(paths)} holds no conversations.")
        self.chat = ChatTokenizer(tokenizer, ChatTemplateConfig(max_length=max_length, enable_thinking=enable_thinking))

    def __len__(self) -> int:
        return len(self.conversations)

    def __getitem__(self, index: int) -> dict:
        tokenized = self.chat.tokenize(self.conversations[index])
        return {
            "sample_id": tokenized.id,
            "input_ids": torch.as_tensor(tokenized.input_ids, dtype=torch.int64),
            "loss_mask": torch.as_tensor(tokenized.loss_mask, dtype=torch.bool),
        }

    def iter_tokens(self, rank: int = 0, ranks: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids, loss_mask) of samples rank, rank + ranks, ... in order; only those are tokenized."""
        for index in range(rank, len(self), ranks):
            sample = self[index]
            yield sample["input_ids"], sample["loss_mask"]


class StoreSamples:
    """The hidden-state store (offline mode): ids, loss mask, aux and final hidden states per sample.

    Training reads it through the store's own reader: background threads decode up
    to `prefetch` samples ahead, in the order the micro-batches ask for.
    """

    def __init__(self, store_dir: str | Path, *, prefetch: int = 8, workers: int = 1, **expect):
        from megatron_osprey.data.hidden_state_store import HiddenStateStore

        self.store = HiddenStateStore(store_dir, **expect)
        self.prefetch, self.workers = prefetch, workers

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, index: int) -> dict:
        return self.store[index]

    def iter_samples(self, indices: Iterator[int]) -> Iterator[dict]:
        """Samples in indices order, read ahead by the store's prefetch threads."""
        return self.store.iter_samples(indices, prefetch=self.prefetch, workers=self.workers)

    def loss_masks(self) -> Iterator[torch.Tensor]:
        """Every sample's loss mask in store order, read without the hidden states."""
        for _, mask in self.store.iter_tokens():
            yield mask

    def iter_tokens(self, rank: int = 0, ranks: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids, loss_mask) of samples rank, rank + ranks, ..., without decoding hidden states."""
        return itertools.islice(self.store.iter_tokens(), rank, None, ranks)


def loss_token_survivors(source, seq_length: int, rank: int = 0, ranks: int = 1) -> tuple[int, int]:
    """(samples, loss tokens) of samples rank, rank + ranks, ... that still train once cut to seq_length, as
    collate cuts them; the sums over rank = 0..ranks-1 are the data set's."""
    samples = tokens = 0
    for _, mask in source.iter_tokens(rank, ranks):
        kept = int(mask[:seq_length].sum())
        samples += kept > 0
        tokens += kept
    return samples, tokens


def _pad(tensor: torch.Tensor, length: int, value=0) -> torch.Tensor:
    tensor = tensor[:length]
    if tensor.shape[0] == length:
        return tensor
    pad = tensor.new_full((length - tensor.shape[0], *tensor.shape[1:]), value)
    return torch.cat([tensor, pad])


def pad_samples(
    samples: list[dict], seq_length: int, pad_id: int, multiple: int | None = None
) -> dict[str, torch.Tensor]:
    """Right-pad (or cut) every sample to seq_length; padding never counts in the loss.

    With `multiple`, the batch is padded only to its longest sample rounded up to that multiple (at most
    seq_length): attention is causal and the TTT steps' extra keys are per-position, so positions past a
    sample's end never reach its real tokens, and the loss is the same at a fraction of the compute.
    """
    if multiple is not None:
        longest = max(int(s["input_ids"].shape[0]) for s in samples)
        seq_length = min(seq_length, -(-longest // multiple) * multiple)
    batch = {
        "input_ids": torch.stack([_pad(s["input_ids"], seq_length, pad_id) for s in samples]),
        "loss_mask": torch.stack([_pad(s["loss_mask"].bool(), seq_length, False) for s in samples]),
        # Each sample's own length after the cut: the reference TTT normalisation divides by it.
        "lengths": torch.tensor([min(int(s["input_ids"].shape[0]), seq_length) for s in samples]),
    }
    for key in ("aux_hidden", "final_hidden"):
        if key in samples[0]:
            batch[key] = torch.stack([_pad(s[key].float(), seq_length) for s in samples])
    return batch
