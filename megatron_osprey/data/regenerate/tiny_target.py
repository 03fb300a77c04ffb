"""Tiny random chat targets (tokenizer + LlamaForCausalLM) for tests and the CPU demo.

The chat templates below are written here to reproduce the official Qwen3 and
Llama-3.1/3.3 Instruct prompt formats for tool-free conversations, including
Qwen3's thinking blocks and ``enable_thinking`` switch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Sequence

# Qwen3 (ChatML). Reasoning of turns up to the last user message is dropped; the final
# assistant turn (and later turns that carry reasoning) are written with a think block.
QWEN3_CHAT_TEMPLATE = r"""
{%- if messages and messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- set state = namespace(last_user=messages|length - 1) -%}
{%- for m in messages -%}
{%- if m.role == 'user' and m.content is string and not (m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>')) -%}
{%- set state.last_user = loop.index0 -%}
{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
{%- set content = m.content if m.content is string else '' -%}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
{{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' -}}
{%- elif m.role == 'assistant' -%}
{%- set reasoning = '' -%}
{%- if m.reasoning_content is string -%}
{%- set reasoning = m.reasoning_content -%}
{%- elif '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
{%- set content = content.split('</think>')[-1].lstrip('\n') -%}
{%- endif -%}
{{- '<|im_start|>assistant\n' -}}
{%- if loop.index0 > state.last_user and (loop.last or reasoning) -%}
{{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') -}}
{%- else -%}
{{- content -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\n\n</think>\n\n' -}}
{%- endif -%}
{%- endif -%}
""".strip()

# Llama-3.1 / 3.3 Instruct: BOS, a system block that always carries the knowledge-cutoff
# header and the template's fixed date, then one trimmed block per message.
LLAMA3_CHAT_TEMPLATE = r"""
{{- bos_token -}}
{%- if messages[0].role == 'system' -%}
{%- set system_text = messages[0].content | trim -%}
{%- set rest = messages[1:] -%}
{%- else -%}
{%- set system_text = '' -%}
{%- set rest = messages -%}
{%- endif -%}
{%- if date_string is not defined -%}
{%- set date_string = '26 Jul 2024' -%}
{%- endif -%}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' -}}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' + date_string + '\n\n' -}}
{{- system_text + '<|eot_id|>' -}}
{%- for m in rest -%}
{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content | trim + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
""".strip()


@dataclass(frozen=True)
class TinyFamily:
    """Special tokens and template of one chat format."""

    chat_template: str
    special_tokens: tuple[str, ...]
    added_tokens: tuple[str, ...]
    bos_token: str | None
    eos_token: str
    pad_token: str
    stop_tokens: tuple[str, ...]


FAMILIES = MappingProxyType(
    {
        "qwen3": TinyFamily(
            chat_template=QWEN3_CHAT_TEMPLATE,
            special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
            added_tokens=("<think>", "</think>"),
            bos_token=None,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            stop_tokens=("<|im_end|>", "<|endoftext|>"),
        ),
        "llama3": TinyFamily(
            chat_template=LLAMA3_CHAT_TEMPLATE,
            special_tokens=(
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
            ),
            added_tokens=(),
            bos_token="<|begin_of_text|>",
            eos_token="<|eot_id|>",
            pad_token="<|end_of_text|>",
            stop_tokens=("<|eot_id|>", "<|end_of_text|>"),
        ),
    }
)

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and the target verifies them.",
    "What is two plus two? Two plus two is four. Explain the answer step by step, then give the result.",
    "system user assistant think Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))  # 3\n",
    "Hello! How can I help you today? Sure, here is a short poem about the sea.",
    "Bonjour, ça va? Grüße aus München. 你好，世界。 Ответ: да.",
)


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str]) -> Any:
    """A GPT-2-style byte-level BPE (a `tokenizers.Tokenizer`) trained on `texts`, the special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return backend


def build_tiny_tokenizer(family: str, vocab_size: int = 400, corpus: Sequence[str] | None = None) -> Any:
    """Train a small byte-level BPE tokenizer carrying ``family``'s chat template and control tokens.

    ``corpus`` defaults to a few built-in lines (tests); the demo trains on its own text.
    """
    from transformers import PreTrainedTokenizerFast

    if family not in FAMILIES:
        raise ValueError(f"Unknown tiny chat family {family!r}; expected one of {sorted(FAMILIES)}.")
    spec = FAMILIES[family]
    texts = list(corpus) if corpus is not None else list(_CORPUS) * 4
    backend = train_byte_level_bpe(texts, vocab_size, spec.special_tokens)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=spec.bos_token,
        eos_token=spec.eos_token,
        pad_token=spec.pad_token,
    )
    if spec.added_tokens:
        tokenizer.add_tokens(list(spec.added_tokens))
    tokenizer.chat_template = spec.chat_template
    return tokenizer


def write_tiny_target(out_dir: str | Path, family: str = "qwen3", seed: int = 0) -> Path:
    """Write a tiny random LlamaForCausalLM plus tokenizer to ``out_dir`` and return the path."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    tokenizer = build_tiny_tokenizer(family)
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in FAMILIES[family].stop_tokens]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=stop_ids,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
