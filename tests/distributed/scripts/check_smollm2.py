"""Run under `torchrun --nproc_per_node=3`: SmolLM2-135M-Instruct at TP=3 and PP=3 against HF, and the
HF export from each layout.

    check_smollm2.py WORK RESULT_JSON MODEL_DIR

SmolLM2 has 9 query and 3 KV heads, so tensor parallelism must divide 3: TP=2 is not a valid layout
for it, TP=3 is (3 query heads and 1 KV head per rank). One 3-rank launch then also runs PP=3, whose
middle stage holds neither the embedding nor the head, and whose first and last stages share the tied
embedding. Rank 0 runs the HF reference once and broadcasts it; it writes the measured figures to
RESULT_JSON, and the pytest side asserts them.
"""

import json
from pathlib import Path

import torch

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.convert.hf_to_megatron import load_hf_weights
from megatron_osprey.convert.megatron_to_hf import export_to_hf
from megatron_osprey.models.backbone.gpt import build_gpt_model
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.testing.tiny_models import causal_logits
from tests.distributed.scripts.check_foundation import gather_vocab, pp_forward, same_files
from tests.distributed.scripts.ranks import merged_on_rank0, run_script
from tests.real_model import PROMPTS, chat_ids

SIZE = 3


def reference(model_dir: Path, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [1, n], HF logits [1, n, V]) of the chat prompts back to back, computed on rank 0 only."""
    shape = torch.zeros(3, dtype=torch.long)
    if rank == 0:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        ids = torch.cat([chat_ids(tokenizer, text) for text in PROMPTS])[None]
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = hf(ids).logits.contiguous()
        del hf
        shape = torch.tensor(logits.shape)
    torch.distributed.broadcast(shape, 0)
    if rank != 0:
        ids = torch.empty(1, int(shape[1]), dtype=torch.long)
        logits = torch.empty(*shape.tolist())
    torch.distributed.broadcast(ids, 0)
    torch.distributed.broadcast(logits, 0)
    return ids, logits


def main(work: Path, result_path: Path, model: str) -> None:
    model_dir = Path(model)
    rank = torch.distributed.get_rank()
    ids, expected = reference(model_dir, rank)
    arch = ModelArch.from_hf_config(model_dir)
    vocab = expected.shape[-1]
    results = {}

    cfg = ParallelConfig(tensor_model_parallel_size=SIZE)
    with parallel_context(cfg) as state:
        model = build_gpt_model(arch, cfg, perform_initialization=False).eval()
        load_hf_weights(model, model_dir, arch, state.tp_rank, SIZE)
        with torch.no_grad():
            local = causal_logits(model, ids)
            logits = gather_vocab(local)
        results["tp3_local_vocab"] = local.shape[-1]
        results["tp3_max_abs"] = (logits[..., :vocab] - expected).abs().max().item()
        results["tp3_argmax_equal"] = torch.equal(logits[..., :vocab].argmax(-1), expected.argmax(-1))
        export_to_hf([model], arch, work / "export_tp3")
        del model

    cfg = ParallelConfig(pipeline_model_parallel_size=SIZE)
    with parallel_context(cfg) as state:
        model = build_gpt_model(arch, cfg, perform_initialization=False).eval()
        load_hf_weights(model, model_dir, arch, 0, 1)
        with torch.no_grad():
            logits = pp_forward(model, ids)
        if logits is not None:
            results["pp3_max_abs"] = (logits[..., :vocab] - expected).abs().max().item()
            results["pp3_argmax_equal"] = torch.equal(logits[..., :vocab].argmax(-1), expected.argmax(-1))
        results[f"pp3_layers_stage{state.rank}"] = len(model.decoder.layers)
        export_to_hf([model], arch, work / "export_pp3")
        del model

    merged = merged_on_rank0(results)
    if merged is not None:
        # Bit-identical exports, compared once on rank 0 (each side is the whole 540 MB model).
        for layout in ("tp3", "pp3"):
            merged[f"{layout}_export_identical"] = same_files(model_dir, work / f"export_{layout}")
        result_path.write_text(json.dumps(merged, indent=2))


if __name__ == "__main__":
    run_script(main, timeout_s=600)
