"""Run under `torchrun --nproc_per_node=2`: targets at TP=2+SP / PP=2 / EP=2 against HF, and extraction.

Rank 0 writes a JSON of measured figures to argv[2]; the pytest side asserts them.
"""

import json
from pathlib import Path

import torch

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.data.extract import extract_hidden_states
from megatron_osprey.data.hidden_state_store import HiddenStateStore, HiddenStateStoreConfig
from megatron_osprey.models.target.config import TargetConfig
from megatron_osprey.models.target.pipeline_stage import PrefillCapture, load_target
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.stages.extract import ExtractConfig
from megatron_osprey.testing.tiny_models import write_chat_target, write_conversations_jsonl
from tests.distributed.scripts.ranks import merged_on_rank0, run_script
from tests.store_quanta import error_in_quanta

FAMILIES = ("llama", "qwen3", "qwen3_moe", "minimax_m2")
LAYOUTS = {
    "tp2_sp": ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
    "pp2": ParallelConfig(pipeline_model_parallel_size=2),
    "ep2": ParallelConfig(expert_model_parallel_size=2),
}


def hf_layer_outputs(model, ids):
    """Every decoder layer's output (the last one before the final norm), as [b, s, h] tensors."""
    outputs = {}
    hooks = [
        layer.register_forward_hook(
            lambda m, i, o, k=k: outputs.__setitem__(k, (o[0] if isinstance(o, tuple) else o).detach())
        )
        for k, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        result = model(ids, output_hidden_states=True)
    for hook in hooks:
        hook.remove()
    return outputs, result.logits, result.hidden_states


def main(work: Path, result_path: Path) -> None:
    results = {}
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(5))
    references = {}
    rank = torch.distributed.get_rank()
    for family in FAMILIES:
        directory = work / family
        if rank == 0:
            write_chat_target(directory, family)
        torch.distributed.barrier()
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(directory).eval()
        references[family] = (directory, hf_layer_outputs(hf, ids))
        layers, _, hidden_states = references[family][1]
        # HF's output_hidden_states[i + 1] is layer i's output (the last one is normed).
        results[f"{family}_hf_hooks_match_output_hidden_states"] = all(
            torch.equal(layers[i], hidden_states[i + 1]) for i in range(len(layers) - 1)
        )

    for family, (directory, (layers, logits, _)) in references.items():
        num_layers = len(layers)
        for label, cfg in LAYOUTS.items():
            if label == "ep2" and family in ("llama", "qwen3"):
                continue
            with parallel_context(cfg) as state:
                stage = load_target(directory, cfg, state.device, with_lm_head=label == "ep2")
                capture = PrefillCapture(stage, range(num_layers))
                if label == "ep2":
                    # The same capture run also yields the logits: the last stage keeps the LM head here.
                    with torch.no_grad():
                        position = torch.arange(ids.shape[1]).expand_as(ids)
                        out = stage.model(ids, position, attention_mask=None)
                    results[f"{family}_ep2_logits_max_abs"] = (out[..., : logits.shape[-1]] - logits).abs().max().item()
                    experts = stage.model.decoder.layers[0].mlp.experts.local_experts
                    results[f"{family}_ep2_local_experts"] = len(experts)
                got = capture(ids)
                capture.close()
                if got is not None:
                    results[f"{family}_{label}_max_abs"] = max(
                        (got[i] - layers[i]).abs().max().item() for i in range(num_layers)
                    )
                    results[f"{family}_{label}_layers_seen"] = sorted(got)

    # End to end: 7 conversations over 2 data-parallel writers (EP=2: the writer with
    # fewer micro-batches runs a dummy forward), and at PP=2 (aux layers cross stages).
    data = work / "conversations.jsonl"
    if rank == 0:
        write_conversations_jsonl(data, 7)
    torch.distributed.barrier()
    for family, label in (("minimax_m2", "ep2"), ("qwen3", "pp2")):
        directory = references[family][0]
        store_dir = work / f"store_{family}_{label}"
        config = ExtractConfig(
            target=TargetConfig(path=str(directory)),
            data_path=str(data),
            micro_batch_size=2,
            aux_layer_ids=(0, 2, 4),
            store=HiddenStateStoreConfig(store_dir=str(store_dir), samples_per_shard=2),
        )
        arch = ModelArch.from_hf_config(directory)
        with parallel_context(LAYOUTS[label]) as state:
            extract_hidden_states(config, state, arch, log=lambda _: None)
        if rank == 0:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(directory).eval()
            store = HiddenStateStore(store_dir, dtype=torch.float32)
            worst = 0.0
            for sample in store:
                layers, _, _ = hf_layer_outputs(hf, sample["input_ids"][None])
                aux = torch.cat([layers[i][0] for i in (0, 2, 4)], dim=-1)
                # The store keeps bf16: measured in bf16 quanta of the HF value.
                worst = max(
                    worst,
                    error_in_quanta(sample["aux_hidden"], aux, "bf16", 3),
                    error_in_quanta(sample["final_hidden"], layers[5][0], "bf16", 1),
                )
            results[f"extract_{family}_{label}_num_samples"] = len(store)
            results[f"extract_{family}_{label}_writers"] = len(store.manifest["writers"])
            results[f"extract_{family}_{label}_quanta"] = worst

    merged = merged_on_rank0(results)
    if merged is not None:
        result_path.write_text(json.dumps(merged, indent=2))


if __name__ == "__main__":
    run_script(main)
