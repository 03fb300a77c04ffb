"""Locate a Hugging Face fast tokenizer on disk and resolve its end-of-document token.

Only the `tokenizers` library is used here (no `transformers` import), so
worker processes start quickly and encode through the Rust batch API.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from megatron_osprey.base.checksums import file_sha256

# Mirrors megatron.core's DType.optimal_dtype threshold, so our .bin files use the
# same token dtype Megatron-LM's preprocess_data.py would choose.
_UINT16_VOCAB_LIMIT = 65500

# Files that may name the EOS token in a saved Hugging Face tokenizer directory,
# in the order transformers itself consults them.
_EOS_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class TokenizerSpec:
    """What a worker needs to rebuild the tokenizer, plus facts for the output."""

    tokenizer_json: str
    eod_id: int
    eod_token: str
    vocab_size: int
    sha256: str

    @property
    def token_dtype(self) -> np.dtype:
        """Token dtype of the .bin file: uint16 when the vocabulary fits, else int32."""
        return np.dtype(np.uint16 if self.vocab_size < _UINT16_VOCAB_LIMIT else np.int32)


def _eos_from_config(directory: str) -> Optional[str]:
    for name in _EOS_CONFIG_FILES:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            try:
                config = json.load(f)
            except json.JSONDecodeError as err:
                raise ValueError(f"--tokenizer file {path} is not valid JSON ({err}).") from err
        eos = config.get("eos_token")
        # Saved configs store either the string or an AddedToken dict.
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and eos:
            return eos
    return None


def load_tokenizer_spec(tokenizer: str, eod_token: Optional[str] = None) -> TokenizerSpec:
    """Resolve --tokenizer (a directory with tokenizer.json, or the file) and its EOD id."""
    from tokenizers import Tokenizer

    if os.path.isdir(tokenizer):
        directory, path = tokenizer, os.path.join(tokenizer, "tokenizer.json")
    else:
        directory, path = os.path.dirname(tokenizer) or ".", tokenizer
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"--tokenizer {tokenizer}: no tokenizer.json found; pass a saved Hugging Face "
            "fast-tokenizer directory (or its tokenizer.json)."
        )
    try:
        tok = Tokenizer.from_file(path)
    except Exception as err:  # tokenizers raises a bare Exception on parse errors
        raise ValueError(f"--tokenizer file {path} could not be loaded ({err}).") from err

    token = eod_token if eod_token is not None else _eos_from_config(directory)
    if token is None:
        raise ValueError(
            f"--tokenizer {tokenizer} names no eos_token in tokenizer_config.json or "
            "special_tokens_map.json; pass --eod-token with the end-of-document token."
        )
    eod_id = tok.token_to_id(token)
    if eod_id is None:
        raise ValueError(f"EOD token {token!r} is not in the vocabulary of --tokenizer {path}.")
    return TokenizerSpec(
        tokenizer_json=os.path.abspath(path),
        eod_id=int(eod_id),
        eod_token=token,
        vocab_size=int(tok.get_vocab_size(with_added_tokens=True)),
        sha256=file_sha256(path),
    )
