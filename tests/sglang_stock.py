"""A mock of stock SGLang loading an EAGLE-3 draft, modelled on sglang/srt/models/llama_eagle3.py (0.5.x).

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
STACKED = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))
SHARDS = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1}


@dataclasses.dataclass
class StockLoad:
    skipped: list[str]  # checkpoint tensors stock SGLang drops without a word
    missing: list[str]  # stock parameters nothing was loaded into (they keep their random init)
    loaded: list[str]


def stock_parameters(config: dict) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of stock LlamaForCausalLMEagle3 built from `config` (unknown keys ignored)."""
    h = config["hidden_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    d = config.get("head_dim") or h // heads
    ffn = config["intermediate_size"]
    target_h = config.get("target_hidden_size", h)
    params = {
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "model.fc.weight": (h, 3 * target_h),
        "model.norm.weight": (h,),
    }

    def layer(prefix: str, width: int, norms: tuple[str, ...]) -> None:
        params[f"{prefix}.self_attn.qkv_proj.weight"] = ((heads + 2 * kv) * d, width)
        params[f"{prefix}.self_attn.o_proj.weight"] = (h, heads * d)
        params[f"{prefix}.mlp.gate_up_proj.weight"] = (2 * ffn, h)
        params[f"{prefix}.mlp.down_proj.weight"] = (h, ffn)
        for norm in norms:
            params[f"{prefix}.{norm}.weight"] = (h,)

    layer("model.midlayer", 2 * h, ("input_layernorm", "hidden_norm", "post_attention_layernorm"))
    # Extra layers are plain decoder layers with hidden_norm in place of input_layernorm.
    for i in range(1, config.get("num_hidden_layers", 1)):
        layer(f"model.additional_layers.{i - 1}", h, ("hidden_norm", "post_attention_layernorm"))
    if not config.get("tie_word_embeddings", False):
        params["lm_head.weight"] = (config.get("draft_vocab_size") or config["vocab_size"], h)
    return params


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
    needed = {name: ({0, 1, 2} if ".qkv_proj." in name else {0, 1} if ".gate_up_proj." in name else {None})
              for name in params}
    missing = sorted(name for name, want in needed.items() if shards.get(name, set()) != want)
    return StockLoad(skipped=skipped, missing=missing, loaded=sorted(shards))
