"""Run under `torchrun --nproc_per_node=2`: Stage 2 pretraining at TP=2 / PP=2 / DP=2, resume, reshard.

Rank 0 writes a JSON of measured figures to argv[2]; the pytest side asserts them.
"""

import json
from pathlib import Path

import torch

from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.recipes import get_recipe
from megatron_osprey.stages import prune
from megatron_osprey.stages.prune import PruneConfig
from megatron_osprey.testing.tiny_models import make_hf_model, qwen3_config
from megatron_osprey.training import data
from megatron_osprey.training.gpt_step import gpt_forward_step
from megatron_osprey.training.pretraining import run_pretrain
from tests.distributed.scripts.check_pretrain_fixtures import EOD, make_corpus, plain_pytorch_run
from tests.distributed.scripts.ranks import run_script

ITERS = 30
RESHARD_AT = 25  # the TP=2 run saves here; resharded runs continue to ITERS


def config(work: Path, **parallel):
    cfg = get_recipe("tiny_cpu_backbone_pretrain_2proc_fp32").pretrain
    cfg.model.backbone = str(work / "backbone")
    cfg.data.data_path = [str(work / "data" / "corpus_text_document")]
    cfg.data.split = "100,0,0"  # no validation: keeps every run to its training steps
    cfg.parallel = ParallelConfig(**parallel)
    cfg.training.train_iters = ITERS
    cfg.optimizer.lr = 3e-3
    cfg.optimizer.min_lr = 3e-4
    cfg.logging.progress_bar = False
    cfg.logging.eval_iters = 0
    return cfg


def train(cfg):
    """Run Stage 2; returns per-iteration losses, lrs, grad norms and a digest of each rank's tokens."""
    digests = []

    def recording_forward_step(data_iterator, model):
        class Tap:
            def __next__(self):
                batch = next(data_iterator)
                digests.append(
                    int(
                        (
                            batch["tokens"].long()
                            * torch.arange(1, batch["tokens"].numel() + 1).view_as(batch["tokens"])
                        ).sum()
                    )
                )
                return batch

        return gpt_forward_step(Tap(), model)

    with parallel_context(cfg.parallel) as state:
        result = run_pretrain(cfg, state, forward_step=recording_forward_step)
        gathered = [None] * state.world_size
        torch.distributed.all_gather_object(gathered, digests)
    history = [h for h in result.history if "loss/train" in h]
    return {
        "loss": [h["loss/train"] for h in history],
        "lr": [h["optim/lr"] for h in history],
        "grad_norm": [h["optim/grad_norm"] for h in history],
        "digests": gathered,
        "final_iteration": result.state.iteration,
        "consumed": result.state.consumed_train_samples,
    }


def hf_first_step_loss(work: Path, cfg) -> float:
    """The HF (pruned) model's mean token loss on global batch 0, from the same GPTDataset."""
    from transformers import AutoModelForCausalLM

    tokenizer = data.DatasetTokenizer(300, EOD)
    sizes = data.split_sizes(ITERS, cfg.training.global_batch_size, 0, 0)
    train_ds = data.build_gpt_datasets(cfg.data, tokenizer, cfg.training.seq_length, cfg.parallel.seed, sizes)[0]
    batch = data.stack_samples([train_ds[i] for i in range(cfg.training.global_batch_size)])
    hf = AutoModelForCausalLM.from_pretrained(work / "backbone" / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(batch["tokens"]).logits
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).double(), batch["labels"].reshape(-1)
    ).item()


