"""The hidden-state extraction loop: conversations -> target prefill -> hidden-state store.

Work split: the conversations are cut into `num_shards` contiguous slices (Slurm
array tasks), each slice into data-parallel replicas' contiguous ranges, each
range into fixed micro-batches. Micro-batches are fixed by sample index, so a
resumed run pads and batches every sample exactly as an uninterrupted run does
and writes identical bytes. One writer per replica (last pipeline stage, TP rank
0) owns writer rank `shard_index * dp_size + dp_rank` of the store.

Resume: samples already in complete shards (the writer's manifest part) are
skipped; a micro-batch is recomputed when any of its samples is missing, and only
the missing ones are written. With expert parallelism the replicas exchange
tokens inside every MoE layer, so every replica runs the same number of forwards
(idle replicas run a one-token dummy).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.data.chat_template import ChatTemplateConfig, ChatTokenizer, TokenizedConversation
from megatron_osprey.data.conversations import read_conversations
from megatron_osprey.data.hidden_state_store import (
    check_free_disk,
    estimate_store_bytes,
    finalize_store,
    open_writer,
)
from megatron_osprey.models.target.pipeline_stage import (
    PrefillCapture,
    load_target,
    target_identity,
)
from megatron_osprey.parallel import ParallelState


@dataclasses.dataclass
class ExtractResult:
    """What this rank's extraction did."""

    num_samples: int  # written by this writer in this run
    num_skipped: int  # already complete from an earlier run
    num_tokens: int
    seconds: float
    store_bytes_estimate: int
    manifest: Path | None


SETTINGS_NAME = "extract_settings.json"


def extract_settings(config, aux_ids) -> dict:
    """Everything a stored sample depends on besides its id: the data, the target and how it was run."""
    from megatron_osprey.data.fingerprint import file_sha256, model_fingerprint

    return {
        "data_sha256": file_sha256(config.data_path),
        "target": model_fingerprint(config.target.path),
        "aux_layer_ids": list(aux_ids),
        "max_length": config.max_length,
        "enable_thinking": config.enable_thinking,
        "encoding": config.store.encoding,
        "outliers_per_token": config.store.outliers_per_token,
        "samples_per_shard": config.store.samples_per_shard,
        "params_dtype": config.params_dtype,
    }


def check_store_settings(config, settings: dict, say: Callable[[str], None]) -> None:
    """Refuse a store made from other inputs or settings (--overwrite: empty it); then record ours.

    Run by one process per job before any writer opens the store. A store that holds or lies inside an
    input, or a non-empty directory without our settings record, is refused even with --overwrite.
    """
    from megatron_osprey.data.fingerprint import claim_store_dir

    inputs = {"--data": config.data_path, "--target": config.target.path}
    claim_store_dir(
        config.store.store_dir,
        SETTINGS_NAME,
        settings,
        inputs,
        overwrite=config.overwrite,
        stage="extract",
        holds="hidden states",
        say=say,
    )


def check_writer_lock_free(store_dir: str | Path, tag: str) -> None:
    """Refuse at start, before the target is loaded, when another process holds this writer's lock."""
    from megatron_osprey.base.locks import lock_is_held
    from megatron_osprey.data.hidden_state_store import lock_path

    path = lock_path(Path(store_dir), tag)
    holder = lock_is_held(path)
    if holder is not None:
        raise ValueError(
            f"--output {store_dir}: another extract ({holder}) is writing it as writer {tag!r} (lock {path} is "
            f"held); this run does not wait for it. Let that run finish (rerunning then resumes), or give this one "
            f"another --shard or --output."
        )


