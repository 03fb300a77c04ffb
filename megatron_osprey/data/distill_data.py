"""Stage 4 samples and micro-batches: tokenized conversations (online) or the hidden-state store (offline).

Both sources index samples 0..N-1. One global order per epoch (a seeded
permutation) is shared by every rank; data-parallel rank r takes micro-batch r of
each group of DP micro-batches, so the consumed-sample count alone fixes the data
position and resume is exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Protocol

import torch


class SampleSource(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict: ...


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


class StoreSamples:
    """The hidden-state store (offline mode): ids, loss mask, aux and final hidden states per sample."""

    def __init__(self, store_dir: str | Path, **expect):
        from megatron_osprey.data.hidden_state_store import HiddenStateStore

        self.store = HiddenStateStore(store_dir, **expect)

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, index: int) -> dict:
        return self.store[index]

    def loss_masks(self) -> Iterator[torch.Tensor]:
        """Every sample's loss mask in store order, read without the hidden states."""
        from safetensors import safe_open

        for rec in self.store.shards:
            with safe_open(str(self.store.store_dir / rec.file), framework="pt") as shard:
                offsets = shard.get_tensor("token_offsets").tolist()
                mask = shard.get_tensor("loss_mask")
            for a, b in zip(offsets[:-1], offsets[1:]):
                yield mask[a:b]


def loss_token_survivors(source: SampleSource, seq_length: int) -> tuple[int, int]:
    """(samples, loss tokens) that still train once every sample is cut to seq_length, as collate cuts it."""
    masks = source.loss_masks() if hasattr(source, "loss_masks") else (source[i]["loss_mask"] for i in range(len(source)))
    samples = tokens = 0
    for mask in masks:
        kept = int(mask[:seq_length].sum())
        samples += kept > 0
        tokens += kept
    return samples, tokens


def epoch_order(num_samples: int, epoch: int, seed: int, shuffle: bool) -> torch.Tensor:
    """The global sample order of one epoch (identical on every rank)."""
    if not shuffle:
        return torch.arange(num_samples)
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


def _pad(tensor: torch.Tensor, length: int, value=0) -> torch.Tensor:
    tensor = tensor[:length]
    if tensor.shape[0] == length:
        return tensor
    pad = tensor.new_full((length - tensor.shape[0], *tensor.shape[1:]), value)
    return torch.cat([tensor, pad])


def collate(samples: list[dict], seq_length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad (or cut) every sample to seq_length; padding never counts in the loss."""
    batch = {
        "input_ids": torch.stack([_pad(s["input_ids"], seq_length, pad_id) for s in samples]),
        "loss_mask": torch.stack([_pad(s["loss_mask"].bool(), seq_length, False) for s in samples]),
    }
    for key in ("aux_hidden", "final_hidden"):
        if key in samples[0]:
            batch[key] = torch.stack([_pad(s[key].float(), seq_length) for s in samples])
    return batch


def micro_batches(source: SampleSource, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                  seq_length: int, pad_id: int, seed: int, shuffle: bool = True,
                  device: torch.device | str = "cpu") -> Iterator[dict[str, torch.Tensor]]:
    """This DP rank's micro-batches from global sample position `consumed_samples` on, over epochs."""
    size = len(source)
    position = consumed_samples
    orders: dict[int, torch.Tensor] = {}
    while True:
        indices = []
        for offset in range(micro_batch_size):
            global_position = position + dp_rank * micro_batch_size + offset
            epoch = global_position // size
            if epoch not in orders:
                orders = {epoch: epoch_order(size, epoch, seed, shuffle)}
            indices.append(int(orders[epoch][global_position % size]))
        batch = collate([source[i] for i in indices], seq_length, pad_id)
        yield {k: v.to(device) for k, v in batch.items()}
        position += micro_batch_size * dp_size
