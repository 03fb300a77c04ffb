"""torchrun --nproc_per_node=2: every GPU distill recipe's drafter family (Osprey, EAGLE-3 with 1 and 2 layers) built
under its recipe's parallel layout scaled to 2 ranks (TP, EP and the expert TP, sequence parallelism as the recipe
sets them; the dense drafter at EP 1 inside it), one TTT step at tiny size: the loss, its metrics and the fusion_fc
gradient equal the same drafter's at DP=2.

Rank 0 writes, per (family, layout), the recipes it stands for and the differences to RESULT.
"""

import copy
import dataclasses
import json
from pathlib import Path

import torch

from megatron_osprey.losses.ttt import TTTLossConfig, drafter_inputs, ttt_loss
from megatron_osprey.models.drafter.convert import load_reference_state
from megatron_osprey.models.drafter.model import build_drafter_model
from megatron_osprey.models.drafter.reference import ReferenceDrafter
from megatron_osprey.models.target.lm_head import TargetHead
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.recipes import RECIPES, get_recipe
from tests.distributed.scripts.ranks import run_script
from tests.ttt_fixtures import make_batch, make_drafter, make_target

WORLD = 2


def scaled_layout(parallel: ParallelConfig) -> ParallelConfig:
    """The recipe's layout on WORLD ranks: each size capped at WORLD, the rest as the recipe sets it."""
    tp = min(parallel.tensor_model_parallel_size, WORLD)
    return dataclasses.replace(
        parallel,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=min(parallel.expert_model_parallel_size, WORLD),
        sequence_parallel=parallel.sequence_parallel and tp > 1,
    )


def families() -> dict[tuple, list[str]]:
    """(variant, layers, extra layers, layout fields) -> the recipes whose distill stage builds that drafter so."""
    out: dict[tuple, list[str]] = {}
    for name in RECIPES:
        recipe = get_recipe(name)
        if recipe.distill is None or recipe.hardware == "cpu":
            continue
        config = recipe.config("distill")
        parallel = copy.deepcopy(config.parallel)
        config.target.fold_into(parallel)
        drafter = config.drafter
        variant = "eagle3" if drafter.baseline else "osprey"
        layers = drafter.eagle3_num_layers if drafter.baseline else 2
        layout = dataclasses.astuple(scaled_layout(parallel))
        out.setdefault((variant, layers, drafter.eagle3_extra_layers, layout), []).append(name)
    return out


def tiny_drafter(variant: str, layers: int, extra: str):
    arch, _ = make_drafter(200, variant)
    arch = dataclasses.replace(arch, body=arch.body.with_num_layers(layers), eagle3_extra_layers=extra)
    torch.manual_seed(11)
    reference = ReferenceDrafter(arch.reference_config())
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.05 * torch.randn_like(param))  # W_new != 0 so every step depends on g
    ids = torch.randperm(arch.vocab_size, generator=torch.Generator().manual_seed(5))[: arch.draft_vocab_size]
    reference.set_draft_vocab(ids)
    return arch, reference


def run(cfg: ParallelConfig, target_dir: Path, arch, reference) -> tuple[float, dict, torch.Tensor]:
    from megatron.core import parallel_state as mpu

    batch = make_batch()
    with parallel_context(cfg) as state:
        tp_size = cfg.tensor_model_parallel_size
        model = build_drafter_model(arch, cfg, transformer_impl="local")
        load_reference_state(model, reference.state_dict(), state.tp_rank, tp_size)
        group = mpu.get_tensor_model_parallel_group()
        head = TargetHead.from_hf(target_dir, reference.t2d, state.tp_rank, tp_size, group)
        draft_logits, in_draft = head(batch["final_hidden"])
        logits, _ = model.ttt_forward(drafter_inputs(batch["input_ids"]), batch["aux_hidden"], 5)
        loss, metrics = ttt_loss(
            logits, draft_logits, batch["loss_mask"], in_draft, arch.draft_vocab_size, TTTLossConfig(), group
        )
        loss.backward()
        return loss.item(), {k: v.item() for k, v in metrics.items()}, model.fusion_fc.weight.grad.clone()


def main(work: Path, result_path: Path) -> None:
    target_dir = work / "target"
    if torch.distributed.get_rank() == 0:
        make_target(target_dir)
    torch.distributed.barrier()
    results = {}
    for (variant, layers, extra, layout), names in families().items():
        arch, reference = tiny_drafter(variant, layers, extra)
        cfg = ParallelConfig(*layout)
        cfg.validate(WORLD)
        base_loss, base_metrics, base_grad = run(ParallelConfig(), target_dir, arch, reference)
        loss, metrics, grad = run(cfg, target_dir, arch, reference)
        key = (
            f"{variant}{layers}_{extra}_tp{cfg.tensor_model_parallel_size}_ep{cfg.expert_model_parallel_size}"
            f"{'_sp' if cfg.sequence_parallel else ''}"
        )
        results[key] = {
            "recipes": names,
            "loss": loss,
            "loss_diff": abs(loss - base_loss),
            "metric_diff": max(abs(metrics[k] - base_metrics[k]) for k in base_metrics),
            "fc_grad_diff": (grad - base_grad).abs().max().item(),
            "fc_grad_norm": grad.norm().item(),
        }
    if torch.distributed.get_rank() == 0:
        result_path.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    run_script(main, timeout_s=300)
