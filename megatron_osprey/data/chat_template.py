"""Tokenize conversations through the target's chat template, with an assistant loss mask.

Which tokens count as assistant tokens: exactly the tokens the target would have
generated after its generation prompt, i.e. each assistant turn's rendered body plus
the end-of-turn token, never the role header and never what the template puts after
the end-of-turn token (a newline in ChatML).

- Qwen3 (ChatML): ``<|im_start|>assistant\\n`` is the header; counted are the body
  (including a ``<think>...</think>`` block where the template renders one, which it does
  only for turns after the last user message) and ``<|im_end|>``. With
  ``enable_thinking=False`` the empty ``<think>\\n\\n</think>\\n\\n`` that the generation
  prompt itself inserts is prompt, not output, so it is not counted.
- Llama-3: ``<|start_header_id|>assistant<|end_header_id|>\\n\\n`` is the header;
  counted are the (trimmed) content and ``<|eot_id|>``.

Reasoning and tool turns (a named choice, `ChatTemplateConfig.reasoning` / `tools`, so that
osprey data, extraction and distillation render a conversation alike):

- reasoning="template": ``reasoning_content`` goes to the template, which decides (Qwen3
  renders it as ``<think>...</think>`` for the turns after the last user query and drops it
  before); what it renders inside an assistant turn is counted.
- reasoning="drop": reasoning is removed (``reasoning_content`` and a ``<think>`` block at the
  start of the content); only the answer is trained on.
- reasoning="inline": ``<think>\n{reasoning}\n</think>\n\n`` is written in front of the
  content, for targets whose template has no reasoning field but whose model writes one.
- tools="template": tool calls and tool results go to the template; the assistant's tool
  calls are counted, tool results (the tool's output, not the model's) never are.
- tools="drop": conversations with tool turns are left out.

`template_defaults(tokenizer)` reads what the target's own template does with a probe: it
renders ``reasoning_content`` ("template") or ignores it ("drop"); it renders tool results
("template") or cannot ("drop").

Spans are found without pattern-matching arbitrary text: the template layout (assistant
header, generation-prompt extra, end-of-turn token) is learnt once by rendering probe
conversations, then the rendered conversation is walked message by message with a
cursor, and character spans map to tokens through the fast tokenizer's offsets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from megatron_osprey.data.conversations import Conversation

# Reasoning models (Qwen3, DeepSeek-R1 style) close their reasoning with this tag; the
# templates drop the reasoning of earlier turns and keep only the text after it.
REASONING_START = "<think>"
REASONING_END = "</think>"
REASONING_MODES = ("template", "drop", "inline")
TOOL_MODES = ("template", "drop")

_PROBE_USER = "probe question one"
_PROBE_USER_2 = "probe question two"
_PROBE_ASSISTANT = "probe answer one"
_PROBE_ASSISTANT_2 = "probe answer two"
_PROBE_REASONING = "probe reasoning"
_PROBE_TOOL = "probe_tool"
_PROBE_TOOL_RESULT = "probe tool result"


class ChatTemplateError(ValueError):
    """The chat template renders a conversation in a way the span finder cannot follow."""


@dataclass(frozen=True)
class ChatTemplateConfig:
    """How conversations are rendered and cut; defaults follow the paper (seq 4096)."""

    max_length: int | None = 4096
    # Passed to the template as ``enable_thinking`` (Qwen3); None leaves the template default.
    enable_thinking: bool | None = None
    # End-of-turn token text; None detects it from the template (e.g. <|im_end|>, <|eot_id|>).
    end_of_turn: str | None = None
    # How reasoning and tool turns enter the template (module docstring); "template" lets it decide.
    reasoning: str = "template"
    tools: str = "template"

    def __post_init__(self) -> None:
        if self.reasoning not in REASONING_MODES:
            raise ValueError(f"--reasoning must be one of {REASONING_MODES}, got {self.reasoning!r}.")
        if self.tools not in TOOL_MODES:
            raise ValueError(f"--tools must be one of {TOOL_MODES}, got {self.tools!r}.")


@dataclass(frozen=True)
class TemplateLayout:
    """What a chat template puts around an assistant turn."""

    assistant_header: str
    generation_extra: str
    end_of_turn: str


@dataclass(frozen=True)
class RenderedConversation:
    """Template-rendered text and the character spans of its assistant tokens."""

    text: str
    assistant_spans: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class TokenizedConversation:
    """Token ids and the boolean loss mask (True on assistant tokens) of one conversation."""

    id: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    truncated: bool = False

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def _template_kwargs(config: ChatTemplateConfig) -> dict[str, Any]:
    return {} if config.enable_thinking is None else {"enable_thinking": config.enable_thinking}


def render_generation_prompt(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    enable_thinking: bool | None = None,
    tools: list[dict] | None = None,
) -> str:
    """Render ``messages`` followed by the assistant generation prompt, as the target sees it."""
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template(
        list(messages), tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
    )


def split_reasoning(content: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a content that opens with a <think> block; (None, content) otherwise."""
    head = content.lstrip()
    if not head.startswith(REASONING_START) or REASONING_END not in head:
        return None, content
    reasoning, answer = head[len(REASONING_START) :].split(REASONING_END, 1)
    return reasoning.strip("\n"), answer.lstrip("\n")