def compare_adam_moments(reference: Path, other: Path, iteration: int) -> dict:
    """Adam's exp_avg / exp_avg_sq of two checkpoints, each gathered to full tensors by its global keys.

    Returns the key sets' agreement and, per moment, the largest |difference| relative to the
    largest |value| of the same tensor. Every rank loads whole tensors (no sharding).
    """
    from megatron.core import dist_checkpointing

    def moments(root: Path) -> dict:
        tensors = dist_checkpointing.load_plain_tensors(str(root / f"iter_{iteration:07d}"))
        return {k: v for k, v in tensors.items() if k.startswith("optimizer.state.exp_avg")}

    ours, theirs = moments(other), moments(reference)
    worst = {"exp_avg": 0.0, "exp_avg_sq": 0.0}
    for key in set(ours) & set(theirs):
        kind = "exp_avg_sq" if key.startswith("optimizer.state.exp_avg_sq.") else "exp_avg"
        # The vocabulary is padded to 128 x TP rows: compare the rows both layouts have.
        rows = min(ours[key].shape[0], theirs[key].shape[0])
        a, b = ours[key][:rows], theirs[key][:rows]
        worst[kind] = max(worst[kind], ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item())
    return {"same_keys": set(ours) == set(theirs), "num_tensors": len(ours), **worst}


def main(work: Path, result_path: Path) -> None:
    results = {}
    with parallel_context(ParallelConfig()) as state:
        if state.rank == 0:
            make_corpus(work / "data" / "corpus_text_document")
            cfg4 = qwen3_config(layers=4)
            cfg4.eos_token_id = EOD
            make_hf_model(cfg4, work / "hf_source")
        torch.distributed.barrier()
    # Stage 1 on both ranks (DP=2), in the process groups its run() sets up.
    prune.run(
        PruneConfig(
            source=str(work / "hf_source"), output=str(work / "backbone"), num_layers=2, transformer_impl="local"
        )
    )
    with parallel_context(ParallelConfig()) as state:
        results["hf_first_loss"] = hf_first_step_loss(work, config(work))
        # The independent reference every layout's curve is held to. Building the GPTDataset is
        # collective, so both ranks run it (at the same time, a few seconds).
        results["plain_pytorch"] = plain_pytorch_run(work, config(work), ITERS)[0]

    # Each layout trains the same global batches; TP=2 also saves at RESHARD_AT (and 30) for the reshard checks.
    tp2 = config(work, tensor_model_parallel_size=2)
    tp2.checkpoint.save, tp2.checkpoint.save_interval = str(work / "ck_tp2"), RESHARD_AT
    results["tp2"] = train(tp2)
    results["tp2_sp"] = train(config(work, tensor_model_parallel_size=2, sequence_parallel=True))
    results["pp2"] = train(config(work, pipeline_model_parallel_size=2))
    results["dp2"] = train(config(work))

    # Resharded runs continue from RESHARD_AT with the TP=2 optimizer state and save at the end:
    # their losses after the first step and their Adam moments depend on that state.
    for name, layout in (("reshard_pp2", {"pipeline_model_parallel_size": 2}), ("reshard_dp2", {})):
        cfg = config(work, **layout)
        cfg.checkpoint.load, cfg.checkpoint.ckpt_step = str(work / "ck_tp2"), RESHARD_AT
        cfg.checkpoint.save = str(work / f"ck_{name}")
        results[name] = train(cfg)
        results[name]["moments"] = compare_adam_moments(work / "ck_tp2", work / f"ck_{name}", ITERS)

    # Resume exactness with the distributed optimizer at DP=2: 20 straight vs 10 + stop + resume + 10.
    def resume_cfg():
        cfg = config(work)
        cfg.training.train_iters = 20
        cfg.optimizer.use_distributed_optimizer = True
        cfg.optimizer.lr_warmup_iters = 5
        return cfg

    results["straight"] = train(resume_cfg())
    first = resume_cfg()
    first.checkpoint.save, first.training.exit_interval = str(work / "ck_resume"), 10
    results["first_half"] = train(first)
    second = resume_cfg()
    second.checkpoint.load = str(work / "ck_resume")
    results["second_half"] = train(second)
    results["resume_latest"] = (work / "ck_resume" / "latest_checkpointed_iteration.txt").read_text().strip()

    if torch.distributed.get_rank() == 0:
        result_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    run_script(main)
