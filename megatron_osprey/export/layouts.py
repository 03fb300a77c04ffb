"""Weight names and config.json of the serving layouts, as pure functions of a reference drafter.

Layouts (all HF-style, no ``model.`` prefix; ``d2t`` int64 [Vd] and ``t2d`` bool [V] buffers in each):

* ``sglang`` (Osprey): architecture ``OspreyQwen3ForCausalLMEagle3`` (q/k-norm bodies) or
  ``OspreyLlamaForCausalLMEagle3``, names only the plugin registers (stock SGLang refuses them rather
  than serve a half-loaded draft); ``swap_h_and_emb: true``; its own ``embed_tokens``; one-layer drafters
  name their layer ``midlayer``, deeper ones ``layers.{i}``. SGLang's fused layer computes
  ``cat(input_layernorm(a), hidden_norm(b))`` with residual ``b``; in swap mode ``a = g`` and ``b`` is
  the embedding stream, so the reference ``hidden_norm`` (on g) is SGLang's ``input_layernorm`` and
  the reference ``input_layernorm`` (on the stream) is SGLang's ``hidden_norm``. QKV column order
  is unchanged (first H columns read g).
* ``sglang`` (EAGLE-3): stock ``LlamaForCausalLMEagle3``, ``midlayer.*`` for the published one-layer
  drafter (Llama layer, no plugin); the reference names already match SGLang's (``input_layernorm`` on
  the embedding, ``hidden_norm`` on g). Deeper EAGLE-3 drafters write ``layers.{i}`` and
  ``eagle3_extra_layers`` (fused or plain) under the plugin's ``OspreyLlamaForCausalLMEagle3``.
* ``vllm``: the reference names unchanged (``layers.{i}.*``; ``d2t``/``t2d`` only with a draft vocabulary)
  and vLLM's config keys (``fc_norm``, ``norm_output``, ``draft_vocab_size``). vLLM counts its aux taps
  as "hidden state after L layers" (its default ``(2, L//2, L-3)``), one more than this project's and
  SGLang's 0-based layer ids, so ``eagle_aux_hidden_state_layer_ids`` holds ``id + 1``. EAGLE-3 drafters
  whose extra layers are plain, without q/k norms, go to stock ``LlamaForCausalLMEagle3``
  (``Eagle3LlamaForCausalLM``); Osprey, fused multi-layer EAGLE-3 and q/k-norm bodies to the plugin's
  ``Eagle3OspreyLlamaForCausalLM`` / ``Eagle3OspreyQwen3ForCausalLM`` with ``draft_layer_kinds``
  (megatron_osprey.export.vllm_plugin).
* ``speculators``: vLLM speculators' ``Eagle3Speculator`` (one fused Llama layer, ``layers.0.*``,
  ``transformer_layer_config``); only the one-layer EAGLE-3 drafter fits it. Its aux taps are vLLM's
  count (id + 1), as in the ``vllm`` layout.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_osprey.export.config import ARCHITECTURE_NAMES
from megatron_osprey.export.sglang_plugin.weight_names import PLUGIN_ARCHITECTURES
from megatron_osprey.export.vllm_plugin import weight_names as vllm_names
from megatron_osprey.models.drafter.reference import DrafterConfig

EXPORT_TAG = "megatron_osprey.export/1"
STOCK_SGLANG_ARCH = "LlamaForCausalLMEagle3"
# Read back as well: exports written before the plugin had names of its own.
LEGACY_QWEN3_ARCH = "Qwen3ForCausalLMEagle3"
SGLANG_ARCHS = (*PLUGIN_ARCHITECTURES, STOCK_SGLANG_ARCH, LEGACY_QWEN3_ARCH)
QK_NORM_ARCHS = (PLUGIN_ARCHITECTURES[1], LEGACY_QWEN3_ARCH)
SPECULATORS_ARCH = "Eagle3Speculator"
_SWAP = {"hidden_norm": "input_layernorm", "input_layernorm": "hidden_norm"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _split_layer_name(name: str) -> tuple[int, str] | None:
    """("layers.3.self_attn.q_proj.weight") -> (3, "self_attn.q_proj.weight"); None for non-layer names."""
    if not name.startswith("layers."):
        return None
    _, index, rest = name.split(".", 2)
    return int(index), rest


def _swap_norm(rest: str) -> str:
    head, _, tail = rest.partition(".")
    return f"{_SWAP[head]}.{tail}" if head in _SWAP else rest


def _body_config(cfg: DrafterConfig, max_position_embeddings: int) -> dict:
    """The Llama/Qwen3-style fields every serving config shares."""
    body = {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    return body


def _reference_fields(cfg: DrafterConfig) -> dict:
    """Fields that make the export read back into exactly this DrafterConfig."""
    return {"format": EXPORT_TAG, **dataclasses.asdict(cfg)}


# ----------------------------------------------------------------------------- sglang


def sglang_state(state: dict[str, torch.Tensor], cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    """Reference state dict -> SGLang draft checkpoint names."""
    out = {}
    for name, tensor in state.items():
        layer = _split_layer_name(name)
        if layer is None:
            out[name] = tensor
            continue
        index, rest = layer
        prefix = "midlayer" if cfg.num_layers == 1 else f"layers.{index}"
        out[f"{prefix}.{_swap_norm(rest) if cfg.variant == 'osprey' else rest}"] = tensor
    if "lm_head.weight" not in out:  # tied drafters: serving layouts always carry the head
        out["lm_head.weight"] = state["embed_tokens.weight"]
    return out


def reference_state_from_sglang(tensors: dict[str, torch.Tensor], cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    """Inverse of sglang_state."""
    out = {}
    for name, tensor in tensors.items():
        if name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer.") :]
        layer = _split_layer_name(name)
        if layer is not None and cfg.variant == "osprey":
            name = f"layers.{layer[0]}.{_swap_norm(layer[1])}"
        out[name] = tensor
    return out


def sglang_architecture(cfg: DrafterConfig, names: str = "osprey") -> str:
    """Stock LlamaForCausalLMEagle3 for a one-layer Llama EAGLE-3 draft; the plugin's names otherwise, or
    with names="release" the ones the release's patched SGLang registers (export/config.py)."""
    if names not in ARCHITECTURE_NAMES:
        raise ValueError(f"--architecture-names must be one of {ARCHITECTURE_NAMES}, got {names!r}.")
    if names == "release":
        return LEGACY_QWEN3_ARCH if cfg.qk_layernorm else STOCK_SGLANG_ARCH
    if cfg.variant == "eagle3" and cfg.num_layers == 1 and not cfg.qk_layernorm:
        return STOCK_SGLANG_ARCH
    return PLUGIN_ARCHITECTURES[1] if cfg.qk_layernorm else PLUGIN_ARCHITECTURES[0]