def apply_reasoning(messages: Sequence[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """The messages with their reasoning handled as `mode` says (module docstring); inputs are not changed."""
    if mode not in REASONING_MODES:
        raise ValueError(f"--reasoning must be one of {REASONING_MODES}, got {mode!r}.")
    out = []
    for message in messages:
        message = dict(message)
        if message["role"] == "assistant" and mode != "template":
            reasoning = message.pop("reasoning_content", None)
            inline, answer = split_reasoning(message["content"])
            reasoning = reasoning if reasoning is not None else inline
            if mode == "drop":
                message["content"] = answer
            elif reasoning is not None:
                message["content"] = f"{REASONING_START}\n{reasoning}\n{REASONING_END}\n\n{answer}"
        out.append(message)
    return out


def template_defaults(tokenizer: Any) -> tuple[str, str]:
    """(reasoning, tools): the modes that do what the target's own chat template does (module docstring)."""
    user = {"role": "user", "content": _PROBE_USER}
    reasoned = [user, {"role": "assistant", "content": _PROBE_ASSISTANT, "reasoning_content": _PROBE_REASONING}]
    text = tokenizer.apply_chat_template(reasoned, tokenize=False)
    reasoning = "template" if _PROBE_REASONING in text else "drop"
    call = {"type": "function", "function": {"name": _PROBE_TOOL, "arguments": {"x": 1}}}
    with_tools = [
        user,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": _PROBE_TOOL_RESULT},
        {"role": "assistant", "content": _PROBE_ASSISTANT},
    ]
    try:
        text = tokenizer.apply_chat_template(with_tools, tokenize=False)
    except Exception:  # a template that raises on tool turns (jinja's raise_exception) cannot take them
        return reasoning, "drop"
    tools = "template" if _PROBE_TOOL in text and _PROBE_TOOL_RESULT in text else "drop"
    return reasoning, tools


def _common_prefix(*texts: str) -> str:
    shortest = min(texts, key=len)
    for i, ch in enumerate(shortest):
        if any(t[i] != ch for t in texts):
            return shortest[:i]
    return shortest


def _control_tokens(tokenizer: Any) -> list[str]:
    tokens = set(getattr(tokenizer, "all_special_tokens", []) or [])
    tokens.update(str(t) for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values())
    return sorted((t for t in tokens if t), key=len, reverse=True)


def detect_layout(tokenizer: Any, config: ChatTemplateConfig = ChatTemplateConfig()) -> TemplateLayout:
    """Learn the assistant header, generation-prompt extra and end-of-turn token from probe renders."""
    kwargs = _template_kwargs(config)

    def render(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    user = [{"role": "user", "content": _PROBE_USER}]
    one_turn = user + [{"role": "assistant", "content": _PROBE_ASSISTANT}]
    two_turns = one_turn + [
        {"role": "user", "content": _PROBE_USER_2},
        {"role": "assistant", "content": _PROBE_ASSISTANT_2},
    ]
    prompt_only, with_prompt = render(user), render(user, add_generation_prompt=True)
    if not with_prompt.startswith(prompt_only) or with_prompt == prompt_only:
        raise ChatTemplateError(
            "The chat template adds no generation prompt after a user message; cannot locate assistant turns."
        )
    generation_prompt = with_prompt[len(prompt_only) :]
    # The bare header is what every assistant turn starts with; the rest of the generation
    # prompt (Qwen3's empty think block when thinking is off) is prompt-only text.
    headers = [generation_prompt]
    rendered_one, rendered_two = render(one_turn), render(two_turns)
    for rendered in (rendered_one, rendered_two):
        if rendered.startswith(prompt_only):
            headers.append(rendered[len(prompt_only) :])
    header = _common_prefix(*headers)
    if not header:
        raise ChatTemplateError("Could not find a common assistant header in the chat template's renders.")

    end_of_turn = config.end_of_turn
    if end_of_turn is None:
        answer_at = rendered_one.rfind(_PROBE_ASSISTANT)
        after = rendered_one[answer_at + len(_PROBE_ASSISTANT) :]
        end_of_turn = next((t for t in _control_tokens(tokenizer) if after.startswith(t)), None)
        if end_of_turn is None:
            raise ChatTemplateError(
                f"Could not detect the end-of-turn token (template puts {after[:20]!r} after an assistant message); "
                "set ChatTemplateConfig.end_of_turn."
            )
    return TemplateLayout(
        assistant_header=header, generation_extra=generation_prompt[len(header) :], end_of_turn=end_of_turn
    )


def _final_answer(content: str) -> str:
    # Templates may drop earlier reasoning and trim whitespace; the answer text survives.
    return content.split(REASONING_END)[-1].strip()


class ChatTokenizer:
    """Renders and tokenizes conversations with a fast HF tokenizer's chat template."""

    def __init__(self, tokenizer: Any, config: ChatTemplateConfig = ChatTemplateConfig()):
        if not getattr(tokenizer, "is_fast", False):
            raise ChatTemplateError("Assistant loss masks need a fast tokenizer (tokenizer.json) for offset mapping.")
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError("The tokenizer has no chat_template; load the target model's tokenizer.")
        if config.max_length is not None and config.max_length < 1:
            raise ValueError(f"max_length must be positive, got {config.max_length}.")
        self.tokenizer = tokenizer
        self.config = config
        self.layout = detect_layout(tokenizer, config)

    def render(
        self, messages: Sequence[dict[str, Any]], conversation_id: str = "?", tools: list[dict] | None = None
    ) -> RenderedConversation:
        """Render a conversation and find each assistant turn's character span by walking it in order."""
        messages = apply_reasoning(messages, self.config.reasoning)
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=False, **_template_kwargs(self.config)
        )
        layout = self.layout
        spans: list[tuple[int, int]] = []
        cursor = 0
        for index, message in enumerate(messages):
            where = f"message {index} ({message['role']}) of conversation {conversation_id!r}"
            content = message["content"]
            if message["role"] != "assistant":
                needle = content
                found = text.find(needle, cursor)
                if found < 0:  # templates such as Llama-3's trim message contents
                    needle = content.strip()
                    found = text.find(needle, cursor)
                if found < 0:
                    raise ChatTemplateError(f"Could not find {where} in the rendered chat template text.")
                cursor = found + len(needle)
                continue
            header_at = text.find(layout.assistant_header, cursor)
            if header_at < 0:
                raise ChatTemplateError(f"Could not find the assistant header {layout.assistant_header!r} for {where}.")
            start = header_at + len(layout.assistant_header)
            if layout.generation_extra and text.startswith(layout.generation_extra, start):
                start += len(layout.generation_extra)
            answer = _final_answer(content)
            answer_at = text.find(answer, start)
            eot_at = text.find(layout.end_of_turn, answer_at + len(answer)) if answer_at >= 0 else -1
            if eot_at < 0:
                raise ChatTemplateError(
                    f"Could not find the content and end-of-turn token {layout.end_of_turn!r} of {where} in the "
                    "rendered text."
                )
            end = eot_at + len(layout.end_of_turn)
            spans.append((start, end))
            cursor = end
        return RenderedConversation(text=text, assistant_spans=tuple(spans))

    def tokenize(self, conversation: Conversation | Sequence[dict[str, Any]]) -> TokenizedConversation:
        """Tokenize one conversation: input ids, assistant loss mask, truncated to max_length."""
        if isinstance(conversation, Conversation):
            conversation_id, messages, tools = conversation.id, conversation.messages, conversation.tools
        else:
            conversation_id, messages, tools = "?", conversation, None
        if self.config.tools == "drop" and any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            raise ChatTemplateError(
                f"conversation {conversation_id!r} has tool turns and tools='drop'; leave it out before tokenizing."
            )
        rendered = self.render(messages, conversation_id, tools)
        # The template writes BOS itself where the model wants one, so no extra specials.
        encoding = self.tokenizer(rendered.text, add_special_tokens=False, return_offsets_mapping=True)
        input_ids = np.asarray(encoding["input_ids"], dtype=np.int64)
        starts = np.asarray([s for s, _ in encoding["offset_mapping"]], dtype=np.int64)
        loss_mask = np.zeros(input_ids.shape[0], dtype=bool)
        # A token belongs to the turn its first character belongs to: a token straddling the
        # header boundary starts in the prompt, so the model never emits it.
        for start, end in rendered.assistant_spans:
            loss_mask |= (starts >= start) & (starts < end)
        truncated = False
        limit = self.config.max_length
        if limit is not None and input_ids.shape[0] > limit:
            input_ids, loss_mask, truncated = input_ids[:limit], loss_mask[:limit], True
        return TokenizedConversation(id=conversation_id, input_ids=input_ids, loss_mask=loss_mask, truncated=truncated)

    def tokenize_all(self, conversations: Iterable[Conversation]) -> Iterator[TokenizedConversation]:
        """Tokenize conversations lazily, in order."""
        for conversation in conversations:
            yield self.tokenize(conversation)
