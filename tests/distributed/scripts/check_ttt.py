"""torchrun --nproc_per_node=2: the TTT loss (and the fusion_fc gradient) at TP=2 / TP=2+SP equals TP=1."""

import json
from pathlib import Path

import torch

from megatron_osprey.losses.ttt import TTTLossConfig, drafter_inputs, ttt_loss
from megatron_osprey.models.drafter.convert import load_reference_state
from megatron_osprey.models.drafter.model import build_drafter_model
from megatron_osprey.models.target.lm_head import TargetHead
from megatron_osprey.parallel import ParallelConfig, parallel_context
from tests.distributed.scripts.ranks import run_script
from tests.ttt_fixtures import make_batch, make_drafter, make_target


def run(cfg, target_dir, draft_vocab):
    from megatron.core import parallel_state as mpu

    arch, reference = make_drafter(draft_vocab)
    batch = make_batch()
    with parallel_context(cfg) as state:
        tp_size = cfg.tensor_model_parallel_size
        model = build_drafter_model(arch, cfg)
        load_reference_state(model, reference.state_dict(), state.tp_rank, tp_size)
        group = mpu.get_tensor_model_parallel_group()
        head = TargetHead.from_hf(target_dir, reference.t2d, state.tp_rank, tp_size, group)
        draft_logits, in_draft = head(batch["final_hidden"])
        logits, _ = model.ttt_forward(drafter_inputs(batch["input_ids"]), batch["aux_hidden"], 5)
        loss, metrics = ttt_loss(
            logits, draft_logits, batch["loss_mask"], in_draft, draft_vocab, TTTLossConfig(), group
        )
        loss.backward()
        return loss.item(), {k: v.item() for k, v in metrics.items()}, model.fusion_fc.weight.grad.clone()


def main(work: Path, result_path: Path) -> None:
    target_dir = work / "target"
    if torch.distributed.get_rank() == 0:
        make_target(target_dir)
    torch.distributed.barrier()
    results = {}
    for draft_vocab in (200, 300):
        base_loss, base_metrics, base_grad = run(ParallelConfig(), target_dir, draft_vocab)
        for label, cfg in (
            ("tp2", ParallelConfig(tensor_model_parallel_size=2)),
            ("tp2_sp", ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)),
        ):
            loss, metrics, grad = run(cfg, target_dir, draft_vocab)
            key = f"v{draft_vocab}_{label}"
            results[f"{key}_loss_diff"] = abs(loss - base_loss)
            results[f"{key}_metric_diff"] = max(abs(metrics[k] - base_metrics[k]) for k in base_metrics)
            results[f"{key}_fc_grad_diff"] = (grad - base_grad).abs().max().item()
            results[f"{key}_loss"] = loss
    if torch.distributed.get_rank() == 0:
        result_path.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    run_script(main)