def sglang_config(
    cfg: DrafterConfig,
    dtype: torch.dtype,
    max_position_embeddings: int,
    extra: dict | None = None,
    architecture_names: str = "osprey",
) -> dict:
    """config.json for SGLang's EAGLE-3 draft loader (and the plugin)."""
    qwen = cfg.qk_layernorm
    config = {
        "architectures": [sglang_architecture(cfg, architecture_names)],
        "model_type": "qwen3" if qwen else "llama",
        **_body_config(cfg, max_position_embeddings),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "torch_dtype": _dtype_name(dtype),
        "use_cache": True,
        "pretraining_tp": 1,
        # SGLang reads the taps (0-based target layer ids) from here.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "use_aux_hidden_state": True},
    }
    if cfg.variant == "osprey":
        config["swap_h_and_emb"] = True
    elif cfg.num_layers > 1:
        config["eagle3_extra_layers"] = cfg.eagle3_extra_layers
    # The flags sglang 0.5.23's LlamaForCausalLMEagle3 reads (the plugin too): an RMSNorm per aux state before
    # fc (weights fc_norm.{0,1,2}), and the final-normed hidden as the state the next draft step reads.
    if cfg.aux_hidden_norm:
        config["fc_norm"] = True
    if cfg.hidden_post_norm:
        config["norm_output"] = True
    config["megatron_osprey"] = {**_reference_fields(cfg), **(extra or {})}
    return config


# ----------------------------------------------------------------------------- speculators


def speculators_refusal(cfg: DrafterConfig) -> str | None:
    """Why this drafter does not fit speculators' Eagle3 format, or None when it does."""
    if cfg.hidden_post_norm or cfg.aux_hidden_norm:
        return (
            "--format speculators: Eagle3Speculator has no post-norm between draft steps and no per-state "
            "norm before fc; export a drafter trained with --hidden-post-norm or --aux-hidden-norm with "
            "--format sglang."
        )
    if cfg.variant == "osprey":
        return (
            "--format speculators: an Osprey drafter keeps its own embedding as the residual stream in every "
            f"layer ({cfg.num_layers} layers), which speculators' one-layer Eagle3Speculator cannot express; "
            "use --format sglang (with the megatron_osprey SGLang plugin) or --format hf."
        )
    if cfg.num_layers != 1:
        return (
            f"--format speculators: Eagle3Speculator has exactly one layer, this EAGLE-3 drafter has "
            f"{cfg.num_layers}; use --format sglang."
        )
    if cfg.qk_layernorm:
        return (
            "--format speculators: Eagle3Speculator is a Llama layer without q/k norms; this drafter has them "
            "(Qwen3 body)."
        )
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        return (
            "--format speculators: Eagle3Speculator derives head_dim = hidden_size / heads, which this drafter "
            "does not satisfy."
        )
    return None


