"""Run under `torchrun --nproc_per_node=2`: a DeepSeek-V3 target (transformers' DeepseekV3ForCausalLM, random, tiny)
loaded as the Megatron target at TP=2 (+SP) and EP=2 against HF, then a drafter distilled on it online at EP=2 and
at DP=2.

argv: WORK RESULT TARGET DRAFTER DATA. Rank 0 writes the measured figures to RESULT; the pytest side asserts them.
"""

import json
from pathlib import Path

import torch

from megatron_osprey.models.target.pipeline_stage import PrefillCapture, load_target
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.testing.distill_setup import tiny_distill_config
from megatron_osprey.training.distillation import run_distill
from tests.distributed.scripts.check_foundation import gather_vocab
from tests.distributed.scripts.check_targets import hf_layer_outputs
from tests.distributed.scripts.ranks import merged_on_rank0, run_script

LAYOUTS = {
    "tp2_sp": ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
    "ep2": ParallelConfig(expert_model_parallel_size=2),
}
DISTILL_LAYOUTS = {"ep2": ParallelConfig(expert_model_parallel_size=2), "dp2": ParallelConfig()}


def compare_with_hf(target: str, results: dict) -> None:
    """Every decoder layer's output and the logits of each layout against HF's forward on the same ids."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    vocab = hf.config.vocab_size
    ids = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(5))
    layers, logits, _ = hf_layer_outputs(hf, ids)
    results["hf_logits_max"] = logits.abs().max().item()
    results["hf_states_max"] = max(t.abs().max().item() for t in layers.values())
    for label, cfg in LAYOUTS.items():
        with parallel_context(cfg) as state:
            stage = load_target(target, cfg, state.device, with_lm_head=True)
            capture = PrefillCapture(stage, range(len(layers)))
            got = capture(ids)
            capture.close()
            with torch.no_grad():
                position = torch.arange(ids.shape[1]).expand_as(ids)
                out = stage.model(ids, position, attention_mask=None)
            out = gather_vocab(out)  # [b, s, padded vocab / TP] on each TP rank
            results[f"{label}_logits_max_abs"] = (out[..., :vocab] - logits).abs().max().item()
            block = stage.model.decoder.layers[1].mlp
            results[f"{label}_local_experts"] = len(block.experts.local_experts)
            results[f"{label}_layer0_is_dense"] = not hasattr(stage.model.decoder.layers[0].mlp, "router")
            results[f"{label}_shared_expert"] = hasattr(block, "shared_experts")
            if got is not None:
                results[f"{label}_max_abs"] = max((got[i] - layers[i]).abs().max().item() for i in layers)
                results[f"{label}_layers_seen"] = sorted(got)


def distill(target: str, drafter: str, data: str, work: Path, results: dict) -> None:
    """Two updates of the adapted drafter on the online target, at EP=2 and at DP=2 (the same updates)."""
    setup = {"target": target, "drafter": drafter, "data": data}
    for label, layout in DISTILL_LAYOUTS.items():
        cfg = tiny_distill_config(setup, ttt__ttt_steps=3, training__train_iters=2, checkpoint__save=str(work / label))
        cfg.parallel = layout
        with parallel_context(cfg.parallel) as state:
            result = run_distill(cfg, state)
        if torch.distributed.get_rank() == 0:
            for key in ("loss/train", "optim/grad_norm", "acc/0"):
                results[f"distill_{label}_{key}"] = [entry[key] for entry in result.history]


def main(work: Path, result_path: Path, target: str, drafter: str, data: str) -> None:
    results: dict = {}
    compare_with_hf(target, results)
    distill(target, drafter, data, work, results)
    merged = merged_on_rank0(results)
    if merged is not None:
        result_path.write_text(json.dumps(merged, indent=2))


if __name__ == "__main__":
    run_script(main, timeout_s=300)
