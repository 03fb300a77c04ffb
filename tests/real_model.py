"""SmolLM2-135M-Instruct, the embedded real target: its name, a few real chat prompts, truncated logits.

The model comes from megatron_osprey.assets.models (a pinned registry wheel, dequantized once into
$OSPREY_CACHE/models or ~/.cache/megatron_osprey/models); the session fixtures live in tests/conftest.py.
"""

from __future__ import annotations

import torch

SMOLLM2 = "smollm2-135m-instruct"
# SGLang's default taps [1, L//2 - 1, L - 4] for SmolLM2's 30 layers.
SMOLLM2_AUX = (1, 14, 26)

# Short, real requests from different domains; the first is the hand check.
PROMPTS = (
    "Write a Python function that reverses a string.",
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
)


def chat_ids(tokenizer, text: str) -> torch.Tensor:
    """Token ids [n] of one user turn through the model's chat template, with the assistant prompt open."""
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = encoded if isinstance(encoded, list) else encoded["input_ids"]  # transformers 5 returns a BatchEncoding
    return torch.tensor(ids, dtype=torch.long)
