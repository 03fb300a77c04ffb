"""Run under `torchrun --nproc_per_node=2`: TP=2 / TP=2+SP / PP=2 forward, export and prune checks.

Rank 0 writes a JSON of measured figures to argv[2]; the pytest side asserts them.
"""

import json
from pathlib import Path

import torch

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.convert.hf_to_megatron import load_hf_weights
from megatron_osprey.convert.megatron_to_hf import export_to_hf
from megatron_osprey.models.backbone.gpt import build_gpt_model
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.stages import prune
from megatron_osprey.stages.prune import PruneConfig
from megatron_osprey.testing.tiny_models import (
    VOCAB,
    causal_logits,
    llama_config,
    make_hf_model,
    qwen3_config,
    truncated_logits,
)
from megatron_osprey.training.checkpointing import load_checkpoint
from tests.distributed.scripts.ranks import merged_on_rank0, run_script


def gather_vocab(logits):
    from megatron.core import parallel_state as mpu

    group = mpu.get_tensor_model_parallel_group()
    parts = [torch.empty_like(logits) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def same_files(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    left = {}
    for f in sorted(a.glob("*.safetensors")):
        left.update(load_file(f))
    right = {}
    for f in sorted(b.glob("*.safetensors")):
        right.update(load_file(f))
    return set(left) == set(right) and all(torch.equal(left[k], right[k]) for k in left)


def pp_forward(model, ids):
    """Forward-only through Megatron's pipeline schedule; logits on the last stage, else None."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    collected = []

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        out = causal_logits(model, batch)

        def loss_func(output_tensor):
            collected.append(output_tensor.detach())
            return output_tensor.sum() * 0, {}

        return out, loss_func

    forward_backward = get_forward_backward_func()
    forward_backward(
        forward_step_func=forward_step,
        data_iterator=iter([ids]),
        model=[model],
        num_microbatches=1,
        seq_length=ids.shape[1],
        micro_batch_size=ids.shape[0],
        forward_only=True,
    )
    return collected[0] if collected else None


def main(work: Path, result_path: Path) -> None:
    results = {}
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(5))
    with parallel_context(ParallelConfig()) as state:  # process group only, to make the models
        rank = state.rank
        models = {}
        for name, make in (("qwen3", qwen3_config), ("llama", llama_config)):
            directory = work / name
            if rank == 0:
                make_hf_model(make(), directory)
            torch.distributed.barrier()
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(directory).eval()
            with torch.no_grad():
                models[name] = (directory, hf(ids).logits, truncated_logits(hf, ids, 2))

    for name, (directory, expected, _) in models.items():
        arch = ModelArch.from_hf_config(directory)
        for label, cfg in (
            ("tp2", ParallelConfig(tensor_model_parallel_size=2)),
            ("tp2_sp", ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)),
        ):
            with parallel_context(cfg) as state:
                model = build_gpt_model(arch, cfg, perform_initialization=False).eval()
                load_hf_weights(model, directory, arch, state.tp_rank, 2)
                with torch.no_grad():
                    logits = gather_vocab(causal_logits(model, ids))
                results[f"{name}_{label}_max_abs"] = (logits[..., :VOCAB] - expected).abs().max().item()
                if label == "tp2":
                    export_to_hf([model], arch, work / f"{name}_export_tp2")
                    results[f"{name}_tp2_export_identical"] = same_files(directory, work / f"{name}_export_tp2")
                    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

                    with get_cuda_rng_tracker().fork():
                        draw = torch.rand(8)
                    draws = [torch.empty(8) for _ in range(2)]
                    torch.distributed.all_gather(draws, draw)
                    results["tp_rng_streams_differ"] = not torch.equal(draws[0], draws[1])

        cfg = ParallelConfig(pipeline_model_parallel_size=2)
        with parallel_context(cfg) as state:
            model = build_gpt_model(arch, cfg, perform_initialization=False).eval()
            load_hf_weights(model, directory, arch, 0, 1)
            with torch.no_grad():
                logits = pp_forward(model, ids)
            if logits is not None:
                results[f"{name}_pp2_max_abs"] = (logits[..., :VOCAB] - expected).abs().max().item()
            export_to_hf([model], arch, work / f"{name}_export_pp2")
            results[f"{name}_pp2_export_identical"] = same_files(directory, work / f"{name}_export_pp2")
            results[f"{name}_pp2_layers_per_stage"] = len(model.decoder.layers)

    # Stage 1 under TP=2, then its dist checkpoint loaded (resharded) at PP=2.
    directory, _, truncated = models["qwen3"]
    prune.run(  # in the TP=2 process groups its run() sets up
        PruneConfig(
            source=str(directory),
            output=str(work / "pruned"),
            num_layers=2,
            parallel=ParallelConfig(tensor_model_parallel_size=2),
        )
    )
    arch = ModelArch.from_hf_config(work / "pruned" / "hf")
    cfg = ParallelConfig(pipeline_model_parallel_size=2)
    with parallel_context(cfg) as state:
        model = build_gpt_model(arch, cfg).eval()
        loaded, _ = load_checkpoint(work / "pruned" / "megatron", model.sharded_state_dict())
        model.load_state_dict(loaded)
        with torch.no_grad():
            logits = pp_forward(model, ids)
        if logits is not None:
            results["prune_tp2_reload_pp2_max_abs"] = (logits[..., :VOCAB] - truncated).abs().max().item()

    with parallel_context(ParallelConfig()):
        merged = merged_on_rank0(results)
        if merged is not None:
            result_path.write_text(json.dumps(merged, indent=2))


if __name__ == "__main__":
    run_script(main)
