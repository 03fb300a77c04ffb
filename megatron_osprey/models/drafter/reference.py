"""Plain-PyTorch reference drafter: Osprey and EAGLE-3, one readable module.

This is the numerical ground truth the Megatron drafter is tested against and
the drafter the reference speculative-decoding engine runs. It favours being
obviously correct over being fast: attention is an explicit masked softmax over
explicitly concatenated keys.

Layer anatomy (H = hidden_size, Ht = target_hidden_size):

* osprey: the residual stream x starts from the drafter's own embedding.
  Every layer's attention reads ``cat(hidden_norm(g), input_layernorm(x))``
  (width 2H). Column order of ``q_proj/k_proj/v_proj.weight`` (shape
  ``[out, 2H]``): columns ``[:, :H]`` are ``W_new`` (they read
  ``hidden_norm(g)``, zero at init), columns ``[:, H:]`` are the pretrained
  projection (they read ``input_layernorm(x)``). All layers see the same g.
* eagle3: the residual stream starts from g. The first layer's attention reads
  ``cat(input_layernorm(emb), hidden_norm(h))`` (SGLang's
  ``LlamaForCausalLMEagle3`` midlayer order); later layers are plain decoder
  layers (``eagle3_extra_layers="plain"``, upstream SGLang) or the same fused
  layer again (``"fused"``, the multi-layer body of Osprey's patched SGLang).

Side input g: ``fusion_fc(cat(aux states))`` (parameter name ``fc``) at TTT
step 0; at step k > 0 the drafter's own pre-final-norm output of step k-1.

Two options against attention drift, both off by default (faithful to Osprey):
``hidden_post_norm`` passes ``norm(output)`` (the final norm, the one before the
LM head) to the next step instead of the pre-norm output, so the state's
magnitude cannot grow with chain depth (SGLang's ``norm_output``);
``aux_hidden_norm`` applies one RMSNorm per captured target hidden state before
``fc`` (``fc_norm.{0,1,2}``, SGLang's ``fc_norm``).

Weight names are HF-style without a ``model.`` prefix: ``embed_tokens``,
``fc``, ``layers.{i}.self_attn.{q,k,v,o}_proj``, ``layers.{i}.self_attn.
{q,k}_norm``, ``layers.{i}.{hidden_norm,input_layernorm,
post_attention_layernorm}``, ``layers.{i}.mlp.{gate,up,down}_proj``, ``norm``,
``lm_head`` and the ``d2t`` / ``t2d`` buffers. Export to SGLang renames
``layers.0`` to ``midlayer`` for one-layer drafters and, for Osprey's
``swap_h_and_emb`` layout, swaps ``hidden_norm`` and ``input_layernorm`` (there
the norm on g is called ``input_layernorm``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from megatron_osprey.base.atomic_io import atomic_path, write_text_atomic
from megatron_osprey.models.drafter.config import EAGLE3_EXTRA_LAYERS, VARIANTS

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_TAG = "megatron_osprey.reference_drafter/1"


@dataclass
class DrafterConfig:
    """Shape and flavour of a reference drafter."""

    hidden_size: int
    target_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    qk_layernorm: bool = False
    aux_layer_ids: list[int] = field(default_factory=list)
    tie_word_embeddings: bool = False
    variant: str = "osprey"
    eagle3_extra_layers: str = "plain"
    hidden_post_norm: bool = False
    aux_hidden_norm: bool = False

    def __post_init__(self) -> None:
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.variant not in VARIANTS:
            raise ValueError(f"DrafterConfig.variant must be one of {VARIANTS}, got {self.variant!r}.")
        if self.eagle3_extra_layers not in EAGLE3_EXTRA_LAYERS:
            raise ValueError(
                f"DrafterConfig.eagle3_extra_layers must be one of {EAGLE3_EXTRA_LAYERS}, "
                f"got {self.eagle3_extra_layers!r}."
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"DrafterConfig.draft_vocab_size ({self.draft_vocab_size}) must be in 1..vocab_size "
                f"({self.vocab_size})."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DrafterConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})."
            )
        if self.tie_word_embeddings and self.draft_vocab_size != self.vocab_size:
            raise ValueError("DrafterConfig.tie_word_embeddings needs draft_vocab_size == vocab_size.")
        if self.num_layers < 1:
            raise ValueError(f"DrafterConfig.num_layers must be >= 1, got {self.num_layers}.")
        if self.head_dim % 2:
            raise ValueError(f"DrafterConfig.head_dim must be even for rotary embeddings, got {self.head_dim}.")
        rope_type = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if rope_type not in ("default", "llama3", "linear"):
            raise ValueError(f"DrafterConfig.rope_scaling type {rope_type!r} is not supported (default/llama3/linear).")


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as HF Llama/Qwen3 do."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dimension."""
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(cfg: DrafterConfig) -> torch.Tensor:
    """Rotary inverse frequencies, with Llama-3 or linear frequency scaling when configured."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":  # an EAGLE-3 drafter of a Gemma 3 target takes its global layers' RoPE
        return inv_freq / float(scaling["factor"])
    if kind != "llama3":
        return inv_freq
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    smooth = (original / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    mid = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, T, D] by positions [B, T] (rotate-half convention)."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(x.device)
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DrafterAttention(nn.Module):
    """Grouped-query attention with an explicit masked softmax."""

    def __init__(self, cfg: DrafterConfig, in_features: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_layernorm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_layernorm = cfg.qk_layernorm

    def project(self, a: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
        """Return rotated q [B, h, T, D] and k, v [B, h_kv, T, D] for input a [B, T, in]."""
        b, t, _ = a.shape
        q = self.q_proj(a).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(a).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(a).view(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_layernorm:  # Qwen3: per-head norm before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Softmax attention of q over keys/values where `allowed` [B|1, Tq, S] is True; returns o_proj output."""
        groups = self.num_heads // self.num_kv_heads
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
        scores = (q @ keys.transpose(-1, -2)).float() / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = (probs @ values).transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
        return self.o_proj(out)


