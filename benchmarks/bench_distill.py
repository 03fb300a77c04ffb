"""The distillation pair of `make bench`: one TTT update of the distill stage against a plain-PyTorch SpecForge step.

Ours is the distill stage itself (`training.distillation.run_distill`, offline from a bf16 hidden-state store,
Osprey drafter adapted from the target's first 2 layers, TTT 5, --bf16 where the CPU computes bf16 natively (else
float32, as both sides then run: base/hardware.py's CpuCapability), SpecForge's mask alignment and per-sample
normalisation): run_distill builds the model, optimizer, forward step and data iterator as a user's run does, and
its loop is replaced by one that hands them back, so each timed call is one `train_step` (one global batch:
the store read, forward, backward and the optimizer step).

The peer is written here after SpecForge's EAGLE-3 trainer (specforge/core/eagle3.py and the Llama draft model
in specforge/modeling/draft/llama3_eagle.py): HF-style nn.Modules (an `fc` over the 3 concatenated aux states, Llama
decoder layers whose attention reads cat(input_layernorm(embedding), hidden_norm(hidden)) of width 2H, the final
norm and a draft-vocab LM head over every row), its unrolled TTT loop (the step-k keys appended to a per-layer cache,
each query attending causally to step 0's keys and to its own position in the later steps, the additive mask
losing one diagonal per step), the target's distribution from the stored final hidden state through the target's
norm and head, the loss -sum p log q over the draft vocabulary weighted 0.8^k and divided by each sample's length,
fp32 master weights under bf16 autocast (SpecForge's FSDP mixed precision on one device; float32 throughout on a
CPU without native bf16), gradient clipping at
1.0 and torch's AdamW. It has the drafter's shapes (layers, widths, heads, vocabularies) and trains on the same
global batch, already in memory (ours reads it from the store inside the timed call).

The limit is the step's matmul FLOPs at this CPU's measured matmul rate in the compute dtype (`matmul_rate`):
3x the forward (forward + backward) of the drafter layers over all rows for K steps (training/flops.py's count,
plus the side half of each 2H-wide QKV projection and the fusion fc), of the draft-vocab LM head over the rows the
loss reads (all that the loss needs, and all that ours computes), plus one forward of the target's head.
"""

from __future__ import annotations

import contextlib
import io
import math
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.bench_harness import Pair
from megatron_osprey.models.drafter.reference import RMSNorm

TTT_STEPS = 5
DECAY = 0.8
DOMAIN = "prose"  # the demo's longest conversations: most fill --seq-length 256
PAD_MULTIPLE = 16  # training/distillation.py pads each micro-batch to a multiple of it


