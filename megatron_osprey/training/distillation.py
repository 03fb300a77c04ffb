"""Stage 4 assembled: drafter, frozen target (online) or hidden-state store (offline), TTT loss, shared loop."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Callable

import torch
import yaml

from megatron_osprey.config.distill import DistillConfig
from megatron_osprey.config.run_config import load_run_config, to_plain
from megatron_osprey.losses.ttt import drafter_inputs, ttt_step_terms
from megatron_osprey.models.arch import ModelArch
from megatron_osprey.models.drafter import DrafterArch, build_drafter_model, default_aux_layer_ids, validate_aux_layer_ids
from megatron_osprey.models.target_head import TargetHead
from megatron_osprey.parallel import ParallelState
from megatron_osprey.training import checkpointing
from megatron_osprey.training.flops import (
    ModelShape, device_peak_tflops, forward_flops_per_sequence, training_flops_per_sequence,
)
from megatron_osprey.training.loop import TrainState, train
from megatron_osprey.training.metrics import MetricsLogger, ThroughputModel
from megatron_osprey.training.optimizer import sharding_metadata
from megatron_osprey.training.setup import build_model_chunks, build_optimizer_and_scheduler, make_train_run


@dataclasses.dataclass
class DistillResult:
    state: TrainState
    history: list[dict[str, float]]
    notes: list[str]
    arch: DrafterArch


def drafter_arch(cfg: DistillConfig) -> DrafterArch:
    """Osprey: Stage 3's saved arch. EAGLE-3: the target's own layer shape, K-token draft vocab."""
    if cfg.drafter.drafter_init:
        saved = load_run_config(cfg.drafter.drafter_init)
        if "drafter" not in saved:
            raise ValueError(f"--drafter-init {cfg.drafter.drafter_init}: run_config.yaml has no drafter section.")
        return DrafterArch.from_dict(saved["drafter"])
    target = ModelArch.from_hf_config(Path(cfg.target.target))
    if not target.is_dense:
        raise ValueError("--baseline eagle3 builds its layer from a dense target's shape; this target is MoE.")
    aux = cfg.drafter.aux_layer_ids or default_aux_layer_ids(target.num_layers)
    return DrafterArch(
        body=target.with_num_layers(cfg.drafter.eagle3_num_layers),
        target_hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        draft_vocab_size=min(cfg.drafter.draft_vocab_size, target.vocab_size),
        aux_layer_ids=tuple(validate_aux_layer_ids(aux, target.num_layers)),
        variant="eagle3",
    )


def assistant_token_counts(source, vocab_size: int) -> torch.Tensor:
    """How often each target token is an assistant (trained) token in the training data."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for index in range(len(source)):
        sample = source[index]
        ids = sample["input_ids"][sample["loss_mask"].bool()]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size].double()
    return counts


def top_k_ids(counts: torch.Tensor, k: int) -> torch.Tensor:
    """The k most frequent ids (ties to the lower id), sorted."""
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(order[:k]).values


@torch.no_grad()
def init_eagle3(model, cfg: DistillConfig, arch: DrafterArch, draft_ids: torch.Tensor, parallel: ParallelState) -> None:
    """EAGLE-3 from scratch: the target's frozen embedding, the draft vocabulary's d2t / t2d."""
    from megatron_osprey.convert.safetensors_io import SafetensorsCheckpoint
    from megatron_osprey.convert.sharding import read_shard
    from megatron_osprey.convert.weight_map import DENSE_RULES

    embedding_rule = DENSE_RULES[0]
    with SafetensorsCheckpoint(cfg.target.target) as ckpt:
        shard = read_shard(ckpt, embedding_rule, ["model.embed_tokens.weight"], arch.body,
                           parallel.tp_rank, parallel.config.tensor_model_parallel_size)
    weight = model.embedding.word_embeddings.weight
    weight.copy_(shard.to(weight.dtype))
    model.d2t.copy_(draft_ids - torch.arange(draft_ids.numel()))
    model.t2d.zero_()
    model.t2d[draft_ids] = True


def unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def distill_forward_step(target: Callable | None, head: TargetHead, cfg: DistillConfig, draft_vocab: int, tp_group):
    """forward_step(data_iterator, model) -> (loss, loss_func) over one micro-batch."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        if "aux_hidden" in batch:
            aux, final = batch["aux_hidden"], batch["final_hidden"]
        else:
            aux, final = target(batch["input_ids"])
        draft_logits, in_draft = head(final)
        drafter = unwrap(model)
        dtype = drafter.fusion_fc.weight.dtype
        logits, _ = drafter.ttt_forward(drafter_inputs(batch["input_ids"]), aux.to(dtype), cfg.ttt.ttt_steps)
        terms = ttt_step_terms(logits, draft_logits, batch["loss_mask"], in_draft, draft_vocab, tp_group)
        weights = cfg.ttt.weights()
        loss = sum(w * t.loss_sum for w, t in zip(weights, terms))
        return loss, functools.partial(ttt_loss_func, terms)

    return forward_step


def ttt_loss_func(terms, loss):
    """Megatron's per-token contract: (sum, step-0 token count, {metric: [sum, count]})."""
    count = terms[0].count
    report = {"lm loss": torch.stack([loss.detach().float(), count.float()])}
    for k, term in enumerate(terms):
        report[f"ploss/{k}"] = torch.stack([term.loss_sum.detach().float(), term.count.float()])
        report[f"acc/{k}"] = torch.stack([term.agree_sum.float(), term.count.float()])
        report[f"accept/{k}"] = torch.stack([term.accept_sum.float(), term.count.float()])
    return loss, count.to(torch.int), report


def build_sources(cfg: DistillConfig, arch: DrafterArch, tokenizer):
    from megatron_osprey.data.distill_data import ConversationSamples, StoreSamples

    if cfg.target.mode == "offline":
        return StoreSamples(cfg.target.hidden_states, aux_layer_ids=list(arch.aux_layer_ids),
                            hidden_size=arch.target_hidden_size)
    return ConversationSamples(cfg.data.data_path, tokenizer, cfg.training.seq_length, cfg.data.enable_thinking)


def check_loss_tokens(cfg: DistillConfig, source, parallel: ParallelState) -> str:
    """Count the samples and assistant tokens left after the --seq-length cut; refuse a run with none.

    Rank 0 counts (a pass over the data) and broadcasts, so every rank refuses together.
    """
    from megatron_osprey.data.distill_data import loss_token_survivors

    counts = torch.zeros(2, dtype=torch.long, device=parallel.device)
    if parallel.rank == 0:
        counts[:] = torch.tensor(loss_token_survivors(source, cfg.training.seq_length))
    torch.distributed.broadcast(counts, src=0)
    samples, tokens = counts.tolist()
    data = (f"--hidden-states {cfg.target.hidden_states}" if cfg.target.mode == "offline"
            else f"--data-path {' '.join(cfg.data.data_path)}")
    if tokens == 0:
        raise ValueError(
            f"{data}: none of its {len(source)} samples keeps an assistant token within --seq-length "
            f"{cfg.training.seq_length}, so there is nothing to train on (prompts only, or every prompt longer "
            f"than --seq-length); add assistant turns (tools/regenerate.py) or raise --seq-length.")
    return (f"{samples} of {len(source)} samples keep assistant tokens within --seq-length "
            f"{cfg.training.seq_length}: {tokens} loss tokens")


