"""Distillation's counts before step 1 are shared: each rank tokenizes its own share of the conversations and the
counts are summed, so no rank sits in a collective (under the 10-minute timeout) while rank 0 tokenizes them all."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from megatron_osprey.data.distill_data import ConversationSamples, loss_token_survivors
from megatron_osprey.training.distillation import assistant_token_counts, check_loss_tokens

VOCAB = 50


@dataclasses.dataclass
class _Tokenized:
    id: str
    input_ids: list[int]
    loss_mask: list[bool]


class _CountingChat:
    """Stands in for ChatTokenizer: conversation i is i + 3 tokens, the last i % 3 of them assistant tokens."""

    def __init__(self):
        self.tokenized: list[int] = []

    def tokenize(self, conversation: dict) -> _Tokenized:
        i = int(conversation["id"])
        self.tokenized.append(i)
        length, trained = i + 3, i % 3
        ids = [(7 * i + j) % VOCAB for j in range(length)]
        return _Tokenized(str(i), ids, [j >= length - trained for j in range(length)])


def _samples(count: int) -> ConversationSamples:
    source = ConversationSamples.__new__(ConversationSamples)  # the real class, with its tokenizer stood in for
    source.conversations = [{"id": str(i), "conversations": []} for i in range(count)]
    source.chat = _CountingChat()
    return source


@pytest.mark.parametrize("count, ranks", [(10, 1), (10, 3), (10, 4), (2, 4)])
def test_shares_partition_the_samples_and_sum_to_the_whole(count, ranks):
    whole = _samples(count)
    total = loss_token_survivors(whole, seq_length=8)
    whole_counts = assistant_token_counts(whole, VOCAB)
    assert whole.chat.tokenized == list(range(count)) * 2  # one pass each
    seen, sums, counts = [], [0, 0], torch.zeros(VOCAB, dtype=torch.float64)
    for rank in range(ranks):
        share = _samples(count)
        samples, tokens = loss_token_survivors(share, 8, rank, ranks)
        counts += assistant_token_counts(share, VOCAB, rank, ranks)
        assert share.chat.tokenized == [i for i in range(count) if i % ranks == rank] * 2  # its own share only
        seen += share.chat.tokenized[: len(share.chat.tokenized) // 2]
        sums = [sums[0] + samples, sums[1] + tokens]
    assert sorted(seen) == list(range(count))
    assert tuple(sums) == total and torch.equal(counts, whole_counts)
    assert total[1] > 0 and total[0] < count  # a cut at 8 and samples without assistant tokens both count


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, world: int, port: int, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        source = _samples(9)
        cfg = SimpleNamespace(
            training=SimpleNamespace(seq_length=8), data=SimpleNamespace(mode="online", data_path=["x"])
        )
        parallel = SimpleNamespace(rank=rank, world_size=world, device=torch.device("cpu"))
        note = check_loss_tokens(cfg, source, parallel)
        Path(out, f"{rank}.json").write_text(json.dumps({"note": note, "tokenized": source.chat.tokenized}))
    finally:
        torch.distributed.destroy_process_group()


def test_two_gloo_ranks_each_tokenize_half_and_agree_on_the_totals(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    samples, tokens = loss_token_survivors(_samples(9), seq_length=8)
    expected = f"{samples} of 9 samples keep assistant tokens within --seq-length 8: {tokens} loss tokens"
    assert [r["note"] for r in results] == [expected, expected]
    assert results[0]["tokenized"] == [0, 2, 4, 6, 8] and results[1]["tokenized"] == [1, 3, 5, 7]
