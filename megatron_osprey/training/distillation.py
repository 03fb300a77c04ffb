"""Stage 4 assembled: drafter, frozen target (online) or hidden-state store (offline), TTT loss, shared loop.

`cfg` is stages/distill.py's DistillConfig: its sections drafter, target, data, ttt and the shared training
sections (training/config.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Callable

import torch
from megatron.core.utils import unwrap_model

from megatron_osprey.base.arch import ModelArch, resolve_aux_layer_ids
from megatron_osprey.base.outputs import check_output_writable
from megatron_osprey.base.run_config import load_run_config
from megatron_osprey.data.distill_data import pad_samples
from megatron_osprey.data.fingerprint import model_fingerprint
from megatron_osprey.data.micro_batches import micro_batches
from megatron_osprey.losses.ttt import drafter_inputs, step_masks, ttt_objective, ttt_step_terms, within_lengths
from megatron_osprey.models.drafter.model import DrafterArch, build_drafter_model, eagle3_body
from megatron_osprey.models.target.lm_head import TargetHead
from megatron_osprey.parallel import ParallelState
from megatron_osprey.training import checkpointing, resume_check
from megatron_osprey.training.assembly import TrainSpec, train_stage
from megatron_osprey.training.flops import forward_flops_per_sequence, training_flops_per_sequence
from megatron_osprey.training.loop import TrainState

PAD_MULTIPLE = 16


@dataclasses.dataclass
class DistillResult:
    state: TrainState
    history: list[dict[str, float]]
    notes: list[str]
    arch: DrafterArch


def drafter_arch(cfg, target: ModelArch) -> DrafterArch:
    """Osprey: Stage 3's saved arch. EAGLE-3: Llama-style layers of the target's width, K-token draft vocab.
    On-policy: the SFT-distilled checkpoint's own arch (either variant)."""
    if cfg.data.mode == "on-policy":
        return distilled_arch(cfg.drafter.drafter_init)
    if cfg.drafter.drafter_init:
        saved = load_run_config(cfg.drafter.drafter_init)
        if "drafter" not in saved:
            raise ValueError(f"--drafter-init {cfg.drafter.drafter_init}: run_config.yaml has no drafter section.")
        return DrafterArch.from_dict(saved["drafter"]).with_drift_norms(cfg.drafter)
    return DrafterArch(
        body=eagle3_body(target, cfg.drafter.eagle3_num_layers),
        target_hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        draft_vocab_size=min(cfg.drafter.draft_vocab_size, target.vocab_size),
        aux_layer_ids=tuple(resolve_aux_layer_ids(cfg.drafter.aux_layer_ids, target.num_layers)),
        variant="eagle3",
        eagle3_extra_layers=cfg.drafter.eagle3_extra_layers,
        hidden_post_norm=cfg.drafter.hidden_post_norm,
        aux_hidden_norm=cfg.drafter.aux_hidden_norm,
    )


def distilled_arch(root: str) -> DrafterArch:
    """The drafter arch of a distill checkpoint root (--drafter-init under --mode on-policy); refuses any other."""
    from megatron_osprey.training.checkpointing import iteration_dir, read_latest_iteration

    saved = load_run_config(iteration_dir(Path(root), read_latest_iteration(Path(root))))
    if not isinstance(saved, dict) or saved.get("stage") != "distill" or "drafter" not in saved:
        raise ValueError(
            f"--drafter-init {root}: --mode on-policy starts from an SFT-distilled drafter, and this checkpoint "
            f"was not written by the distill stage (its run_config.yaml names stage {saved.get('stage')!r})."
        )
    return DrafterArch.from_dict(saved["drafter"])


