"""Demo of Stage 1: build a tiny Qwen3-style small LM, prune it with tools/prune_backbone.py, check it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def build_small_lm(directory: Path, layers: int = 6, seed: int = 0) -> Path:
    """A tiny Qwen3 (tied embedding, qk-norm, decoupled head_dim) with a real BPE tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from megatron_osprey.data.regenerate.tiny_target import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer("qwen3", vocab_size=512)
    config = Qwen3Config(
        hidden_size=128, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, intermediate_size=384, vocab_size=len(tokenizer), max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def run(output: Path, num_layers: int = 2) -> dict:
    """Prune the tiny LM through the real Stage 1 entry point and verify the result."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    output.mkdir(parents=True, exist_ok=True)
    source = build_small_lm(output / "small_lm")
    pruned = output / "backbone"
    start = time.time()
    command = [sys.executable, str(ROOT / "tools" / "prune_backbone.py"), "--source", str(source),
               "--num-layers", str(num_layers), "--output", str(pruned), "--overwrite"]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    seconds = time.time() - start

    tokenizer = AutoTokenizer.from_pretrained(str(pruned / "hf"))
    ids = tokenizer("def fibonacci(n): return n if n < 2 else fibonacci(n - 1)", return_tensors="pt").input_ids
    original = AutoModelForCausalLM.from_pretrained(str(source)).eval()
    backbone = AutoModelForCausalLM.from_pretrained(str(pruned / "hf")).eval()
    with torch.no_grad():
        hidden = original(ids, output_hidden_states=True).hidden_states[num_layers]
        expected = original.lm_head(original.model.norm(hidden))
        got = backbone(ids).logits
    report = {
        "stage": "prune",
        "source_layers": original.config.num_hidden_layers,
        "kept_layers": num_layers,
        "source_parameters": sum(p.numel() for p in original.parameters()),
        "backbone_parameters": sum(p.numel() for p in backbone.parameters()),
        "max_abs_logit_diff_vs_truncated_source": float((got - expected).abs().max()),
        "seconds": round(seconds, 1),
    }
    (output / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
