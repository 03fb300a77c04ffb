"""Vocabulary alignment: give every target token a row built from the backbone's embedding.

A target token whose bytes exist as one backbone token copies that row (after
translating the space/byte markers of each vocabulary style: byte-level BPE's
`Ġ`-alphabet, SentencePiece's `▁` and `<0xNN>` byte fallback, tiktoken-style raw
bytes). What happens to the other rows is a policy:

* ``reference`` (default; the rule of Osprey's released aligner, which gives its
  paper's 109,566 copied / 18,393 averaged / 297 single rows for Qwen3 -> Llama-3):
  the token's string as the target tokenizer decodes it (a partial UTF-8 sequence
  becomes U+FFFD) is tokenized by the backbone; one resulting token is a "single"
  row, several are "averaged". Special tokens have no special case: their literal
  string (``<|eot_id|>``) is tokenized the same way. A token that tokenizes to
  nothing, and every row beyond the tokenizer (config padding), is zero.
* ``bytes_and_roles`` (this project's earlier rule): a partial UTF-8 sequence is
  averaged over the backbone's byte tokens; a special token maps to the backbone
  token of the same role (bos, eos, pad, unk) or string, else the mean row; rows
  beyond the tokenizer and unmapped rows get the mean row.

The report counts each class and names the policy and the rule behind each class.
"""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache

import torch

BYTE_LEVEL = "byte_level"
SENTENCEPIECE = "sentencepiece"
RAW_BYTES = "raw_bytes"
POLICIES = ("reference", "bytes_and_roles")
# What made each class of row, per policy (written into the report).
RULES = {
    "reference": {
        "copied": "the same bytes exist as one backbone token: that row",
        "single": "the decoded string (partial UTF-8 -> U+FFFD, special tokens literally) is one backbone token: "
        "that row",
        "averaged": "the decoded string (special tokens literally) is several backbone tokens: their mean",
        "unmapped": "the decoded string tokenizes to nothing: a zero row",
        "unused": "beyond the tokenizer (config padding): a zero row",
    },
    "bytes_and_roles": {
        "copied": "the same bytes exist as one backbone token: that row",
        "averaged": "the decoded string re-tokenized (a partial UTF-8 sequence: its byte tokens): their mean",
        "special": "a special token mapped to the backbone's token of the same role or string",
        "fallback": "no counterpart (special tokens without one, undecodable tokens): the mean row",
        "unused": "beyond the tokenizer (config padding): the mean row",
    },
}
KINDS = ("copied", "single", "averaged", "special", "fallback", "unmapped", "unused")


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _byte_level_inverse() -> dict[str, int]:
    return {c: b for b, c in byte_level_alphabet().items()}


@dataclasses.dataclass
class VocabView:
    """What alignment needs of a tokenizer: its vocabulary, style, special tokens and an encoder."""

    vocab: dict  # token (str, or bytes for RAW_BYTES) -> id
    style: str
    special_ids: dict[int, str]  # id -> role or string, for special/added control tokens
    role_ids: dict[str, int]  # bos/eos/pad/unk -> id
    encode: object  # callable(str) -> list[int]
    size: int
    # callable(token) -> the string the tokenizer decodes the token to (None: decode its bytes,
    # invalid UTF-8 replaced by U+FFFD as byte-level decoders do)
    token_string: object = None

    def decoded(self, token) -> str:
        """The token as its tokenizer decodes it on its own."""
        if self.token_string is not None:
            return self.token_string(token)
        data = self.token_bytes(token)
        return "" if data is None else data.decode("utf-8", errors="replace")

    def token_bytes(self, token) -> bytes | None:
        """The bytes a vocabulary entry stands for, or None when it has no byte meaning."""
        if self.style == RAW_BYTES:
            return bytes(token)
        if self.style == BYTE_LEVEL:
            inverse = _byte_level_inverse()
            try:
                return bytes(inverse[c] for c in token)
            except KeyError:
                return None
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return bytes([int(token[3:5], 16)])
        return token.replace("\u2581", " ").encode("utf-8")

    def bytes_to_token(self, data: bytes):
        """The vocabulary entry spelling `data` in this vocabulary's style (it may not exist)."""
        if self.style == RAW_BYTES:
            return data
        if self.style == BYTE_LEVEL:
            table = byte_level_alphabet()
            return "".join(table[b] for b in data)
        if len(data) == 1 and data[0] >= 0x80:
            return f"<0x{data[0]:02X}>"
        try:
            return data.decode("utf-8").replace(" ", "\u2581")
        except UnicodeDecodeError:
            return None

    def byte_token_ids(self, data: bytes) -> list[int] | None:
        """One backbone token per byte (byte-level alphabet or <0xNN> fallback), if the vocabulary has them."""
        ids = []
        for b in data:
            if self.style == BYTE_LEVEL:
                token = byte_level_alphabet()[b]
            elif self.style == SENTENCEPIECE:
                token = f"<0x{b:02X}>"
            else:
                token = bytes([b])
            if token not in self.vocab:
                return None
            ids.append(self.vocab[token])
        return ids


