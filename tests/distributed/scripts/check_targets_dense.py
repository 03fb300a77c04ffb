"""Run under `torchrun --nproc_per_node=2`: Qwen2, Mistral and Gemma 3 (text, and the multimodal checkpoint's
language model) at TP=2 + sequence parallel (Gemma 3 text at PP=2 too) against their transformers classes, and
EAGLE-3 distilled online on the multimodal Gemma 3 checkpoint (its embedding, layers and head under language_model.)
at TP=2 and at DP=2.

Rank 0 writes a JSON of measured figures to argv[2]; the pytest side asserts them.
"""

import json
from pathlib import Path

import torch

from megatron_osprey.models.target.lm_head import TargetHead
from megatron_osprey.models.target.pipeline_stage import PrefillCapture, load_target
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.testing.distill_setup import write_topic_conversations
from megatron_osprey.testing.tiny_models import write_chat_target
from tests.distributed.scripts.ranks import merged_on_rank0, run_script

FAMILIES = ("qwen2", "mistral", "gemma3_text", "gemma3")
WINDOWED = ("mistral", "gemma3_text")
TP2_SP = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
PP2 = ParallelConfig(pipeline_model_parallel_size=2)
LAYERS, SEQ = 6, 32
DISTILL_LAYOUTS = {"tp2": ParallelConfig(tensor_model_parallel_size=2), "dp2": ParallelConfig()}
DISTILL_ITERS = 3


def decoder_layers(model):
    """The HF decoder layers (the multimodal Gemma 3 keeps them in its language model)."""
    inner = model.model
    return inner.language_model.layers if hasattr(inner, "language_model") else inner.layers


def hf_forward(model, ids):
    """Each decoder layer's output (before the final norm) and the logits."""
    outputs = {}
    hooks = [
        layer.register_forward_hook(
            lambda m, i, o, k=k: outputs.__setitem__(k, (o[0] if isinstance(o, tuple) else o).detach())
        )
        for k, layer in enumerate(decoder_layers(model))
    ]
    with torch.no_grad():
        logits = model(ids).logits
    for hook in hooks:
        hook.remove()
    return outputs, logits


def max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return tensor.item()


def vocab_shard_error(shard: torch.Tensor, reference: torch.Tensor, tp_rank: int) -> float:
    """max |shard - the HF logits of this rank's vocabulary rows| (the padded rows past the vocabulary skipped)."""
    per = shard.shape[-1]
    start, end = tp_rank * per, min((tp_rank + 1) * per, reference.shape[-1])
    return (shard[..., : end - start] - reference[..., start:end]).abs().max().item()


def compare_family(family: str, directory: Path, ids: torch.Tensor, results: dict) -> None:
    from megatron.core import parallel_state as mpu
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory).eval()
    layers, logits = hf_forward(hf, ids)
    results[f"{family}_hf_class"] = type(hf).__name__
    results[f"{family}_hidden_scale"] = max(layers[i].abs().max().item() for i in range(LAYERS))
    results[f"{family}_logits_scale"] = logits.abs().max().item()
    if family in WINDOWED:
        # The same weights with a window as long as the sequence: how much the window changes the logits.
        unwindowed = AutoModelForCausalLM.from_pretrained(directory, sliding_window=4 * SEQ).eval()
        with torch.no_grad():
            results[f"{family}_window_effect"] = (unwindowed(ids).logits - logits).abs().max().item()
    with parallel_context(TP2_SP) as state:
        stage = load_target(directory, TP2_SP, state.device, with_lm_head=True)
        tp_rank = mpu.get_tensor_model_parallel_rank()
        capture = PrefillCapture(stage, range(LAYERS))
        got = capture(ids)
        capture.close()
        if got is not None:
            results[f"{family}_layers_max_abs"] = max((got[i] - layers[i]).abs().max().item() for i in range(LAYERS))
            results[f"{family}_layers_seen"] = sorted(got)
        with torch.no_grad():
            positions = torch.arange(SEQ).expand_as(ids)
            shard = stage.model(ids, positions, attention_mask=None)
        results[f"{family}_logits_max_abs"] = max_over_ranks(vocab_shard_error(shard, logits, tp_rank))
        # The distillation's target logits: the frozen final norm + LM head on HF's last (pre-norm) layer output.
        vocab = stage.arch.vocab_size
        head = TargetHead.from_hf(
            directory, torch.ones(vocab, dtype=torch.bool), tp_rank, 2, mpu.get_tensor_model_parallel_group()
        )
        head_logits, _ = head(layers[LAYERS - 1])
        results[f"{family}_head_logits_max_abs"] = max_over_ranks(vocab_shard_error(head_logits, logits, tp_rank))
    if family == "gemma3_text":
        # Pipelined: each stage builds its own layers of the block spec (the final norm on the last stage only).
        with parallel_context(PP2) as state:
            capture = PrefillCapture(load_target(directory, PP2, state.device), range(LAYERS))
            got = capture(ids)
            capture.close()
            if got is not None:
                results[f"{family}_pp2_layers_max_abs"] = max(
                    (got[i] - layers[i]).abs().max().item() for i in range(LAYERS)
                )
                results[f"{family}_pp2_layers_seen"] = sorted(got)


def distill(target: Path, data: Path, results: dict) -> None:
    """EAGLE-3 from scratch (the tiny CPU recipe) online on the target: the same updates at TP=2 as at DP=2."""
    from megatron_osprey.recipes import get_recipe
    from megatron_osprey.training.distillation import run_distill

    for label, layout in DISTILL_LAYOUTS.items():
        cfg = get_recipe("tiny_cpu_eagle3_distill_2proc_fp32").distill
        cfg.target.path = str(target)
        cfg.data.data_path = [str(data)]
        cfg.data.shuffle = False
        cfg.training.seq_length = 64
        cfg.training.train_iters = DISTILL_ITERS
        cfg.ttt.ttt_steps = 3
        cfg.logging.progress_bar = False
        cfg.parallel = layout
        with parallel_context(cfg.parallel) as state:
            result = run_distill(cfg, state)
        if torch.distributed.get_rank() == 0:
            for key in ("loss/train", "optim/grad_norm", "acc/0"):
                results[f"distill_{label}_{key}"] = [entry[key] for entry in result.history]


def main(work: Path, result_path: Path) -> None:
    results = {}
    rank = torch.distributed.get_rank()
    ids = torch.randint(0, 300, (2, SEQ), generator=torch.Generator().manual_seed(5))
    if rank == 0:
        for family in FAMILIES:
            write_chat_target(work / family, family)
        write_topic_conversations(work / "train.jsonl", 16)
    torch.distributed.barrier()
    for family in FAMILIES:
        compare_family(family, work / family, ids, results)
    distill(work / "gemma3", work / "train.jsonl", results)
    merged = merged_on_rank0(results)
    if merged is not None:
        result_path.write_text(json.dumps(merged, indent=2))


if __name__ == "__main__":
    run_script(main, timeout_s=300)
