"""GPT pretraining data: Megatron-Core's GPTDataset + BlendedMegatronDatasetBuilder, and a resumable sampler.

The sampler is a pure function of `consumed_samples`: a resumed run that starts
from the checkpoint's consumed sample count sees exactly the batches the
uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from megatron_osprey.data.config import IndexedDataConfig


@dataclasses.dataclass(frozen=True)
class DatasetTokenizer:
    """The two facts GPTDataset needs from a tokenizer: the vocabulary size and the end-of-document id."""

    vocab_size: int
    eod: int

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def unique_identifiers(self) -> dict:
        # Part of GPTDataset's cache key: a different vocabulary means different indices.
        return {"class": "DatasetTokenizer", "vocab_size": self.vocab_size, "eod": self.eod}


def eod_token_id(hf_config: dict, override: int | None) -> int:
    """--eod-token-id, else the model config's eos_token_id (the first one when it is a list)."""
    if override is not None:
        return int(override)
    eos = hf_config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if not isinstance(eos, int):
        raise ValueError(f"the model config's eos_token_id is {eos!r}, not a token id; pass --eod-token-id.")
    return eos


def parse_blend(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """`--data-path PREFIX`, `--data-path W1 P1 W2 P2 ...`, or `--data-path P1 P2 ...` (no weights: the
    prefixes are blended by their token counts, `token_weights`) -> (prefixes, weights or None)."""
    if len(data_path) == 1:
        return [data_path[0]], None
    if not any(_is_number(value) for value in data_path):
        return list(data_path), None
    if len(data_path) % 2:
        raise ValueError(
            f"--data-path {' '.join(data_path)}: expected one PREFIX, PREFIX PREFIX ... or WEIGHT PREFIX pairs "
            f"(an even count), got {len(data_path)} values."
        )
    weights, prefixes = [], []
    for weight, prefix in zip(data_path[::2], data_path[1::2]):
        try:
            weights.append(float(weight))
        except ValueError:
            raise ValueError(f"--data-path: {weight!r} should be a blend weight before {prefix!r}.") from None
        if weights[-1] <= 0:
            raise ValueError(f"--data-path: blend weight {weight} for {prefix} must be > 0.")
        prefixes.append(prefix)
    return prefixes, weights


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def token_weights(prefixes: list[str]) -> list[float]:
    """Each prefix's token count (PREFIX.bin's size over its token width), the weights of an unweighted blend:
    every token is as likely to be drawn as in one dataset of them all, and Megatron builds as many samples
    of each as the run needs (an unweighted blend would stop at one pass over each)."""
    weights = []
    for prefix in prefixes:
        tokens = Path(prefix + ".bin").stat().st_size // token_dtype(prefix)().itemsize
        if tokens == 0:
            raise ValueError(f"--data-path {prefix}: {prefix}.bin holds no tokens.")
        weights.append(float(tokens))
    return weights


def check_prefixes(prefixes: list[str]) -> None:
    """Every prefix has its PREFIX.bin and PREFIX.idx (tools/preprocess_data.py writes both)."""
    for prefix in prefixes:
        missing = [s for s in (".bin", ".idx") if not Path(prefix + s).is_file()]
        if missing:
            raise FileNotFoundError(
                f"--data-path {prefix}: {' and '.join(prefix + s for s in missing)} not found; a prefix "
                f"names PREFIX.bin + PREFIX.idx as written by tools/preprocess_data.py "
                f"(e.g. OUT_text_document)."
            )


_INDEX_HEADER = b"MMIDIDX\x00\x00"  # Megatron-Core's indexed-dataset .idx magic
SPLIT_NAMES = ("train", "validation", "test")


def indexed_sequence_count(prefix: str) -> int:
    """The number of documents (sequences) PREFIX.idx records, read from its 34-byte header."""
    import struct

    path = prefix + ".idx"
    with open(path, "rb") as stream:
        head = stream.read(34)
    if len(head) < 34 or head[:9] != _INDEX_HEADER:
        raise ValueError(
            f"--data-path {prefix}: {path} is not a Megatron indexed-dataset index (bad or "
            f"truncated header); rerun tools/preprocess_data.py."
        )
    return struct.unpack("<Q", head[18:26])[0]


def token_dtype(prefix: str):
    """The numpy type of PREFIX.bin's token ids, from the dtype code in PREFIX.idx's header (byte 17)."""
    from megatron.core.datasets.indexed_dataset import DType

    with open(prefix + ".idx", "rb") as stream:
        return DType.dtype_from_code(stream.read(18)[17])


FULL_SCAN_BYTES = 4 << 30  # up to this much token data is scanned whole before step 1 (a few seconds)


def max_token_id(prefix: str) -> int | None:
    """The largest token id in PREFIX.bin (a chunked scan), or None when the file is over FULL_SCAN_BYTES."""
    import numpy as np

    path = Path(prefix + ".bin")
    if path.stat().st_size > FULL_SCAN_BYTES or path.stat().st_size == 0:
        return None
    tokens = np.memmap(path, dtype=token_dtype(prefix), mode="r")
    step = 1 << 26
    return max(int(tokens[i : i + step].max()) for i in range(0, len(tokens), step))


def check_vocabulary(prefixes: list[str], vocab_size: int) -> list[str]:
    """Refuse a dataset holding an id >= vocab_size before step 1; returns notes for datasets too big to scan.

    Bigger datasets are left to the per-batch check in micro_batches, which
    still stops before a bad batch is trained on.
    """
    notes = []
    for prefix in prefixes:
        top = max_token_id(prefix)
        if top is None:
            notes.append(
                f"--data-path {prefix}: over {FULL_SCAN_BYTES >> 30} GiB, so token ids are checked "
                f"against the vocabulary ({vocab_size}) batch by batch"
            )
        elif top >= vocab_size:
            raise ValueError(
                f"--data-path {prefix}: token id {top} is outside the model's vocabulary of {vocab_size} ids; the "
                f"data was tokenized with another tokenizer. Rerun tools/preprocess_data.py with the model's "
                f"tokenizer."
            )
    return notes


def check_has_documents(prefix: str) -> int:
    """PREFIX's document count; 0 is refused (Megatron would fail to mmap the empty .bin)."""
    count = indexed_sequence_count(prefix)
    if count == 0:
        raise ValueError(
            f"--data-path {prefix}: the dataset holds 0 documents; every input record was "
            f"skipped when it was preprocessed (see tools/preprocess_data.py's report)."
        )
    return count


def parse_split(split: str) -> list[float]:
    """--split's three weights (train, validation, test; missing ones are 0), refused unless they can train."""
    parts = [p.strip() for p in str(split).split(",")]
    # Plain decimals only: Megatron reads the weights with the pattern [.0-9]+.
    weights = [float(p) for p in parts if re.fullmatch(r"\d+\.?\d*|\.\d+", p)]
    if not 1 <= len(parts) <= 3 or len(weights) != len(parts):
        raise ValueError(f"--split {split}: give up to three non-negative numbers, train,valid,test (e.g. 969,30,1).")
    weights += [0.0] * (3 - len(weights))
    if weights[0] == 0:
        raise ValueError(f"--split {split} gives the training split no share of the data; e.g. --split 969,30,1.")
    return weights


def check_split_documents(prefixes: list[str], split_matrix: list, sizes: list[int], split: str) -> None:
    """Every split that must yield samples gets at least one document of every prefix.

    GPTDataset loops for ever looking for enough epochs of a split with no
    tokens (even for 0 samples: it asks for one extra token), so an empty split
    that is asked for is refused here, with Megatron's own rounding.
    """
    for prefix in prefixes:
        count = check_has_documents(prefix)
        for name, bounds, size in zip(SPLIT_NAMES, split_matrix, sizes):
            if bounds is None or size == 0:
                continue
            docs = int(round(bounds[1] * float(count))) - int(round(bounds[0] * float(count)))
            if docs == 0:
                hint = " or --eval-iters 0" if name == "validation" else ""
                raise ValueError(
                    f"--split {split}: the {name} split of {prefix} gets 0 of its {count} documents; "
                    f"use more data, or a --split that gives it at least one{hint}."
                )


def drop_unread_splits(split_matrix: list, sizes: list[int]) -> list:
    """The split matrix without the parts no sample is drawn from, so Megatron does not build them.

    A part asked for 0 samples is still built, and one with 0 documents then never finishes
    building (the default 969,30,1 gives a 300-document corpus a 0-document test part).
    """
    return [bounds if size else None for bounds, size in zip(split_matrix, sizes)]


def plan_splits(data: IndexedDataConfig, prefixes: list[str], sizes: list[int]) -> list:
    """The split matrix Megatron builds from --split, without unread parts; refused when a read part is empty.

    Cheap and model-free: run it before the model is built, and again where the datasets are.
    """
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    parse_split(data.split)
    matrix = drop_unread_splits(convert_split_vector_to_split_matrix(parse_and_normalize_split(data.split)), sizes)
    check_split_documents(prefixes, matrix, sizes, data.split)
    return matrix


def split_sizes(train_iters: int, global_batch_size: int, eval_iters: int, eval_interval: int) -> list[int]:
    """Samples to draw per split: every evaluation re-reads the same first `eval_iters` batches."""
    valid = eval_iters * global_batch_size if eval_iters > 0 and eval_interval > 0 else 0
    return [train_iters * global_batch_size, valid, 0]


def build_gpt_datasets(
    data: IndexedDataConfig, tokenizer: DatasetTokenizer, seq_length: int, seed: int, sizes: list[int]
):
    """Train / valid / test GPTDatasets (blended when weighted); collective: call on every rank."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    prefixes, weights = parse_blend(data.data_path)
    check_prefixes(prefixes)
    if weights is None and len(prefixes) > 1:
        weights = token_weights(prefixes)
    matrix = plan_splits(data, prefixes, sizes)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split=data.split,
        path_to_cache=data.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        # The model applies the causal mask itself; a [s, s] mask per sample is waste.
        create_attention_mask=False,
    )
    config.split_matrix = matrix  # the same bounds Megatron computed, less the parts nobody reads
    # Every rank reads its own batches (no TP broadcast): each must hold the datasets.
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def stack_samples(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Stack GPTDataset samples into a batch dict."""
    return {key: torch.stack([s[key] for s in samples]) for key in ("tokens", "labels", "loss_mask", "position_ids")}


def check_token_ids(batch: dict[str, torch.Tensor], vocab_size: int, source: str) -> None:
    """Refuse a batch holding a token id the model has no embedding row for.

    Out-of-range labels are masked to -inf logits (loss inf) and out-of-range
    inputs index past the embedding (an error on one TP size, silent on
    another): either way the run would train on garbage, so stop naming the data.
    """
    top = max(int(batch["tokens"].max()), int(batch["labels"].max()))
    if top >= vocab_size:
        raise ValueError(
            f"--data-path {source}: token id {top} is outside the model's vocabulary of {vocab_size} ids; the data "
            f"was tokenized with another tokenizer. Rerun tools/preprocess_data.py with the model's tokenizer."
        )