def detect_style(tokenizer) -> str:
    """byte_level or sentencepiece, from a fast tokenizer's tokenizer.json."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    text = json.dumps({k: spec.get(k) for k in ("pre_tokenizer", "decoder")})
    if '"ByteLevel"' in text:
        return BYTE_LEVEL
    if spec["model"].get("byte_fallback") or "\u2581" in text or "Metaspace" in text:
        return SENTENCEPIECE
    raise ValueError(
        "the tokenizer is neither byte-level BPE nor SentencePiece-style; vocabulary alignment "
        "supports those two and tiktoken-style raw-byte vocabularies."
    )


def view_of(tokenizer, source: str = "tokenizer") -> VocabView:
    """A VocabView of a transformers fast tokenizer."""
    vocab = tokenizer.get_vocab()
    if not vocab:
        raise ValueError(f"{source}: the tokenizer has no vocabulary.")
    special_ids = {}
    for token, token_id in vocab.items():
        if token in tokenizer.all_special_tokens:
            special_ids[token_id] = token
    for token_id, added in tokenizer.added_tokens_decoder.items():
        if added.special:
            special_ids[token_id] = added.content
    roles = {}
    for role in ("bos", "eos", "pad", "unk"):
        token_id = getattr(tokenizer, f"{role}_token_id", None)
        if token_id is not None:
            roles[role] = int(token_id)
    return VocabView(
        vocab=vocab,
        style=detect_style(tokenizer),
        special_ids=special_ids,
        role_ids=roles,
        encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
        size=max(vocab.values()) + 1,
        token_string=lambda token: tokenizer.convert_tokens_to_string([token]),
    )


@dataclasses.dataclass
class Alignment:
    """Per target id, the backbone rows to average (one row for a copy) and the class of the row."""

    sources: list[list[int]]
    kinds: list[str]  # one of KINDS (which ones a policy uses: RULES[policy])
    special_map: dict[str, str]
    policy: str = "reference"
    partial_utf8: int = 0  # target tokens whose bytes are not valid UTF-8 on their own
    special_tokens: int = 0  # target tokens the tokenizer marks special

    def counts(self) -> dict[str, int]:
        out = {k: 0 for k in RULES[self.policy]}
        for kind in self.kinds:
            out[kind] += 1
        return out

    @property
    def empty_row(self) -> str:
        """What a row with no source rows holds: zero (reference) or the backbone's mean row."""
        return "zero" if self.policy == "reference" else "mean"


def align_vocabularies(
    backbone: VocabView, target: VocabView, target_rows: int, policy: str = "reference"
) -> Alignment:
    """Map each of the `target_rows` target ids (the config's vocab, maybe padded) to backbone rows."""
    if policy not in POLICIES:
        raise ValueError(f"--alignment-policy must be one of {POLICIES}, got {policy!r}.")
    if policy == "reference":
        return _align_reference(backbone, target, target_rows)
    return _align_bytes_and_roles(backbone, target, target_rows)


def _copy_source(backbone: VocabView, target: VocabView, token) -> int | None:
    """The backbone id spelling the same bytes as `token`, if there is one."""
    data = target.token_bytes(token)
    if data is None:
        return None
    spelled = backbone.bytes_to_token(data)
    return backbone.vocab.get(spelled) if spelled is not None else None


def _is_partial_utf8(target: VocabView, token) -> bool:
    data = target.token_bytes(token)
    if data is None:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _align_reference(backbone: VocabView, target: VocabView, target_rows: int) -> Alignment:
    """Osprey's released rule: copy, else tokenize the decoded string; no special cases; zero rows."""
    by_id = {i: t for t, i in target.vocab.items()}
    sources: list[list[int]] = []
    kinds: list[str] = []
    special_map: dict[str, str] = {}
    partial = specials = 0
    backbone_by_id = {i: t for t, i in backbone.vocab.items()}
    for target_id in range(target_rows):
        token = by_id.get(target_id)
        if token is None:
            sources.append([])
            kinds.append("unused")
            continue
        is_special = target_id in target.special_ids
        specials += is_special
        # A special token's own string, when the backbone has it, is a copy like any other.
        match = (
            backbone.vocab.get(token)
            if is_special and isinstance(token, str)
            else _copy_source(backbone, target, token)
        )
        if match is not None:
            sources.append([match])
            kinds.append("copied")
        else:
            partial += _is_partial_utf8(target, token) and not is_special
            ids = list(backbone.encode(target.decoded(token)))
            sources.append(ids)
            kinds.append("unmapped" if not ids else "single" if len(ids) == 1 else "averaged")
        if is_special:
            names = [backbone_by_id.get(i, str(i)) for i in sources[-1]]
            special_map[target.special_ids[target_id]] = f"{kinds[-1]}: {names}"
    return Alignment(
        sources=sources,
        kinds=kinds,
        special_map=special_map,
        policy="reference",
        partial_utf8=partial,
        special_tokens=specials,
    )


