"""Run under `torchrun --nproc_per_node=2`: GLM-4.5 and gpt-oss targets at TP=2+SP and EP=2 against HF, then a tiny
drafter distilled online on a GLM-4.5 target at EP=2 for a few steps.

argv: WORK RESULT TARGET DRAFTER DATA (the distillation's GLM-4.5 target, drafter adapted to it, conversations).
The gpt-oss target is written as an MXFP4 checkpoint (experts as blocks +
scales, dequantized by the loader); its HF reference is the model in memory, holding the same rounded values.
Rank 0 writes a JSON of measured figures to RESULT; the pytest side asserts them.
"""

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from megatron_osprey.models.target.pipeline_stage import PrefillCapture, load_target
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.testing.distill_setup import tiny_distill_config
from megatron_osprey.testing.tiny_models import TINY_TARGET_CONFIGS, write_chat_target
from megatron_osprey.training.distillation import run_distill
from tests.distributed.scripts.ranks import merged_on_rank0, run_script

FAMILIES = ("glm4_moe", "gpt_oss")
LAYOUTS = {
    # gpt-oss's biased experts run at expert-tensor-parallel size 1 (Megatron-Core's rule).
    "tp2_sp": ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1),
    "ep2": ParallelConfig(expert_model_parallel_size=2),
}
DISTILL_ITERS = 4
SEQ = 32  # longer than gpt-oss's tiny window (8): the sliding layers mask keys the full layers see


def hf_outputs(model, ids):
    """Every decoder layer's output and the logits of HF's own forward."""
    outputs = {}
    hooks = [
        layer.register_forward_hook(
            lambda m, i, o, k=k: outputs.__setitem__(k, (o[0] if isinstance(o, tuple) else o).detach())
        )
        for k, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        logits = model(ids).logits
    for hook in hooks:
        hook.remove()
    return outputs, logits


def main(work: Path, result_path: Path, target: str, drafter: str, data: str) -> None:
    results = {}
    rank = torch.distributed.get_rank()
    ids = torch.randint(0, 300, (2, SEQ), generator=torch.Generator().manual_seed(5))
    for family in FAMILIES:
        directory = work / family
        # Rank 0 writes the target; its in-memory model (MXFP4-rounded experts) is every rank's reference.
        state = [write_chat_target(directory, family, mxfp4=True).state_dict() if rank == 0 else None]
        torch.distributed.broadcast_object_list(state, src=0)
        vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
        hf = AutoModelForCausalLM.from_config(TINY_TARGET_CONFIGS[family](vocab), attn_implementation="eager")
        hf.load_state_dict(state[0])
        hf = hf.eval()
        layers, logits = hf_outputs(hf, ids)
        results[f"{family}_hf_logits_max"] = logits.abs().max().item()
        results[f"{family}_hf_states_max"] = max(t.abs().max().item() for t in layers.values())
        for label, cfg in LAYOUTS.items():
            with parallel_context(cfg) as state:
                stage = load_target(directory, cfg, state.device, with_lm_head=True)
                capture = PrefillCapture(stage, range(len(layers)))
                got = capture(ids)
                capture.close()
                with torch.no_grad():
                    position = torch.arange(ids.shape[1]).expand_as(ids)
                    out = stage.model(ids, position, attention_mask=None)
                if label == "tp2_sp":  # vocab-parallel logits: gather the two halves
                    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

                    out = gather_from_tensor_model_parallel_region(out)
                if got is not None:
                    results[f"{family}_{label}_states_max_abs"] = max(
                        (got[i] - layers[i]).abs().max().item() for i in range(len(layers))
                    )
                    results[f"{family}_{label}_logits_max_abs"] = (
                        (out[..., : logits.shape[-1]] - logits).abs().max().item()
                    )
                    mlp = stage.model.decoder.layers[-1].mlp
                    results[f"{family}_{label}_local_experts"] = len(mlp.experts.local_experts)
    # Online distillation: the frozen GLM-4.5 target (experts over EP 2) feeds the dense drafter, replicated.
    setup = {"target": target, "drafter": drafter, "data": data}
    cfg = tiny_distill_config(setup, ttt__ttt_steps=3, training__train_iters=DISTILL_ITERS, checkpoint__save=None)
    cfg.parallel = ParallelConfig(expert_model_parallel_size=2)
    with parallel_context(cfg.parallel) as state:
        history = run_distill(cfg, state).history
    if rank == 0:
        for key in ("loss/train", "acc/0", "optim/grad_norm"):
            results[f"distill_{key}"] = [entry[key] for entry in history]
    merged = merged_on_rank0(results)
    if merged is not None:
        result_path.write_text(json.dumps(merged, indent=2))


if __name__ == "__main__":
    run_script(main, timeout_s=300)