def speculators_state(state: dict[str, torch.Tensor], cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    """Reference state -> speculators names (identical for the one-layer EAGLE-3 drafter; vLLM's loader)."""
    reason = speculators_refusal(cfg)
    if reason:
        raise ValueError(reason)
    return vllm_state(state, cfg)  # vLLM loads it: no d2t/t2d without a draft vocabulary


def speculators_config(
    cfg: DrafterConfig,
    dtype: torch.dtype,
    max_position_embeddings: int,
    verifier: dict | None = None,
    speculative_tokens: int = 5,
    extra: dict | None = None,
) -> dict:
    """config.json of a speculators Eagle3 checkpoint."""
    reason = speculators_refusal(cfg)
    if reason:
        raise ValueError(reason)
    layer = {"model_type": "llama", **_body_config(cfg, max_position_embeddings)}
    return {
        "architectures": [SPECULATORS_ARCH],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": False,
        "target_hidden_size": cfg.target_hidden_size,
        # vLLM reads these as "hidden state after L layers": this project's layer id + 1 (see vllm_aux_layer_ids).
        "eagle_aux_hidden_state_layer_ids": vllm_aux_layer_ids(cfg),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": verifier or {"name_or_path": None, "architectures": []},
        },
        "torch_dtype": _dtype_name(dtype),
        "megatron_osprey": {**_reference_fields(cfg), **(extra or {})},
    }


# ----------------------------------------------------------------------------- vllm

VLLM_LAYOUT = "vllm"


def vllm_layer_kinds(cfg: DrafterConfig) -> list[str]:
    """What each layer's attention reads (export/vllm_plugin/weight_names.py)."""
    if cfg.variant == "osprey":
        return ["osprey"] * cfg.num_layers
    return ["eagle3"] + ["eagle3" if cfg.eagle3_extra_layers == "fused" else "plain"] * (cfg.num_layers - 1)


def vllm_uses_stock(cfg: DrafterConfig) -> bool:
    """Whether stock Eagle3LlamaForCausalLM computes exactly this drafter (one fused layer, then plain ones)."""
    return cfg.variant == "eagle3" and not cfg.qk_layernorm and "eagle3" not in vllm_layer_kinds(cfg)[1:]


def vllm_aux_layer_ids(cfg: DrafterConfig) -> list[int]:
    """This project's 0-based layer ids (output of layer i) as vLLM counts them (hidden state after i+1 layers)."""
    return [int(i) + 1 for i in cfg.aux_layer_ids]


def vllm_refusal(cfg: DrafterConfig, target: dict | None = None) -> str | None:
    """Why vLLM 0.32 cannot serve this drafter for `target` (its config.json, when known), or None."""
    if len(cfg.aux_layer_ids) != 3:
        return (
            f"--format vllm: aux_layer_ids {list(cfg.aux_layer_ids)} must name three target layers "
            "(vLLM's fc reads three captured states)."
        )
    if list(cfg.aux_layer_ids) != sorted(cfg.aux_layer_ids):
        return (
            f"--format vllm: aux_layer_ids {list(cfg.aux_layer_ids)} must be ascending: vLLM hands the taps over in "
            "layer order, training concatenated them in the order given."
        )
    if not target:
        return None
    target = _language_model_fields(target)
    layers = target.get("num_hidden_layers")
    if layers is not None and max(cfg.aux_layer_ids) >= int(layers) - 1:
        return (
            f"--format vllm: aux_layer_ids {list(cfg.aux_layer_ids)} taps the target's last layer ({int(layers) - 1}); "
            "vLLM hands the drafter that layer's output before the final norm, the training data after it."
        )
    for field_name, ours, theirs in (
        ("vocab_size", cfg.vocab_size, target.get("vocab_size")),
        ("target_hidden_size", cfg.target_hidden_size, target.get("hidden_size")),
    ):
        if theirs is not None and int(theirs) != ours:
            return (
                f"--format vllm: the drafter's {field_name} is {ours} but the target's config.json says {theirs}; "
                "vLLM would index the wrong rows."
            )
    return None