def assistant_token_counts(source, vocab_size: int, rank: int = 0, ranks: int = 1) -> torch.Tensor:
    """How often each target token is an assistant (trained) token in samples rank, rank + ranks, ..."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for input_ids, loss_mask in source.iter_tokens(rank, ranks):  # tokens only: a store's hidden states stay on disk
        counts += torch.bincount(input_ids[loss_mask.bool()], minlength=vocab_size)[:vocab_size].double()
    return counts


def top_k_ids(counts: torch.Tensor, k: int) -> torch.Tensor:
    """The k most frequent ids (ties to the lower id), sorted."""
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(order[:k]).values


@torch.no_grad()
def init_eagle3(
    model, cfg, arch: DrafterArch, draft_ids: torch.Tensor, parallel: ParallelState, target: ModelArch | None = None
) -> None:
    """EAGLE-3 from scratch: the target's frozen embedding, the draft vocabulary's d2t / t2d; `target` is the
    target's parsed config.json (it says where its checkpoint keeps the embedding)."""
    from megatron_osprey.convert.safetensors_io import SafetensorsCheckpoint
    from megatron_osprey.convert.sharding import read_shard
    from megatron_osprey.convert.weight_map import DENSE_RULES, hf_checkpoint_name

    embedding_rule = DENSE_RULES[0]
    with SafetensorsCheckpoint(cfg.target.path) as ckpt:
        shard = read_shard(
            ckpt,
            embedding_rule,
            [hf_checkpoint_name(target, "model.embed_tokens.weight") if target else "model.embed_tokens.weight"],
            arch.body,
            parallel.tp_rank,
            parallel.config.tensor_model_parallel_size,
        )
    weight = model.embedding.word_embeddings.weight
    weight.copy_(shard.to(weight.dtype))
    model.d2t.copy_(draft_ids - torch.arange(draft_ids.numel()))
    model.t2d.zero_()
    model.t2d[draft_ids] = True


def on_policy_forward_step(cfg, vocab_size: int, draft_vocab: int, tp_group):
    """forward_step over one micro-batch of a rollout store: every recorded round re-drafted (training/on_policy.py)."""
    from megatron_osprey.training.on_policy import draft_step_ids, on_policy_step_terms

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        drafter, steps = unwrap_model(model), cfg.ttt.ttt_steps
        inputs, roots = drafter_inputs(batch["input_ids"]), batch["rollout_roots"]
        step_ids = draft_step_ids(inputs, roots, batch["rollout_drafts"], steps)
        aux = batch["aux_hidden"].to(drafter.fusion_fc.weight.dtype)
        logits, _ = drafter.ttt_forward(inputs, aux, steps, [roots] * steps, step_ids=step_ids)
        terms = on_policy_step_terms(logits, batch, drafter.d2t, vocab_size, draft_vocab, tp_group)
        loss, denominator = ttt_objective(terms, cfg.ttt, batch["lengths"])
        return loss, functools.partial(ttt_loss_func, terms, denominator)

    return forward_step


def distill_forward_step(target: Callable | None, head: TargetHead, cfg, draft_vocab: int, tp_group):
    """forward_step(data_iterator, model) -> (loss, loss_func) over one micro-batch."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        if "aux_hidden" in batch:
            aux, final = batch["aux_hidden"], batch["final_hidden"]
        else:
            aux, final = target(batch["input_ids"])
        draft_logits, in_draft = head(final)
        in_draft = in_draft & within_lengths(batch["lengths"], in_draft.shape[1]).to(in_draft.device)
        drafter = unwrap_model(model)
        dtype = drafter.fusion_fc.weight.dtype
        # Each step's LM head runs on the rows its loss counts only (same loss, a fraction of the work).
        rows = step_masks(batch["loss_mask"], in_draft, cfg.ttt.ttt_steps, cfg.ttt.mask_alignment)
        logits, _ = drafter.ttt_forward(drafter_inputs(batch["input_ids"]), aux.to(dtype), cfg.ttt.ttt_steps, rows)
        terms = ttt_step_terms(
            logits, draft_logits, batch["loss_mask"], in_draft, draft_vocab, tp_group, cfg.ttt.mask_alignment
        )
        # The same numerator and denominator as ttt_loss(): Megatron sums both over
        # micro-batches and data-parallel ranks before dividing.
        loss, denominator = ttt_objective(terms, cfg.ttt, batch["lengths"])
        return loss, functools.partial(ttt_loss_func, terms, denominator)

    return forward_step


def ttt_loss_func(terms, denominator, loss):
    """Megatron's per-token contract: (sum, ttt_objective's denominator, {metric: [sum, count]})."""
    count = denominator
    report = {"lm loss": torch.stack([loss.detach().float(), count.float()])}
    for k, term in enumerate(terms):
        report[f"ploss/{k}"] = torch.stack([term.loss_sum.detach().float(), term.count.float()])
        report[f"acc/{k}"] = torch.stack([term.agree_sum.float(), term.count.float()])
        report[f"accept/{k}"] = torch.stack([term.accept_sum.float(), term.count.float()])
    return loss, count.to(torch.int), report


def online_opd(cfg) -> bool:
    """Draft-OPD's online loop (--mode on-policy --opd-form online): the job rolls out its own data each round."""
    return cfg.data.rolls_out_online()