def _align_bytes_and_roles(backbone: VocabView, target: VocabView, target_rows: int) -> Alignment:
    """This project's earlier rule: byte tokens for partial UTF-8, specials by role, mean rows."""
    by_id = {i: t for t, i in target.vocab.items()}
    backbone_special_by_string = {s: i for i, s in backbone.special_ids.items()}
    backbone_role_by_id = {i: r for r, i in backbone.role_ids.items()}
    target_roles = {i: r for r, i in target.role_ids.items()}
    sources: list[list[int]] = []
    kinds: list[str] = []
    special_map: dict[str, str] = {}
    partial = 0
    for target_id in range(target_rows):
        token = by_id.get(target_id)
        if token is None:
            sources.append([])
            kinds.append("unused")  # padding rows of the config's vocab beyond the tokenizer
            continue
        if target_id in target.special_ids:
            string = target.special_ids[target_id]
            role = target_roles.get(target_id)
            match = backbone_special_by_string.get(string)
            if match is None and role in backbone.role_ids:
                match = backbone.role_ids[role]
            if match is None and string in backbone.vocab:
                match = backbone.vocab[string]
            if match is not None:
                sources.append([match])
                kinds.append("special")
                matched = backbone_role_by_id.get(match) or "same string"
                special_map[string] = f"{_name(backbone, match)} ({matched})"
            else:
                sources.append([])
                kinds.append("fallback")
                special_map[string] = "mean row (no counterpart)"
            continue
        data = target.token_bytes(token)
        if data is None:
            sources.append([])
            kinds.append("fallback")
            continue
        spelled = backbone.bytes_to_token(data)
        if spelled is not None and spelled in backbone.vocab:
            sources.append([backbone.vocab[spelled]])
            kinds.append("copied")
            continue
        try:
            ids = backbone.encode(data.decode("utf-8"))
        except UnicodeDecodeError:
            ids = backbone.byte_token_ids(data)  # a partial UTF-8 sequence: its bytes
            partial += 1
        if ids:
            sources.append(list(ids))
            kinds.append("averaged")
        else:
            sources.append([])
            kinds.append("fallback")
    return Alignment(
        sources=sources,
        kinds=kinds,
        special_map=special_map,
        policy="bytes_and_roles",
        partial_utf8=partial,
        special_tokens=len(target.special_ids),
    )


def _name(view: VocabView, token_id: int) -> str:
    for token, i in view.vocab.items():
        if i == token_id:
            return token if isinstance(token, str) else repr(token)
    return str(token_id)


@torch.no_grad()
def aligned_rows(matrix: torch.Tensor, alignment: Alignment) -> torch.Tensor:
    """Target-vocabulary rows: copies, averages over the listed backbone rows; empty rows per the policy."""
    empty = torch.zeros(matrix.shape[1]) if alignment.empty_row == "zero" else matrix.float().mean(dim=0)
    rows = torch.empty(len(alignment.sources), matrix.shape[1], dtype=torch.float32)
    for target_id, source_ids in enumerate(alignment.sources):
        if source_ids:
            rows[target_id] = matrix[source_ids].float().mean(dim=0)
        else:
            rows[target_id] = empty
    return rows.to(matrix.dtype)


def alignment_report(alignment: Alignment, backbone: VocabView, target: VocabView, examples: int = 8) -> dict:
    """The JSON report: counts per class, examples of each, and the special-token map."""
    by_id = {i: t for t, i in target.vocab.items()}
    back_by_id = {i: t for t, i in backbone.vocab.items()}

    def show(token):
        return token if isinstance(token, str) else repr(token)

    samples: dict[str, list] = {k: [] for k in RULES[alignment.policy] if k != "unused"}
    for target_id, (kind, sources) in enumerate(zip(alignment.kinds, alignment.sources)):
        if kind in samples and len(samples[kind]) < examples:
            samples[kind].append(
                {
                    "target_id": target_id,
                    "target_token": show(by_id[target_id]),
                    "backbone_ids": sources,
                    "backbone_tokens": [show(back_by_id.get(i, "?")) for i in sources],
                }
            )
    return {
        "policy": alignment.policy,
        "counts": alignment.counts(),
        "rules": RULES[alignment.policy],
        "partial_utf8_tokens": alignment.partial_utf8,
        "special_tokens_count": alignment.special_tokens,
        "target_rows": len(alignment.kinds),
        "backbone_vocab_style": backbone.style,
        "target_vocab_style": target.style,
        "examples": samples,
        "special_tokens": alignment.special_map,
    }