# --- the peer: SpecForge's formulation in plain PyTorch ---------------------------------------------------------
# (RMSNorm is HF Llama's, float32 inside: the reference drafter's module, the same op SpecForge uses.)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class SpecForgeAttention(nn.Module):
    """Llama attention over the 2H-wide input, with SpecForge's TTT cache (eager: explicit matmuls and softmax)."""

    def __init__(self, cfg):
        super().__init__()
        self.heads, self.groups, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        width = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.groups * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.groups * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, blocked, cache: list) -> torch.Tensor:
        """x [b, s, 2H]; cos/sin [s, d] at this step's positions; blocked [s, s] bool; cache: earlier steps' (k, v)."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.groups, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.groups, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # HF's apply_rotary_pos_emb: in the activations' dtype
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        repeat = self.heads // self.groups
        cache.append((k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)))
        scale = 1.0 / math.sqrt(self.head_dim)
        k0, v0 = cache[0]
        weights = (q @ k0.transpose(2, 3)) * scale
        weights = weights.masked_fill(blocked, torch.finfo(weights.dtype).min)
        # Steps 1..k: each query sees the key of its own position only.
        extra = [((q * ki).sum(-1) * scale)[..., None] for ki, _ in cache[1:]]
        weights = torch.softmax(torch.cat([weights, *extra], dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
        out = weights[..., :s] @ v0
        for i, (_, vi) in enumerate(cache[1:]):
            out = out + weights[..., s + i, None] * vi
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class SpecForgeDecoderLayer(nn.Module):
    """SpecForge's draft decoder layer: the residual stream is the hidden state, the embedding joins in attention."""

    def __init__(self, cfg):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = SpecForgeAttention(cfg)
        self.hidden_norm, self.input_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, emb, hidden, cos, sin, blocked, cache):
        fused = torch.cat((self.input_layernorm(emb), self.hidden_norm(hidden)), dim=-1)
        hidden = hidden + self.self_attn(fused, cos, sin, blocked, cache)
        x = self.post_attention_layernorm(hidden)
        return hidden + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SpecForgeDrafter(nn.Module):
    """embed_tokens, fc (3 aux states -> H), the decoder layers, norm, lm_head (draft vocabulary)."""

    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList(SpecForgeDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        d = cfg.head_dim
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2).float() / d), persistent=False)

    def ttt_logits(self, input_ids: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The K-step unroll: step k reads the ids shifted by k at positions + k and step k-1's hidden state."""
        s = input_ids.shape[1]
        angles = torch.outer(torch.arange(s + steps, dtype=torch.float32), self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        blocked = ~torch.ones(s, s, dtype=torch.bool).tril()
        caches = [[] for _ in self.layers]
        hidden, logits = self.fc(aux), []
        for k in range(steps):
            emb = self.embed_tokens(input_ids)
            cos, sin = angles[k : k + s].cos(), angles[k : k + s].sin()
            for layer, cache in zip(self.layers, caches):
                hidden = layer(emb, hidden, cos, sin, blocked, cache)
            logits.append(self.lm_head(self.norm(hidden)))
            input_ids = F.pad(input_ids[:, 1:], (0, 1))
            blocked = blocked.clone()
            blocked[torch.arange(k, s), torch.arange(0, s - k)] = True  # SpecForge masks one more diagonal per step
        return logits


def specforge_targets(target_logits, loss_mask, lengths, t2d):
    """(target_p [b, s, Vd], position_mask [b, s]) as SpecForge prepares them: both shifted by one, so row t
    learns the target's distribution at t + 1, restricted to the draft vocabulary and renormalised, where x_t is an
    assistant token, the target's argmax at t + 1 is in the draft vocabulary and t + 1 is within the sample."""
    s = target_logits.shape[1]
    shifted = F.pad(target_logits[:, 1:], (0, 0, 0, 1))
    in_draft = t2d[shifted.argmax(-1)]
    within = torch.arange(s)[None] + 1 < lengths[:, None]
    target_p = torch.softmax(shifted[..., t2d].float(), dim=-1)
    return target_p, loss_mask.bool() & in_draft & within


def specforge_ttt_loss(logits: list, target_p, position_mask, lengths, decay: float = DECAY) -> torch.Tensor:
    """sum_k decay^k * mean over samples of (-sum over counted rows of p . log q) / the sample's length.

    Step k reads target_p and position_mask shifted by k (SpecForge's padding of both after every step)."""
    s = target_p.shape[1]
    target_p = F.pad(target_p, (0, 0, 0, len(logits)))
    total = 0.0
    for k, step_logits in enumerate(logits):
        mask = F.pad(position_mask[:, k:], (0, k))
        logp = torch.log_softmax(step_logits.float(), dim=-1)
        per_sample = -(mask[..., None] * target_p[:, k : k + s] * logp).sum(dim=(1, 2))
        total = total + decay**k * (per_sample / lengths).mean()
    return total


class SpecForgeStep:
    """One SpecForge-style optimizer step on a fixed batch: the target head, the unroll, the loss, AdamW."""

    def __init__(
        self, cfg, target_norm, target_eps, target_head, t2d, batch: dict, lr: float = 1e-4, bf16: bool = True
    ):
        self.bf16 = bf16
        self.model = SpecForgeDrafter(cfg)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.target_norm, self.target_eps, self.target_head, self.t2d = target_norm, target_eps, target_head, t2d
        self.batch = batch

    def __call__(self) -> float:
        batch = self.batch
        with torch.no_grad():
            final = batch["final_hidden"].float()
            normed = final * torch.rsqrt(final.pow(2).mean(-1, keepdim=True) + self.target_eps) * self.target_norm
            target_p, position_mask = specforge_targets(
                normed @ self.target_head.T, batch["loss_mask"], batch["lengths"], self.t2d
            )
        ids = F.pad(batch["input_ids"][:, 1:], (0, 1))  # SpecForge shifts the inputs by one too
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            logits = self.model.ttt_logits(ids, batch["aux_hidden"], TTT_STEPS)
        loss = specforge_ttt_loss(logits, target_p, position_mask, batch["lengths"].float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


# --- the limit --------------------------------------------------------------------------------------------------


def matmul_rate(dtype: torch.dtype, size: int = 4096, repeats: int = 3) -> float:
    """FLOP/s of this CPU's best `dtype` matmul of two size x size matrices (torch's threads), best of `repeats`."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up: thread pool, kernel choice
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def distill_step_flops(arch, batch_size: int, seq: int, counted_rows: list[int], steps: int) -> float:
    """Matmul FLOPs of one TTT update over a [batch_size, seq] batch (see the module docstring)."""
    from megatron_osprey.training.flops import forward_flops_per_sequence

    body = arch.body
    h = body.hidden_size
    qkv_width = (body.num_attention_heads + 2 * body.num_query_groups) * body.head_dim
    side_qkv = body.num_layers * 2 * seq * h * qkv_width  # the W_new half of the 2H-wide QKV, per sequence
    fusion = 2 * seq * 3 * arch.target_hidden_size * h  # fusion_fc, step 0 only
    layers = batch_size * (steps * (forward_flops_per_sequence(body, seq, 0) + side_qkv) + fusion)
    head = sum(counted_rows) * 2 * h * arch.draft_vocab_size
    target_head = batch_size * seq * 2 * arch.target_hidden_size * arch.vocab_size
    return 3.0 * (layers + head) + target_head


# --- the pair ---------------------------------------------------------------------------------------------------


class _Recording:
    """The stage's train iterator, remembering the last micro-batch it handed out."""

    def __init__(self, iterator):
        self.iterator, self.last = iterator, None

    def __iter__(self):
        return self

    def __next__(self):
        self.last = next(self.iterator)
        return self.last


def build_store(workdir: Path, target: Path, data: Path, seq_length: int) -> Path:
    """The extract stage's bf16 store of `data` (aux layers + final) from `target`."""
    from megatron_osprey.stages.extract import ExtractConfig, run

    config = ExtractConfig(data_path=str(data), max_length=seq_length, micro_batch_size=4, overwrite=True)
    config.target.path = str(target)
    config.store.store_dir = str(workdir / "store")
    config.store.encoding = "bf16"
    run(config)
    return workdir / "store"


def distill_config(target: Path, drafter: Path, data: Path, store: Path, batch: int, seq_length: int, bf16: bool):
    """The distill stage's config: offline, --bf16 (or float32), TTT 5 with SpecForge's alignment and normalisation, one
    global batch of `batch` samples, no shuffle (every update sees the store's same `batch` samples)."""
    from megatron_osprey.stages.distill import DistillConfig

    cfg = DistillConfig()
    cfg.drafter.drafter_init, cfg.drafter.bf16, cfg.drafter.transformer_impl = str(drafter), bf16, "local"
    cfg.target.path = str(target)
    cfg.data.mode, cfg.data.hidden_states, cfg.data.data_path = "offline", str(store), [str(data)]
    cfg.data.shuffle = False
    cfg.ttt.ttt_steps, cfg.ttt.mask_alignment, cfg.ttt.normalization = TTT_STEPS, "reference", "reference"
    cfg.training.micro_batch_size = cfg.training.global_batch_size = batch
    cfg.training.seq_length, cfg.training.train_iters = seq_length, 1000
    cfg.optimizer.lr_warmup_fraction = None
    cfg.logging.progress_bar = False
    cfg.logging.log_interval = 10**6
    return cfg


def distill_pair(workdir: Path, target: Path, drafter: Path, batch: int, seq_length: int, bf16: bool = True) -> Pair:
    """The distillation Pair: `batch` prose conversations (cut to seq_length) in the target's bf16 store, both
    sides computing in bf16 (`bf16`: the CPU has it natively) or float32."""
    from megatron.core.utils import unwrap_model

    from benchmarks.bench_models import write_conversations
    from megatron_osprey.base.run_config import load_run_config
    from megatron_osprey.data.distill_data import StoreSamples, pad_samples
    from megatron_osprey.losses.ttt import step_masks, within_lengths
    from megatron_osprey.models.drafter.model import DrafterArch
    from megatron_osprey.models.target.lm_head import TargetHead
    from megatron_osprey.parallel import parallel_context
    from megatron_osprey.training import assembly
    from megatron_osprey.training.distillation import run_distill
    from megatron_osprey.training.loop import train_step

    workdir.mkdir(parents=True, exist_ok=True)
    data = write_conversations(workdir / "prose.jsonl", batch, domain=DOMAIN)
    store = build_store(workdir, target, data, seq_length)
    cfg = distill_config(target, drafter, data, store, batch, seq_length, bf16)
    arch = DrafterArch.from_dict(load_run_config(drafter)["drafter"])

    stack = contextlib.ExitStack()
    captured = {}

    def hand_back(run, state, forward_step, train_iterator, valid_iterator=None):
        captured.update(run=run, forward_step=forward_step, iterator=_Recording(train_iterator))
        return state

    try:
        state = stack.enter_context(parallel_context(cfg.parallel))
        with mock.patch.object(assembly, "train", hand_back), contextlib.redirect_stdout(io.StringIO()):
            run_distill(cfg, state)
    except BaseException:
        stack.close()
        raise

    def ours() -> float:
        return train_step(captured["forward_step"], captured["iterator"], captured["run"]).loss

    # The peer's batch: the same samples, collated as the stage collates them.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    source = StoreSamples(store)
    fixed = pad_samples([source[i] for i in range(batch)], seq_length, pad_id, multiple=PAD_MULTIPLE)
    t2d = unwrap_model(captured["run"].model[0]).t2d.cpu().bool()
    head = TargetHead.from_hf(target, t2d)
    full_head = head.head_shard[: arch.vocab_size]
    peer = SpecForgeStep(arch.reference_config(), head.norm_weight, head.eps, full_head, t2d, fixed, bf16=bf16)

    with torch.no_grad():
        _, in_draft = head(fixed["final_hidden"])
    in_draft = in_draft & within_lengths(fixed["lengths"], in_draft.shape[1])
    counted = [int(m.sum()) for m in step_masks(fixed["loss_mask"], in_draft, TTT_STEPS, "reference")]
    b, s = fixed["input_ids"].shape
    flops = distill_step_flops(arch, b, s, counted, TTT_STEPS)

    dtype_name = "bf16" if bf16 else "float32"

    def check(ours_loss, peer_loss):
        used = captured["iterator"].last
        if used is None or not torch.equal(used["input_ids"].cpu(), fixed["input_ids"]):
            raise AssertionError("distillation: the stage's step did not train on the peer's batch.")
        if not (math.isfinite(ours_loss) and math.isfinite(peer_loss)):
            raise AssertionError(f"distillation: non-finite loss (ours {ours_loss}, peer {peer_loss}).")

    return Pair(
        stage=f"distillation step (Osprey drafter, bf16 store of {b} conversations, padded to {s} tokens, TTT 5, "
        f"{dtype_name})",
        ours=ours,
        peer=peer,
        peer_name=(
            "a plain-PyTorch TTT step after SpecForge's EAGLE-3 trainer (HF-style modules, the same shapes, "
            f"per-sample normalised loss, {'bf16 autocast' if bf16 else 'float32'}, AdamW; written here)"
        ),
        limit_name=f"{flops / 1e9:.1f} GFLOP at this CPU's measured {dtype_name} matmul rate",
        check=check,
        limit_seconds=lambda: flops / matmul_rate(torch.bfloat16 if bf16 else torch.float32),
        close=stack.close,
    )