def build_sources(cfg, arch: DrafterArch, target: ModelArch, tokenizer):
    from megatron_osprey.data.distill_data import ConversationSamples, StoreSamples
    from megatron_osprey.models.target.pipeline_stage import target_identity

    if online_opd(cfg):  # no data before the first round: the rollouts are made as training goes
        return None
    if cfg.data.mode in ("offline", "on-policy"):
        # The store must come from this very target: same taps and width, and the same config and weights.
        _, fingerprint = target_identity(target, cfg.target.path)
        source = StoreSamples(
            cfg.data.hidden_states,
            aux_layer_ids=list(arch.aux_layer_ids),
            hidden_size=arch.target_hidden_size,
            config_hash=fingerprint,
        )
        if cfg.data.mode == "on-policy":
            check_rollout_store(cfg, source.store.header)
        return source
    return ConversationSamples(cfg.data.data_path, tokenizer, cfg.training.seq_length, cfg.data.enable_thinking)


def check_rollout_store(cfg, header) -> None:
    """On-policy reads the rollout stage's store, whose rounds drafted at least --ttt-steps tokens."""
    if not header.rollout_steps:
        raise ValueError(
            f"--hidden-states {cfg.data.hidden_states} holds no rollout rounds (an extract store?); --mode on-policy "
            f"reads the rollout stage's output (python -m megatron_osprey rollout)."
        )
    if cfg.ttt.ttt_steps > header.rollout_steps:
        raise ValueError(
            f"--ttt-steps {cfg.ttt.ttt_steps} exceeds the {header.rollout_steps} tokens drafted per round in "
            f"--hidden-states {cfg.data.hidden_states}; lower --ttt-steps or roll out with --steps >= it."
        )


def check_drafter_matches_target(cfg, arch: DrafterArch, target: ModelArch) -> None:
    """Refuse a drafter adapted to another target before any step: its vocabulary rows index the target's."""
    if arch.vocab_size != target.vocab_size:
        raise ValueError(
            f"--drafter-init {cfg.drafter.drafter_init}: its vocabulary ({arch.vocab_size}) is not --target "
            f"{cfg.target.path}'s ({target.vocab_size}); adapt the backbone to this target first (the adapt stage)."
        )
    if arch.target_hidden_size != target.hidden_size:
        raise ValueError(
            f"--drafter-init {cfg.drafter.drafter_init} reads hidden states of size {arch.target_hidden_size}, but "
            f"--target {cfg.target.path} has hidden_size {target.hidden_size}; it was adapted to another target."
        )


def data_note(cfg, source, parallel: ParallelState, online_rollout) -> str:
    """check_loss_tokens(), or for the online Draft-OPD loop (which has no data before its first round) its size."""
    if not online_opd(cfg):
        return check_loss_tokens(cfg, source, parallel)
    if online_rollout is None:
        raise ValueError("--opd-form online: run_distill needs the stage's OnlineRollout (stages/distill.py).")
    return f"online Draft-OPD: {len(online_rollout.prompts)} prompts, rounds of {cfg.data.opd_round_updates} update(s)"


