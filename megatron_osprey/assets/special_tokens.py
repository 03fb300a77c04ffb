"""Published special-token tables of target tokenizers whose GGUF vocabularies predate them."""

from __future__ import annotations

from .gguf_tokenizer import AddedTokenSpec

# Qwen3 (all sizes) appends these 26 tokens to the 151,643-token Qwen byte-level BPE; the tool and
# think tags are ordinary (non-special) added tokens so they survive skip_special_tokens decoding.
_QWEN3_ADDED = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", True),
    ("<|fim_middle|>", True),
    ("<|fim_suffix|>", True),
    ("<|fim_pad|>", True),
    ("<|repo_name|>", True),
    ("<|file_sep|>", True),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
QWEN3_REGULAR_VOCAB_SIZE = 151643

# Llama 3.1 / 3.2 / 3.3 name eight of the 256 reserved slots after the 128,000 BPE tokens; the rest
# are <|reserved_special_token_N|> numbered in id order.
_LLAMA3_NAMED = {
    0: "<|begin_of_text|>",
    1: "<|end_of_text|>",
    4: "<|finetune_right_pad_id|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    8: "<|eom_id|>",
    9: "<|eot_id|>",
    10: "<|python_tag|>",
}
LLAMA3_REGULAR_VOCAB_SIZE = 128000
_LLAMA3_SPECIAL_COUNT = 256


def qwen3_added_tokens() -> list[AddedTokenSpec]:
    """Qwen3's added tokens with their ids (151643 <|endoftext|> ... 151668 </think>)."""
    return [
        AddedTokenSpec(QWEN3_REGULAR_VOCAB_SIZE + i, content, special)
        for i, (content, special) in enumerate(_QWEN3_ADDED)
    ]


def llama3_added_tokens() -> list[AddedTokenSpec]:
    """Llama-3.1+ special tokens with their ids (128000 <|begin_of_text|> ... 128255)."""
    added = []
    reserved = 0
    for offset in range(_LLAMA3_SPECIAL_COUNT):
        name = _LLAMA3_NAMED.get(offset)
        if name is None:
            name = f"<|reserved_special_token_{reserved}|>"
            reserved += 1
        added.append(AddedTokenSpec(LLAMA3_REGULAR_VOCAB_SIZE + offset, name, True))
    return added
