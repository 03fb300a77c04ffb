"""A mock of stock SGLang loading an EAGLE-3 draft, modelled on sglang/srt/models/llama_eagle3.py of
sglang 0.5.23 (the release the `serve` extra pins).

Stock SGLang picks the model class by the first name in `architectures` from the classes it registers,
builds LlamaForCausalLMEagle3 from the config keys it knows (ignoring every other key), and its
load_weights skips any checkpoint tensor whose name matches no parameter, without a word. This mock
does the same with parameter names and shapes only, and reports what was skipped and what was never
loaded, which stock SGLang does not.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

# The EAGLE-3 draft architectures stock SGLang registers.
STOCK_EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
# (fused parameter, checkpoint name, shard id), as in the stock load_weights.
STACKED = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)
SHARDS = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1}


@dataclasses.dataclass
class StockLoad:
    skipped: list[str]  # checkpoint tensors stock SGLang drops without a word
    missing: list[str]  # stock parameters nothing was loaded into (they keep their random init)
    loaded: list[str]


# Checkpoint names 0.5.23 renames before matching (its legacy_name_map).
LEGACY_NAMES = {
    "midlayer": "layers.0",
    "aux_norm_low": "fc_norm.0",
    "aux_norm_mid": "fc_norm.1",
    "aux_norm_high": "fc_norm.2",
}


def stock_parameters(config: dict) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of stock LlamaForCausalLMEagle3 built from `config` (unknown keys ignored).

    Layer 0 reads cat(input_layernorm(embeds), hidden_norm(hidden)) (QKV input 2H); later layers fold the
    carried residual into hidden_norm and read H (their inherited input_layernorm exists but is unused).
    """
    h = config["hidden_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    d = config.get("head_dim") or h // heads
    ffn = config["intermediate_size"]
    target_h = config.get("target_hidden_size", h)
    aux = len((config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    params = {
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "model.fc.weight": (h, aux * target_h),
        "model.norm.weight": (h,),
    }
    if config.get("fc_norm") or config.get("use_aux_norm", False):  # one RMSNorm per aux state before fc
        params.update({f"model.fc_norm.{i}.weight": (target_h,) for i in range(aux)})
    for i in range(config.get("num_hidden_layers", 1)):
        prefix = f"model.layers.{i}"
        params[f"{prefix}.self_attn.qkv_proj.weight"] = ((heads + 2 * kv) * d, 2 * h if i == 0 else h)
        params[f"{prefix}.self_attn.o_proj.weight"] = (h, heads * d)
        params[f"{prefix}.mlp.gate_up_proj.weight"] = (2 * ffn, h)
        params[f"{prefix}.mlp.down_proj.weight"] = (h, ffn)
        for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            params[f"{prefix}.{norm}.weight"] = (h,)
    if not config.get("tie_word_embeddings", False):
        params["lm_head.weight"] = (config.get("draft_vocab_size") or config["vocab_size"], h)
    return params


def unused_parameters(config: dict) -> set[str]:
    """Stock parameters its forward never reads: the input_layernorm of layers after the first."""
    return {f"model.layers.{i}.input_layernorm.weight" for i in range(1, config.get("num_hidden_layers", 1))}


def stock_load(directory: str | Path) -> StockLoad:
    """Load an exported draft the way stock SGLang would; raise as it does for an unregistered architecture."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    architectures = config.get("architectures") or []
    if not any(a in STOCK_EAGLE3_ARCHITECTURES for a in architectures):
        raise ValueError(f"Model architectures {architectures} are not supported for now.")
    params = stock_parameters(config)
    shards: dict[str, set] = {}
    skipped = []
    for name, tensor in load_file(str(directory / "model.safetensors")).items():
        for legacy, new in LEGACY_NAMES.items():
            if legacy in name:
                name = name.replace(legacy, new)
        if "d2t" in name or "t2d" in name:
            continue
        for fused, source, shard in STACKED:
            if source in name:
                mapped = name.replace(source, fused)
                break
        else:
            mapped, shard = name, None
        param = mapped if mapped in params else f"model.{mapped}"
        if param not in params:
            skipped.append(name)
            continue
        expected = params[param]
        if shard is not None:  # a shard of a fused parameter: same input width, part of the rows
            assert tuple(tensor.shape[1:]) == expected[1:], (name, tuple(tensor.shape), expected)
        else:
            assert tuple(tensor.shape) == expected, (name, tuple(tensor.shape), expected)
        shards.setdefault(param, set()).add(SHARDS[shard] if shard is not None else None)
    needed = {
        name: ({0, 1, 2} if ".qkv_proj." in name else {0, 1} if ".gate_up_proj." in name else {None}) for name in params
    }
    missing = sorted(
        name
        for name, want in needed.items()
        if shards.get(name, set()) != want and name not in unused_parameters(config)
    )
    return StockLoad(skipped=skipped, missing=missing, loaded=sorted(shards))