def check_loss_tokens(cfg, source, parallel: ParallelState) -> str:
    """Count the samples and assistant tokens left after the --seq-length cut; refuse a run with none.

    Each rank counts its share (tokenizing 1/world of the conversations) and the counts are summed, so every rank
    refuses together and none waits in the collective while another tokenizes the whole data set.
    """
    from megatron_osprey.data.distill_data import loss_token_survivors

    share = loss_token_survivors(source, cfg.training.seq_length, parallel.rank, parallel.world_size)
    counts = torch.tensor(share, dtype=torch.long, device=parallel.device)
    torch.distributed.all_reduce(counts)
    samples, tokens = counts.tolist()
    data = (
        f"--hidden-states {cfg.data.hidden_states}"
        if cfg.data.mode != "online"
        else f"--data-path {' '.join(cfg.data.data_path)}"
    )
    if tokens == 0:
        raise ValueError(
            f"{data}: none of its {len(source)} samples keeps an assistant token within --seq-length "
            f"{cfg.training.seq_length}, so there is nothing to train on (prompts only, or every prompt longer "
            f"than --seq-length); add assistant turns (tools/regenerate.py) or raise --seq-length."
        )
    return (
        f"{samples} of {len(source)} samples keep assistant tokens within --seq-length "
        f"{cfg.training.seq_length}: {tokens} loss tokens"
    )


def run_distill(cfg, parallel: ParallelState, online_rollout=None) -> DistillResult:
    """Validate, then train through the shared assembly; collective over every rank of `parallel`.

    Draft-OPD's online form needs `online_rollout` (speculative/online_rollout.py's OnlineRollout over the
    --data-path prompts, which the stage builds): training does not import the decoding engines."""
    from transformers import AutoTokenizer

    cfg.validate(parallel.world_size)
    if cfg.checkpoint.save:
        check_output_writable(cfg.checkpoint.save, "--save")
    tokenizer = AutoTokenizer.from_pretrained(cfg.target.path)
    target = ModelArch.from_hf_config(cfg.target.path)  # the one parse of its config.json, passed down
    arch = drafter_arch(cfg, target)
    check_drafter_matches_target(cfg, arch, target)
    source = build_sources(cfg, arch, target, tokenizer)
    loss_tokens_note = data_note(cfg, source, parallel, online_rollout)  # refuses data with nothing to train on
    draft_ids = draft_vocabulary(source, arch, parallel) if cfg.drafter.baseline else None
    run_config = {
        "stage": "distill",
        "config": cfg,
        "drafter": arch.to_dict(),
        "target": cfg.target.path,
        "train_domain": cfg.data.domain,
        "world_size": parallel.world_size,
    }
    dtype = torch.bfloat16 if cfg.drafter.bf16 else torch.float32
    provider = functools.partial(
        build_drafter_model, arch, cfg.parallel, transformer_impl=cfg.drafter.transformer_impl, params_dtype=dtype
    )
    frozen = _FrozenTarget(cfg, arch, target, dtype, parallel)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    # Pad each micro-batch to its own longest sample (a multiple that sequence parallelism can split).
    multiple = math.lcm(PAD_MULTIPLE, cfg.parallel.tensor_model_parallel_size)
    collate = functools.partial(pad_samples, seq_length=cfg.training.seq_length, pad_id=pad_id, multiple=multiple)
    if cfg.data.mode == "on-policy" and not online_opd(cfg):
        from megatron_osprey.training.on_policy import pad_rollout_samples

        collate = functools.partial(pad_rollout_samples, **collate.keywords, steps=cfg.ttt.ttt_steps)

    def data_iterators(model: list, state: TrainState, notes: list[str]):
        notes.append(loss_tokens_note)
        if online_opd(cfg):
            return _online_batches(cfg, parallel, model, online_rollout, state, collate), None
        return micro_batches(
            source,
            state.consumed_train_samples,
            cfg.training.micro_batch_size,
            parallel.dp_rank,
            parallel.dp_size,
            collate,
            seed=cfg.parallel.seed,
            shuffle=cfg.data.shuffle,
            device=parallel.device,
        ), held_out_sets(cfg, tokenizer, collate, parallel)

    spec = TrainSpec(
        run_config=run_config,
        model_provider=lambda pre_process=True, post_process=True, vp_stage=None: provider(),
        initialize=initial_drafter_weights(cfg, arch, draft_ids, parallel, target),
        forward_step=frozen.forward_step,
        data_iterators=data_iterators,
        flops_per_iteration=frozen.flops_per_iteration,
        bf16=cfg.drafter.bf16,
        progress_label="distill",
    )
    settings = functools.partial(distill_settings, cfg, arch)
    result = train_stage(cfg, spec, parallel, settings, warmup_fraction=True)
    return DistillResult(result.state, result.history, result.notes, arch)