class SwiGLU(nn.Module):
    """Gated SiLU MLP with HF names."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x))."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """One decoder layer; `kind` says what its attention reads.

    kind "osprey": cat(hidden_norm(side=g), input_layernorm(stream=x));
    kind "eagle3": cat(input_layernorm(side=emb), hidden_norm(stream=h));
    kind "plain":  input_layernorm(stream).
    """

    def __init__(self, cfg: DrafterConfig, kind: str):
        super().__init__()
        self.kind = kind
        fused = kind != "plain"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if fused:
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg, (2 if fused else 1) * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def attention_input(self, stream: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
        """The tensor the QKV projections read (see the class docstring)."""
        if self.kind == "osprey":
            return torch.cat((self.hidden_norm(side), self.input_layernorm(stream)), dim=-1)
        if self.kind == "eagle3":
            return torch.cat((self.input_layernorm(side), self.hidden_norm(stream)), dim=-1)
        return self.input_layernorm(stream)

    def forward(self, stream, side, positions, inv_freq, past_kv, allowed):
        """Run the layer; past_kv is (keys, values) already cached or None. Returns (stream, k_new, v_new)."""
        q, k, v = self.self_attn.project(self.attention_input(stream, side), positions, inv_freq)
        keys = k if past_kv is None else torch.cat((past_kv[0], k), dim=2)
        values = v if past_kv is None else torch.cat((past_kv[1], v), dim=2)
        stream = stream + self.self_attn.attend(q, keys, values, allowed)
        stream = stream + self.mlp(self.post_attention_layernorm(stream))
        return stream, k, v


@dataclass
class DrafterKVCache:
    """Per-layer cached keys/values [B, h_kv, S, D] (post-RoPE), grown by explicit concatenation."""

    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)

    @property
    def length(self) -> int:
        """Number of cached positions."""
        return 0 if not self.keys else self.keys[0].shape[2]

    def layer(self, i: int):
        """(keys, values) of layer i, or None when empty."""
        return (self.keys[i], self.values[i]) if i < len(self.keys) else None

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Concatenate new keys/values for layer i."""
        if i < len(self.keys):
            self.keys[i] = torch.cat((self.keys[i], k), dim=2)
            self.values[i] = torch.cat((self.values[i], v), dim=2)
        else:
            self.keys.append(k)
            self.values.append(v)

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (rollback after rejection)."""
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]


def causal_allowed(q_len: int, past_len: int, device=None) -> torch.Tensor:
    """[1, q_len, past_len + q_len] mask: every cached key plus new keys up to the query's own."""
    rows = torch.arange(q_len, device=device)[:, None]
    cols = torch.arange(past_len + q_len, device=device)[None, :]
    return (cols <= rows + past_len)[None]