def run_distill(cfg: DistillConfig, parallel: ParallelState) -> DistillResult:
    """Validate, build, (re)load, train; collective over every rank of `parallel`."""
    from transformers import AutoTokenizer

    from megatron.core import parallel_state as mpu

    from megatron_osprey.data.distill_data import micro_batches

    cfg.validate(parallel.world_size)
    cfg.optimizer.lr_warmup_iters = cfg.warmup_iters()
    if cfg.checkpoint.save:
        checkpointing.check_writable(cfg.checkpoint.save, "--save")
    tokenizer = AutoTokenizer.from_pretrained(cfg.target.target)
    is_writer = parallel.rank == 0
    notes: list[str] = []

    arch = drafter_arch(cfg)
    source = build_sources(cfg, arch, tokenizer)
    notes.append(check_loss_tokens(cfg, source, parallel))
    draft_ids = None
    if cfg.drafter.baseline:
        draft_ids = top_k_ids(assistant_token_counts(source, arch.vocab_size), arch.draft_vocab_size)
    train_iters = cfg.training.num_train_iters()
    run_config = {"stage": "distill", "config": cfg, "drafter": arch.to_dict(), "target": cfg.target.target,
                  "train_domain": cfg.data.domain, "world_size": parallel.world_size}
    if is_writer:
        print("resolved configuration:\n" + yaml.safe_dump(to_plain(cfg), sort_keys=False), flush=True)

    dtype = torch.bfloat16 if cfg.drafter.bf16 else torch.float32
    provider = functools.partial(build_drafter_model, arch, cfg.parallel, transformer_impl=cfg.drafter.transformer_impl,
                                 params_dtype=dtype)

    def model_provider(pre_process=True, post_process=True, vp_stage=None):
        return provider()

    resume = checkpointing.read_latest_iteration(cfg.checkpoint.load) if cfg.checkpoint.load else None

    def initialize(chunks):
        if cfg.drafter.drafter_init:
            checkpointing.load_backbone_weights(Path(cfg.drafter.drafter_init) / "megatron", chunks)
        else:
            init_eagle3(chunks[0], cfg, arch, draft_ids, parallel)

    model = build_model_chunks(model_provider, cfg.parallel, bf16=cfg.drafter.bf16,
                               use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
                               initialize=None if resume is not None else initialize)
    optimizer, scheduler = build_optimizer_and_scheduler(model, cfg.optimizer, bf16=cfg.drafter.bf16,
                                                         train_iters=train_iters)
    metadata = sharding_metadata(cfg.optimizer) | {"use_distributed_optimizer": cfg.optimizer.use_distributed_optimizer}
    state = TrainState()
    if resume is not None:
        length = "--train-iters" if cfg.training.train_iters is not None else "--train-samples"
        info = checkpointing.load_training_checkpoint(
            cfg.checkpoint.load, model, optimizer, scheduler, metadata, iteration=resume,
            load_optim=not cfg.checkpoint.no_load_optim, load_rng=not cfg.checkpoint.no_load_rng,
            scheduler_flags=checkpointing.scheduler_flags(
                "--lr-decay-iters" if cfg.optimizer.lr_decay_iters else None, length,
                warmup_flag=f"--lr-warmup-fraction x {length}"))
        state = TrainState(info["iteration"], info["consumed_train_samples"])
        notes += info["notes"] + [f"resumed from {cfg.checkpoint.load} at iteration {state.iteration}"]

    drafter = unwrap(model[0])
    tp_group = mpu.get_tensor_model_parallel_group()
    head = TargetHead.from_hf(cfg.target.target, drafter.t2d.cpu(), parallel.tp_rank,
                              cfg.parallel.tensor_model_parallel_size, tp_group).to(parallel.device)
    target = None
    if cfg.target.mode == "online":
        from megatron_osprey.models.online_target import OnlineTarget

        target = OnlineTarget(cfg.target.target, cfg.parallel, parallel.device, arch.aux_layer_ids,
                              params_dtype=dtype, transformer_impl=cfg.drafter.transformer_impl)
    forward_step = distill_forward_step(target, head, cfg, arch.draft_vocab_size, tp_group)

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    train_iterator = micro_batches(source, state.consumed_train_samples, cfg.training.micro_batch_size,
                                   parallel.dp_rank, parallel.dp_size, cfg.training.seq_length, pad_id,
                                   cfg.parallel.seed, cfg.data.shuffle, parallel.device)
    seq = cfg.training.seq_length
    drafter_flops = training_flops_per_sequence(ModelShape.from_arch(arch.body, drafter.output_layer.weight.shape[0]
                                                                     * cfg.parallel.tensor_model_parallel_size), seq)
    target_flops = 0.0
    if target is not None:  # a forward only (no LM head: logits come from the draft-vocab head)
        target_arch = target.stage.arch
        target_flops = forward_flops_per_sequence(ModelShape.from_arch(target_arch, 0), seq)
    throughput = ThroughputModel(
        tokens_per_iteration=cfg.training.global_batch_size * seq,
        flops_per_iteration=cfg.training.global_batch_size * (cfg.ttt.ttt_steps * drafter_flops + target_flops),
        world_size=parallel.world_size,
        peak_tflops=device_peak_tflops(cfg.logging.peak_tflops, fp8=False),
    )
    metrics = MetricsLogger(cfg.logging, throughput, is_writer=is_writer, total_iters=train_iters,
                            start_iter=state.iteration, save_dir=cfg.checkpoint.save, run_config=run_config,
                            desc="distill")
    for note in notes:
        metrics.note(note)

    run = make_train_run(cfg, model, optimizer, scheduler, metrics, run_config, metadata, parallel)
    try:
        state = train(run, state, forward_step, train_iterator, None)
    finally:
        metrics.close()
    return DistillResult(state, metrics.history, notes, arch)
