"""--split on small corpora: a part that is read but gets 0 documents is refused; a part nobody reads is not built."""

import threading

import numpy as np
import pytest
import torch

from megatron_osprey.data.config import IndexedDataConfig
from megatron_osprey.training.data import DatasetTokenizer, build_gpt_datasets, plan_splits, split_sizes

DEFAULT = "969,30,1"


def corpus(tmp_path, count: int) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / f"docs{count}_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for i in range(count):
        builder.add_document(torch.tensor([(i + j) % 50 for j in range(12)] + [99]), [13])
    builder.finalize(prefix + ".idx")
    return prefix


def plan(prefix, split, sizes):
    return plan_splits(IndexedDataConfig(data_path=[prefix], split=split), [prefix], sizes)


@pytest.mark.parametrize("count", [2, 300, 999])
def test_every_part_of_the_default_split_on_2_300_and_999_documents(tmp_path, count):
    prefix = corpus(tmp_path, count)
    # Megatron's rounding of 969,30,1: the documents each part gets.
    bounds = [0, round(0.969 * count), round(0.999 * count), count]
    docs = [bounds[i + 1] - bounds[i] for i in range(3)]
    for part, name in enumerate(("train", "validation", "test")):
        sizes = [8, 0, 0]
        sizes[part] = 8
        if docs[part] == 0:
            with pytest.raises(ValueError, match=rf"--split {DEFAULT}: the {name} split of .* gets 0 of its {count} "):
                plan(prefix, DEFAULT, sizes)
        else:
            matrix = plan(prefix, DEFAULT, sizes)
            assert [b is not None for b in matrix] == [s > 0 for s in sizes]  # unread parts are not built


def test_an_unread_empty_part_is_dropped_so_training_does_not_wait_for_it(tmp_path):
    # The hang: 300 documents, the default split, the test part (0 documents) asked for 0 samples.
    prefix = corpus(tmp_path, 300)
    sizes = split_sizes(train_iters=3, global_batch_size=2, eval_iters=1, eval_interval=3)
    assert sizes[2] == 0 and plan(prefix, DEFAULT, sizes)[2] is None
    built = []

    def build():  # on a daemon thread: a regression hangs this thread, not the test session
        tokenizer = DatasetTokenizer(128, 99)
        config = IndexedDataConfig(data_path=[prefix], split=DEFAULT, data_cache_path=str(tmp_path / "cache"))
        built.append(build_gpt_datasets(config, tokenizer, 8, 1, sizes))

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    thread.join(timeout=300)
    assert built, "building the datasets did not finish"
    train, valid, test = built[0]
    assert len(train) >= sizes[0] and len(valid) >= sizes[1] and test is None


@pytest.mark.parametrize(
    "split, message",
    [
        ("0,0,0", r"--split 0,0,0 gives the training split no share of the data"),
        ("0,10,0", r"--split 0,10,0 gives the training split no share"),
        ("a,b", r"--split a,b: give up to three non-negative numbers"),
        ("98,-2,0", r"--split 98,-2,0: give up to three non-negative numbers"),
        ("1,1,1,1", r"--split 1,1,1,1: give up to three"),
    ],
)
def test_a_split_that_cannot_train_is_refused_with_its_own_message(tmp_path, split, message):
    prefix = corpus(tmp_path, 10)
    with pytest.raises(ValueError, match=message):
        plan(prefix, split, [8, 0, 0])


def test_prefixes_without_weights_are_blended_by_token_count_past_one_pass(tmp_path):
    """`--data-path P1 P2` (the shards of a preprocessing array): weighted by tokens (2:1 here), so Megatron
    builds as many samples as training asks for, more than one pass over both (an unweighted Megatron blend
    would stop at one)."""
    from megatron_osprey.training.data import parse_blend, token_weights

    small, large = corpus(tmp_path, 20), corpus(tmp_path, 40)
    assert parse_blend([small, large]) == ([small, large], None)
    assert token_weights([small, large]) == [20 * 13.0, 40 * 13.0]
    sizes = [400, 0, 0]  # 400 samples of 8 tokens: about 6 passes over the 780 tokens
    config = IndexedDataConfig(data_path=[small, large], split="100,0,0", data_cache_path=str(tmp_path / "cache"))
    # Megatron's blend index is built on rank 0 of the default group: a group of one, as in a 1-GPU run.
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/group", rank=0, world_size=1)
    try:
        train, _, _ = build_gpt_datasets(config, DatasetTokenizer(128, 99), 8, 1, sizes)
    finally:
        torch.distributed.destroy_process_group()
    assert len(train) >= 400
    drawn = np.bincount(np.asarray(train.dataset_index[:400]), minlength=2)
    assert abs(drawn[1] / drawn.sum() - 2 / 3) < 0.02, drawn