def _online_batches(cfg, parallel: ParallelState, model: list, online_rollout, state: TrainState, collate):
    """Draft-OPD's online loop as this rank's micro-batches: a round of rollouts, then its updates."""
    from megatron_osprey.training.opd_online import online_micro_batches, round_prompts

    return online_micro_batches(
        model,
        online_rollout,
        len(online_rollout.prompts),
        state.consumed_train_samples,
        cfg.training.micro_batch_size,
        parallel.dp_rank,
        parallel.dp_size,
        round_prompts(cfg.training.global_batch_size, cfg.data.opd_round_updates),
        collate,
        seed=cfg.parallel.seed,
        shuffle=cfg.data.shuffle,
        device=parallel.device,
    )


def held_out_sets(cfg, tokenizer, collate, parallel: ParallelState) -> dict | None:
    """--eval-data: per domain, a fresh in-order pass over its held-out conversations (whole global batches covering
    the file once, the last one wrapping to its start), for the loop's loss/valid/DOMAIN; None without it."""
    from megatron_osprey.data.distill_data import ConversationSamples
    from megatron_osprey.training.loop import HeldOutSet

    sets = cfg.data.held_out_sets()
    if not sets:
        return None
    out = {}
    for domain, path in sets.items():
        try:
            samples = ConversationSamples([path], tokenizer, cfg.training.seq_length, cfg.data.enable_thinking)
        except ValueError as err:
            raise ValueError(f"--eval-data {domain}={path}: {err}") from None

        def fresh(samples=samples):
            mbs, dp = cfg.training.micro_batch_size, (parallel.dp_rank, parallel.dp_size)
            return micro_batches(samples, 0, mbs, *dp, collate, shuffle=False, device=parallel.device)

        out[domain] = HeldOutSet(fresh, math.ceil(len(samples) / cfg.training.global_batch_size))
    return out


def draft_vocabulary(source, arch: DrafterArch, parallel: ParallelState) -> torch.Tensor:
    """Collective: EAGLE-3's draft vocabulary, the most frequent assistant tokens over every rank's share."""
    counts = assistant_token_counts(source, arch.vocab_size, parallel.rank, parallel.world_size)
    counts = counts.to(parallel.device)
    torch.distributed.all_reduce(counts)  # each rank counted its share; every rank picks the same ids
    return top_k_ids(counts.cpu(), arch.draft_vocab_size)


def initial_drafter_weights(
    cfg, arch: DrafterArch, draft_ids: torch.Tensor | None, parallel: ParallelState, target: ModelArch | None = None
) -> Callable[[list], None]:
    """Loads Stage 3's drafter (--drafter-init) or initializes EAGLE-3 from the target into fresh chunks."""

    verify = not cfg.checkpoint.skip_checksum  # --skip-checksum covers --drafter-init too, as pretrain's --backbone

    def initialize(chunks: list) -> None:
        if cfg.data.mode == "on-policy":  # the SFT-distilled checkpoint, every weight
            checkpointing.load_backbone_weights(cfg.drafter.drafter_init, chunks, verify=verify)
        elif cfg.drafter.drafter_init:
            # Stage 3 writes no aux_norms: under --aux-hidden-norm they start at their init (ones, the identity).
            fresh = ("aux_norms.",) if arch.aux_hidden_norm else ()
            checkpointing.load_backbone_weights(
                Path(cfg.drafter.drafter_init) / "megatron", chunks, fresh=fresh, verify=verify
            )
        else:
            init_eagle3(chunks[0], cfg, arch, draft_ids, parallel, target)

    return initialize