def ttt_allowed(seq_len: int, step: int, device=None) -> torch.Tensor:
    """[1, T, (step+1)*T] mask: causal over step-0 keys plus the same-index key of steps 1..step."""
    blocks = [causal_allowed(seq_len, 0, device)[0]]
    blocks += [torch.eye(seq_len, dtype=torch.bool, device=device)] * step
    return torch.cat(blocks, dim=1)[None]


class ReferenceDrafter(nn.Module):
    """Osprey / EAGLE-3 drafter in plain PyTorch (see the module docstring)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        if cfg.aux_hidden_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(3))
        kinds = [cfg.variant] + [
            "osprey" if cfg.variant == "osprey" else ("eagle3" if cfg.eagle3_extra_layers == "fused" else "plain")
        ] * (cfg.num_layers - 1)
        self.layers = nn.ModuleList(DrafterLayer(cfg, kind) for kind in kinds)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if cfg.variant == "eagle3":  # EAGLE-3 reads the target's frozen embedding
            self.embed_tokens.weight.requires_grad_(False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        # A plain attribute, not a buffer, so .to(bfloat16) never rounds the rotary frequencies.
        self.inv_freq = rope_inv_freq(cfg)

    # ----- vocabulary -----
    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Set d2t/t2d from the target ids of the draft vocabulary (draft id i -> target_ids sorted[i])."""
        ids = torch.sort(torch.as_tensor(target_ids, dtype=torch.int64)).values
        if ids.numel() != self.config.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(
                f"draft vocabulary needs {self.config.draft_vocab_size} distinct target ids, got {ids.numel()}."
            )
        if ids[0] < 0 or ids[-1] >= self.config.vocab_size:
            raise ValueError(f"draft vocabulary ids must lie in 0..{self.config.vocab_size - 1}.")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids (id + d2t[id])."""
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Scatter draft-vocab logits onto the target vocab; tokens outside the draft vocab get -inf."""
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        ids = self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=draft_logits.device))
        out[..., ids] = draft_logits
        return out

    # ----- init -----
    @torch.no_grad()
    def init_osprey_side_path(self) -> None:
        """Osprey init of the new parameters: W_new = 0, hidden_norm = input_layernorm, fc = identity on the deepest
        tap."""
        h, ht = self.config.hidden_size, self.config.target_hidden_size
        for layer in self.layers:
            if layer.kind != "osprey":
                raise ValueError("init_osprey_side_path applies to the osprey variant only.")
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight[:, :h] = 0
            layer.hidden_norm.weight.copy_(layer.input_layernorm.weight)
        # A zero fc behind a zero W_new is a stationary point; the identity gives both a gradient.
        self.fc.weight.zero_()
        shared = min(h, ht)
        self.fc.weight[:shared, 2 * ht : 2 * ht + shared] = torch.eye(shared)

    # ----- forward -----
    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """g = fc(cat(aux states)), each state RMS-normed first under aux_hidden_norm."""
        if self.config.aux_hidden_norm:
            chunks = aux_hidden.chunk(3, dim=-1)
            aux_hidden = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux_hidden)

    def passed_state(self, stream: torch.Tensor) -> torch.Tensor:
        """What the next chain / TTT step reads as g: the pre-norm output, or its final norm (hidden_post_norm)."""
        return self.norm(stream) if self.config.hidden_post_norm else stream

    def _streams(self, emb: torch.Tensor, g: torch.Tensor):
        return (emb, g) if self.config.variant == "osprey" else (g, emb)

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor | None = None,
        g: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        kv_cache: DrafterKVCache | None = None,
        allowed: torch.Tensor | None = None,
        logits_rows: torch.Tensor | None = None,
    ):
        """One drafter pass; returns (draft-vocab logits [B,T,Vd], the state the next step reads as g [B,T,H]).

        That state is the pre-final-norm hidden, or its final norm under hidden_post_norm.

        Pass exactly one of aux_hidden [B,T,3*Ht] (g = fc(aux)) or g [B,T,H].
        position_ids default to cache length + arange(T). With kv_cache, new
        keys/values are appended to it; `allowed` [B|1, T, past+T] (True =
        attend) overrides the default causal mask. logits_rows [B] computes the
        logits of one column per batch row only ([B,1,Vd]; the head is most of a
        long prefill's cost).
        """
        if (aux_hidden is None) == (g is None):
            raise ValueError("ReferenceDrafter.forward needs exactly one of aux_hidden or g.")
        b, t = input_ids.shape
        past = 0 if kv_cache is None else kv_cache.length
        if g is None:
            g = self.fuse(aux_hidden)
        if position_ids is None:
            position_ids = (past + torch.arange(t, device=input_ids.device)).expand(b, t)
        if allowed is None:
            allowed = causal_allowed(t, past, input_ids.device)
        stream, side = self._streams(self.embed_tokens(input_ids), g)
        for i, layer in enumerate(self.layers):
            past_kv = None if kv_cache is None else kv_cache.layer(i)
            stream, k, v = layer(stream, side, position_ids, self.inv_freq, past_kv, allowed)
            if kv_cache is not None:
                kv_cache.append(i, k, v)
        head_input = stream if logits_rows is None else stream[torch.arange(b, device=stream.device), logits_rows, None]
        return self.lm_head(self.norm(head_input)), self.passed_state(stream)

    def ttt_forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        steps: int,
        position_ids: torch.Tensor | None = None,
        return_hidden: bool = False,
    ):
        """Step-by-step training-time-test unroll; returns per-step draft-vocab logits [B,T,Vd] (and pre-norm hiddens).

        Row t of step 0 reads (input_ids[t], fc(aux_hidden[t])) at position_ids[t].
        Step k reads input_ids shifted left by k (zero-padded: rows t >= T-k are
        padding), positions + k, and g = step k-1's pre-final-norm output at the
        same row (its final norm under hidden_post_norm). Its queries attend causally
        to step-0 keys plus the same-row keys of steps 1..k.
        """
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        g = self.fuse(aux_hidden)
        keys = [[] for _ in self.layers]
        values = [[] for _ in self.layers]
        logits_per_step, hidden_per_step = [], []
        for k in range(steps):
            ids_k = F.pad(input_ids[:, k:], (0, min(k, t)))
            stream, side = self._streams(self.embed_tokens(ids_k), g)
            allowed = ttt_allowed(t, k, input_ids.device)
            for i, layer in enumerate(self.layers):
                past_kv = (torch.cat(keys[i], dim=2), torch.cat(values[i], dim=2)) if k else None
                stream, kk, vv = layer(stream, side, position_ids + k, self.inv_freq, past_kv, allowed)
                keys[i].append(kk)
                values[i].append(vv)
            logits_per_step.append(self.lm_head(self.norm(stream)))
            hidden_per_step.append(stream)
            g = self.passed_state(stream)
        return (logits_per_step, hidden_per_step) if return_hidden else logits_per_step

    # ----- persistence -----
    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Write model.safetensors and config.json atomically (config last)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight")  # shared with embed_tokens; safetensors refuses aliases
        with atomic_path(directory / WEIGHTS_NAME) as tmp:
            save_file(state, str(tmp), metadata={"format": "pt"})
        payload = {"format": FORMAT_TAG, **dataclasses.asdict(self.config)}
        text = json.dumps(payload, indent=2, sort_keys=True) + "\n"
        write_text_atomic(directory / CONFIG_NAME, text)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, device: str = "cpu") -> "ReferenceDrafter":
        """Load a drafter written by save_pretrained."""
        from megatron_osprey.convert.safetensors_io import load_safetensors

        directory = Path(directory)
        config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
        for path in (config_path, weights_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing; is {directory} a reference drafter directory?")
        payload = json.loads(config_path.read_text())
        if payload.pop("format", None) != FORMAT_TAG:
            raise ValueError(f"{config_path} is not a {FORMAT_TAG} config.")
        model = cls(DrafterConfig(**payload))
        state = load_safetensors(weights_path, device=device)
        if model.config.tie_word_embeddings:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        dtype = state["embed_tokens.weight"].dtype
        model.to(device=device, dtype=dtype)
        model.load_state_dict(state, strict=True)
        return model