def _language_model_fields(target: dict) -> dict:
    """The layers, vocabulary and width of a target config.json: a multimodal one (Gemma 3) keeps them in its
    text_config, some left to the family's defaults, so it is parsed as the target stages parse it."""
    if "text_config" not in target:
        return target
    from megatron_osprey.base.arch import ModelArch

    arch = ModelArch.from_hf_config(target, source="the target's config.json")
    return {"num_hidden_layers": arch.num_layers, "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size}


def vllm_state(state: dict[str, torch.Tensor], cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    """Reference state -> vLLM draft checkpoint (the same names; d2t/t2d only with a draft vocabulary)."""
    out = dict(state)
    out.setdefault("lm_head.weight", state["embed_tokens.weight"])
    if cfg.draft_vocab_size == cfg.vocab_size:
        out.pop("d2t"), out.pop("t2d")  # identity maps; stock vLLM has no parameter for them then
    return out


def reference_state_from_vllm(tensors: dict[str, torch.Tensor], cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    """Inverse of vllm_state (and of speculators_state)."""
    out = dict(tensors)
    if "d2t" not in out:
        out["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
        out["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    return out


def vllm_config(
    cfg: DrafterConfig, dtype: torch.dtype, max_position_embeddings: int, extra: dict | None = None
) -> dict:
    """config.json for vLLM's EAGLE-3 draft loader (stock Eagle3LlamaForCausalLM or the plugin)."""
    reason = vllm_refusal(cfg)
    if reason:
        raise ValueError(reason)
    stock = vllm_uses_stock(cfg)
    aux = vllm_aux_layer_ids(cfg)
    config = {
        "architectures": [
            vllm_names.STOCK_ARCHITECTURE if stock else vllm_names.VLLM_PLUGIN_ARCHITECTURES[int(cfg.qk_layernorm)]
        ],
        "model_type": "qwen3" if cfg.qk_layernorm else "llama",
        **_body_config(cfg, max_position_embeddings),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "torch_dtype": _dtype_name(dtype),
        # vLLM's model runner reads the top-level key first, its draft model the eagle_config one.
        "eagle_aux_hidden_state_layer_ids": aux,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": cfg.aux_hidden_norm,
        "norm_output": cfg.hidden_post_norm,
    }
    if not stock:
        config[vllm_names.KINDS_KEY] = vllm_layer_kinds(cfg)
    config["megatron_osprey"] = {**_reference_fields(cfg), "layout": VLLM_LAYOUT, **(extra or {})}
    return config


# ----------------------------------------------------------------------------- reading back


def drafter_config_from_export(config: dict) -> DrafterConfig:
    """DrafterConfig of an exported config.json (ours carry it exactly; others are read from their fields)."""
    ours = config.get("megatron_osprey", {})
    if ours.get("format") == EXPORT_TAG:
        names = {f.name for f in dataclasses.fields(DrafterConfig)}
        return DrafterConfig(**{k: v for k, v in ours.items() if k in names})
    body = config.get("transformer_layer_config", config)
    aux = config.get("eagle_aux_hidden_state_layer_ids") or config.get("eagle_config", {}).get(
        "eagle_aux_hidden_state_layer_ids", []
    )
    if config.get("speculators_model_type") or SPECULATORS_ARCH in config.get("architectures", []):
        aux = [int(i) - 1 for i in aux]  # vLLM's count (hidden state after L layers) -> 0-based layer ids
    return DrafterConfig(
        hidden_size=body["hidden_size"],
        target_hidden_size=config.get("target_hidden_size") or body["hidden_size"],
        num_layers=body["num_hidden_layers"],
        num_attention_heads=body["num_attention_heads"],
        num_key_value_heads=body.get("num_key_value_heads", body["num_attention_heads"]),
        head_dim=body.get("head_dim") or body["hidden_size"] // body["num_attention_heads"],
        intermediate_size=body["intermediate_size"],
        vocab_size=body["vocab_size"],
        draft_vocab_size=config.get("draft_vocab_size") or body["vocab_size"],
        rms_norm_eps=body.get("rms_norm_eps", 1e-6),
        rope_theta=body.get("rope_theta", 10000.0),
        rope_scaling=body.get("rope_scaling"),
        qk_layernorm=config.get("architectures", [""])[0] in QK_NORM_ARCHS,
        aux_layer_ids=list(aux),
        variant="osprey" if config.get("swap_h_and_emb") else "eagle3",
        # A third-party multi-layer draft without the key is SGLang's stock layout: plain extra layers.
        eagle3_extra_layers=config.get("eagle3_extra_layers", "plain"),
        hidden_post_norm=bool(config.get("norm_output", False)),
        aux_hidden_norm=bool(config.get("fc_norm") or config.get("use_aux_norm", False)),
    )
