"""Build a Hugging Face `tokenizers.Tokenizer` from the vocabulary stored in GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# GGUF tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# Split patterns llama.cpp applies for each `tokenizer.ggml.pre` value before byte-level BPE.
# GGUF does not store them; they are the published pre-tokenizer regexes of the original models.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerStyle:
    """How text is split and normalized before byte-level BPE for one `tokenizer.ggml.pre` value."""

    pattern: str | None  # None: the GPT-2 pattern built into ByteLevel
    nfc: bool = False
    ignore_merges: bool = False  # Llama-3 looks a whole pre-token up in the vocab before merging


_BYTE_LEVEL_STYLES = {
    "gpt-2": PreTokenizerStyle(pattern=None),
    "qwen2": PreTokenizerStyle(pattern=_QWEN2_PATTERN, nfc=True),
    "llama-bpe": PreTokenizerStyle(pattern=_LLAMA3_PATTERN, ignore_merges=True),
}


@dataclass(frozen=True)
class AddedTokenSpec:
    """One token added on top of the BPE model: its id, text and whether it is special (control)."""

    id: int
    content: str
    special: bool = True


def gguf_added_tokens(metadata: dict[str, Any]) -> list[AddedTokenSpec]:
    """Return the control, unknown and user-defined tokens of a GGUF vocabulary as added tokens."""
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata["tokenizer.ggml.token_type"]
    added = []
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            added.append(AddedTokenSpec(i, tok, special=True))
        elif kind == TOKEN_USER_DEFINED:
            added.append(AddedTokenSpec(i, tok, special=False))
    return added


def _add_tokens(tokenizer: Tokenizer, added: list[AddedTokenSpec], where: str) -> None:
    # tokenizers appends added tokens after the model vocab in call order, so add them in id order
    # and then check each landed on its published id.
    for spec in sorted(added, key=lambda s: s.id):
        # normalized=False: matched on the raw text, so a SentencePiece "▁" prefix cannot hide it.
        token = AddedToken(spec.content, special=spec.special, normalized=False)
        if spec.special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
        got = tokenizer.token_to_id(spec.content)
        if got != spec.id:
            raise ValueError(f"{where}: added token {spec.content!r} got id {got}, expected {spec.id}.")


def byte_level_bpe_from_gguf(
    metadata: dict[str, Any],
    added: list[AddedTokenSpec],
    regular_vocab_size: int,
    bos_token: str | None,
    where: str,
) -> Tokenizer:
    """Byte-level BPE (GPT-2, Llama-3, Qwen) from a GGUF `gpt2`-model vocabulary."""
    if metadata.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"{where} is not a byte-level BPE vocabulary (tokenizer.ggml.model is not 'gpt2').")
    pre = metadata.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in _BYTE_LEVEL_STYLES:
        raise ValueError(f"{where} uses pre-tokenizer {pre!r}; supported: {sorted(_BYTE_LEVEL_STYLES)}.")
    style = _BYTE_LEVEL_STYLES[pre]
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata["tokenizer.ggml.token_type"]
    bad = [i for i in range(regular_vocab_size) if types[i] != TOKEN_NORMAL]
    if bad:
        raise ValueError(f"{where}: token {bad[0]} ({tokens[bad[0]]!r}) inside the regular vocabulary is not normal.")
    vocab = {tok: i for i, tok in enumerate(tokens[:regular_vocab_size])}
    merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=style.ignore_merges)
    tokenizer = Tokenizer(model)
    if style.nfc:
        tokenizer.normalizer = normalizers.NFC()
    if style.pattern is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(style.pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    _add_tokens(tokenizer, added, where)
    if bos_token is None:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        tokenizer.post_processor = _bos_template(bos_token, tokenizer.token_to_id(bos_token))
    return tokenizer


def _bos_template(bos_token: str, bos_id: int) -> processors.TemplateProcessing:
    return processors.TemplateProcessing(
        single=f"{bos_token}:0 $A:0",
        pair=f"{bos_token}:0 $A:0 {bos_token}:1 $B:1",
        special_tokens=[(bos_token, bos_id)],
    )


def _sentencepiece_merges(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    # SentencePiece BPE keeps pieces and scores, not merges; a pair (l, r) may merge whenever l + r is
    # a piece, and a higher-scoring result merges first (ties broken by id, as SentencePiece does).
    ranked = []
    for piece, pid in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[pid], pid, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def sentencepiece_bpe_from_gguf(metadata: dict[str, Any], where: str) -> Tokenizer:
    """SentencePiece BPE with byte fallback (Llama-2 style, `▁` word marker) from a GGUF `llama` vocabulary."""
    if metadata.get("tokenizer.ggml.model") != "llama":
        raise ValueError(f"{where} is not a SentencePiece vocabulary (tokenizer.ggml.model is not 'llama').")
    tokens = metadata["tokenizer.ggml.tokens"]
    scores = metadata["tokenizer.ggml.scores"]
    types = metadata["tokenizer.ggml.token_type"]
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id", 0)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    mergeable = {tok: i for tok, i in vocab.items() if types[i] == TOKEN_NORMAL}
    model = models.BPE(
        vocab=vocab,
        merges=_sentencepiece_merges(mergeable, scores),
        unk_token=tokens[unk_id],
        byte_fallback=True,
        fuse_unk=True,
    )
    tokenizer = Tokenizer(model)
    # SentencePiece with add_dummy_prefix: a leading "▁" and every space becomes "▁"; no splitting.
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    _add_tokens(tokenizer, gguf_added_tokens(metadata), where)
    if metadata.get("tokenizer.ggml.add_bos_token", True):
        bos = tokens[metadata["tokenizer.ggml.bos_token_id"]]
        tokenizer.post_processor = _bos_template(bos, vocab[bos])
    return tokenizer