def contiguous_slice(count: int, index: int, parts: int) -> range:
    """The `index`-th of `parts` contiguous, near-equal ranges of range(count)."""
    return range(count * index // parts, count * (index + 1) // parts)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on a GPU and float32 on the CPU (CPU bf16 matmuls are slow and inexact)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"--params-dtype must be auto, bfloat16, float16 or float32, got {name!r}.")
    return getattr(torch, name)


def tokenize_slice(config, indices: range) -> list[TokenizedConversation]:
    """Tokenize conversations `indices` through the target's chat template, with assistant loss masks."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.target.path)
    chat = ChatTokenizer(
        tokenizer, ChatTemplateConfig(max_length=config.max_length, enable_thinking=config.enable_thinking)
    )
    wanted = set(indices)
    out = []
    for i, conversation in enumerate(read_conversations(config.data_path)):
        if i in wanted:
            out.append(chat.tokenize(conversation))
    return out


def _count_conversations(path: str) -> int:
    with open(path, encoding="utf-8") as handle:
        return sum(1 for line in handle if line.strip())


def _batch_index_lists(samples: Sequence[TokenizedConversation], size: int) -> list[list[int]]:
    return [list(range(i, min(i + size, len(samples)))) for i in range(0, len(samples), size)]


def _pad_batch(samples: Sequence[TokenizedConversation], multiple: int, pad_id: int) -> torch.Tensor:
    length = max(len(s) for s in samples)
    length += -length % multiple
    batch = torch.full((len(samples), length), pad_id, dtype=torch.long)
    for row, sample in enumerate(samples):
        batch[row, : len(sample)] = torch.from_numpy(np.asarray(sample.input_ids, dtype=np.int64))
    return batch


def _all_reduce_int(value: int, op, group=None) -> int:
    tensor = torch.tensor([value], dtype=torch.long)
    if torch.distributed.get_backend(group) == "nccl":
        tensor = tensor.cuda()
    torch.distributed.all_reduce(tensor, op=op, group=group)
    return int(tensor.item())


def _rank_samples(config, shard: tuple[int, int], dp_rank: int, dp_size: int, say) -> list[TokenizedConversation]:
    """This task's slice of the conversations, then this data-parallel replica's part of it, tokenized."""
    total = _count_conversations(config.data_path)
    task = contiguous_slice(total, *shard)
    mine = contiguous_slice(len(task), dp_rank, dp_size)
    say(
        f"extract: {total} conversations; shard {shard[0]}/{shard[1]} holds "
        f"{len(task)}, {dp_size} data-parallel replica(s)"
    )
    return tokenize_slice(config, range(task.start + mine.start, task.start + mine.stop))


def _preflight_disk(
    config, samples: Sequence[TokenizedConversation], hidden_size: int, num_aux_layers: int, say
) -> int:
    """Refuse a store the disk cannot hold, before any weight is read: this task's replicas together."""
    from megatron.core import parallel_state as mpu

    sum_op = torch.distributed.ReduceOp.SUM
    tokens = sum(len(s) for s in samples)
    writer_tokens = tokens if (mpu.get_tensor_model_parallel_rank() == 0 and mpu.is_pipeline_last_stage()) else 0
    task_tokens = _all_reduce_int(writer_tokens, sum_op)
    task_samples = _all_reduce_int(len(samples) if writer_tokens else 0, sum_op)
    needed = estimate_store_bytes(
        task_tokens,
        hidden_size,
        config.store.encoding,
        num_aux_layers=num_aux_layers,
        outliers_per_token=config.store.outliers_per_token,
        num_samples=task_samples,
    )
    say(
        f"extract: {task_samples} samples, {task_tokens} tokens -> store estimate {needed / 2**30:.3f} GiB "
        f"({needed / max(task_tokens, 1):.0f} B/token, {config.store.encoding}) in {config.store.store_dir}"
    )
    check_free_disk(config.store.store_dir, needed)
    return needed


def _batches_to_run(
    samples: Sequence[TokenizedConversation], done_ids: set[str], is_writer: bool, micro_batch_size: int
) -> tuple[list[list[int]], int]:
    """The micro-batches with unfinished samples, and the step count every data-parallel replica runs."""
    from megatron.core import parallel_state as mpu

    dist = torch.distributed
    batches = _batch_index_lists(samples, micro_batch_size)
    # The writer knows what is done; its TP / PP peers must run the same batches.
    todo = torch.tensor([any(samples[i].id not in done_ids for i in b) for b in batches], dtype=torch.long)
    if not is_writer:
        todo.zero_()
    if dist.get_backend() == "nccl":
        todo = todo.cuda()
    dist.all_reduce(todo, op=dist.ReduceOp.MAX, group=mpu.get_model_parallel_group())
    run = [b for b, flag in zip(batches, todo.tolist()) if flag]
    return run, _all_reduce_int(len(run), dist.ReduceOp.MAX, group=mpu.get_data_parallel_group())


def _capture_and_write(
    samples, run, steps, capture, writer, done_ids, aux_ids, final_id, start, say, on_batch
) -> tuple[int, int]:
    """Run the target over the batches (an empty batch where this replica has fewer) and store the states."""
    written = written_tokens = 0
    pad_id = 0
    for step in range(steps):
        batch = [samples[i] for i in run[step]] if step < len(run) else []
        ids = (
            _pad_batch(batch, capture.sequence_multiple, pad_id)
            if batch
            else torch.zeros(1, capture.sequence_multiple, dtype=torch.long)
        )
        outputs = capture(ids)
        if writer is not None and batch:
            for row, sample in enumerate(batch):
                if sample.id in done_ids:
                    continue
                n = len(sample)
                aux = torch.cat([outputs[i][row, :n] for i in aux_ids], dim=-1)
                writer.add(
                    sample.id,
                    torch.from_numpy(np.asarray(sample.input_ids)),
                    torch.from_numpy(np.asarray(sample.loss_mask)),
                    aux,
                    outputs[final_id][row, :n],
                )
                written += 1
                written_tokens += n
        if on_batch is not None:
            on_batch(step)
        if (step + 1) % 10 == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - start
            rate = written_tokens / elapsed if elapsed else 0.0
            eta = elapsed / (step + 1) * (steps - step - 1)
            say(
                f"extract: step {step + 1}/{steps}, {written} samples, {rate:.0f} tokens/s on this writer, "
                f"ETA {eta:.0f}s"
            )
    return written, written_tokens


def extract_hidden_states(
    config,
    state: ParallelState,
    arch: ModelArch,
    *,
    shard: tuple[int, int] = (0, 1),
    log: Callable[[str], None] = print,
    on_batch: Callable[[int], None] | None = None,
) -> ExtractResult:
    """Extract slice `shard` (index, count) of the data into the store; collective over all ranks (call on every
    rank). `config` is the extract stage's ExtractConfig; `arch` its target's parsed config.json."""
    from megatron.core import parallel_state as mpu

    from megatron_osprey.base.arch import resolve_aux_layer_ids

    start = time.perf_counter()
    index, count = shard
    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    say = log if state.rank == 0 else (lambda message: None)
    samples = _rank_samples(config, shard, dp_rank, dp_size, say)
    aux_ids = tuple(resolve_aux_layer_ids(config.aux_layer_ids, arch.num_layers))
    final_id = arch.num_layers - 1
    if state.rank == 0:
        check_store_settings(config, extract_settings(config, aux_ids), say)
    torch.distributed.barrier()
    if mpu.get_tensor_model_parallel_rank() == 0 and mpu.is_pipeline_last_stage():  # this replica's writer
        from megatron_osprey.data.hidden_state_store import writer_tag

        check_writer_lock_free(config.store.store_dir, writer_tag(index * dp_size + dp_rank, count * dp_size))

    needed = _preflight_disk(config, samples, arch.hidden_size, len(aux_ids), say)

    dtype = resolve_dtype(config.params_dtype, state.device)
    stage = load_target(
        config.target.path,
        state.config,
        state.device,
        params_dtype=dtype,
        transformer_impl=config.transformer_impl,
        arch=arch,
    )
    capture = PrefillCapture(stage, list(aux_ids) + [final_id])
    target_id, config_hash = target_identity(arch, config.target.path)
    writer = None
    if capture.is_writer:
        writer = open_writer(
            config.store,
            target_id=target_id,
            config_hash=config_hash,
            aux_layer_ids=aux_ids,
            hidden_size=arch.hidden_size,
            rank=index * dp_size + dp_rank,
            world_size=count * dp_size,
        )
    try:
        done_ids = writer.completed_sample_ids() if writer is not None else set()
        run, steps = _batches_to_run(samples, done_ids, capture.is_writer, config.micro_batch_size)
        skipped = sum(1 for s in samples if s.id in done_ids)
        say(f"extract: {len(run)} micro-batches to run ({skipped} samples already complete), {steps} steps")
        written, written_tokens = _capture_and_write(
            samples, run, steps, capture, writer, done_ids, aux_ids, final_id, start, say, on_batch
        )
    except BaseException:
        if writer is not None:
            writer.abandon()
        raise
    finally:
        capture.close()
    if writer is not None:
        writer.close()
    torch.distributed.barrier()
    manifest = None
    if config.finalize and state.rank == 0:
        manifest = _try_finalize(config, count, say)
    torch.distributed.barrier()
    return ExtractResult(written, skipped, written_tokens, time.perf_counter() - start, needed, manifest)


def _try_finalize(config, num_shards: int, say: Callable[[str], None]) -> Path | None:
    """Finalize the store; with several array tasks, the last one to finish succeeds."""
    try:
        path = finalize_store(config.store.store_dir)
    except RuntimeError as error:
        if num_shards == 1:
            raise
        say(f"extract: store not finalized yet ({error}); the last array task to finish finalizes it.")
        return None
    say(f"extract: finalized {path}")
    return path
