"""torchrun --nproc_per_node=2: the adapted Megatron drafter at TP=2 (and TP=2 + SP) equals the reference.

argv: work_dir result_json adapted_drafter_dir
"""

import json
from pathlib import Path

import torch

from megatron_osprey.base.run_config import load_run_config
from megatron_osprey.models.drafter.convert import reference_state
from megatron_osprey.models.drafter.model import DrafterArch, build_drafter_model
from megatron_osprey.models.drafter.reference import ReferenceDrafter
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.training.checkpointing import load_checkpoint
from tests.distributed.scripts.ranks import run_script


def gather_vocab(logits):
    from megatron.core import parallel_state as mpu

    group = mpu.get_tensor_model_parallel_group()
    parts = [torch.empty_like(logits) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def main(work: Path, result_path: Path, drafter: str) -> None:
    drafter_dir = Path(drafter)
    arch = DrafterArch.from_dict(load_run_config(drafter_dir)["drafter"])
    reference = ReferenceDrafter.from_pretrained(drafter_dir / "hf").eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128000, (2, 16), generator=generator)
    aux = torch.randn(2, 16, 3 * arch.target_hidden_size, generator=generator)
    with torch.no_grad():
        expected = reference.ttt_forward(ids, aux, 3)
    results = {}
    for label, cfg in (
        ("tp2", ParallelConfig(tensor_model_parallel_size=2)),
        ("tp2_sp", ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)),
    ):
        with parallel_context(cfg):
            model = build_drafter_model(arch, cfg).eval()
            state, _ = load_checkpoint(drafter_dir / "megatron", model.sharded_state_dict())
            model.load_state_dict(state)
            with torch.no_grad():
                steps, _ = model.ttt_forward(ids, aux, 3)
            errors = [(gather_vocab(s)[..., : arch.vocab_size] - e).abs().max().item() for s, e in zip(steps, expected)]
            results[f"{label}_ttt_max_abs"] = max(errors)
            back = reference_state(
                model, __import__("megatron.core.parallel_state", fromlist=["x"]).get_tensor_model_parallel_group()
            )
            ref_state = reference.state_dict()
            results[f"{label}_reference_state_identical"] = set(back) == set(ref_state) and all(
                torch.equal(back[k], ref_state[k]) for k in ref_state
            )
            # One backward: W_new gets a gradient on every TP rank's shard.
            model.train()
            logits, _ = model(ids, aux_hidden=aux)
            logits.float().pow(2).mean().backward()
            grad = model.decoder.layers[0].self_attention.linear_qkv.weight.grad[:, : arch.hidden_size]
            flags = torch.tensor([float(grad.abs().sum() > 0)])
            torch.distributed.all_reduce(flags)
            results[f"{label}_w_new_grad_on_all_ranks"] = flags.item() == 2
    if torch.distributed.get_rank() == 0:
        result_path.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    run_script(main)
