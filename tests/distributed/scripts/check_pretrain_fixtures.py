"""Fixtures for the pretraining tests: a tiny pruned Qwen3 backbone and a tiny learnable indexed corpus."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from megatron_osprey.testing.tiny_models import VOCAB, make_hf_model, qwen3_config

EOD = VOCAB - 1


def make_corpus(prefix: str | Path, num_docs: int = 400, seed: int = 0) -> str:
    """Documents that are arithmetic progressions mod VOCAB-1, then EOD: a model can learn them quickly."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(num_docs):
        length = int(rng.integers(20, 90))
        start, step = int(rng.integers(0, EOD)), int(rng.choice([1, 2, 3, 5]))
        doc = (start + step * np.arange(length)) % EOD
        builder.add_document(torch.from_numpy(np.append(doc, EOD).astype(np.int64)), [length + 1])
    builder.finalize(prefix + ".idx")
    return prefix


def make_backbone(work: Path) -> Path:
    """A 4-layer tiny Qwen3 pruned to its first 2 layers (Stage 1, single rank); returns the output dir."""
    from megatron_osprey.stages import prune

    source, out = work / "hf_source", work / "backbone"
    config = qwen3_config(layers=4)
    config.eos_token_id = EOD
    make_hf_model(config, source)
    # The stage's run: its own single-rank process groups, then OUT/megatron, OUT/hf, OUT/run_config.yaml.
    prune.run(prune.PruneConfig(source=str(source), output=str(out), num_layers=2, transformer_impl="local"))
    return out


def scheduled_lr(step: int, lr: float, min_lr: float, warmup: int, decay: int) -> float:
    """Linear warmup from 0 over `warmup` steps, then cosine to `min_lr` at `decay` (Megatron-LM's curve)."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if step > decay:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    return min_lr + (lr - min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


def plain_pytorch_run(work: Path, cfg, iters: int):
    """Stage 2's first `iters` steps with no Megatron in the model or the optimizer: the pruned HF model,
    torch.optim.AdamW, torch's grad-norm clipping and the cosine schedule written out above.

    Same global batches (the same GPTDataset indices), the same decay rule (no weight decay on 1-D
    parameters) and the token-mean loss of each global batch. Single process, float32.
    Returns ({"loss": [...], "lr": [...]}, the trained HF model).
    """
    from transformers import AutoModelForCausalLM

    from megatron_osprey.training import data

    opt, train = cfg.optimizer, cfg.training
    tokenizer = data.DatasetTokenizer(VOCAB, EOD)
    sizes = data.split_sizes(
        train.num_train_iters(), train.global_batch_size, cfg.logging.eval_iters, cfg.logging.eval_interval
    )
    dataset = data.build_gpt_datasets(cfg.data, tokenizer, train.seq_length, cfg.parallel.seed, sizes)[0]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(Path(cfg.model.backbone) / "hf", dtype=torch.float32).train()
    params = list(model.parameters())  # the tied embedding / LM head appears once
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim > 1], "weight_decay": opt.weight_decay},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
        ],
        lr=0.0,
        betas=(opt.adam_beta1, opt.adam_beta2),
        eps=opt.adam_eps,
    )
    decay = opt.lr_decay_iters or train.num_train_iters()
    out = {"loss": [], "lr": []}
    for step in range(iters):
        lr = scheduled_lr(step, opt.lr, opt.min_lr, opt.warmup_iters(train.num_train_iters()), decay)
        for group in optimizer.param_groups:
            group["lr"] = lr
        first = step * train.global_batch_size
        batch = data.stack_samples([dataset[first + i] for i in range(train.global_batch_size)])
        logits = model(batch["tokens"]).logits
        per_token = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), reduction="none"
        )
        mask = batch["loss_mask"].reshape(-1).float()
        loss = (per_token * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, opt.clip_grad)
        optimizer.step()
        out["loss"].append(loss.item())
        out["lr"].append(lr)
    return out, model
