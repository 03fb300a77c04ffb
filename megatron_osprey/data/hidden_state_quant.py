"""Encodings of target hidden states for the hidden-state store.

Two encodings:

* ``bf16``: the values cast to bfloat16, stored raw (what SpecForge stores).
* ``int8``: per token and per layer group (each of the three aux layers and the
  final layer is its own group), the ``outliers_per_token`` largest-magnitude
  channels are kept exactly in bf16 with their channel index, and the rest is
  symmetric int8 with one float32 scale. The int8 payload is then entropy
  coded with zstd (lossless), which is what brings the store under half of
  SpecForge's bytes per token including scales, outliers, ids and masks.

Why outliers are split off: LLM residual streams have a few channels 10-100x
larger than the rest (and "massive activations" on sink tokens). With a plain
per-token absmax scale those channels set the step size and the bulk of the
channels keep only a few levels: on LLM-like synthetic states that moved a
TTT-style soft CE by +1.9% (Ht=4096) and +3.0% (Ht=8192); keeping 8 channels
per token and group exactly brings it to +0.04% and +0.10%
(benchmarks/hidden_state_store.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch

from megatron_osprey.data.hidden_state_store.config import ENCODINGS  # noqa: E402,F401

INT8_MAX = 127
# Channel indices are stored as int16, which bounds the hidden size per group.
MAX_INT8_HIDDEN_SIZE = 32767


@dataclass(frozen=True)
class Int8Encoded:
    """Int8 encoding of one [T, G*H] hidden-state tensor."""

    q: torch.Tensor  # int8 [T, G*H]; zero at outlier positions
    scale: torch.Tensor  # float32 [T, G]
    outlier_index: torch.Tensor  # int16 [T, G, k]
    outlier_value: torch.Tensor  # bfloat16 [T, G, k]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Int8Encoded":
        """Move every part to ``device`` (e.g. to dequantize on the GPU)."""
        return Int8Encoded(
            *(
                t.to(device, non_blocking=non_blocking)
                for t in (self.q, self.scale, self.outlier_index, self.outlier_value)
            )
        )


def check_encoding(encoding: str) -> None:
    """Raise if ``encoding`` is not one the store knows."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}.")


def quantize_int8(x: torch.Tensor, groups: int, outliers_per_token: int) -> Int8Encoded:
    """Quantize [T, groups*H] to int8 with per-token-per-group scales and exact outliers."""
    if x.dim() != 2 or x.shape[1] % groups != 0:
        raise ValueError(f"expected a [T, {groups}*H] tensor, got shape {tuple(x.shape)}.")
    tokens, width = x.shape
    hidden = width // groups
    if hidden > MAX_INT8_HIDDEN_SIZE:
        raise ValueError(f"int8 encoding supports hidden sizes up to {MAX_INT8_HIDDEN_SIZE}, got {hidden}.")
    if not 0 <= outliers_per_token < hidden:
        raise ValueError(f"outliers_per_token must be in [0, {hidden}), got {outliers_per_token}.")
    xg = x.detach().to(torch.float32).reshape(tokens, groups, hidden)
    k = outliers_per_token
    magnitude = xg.abs()
    if k > 0:
        index = magnitude.topk(k, dim=-1, sorted=True).indices
        # Outliers are stored exactly (bf16) and left out of the int8 range, so
        # they never set the step size of the other channels.
        value = xg.gather(-1, index).to(torch.bfloat16)
        magnitude.scatter_(-1, index, 0.0)
    else:
        index = torch.zeros(tokens, groups, 0, dtype=torch.int64, device=x.device)
        value = torch.zeros(tokens, groups, 0, dtype=torch.bfloat16, device=x.device)
    scale = magnitude.amax(dim=-1)
    del magnitude
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale)) * INT8_MAX
    scale = scale / INT8_MAX
    scaled = xg * inv.unsqueeze(-1)
    q = scaled.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    del scaled
    if k > 0:
        q.scatter_(-1, index, 0)  # outlier slots carry no int8 value
    return Int8Encoded(
        q=q.reshape(tokens, width),
        scale=scale.contiguous(),
        outlier_index=index.to(torch.int16),
        outlier_value=value.contiguous(),
    )


