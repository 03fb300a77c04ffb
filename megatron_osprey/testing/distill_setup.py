"""A tiny chat target, a tiny backbone with another tokenizer, an adapted drafter and conversations."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

TOPICS = ["the weather", "python lists", "prime numbers", "a short poem", "coffee", "trains", "the moon", "chess"]


def write_topic_conversations(path: Path, count: int, seed: int = 0) -> Path:
    """Conversations JSONL with one or two turns, deterministic."""
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for i in range(count):
            topic = rng.choice(TOPICS)
            turns = [
                {"role": "user", "content": f"Tell me about {topic}, please ({i})."},
                {
                    "role": "assistant",
                    "content": f"Here is something about {topic}: it is {rng.choice(['nice', 'odd', 'big'])}.",
                },
            ]
            if i % 3 == 0:
                turns += [
                    {"role": "user", "content": "And more?"},
                    {"role": "assistant", "content": f"More about {topic} and {rng.choice(TOPICS)}."},
                ]
            handle.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")
    return path


def write_chat_model(directory: Path, family: str, layers: int, hidden: int, seed: int, qwen3: bool = False) -> Path:
    """A random tiny causal LM with a small BPE tokenizer carrying `family`'s chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from megatron_osprey.data.regenerate.tiny_target import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(family)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    if qwen3:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // 4, tie_word_embeddings=True, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    with torch.no_grad():  # a peaked target: larger output weights give confident next-token choices
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build_distill_setup(root: Path) -> dict:
    """target (Qwen3 chat template, Llama layers, 8 of them), backbone (Llama-3 tokenizer, Qwen3 layers)
    pruned to 2 layers and adapted, and 48 conversations."""
    from megatron_osprey.stages import adapt, prune
    from megatron_osprey.stages.adapt import AdaptConfig
    from megatron_osprey.stages.prune import PruneConfig

    target = write_chat_model(root / "target", "qwen3", layers=8, hidden=64, seed=1)
    small_lm = write_chat_model(root / "small_lm", "llama3", layers=4, hidden=64, seed=2, qwen3=True)
    # each stage's run() sets up (and tears down) its own process groups
    prune.run(PruneConfig(source=str(small_lm), output=str(root / "backbone"), num_layers=2, transformer_impl="local"))
    report = adapt.run(AdaptConfig(backbone=str(root / "backbone"), target=str(target), output=str(root / "drafter")))
    data = write_topic_conversations(root / "train.jsonl", 48)
    return {"target": target, "drafter": root / "drafter", "data": data, "report": report, "root": root}


def tiny_distill_config(setup: dict, **changes):
    """The tiny CPU recipe's DistillConfig on build_distill_setup's target, drafter and data: sequences of 64
    tokens, a log line per step; each `section__field=value` in `changes` sets one more field."""
    from megatron_osprey.recipes import get_recipe

    cfg = get_recipe("tiny_cpu_osprey_distill_1proc_fp32").distill
    cfg.target.path = str(setup["target"])
    cfg.drafter.drafter_init = str(setup["drafter"])
    cfg.data.data_path = [str(setup["data"])]
    cfg.training.seq_length = 64
    cfg.logging.log_interval = 1
    cfg.logging.progress_bar = False
    for key, value in changes.items():
        section, field = key.split("__")
        setattr(getattr(cfg, section), field, value)
    return cfg