def distill_settings(cfg, arch: DrafterArch) -> dict[str, dict]:
    """Distillation's own part of the run identity a resume compares (training/resume_check.py)."""
    from_files = cfg.data.mode == "online" or online_opd(cfg)
    data = (
        resume_check.files_setting(list(cfg.data.data_path))
        if from_files
        else resume_check.store_setting(cfg.data.hidden_states)
    )
    online = {}
    if online_opd(cfg):
        online = {
            "--opd-round-updates": resume_check.setting(cfg.data.opd_round_updates),
            "--opd-limit": resume_check.setting(cfg.data.opd_limit),
            "--opd-max-new-tokens": resume_check.setting(cfg.data.opd_max_new_tokens),
        }
    return {
        "--mode": resume_check.setting(cfg.data.mode),
        "--data-path" if from_files else "--hidden-states": data,
        **online,
        "--target": resume_check.setting(model_fingerprint(cfg.target.path)["files_sha256"], str(cfg.target.path)),
        "drafter": resume_check.setting(arch.to_dict(), cfg.drafter.drafter_init or f"{cfg.drafter.baseline}"),
        "--ttt-steps": resume_check.setting(cfg.ttt.ttt_steps),
        "--ttt-decay": resume_check.setting(cfg.ttt.decay),
        "--no-shuffle": resume_check.setting(not cfg.data.shuffle),
    }


class _FrozenTarget:
    """The frozen target's part of a distillation step: its LM head always, its forward when online."""

    def __init__(self, cfg, arch: DrafterArch, target: ModelArch, dtype: torch.dtype, parallel: ParallelState):
        self.cfg, self.arch, self.target_arch, self.dtype, self.parallel = cfg, arch, target, dtype, parallel
        self.target = None

    def forward_step(self, model: list) -> Callable:
        """Build the target head (on the drafter's draft vocabulary) and, online, the target; the step over both."""
        from megatron.core import parallel_state as mpu

        cfg, parallel = self.cfg, self.parallel
        drafter = unwrap_model(model[0])
        tp_group = mpu.get_tensor_model_parallel_group()
        if cfg.data.mode == "on-policy" and not online_opd(cfg):  # the rollout store holds the distributions
            return on_policy_forward_step(cfg, self.target_arch.vocab_size, self.arch.draft_vocab_size, tp_group)
        head = TargetHead.from_hf(
            cfg.target.path,
            drafter.t2d.cpu(),
            parallel.tp_rank,
            cfg.parallel.tensor_model_parallel_size,
            tp_group,
            arch=self.target_arch,
        ).to(parallel.device)
        if cfg.data.mode == "online":
            from megatron_osprey.models.target.online import OnlineTarget

            self.target = OnlineTarget(
                cfg.target.path,
                cfg.parallel,
                parallel.device,
                self.arch.aux_layer_ids,
                params_dtype=self.dtype,
                transformer_impl=cfg.drafter.transformer_impl,
                arch=self.target_arch,
            )
        return distill_forward_step(self.target, head, cfg, self.arch.draft_vocab_size, tp_group)

    def flops_per_iteration(self, model: list) -> float:
        """TTT steps of the drafter (its draft-vocab head included) plus, online, one target forward."""
        cfg, seq = self.cfg, self.cfg.training.seq_length
        draft_head_width = unwrap_model(model[0]).output_layer.weight.shape[0] * cfg.parallel.tensor_model_parallel_size
        drafter_flops = training_flops_per_sequence(self.arch.body, seq, draft_head_width)
        # A forward only, without the LM head: target logits come from the draft-vocab head.
        target_flops = forward_flops_per_sequence(self.target.stage.arch, seq, 0) if self.target is not None else 0.0
        return cfg.training.global_batch_size * (cfg.ttt.ttt_steps * drafter_flops + target_flops)