def dequantize_int8(enc: Int8Encoded, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Invert :func:`quantize_int8` to a [T, G*H] tensor of ``dtype``."""
    tokens, width = enc.q.shape
    groups = enc.scale.shape[1]
    xg = torch.mul(enc.q.reshape(tokens, groups, width // groups), enc.scale.unsqueeze(-1))
    if enc.outlier_index.shape[-1] > 0:
        xg.scatter_(-1, enc.outlier_index.to(torch.int64), enc.outlier_value.to(torch.float32))
    return xg.reshape(tokens, width).to(dtype)


def _zstd():
    try:
        import zstandard
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("encoding='int8' needs the zstandard package: pip install zstandard==0.25.0") from exc
    return zstandard


def compress_int8(q: torch.Tensor, level: int) -> bytes:
    """Losslessly entropy-code an int8 payload with zstd (one frame)."""
    # A frame that records its content size lets decompression allocate once.
    compressor = _zstd().ZstdCompressor(level=level, write_content_size=True)
    return compressor.compress(q.contiguous().cpu().numpy().tobytes())


def decompress_int8(frame: bytes | memoryview, shape: tuple[int, int]) -> torch.Tensor:
    """Decode one zstd frame back to an int8 tensor of ``shape``."""
    raw = _zstd().ZstdDecompressor().decompress(frame)
    expected = shape[0] * shape[1]
    if len(raw) != expected:
        raise ValueError(f"zstd frame decoded to {len(raw)} bytes, expected {expected}.")
    return torch.frombuffer(bytearray(raw), dtype=torch.int8).reshape(shape)


def roundtrip(
    x: torch.Tensor, groups: int, encoding: str, outliers_per_token: int = 8, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Return ``x`` as the store would give it back under ``encoding`` (zstd is lossless, so skipped)."""
    check_encoding(encoding)
    if encoding == "bf16":
        return x.to(torch.bfloat16).to(dtype)
    return dequantize_int8(quantize_int8(x, groups, outliers_per_token), dtype)


def _relative(reference: float, value: float) -> float:
    if reference == 0:
        return 0.0 if value == 0 else math.inf
    return abs(value - reference) / abs(reference)


@dataclass(frozen=True)
class LossDelta:
    """Loss on exact hidden states vs. on hidden states decoded from an encoding."""

    encoding: str
    exact_loss: float
    encoded_loss: float
    relative_change: float  # (encoded - exact) / exact, of the sample-mean loss
    max_sample_relative_change: float  # worst single sample, absolute value


def loss_delta_under_encoding(
    loss_fn: Callable[[Mapping[str, torch.Tensor]], torch.Tensor],
    samples: Iterable[Mapping[str, torch.Tensor]],
    encoding: str,
    outliers_per_token: int = 8,
) -> LossDelta:
    """Compare ``loss_fn`` on exact samples vs. the same samples round-tripped through ``encoding``."""
    check_encoding(encoding)
    exact, encoded = [], []
    for sample in samples:
        aux, final = sample["aux_hidden"], sample["final_hidden"]
        groups = aux.shape[-1] // final.shape[-1]
        decoded = dict(sample)
        decoded["aux_hidden"] = roundtrip(aux, groups, encoding, outliers_per_token, aux.dtype)
        decoded["final_hidden"] = roundtrip(final, 1, encoding, outliers_per_token, final.dtype)
        with torch.no_grad():
            exact.append(float(loss_fn(sample)))
            encoded.append(float(loss_fn(decoded)))
    if not exact:
        raise ValueError("loss_delta_under_encoding needs at least one sample.")
    mean_exact = sum(exact) / len(exact)
    if mean_exact == 0:
        raise ValueError(
            f"the exact loss is 0 on all {len(exact)} samples (no counted token: prompts only, or cut "
            "before the first assistant token), so there is no loss change to measure."
        )
    mean_encoded = sum(encoded) / len(encoded)
    worst = max(_relative(a, b) for a, b in zip(exact, encoded))
    return LossDelta(
        encoding=encoding,
        exact_loss=mean_exact,
        encoded_loss=mean_encoded,
        relative_change=(mean_encoded - mean_exact) / mean_exact,
        max_sample_relative_change=worst,
    )
