"""Reading slices of sharded HF safetensors checkpoints, and writing them atomically.

FP8 block-scaled checkpoints (DeepSeek-V3 / MiniMax-M2 style: an e4m3 `X.weight`
plus a float32 `X.weight_scale_inv` holding one scale per 128x128 block) are
dequantized as they are read, slice by slice: only the scale blocks that cover
the requested rows and columns are read. The fp8 slice and its scales move to the
checkpoint's `device` first (the loading rank's GPU), so the multiply runs there,
not on the CPU where a 229B model's share would keep the other ranks waiting.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_osprey.base.atomic_io import atomic_path

INDEX_NAME = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"
DEFAULT_FP8_BLOCK = (128, 128)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_block_size(directory: Path) -> tuple[int, int]:
    """The (rows, cols) scale block of an FP8 checkpoint, from config.json's quantization_config."""
    config = directory / "config.json"
    if config.is_file():
        quant = json.loads(config.read_text()).get("quantization_config") or {}
        block = quant.get("weight_block_size")
        if block:
            if len(block) != 2:
                raise ValueError(f"{config}: quantization_config.weight_block_size must be [rows, cols], got {block}.")
            return int(block[0]), int(block[1])
    return DEFAULT_FP8_BLOCK


def dequantize_fp8_blocks(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    row_offset: int = 0,
    col_offset: int = 0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`weight * scale` (in float32, returned as `dtype`) where `scale_inv` holds one scale per block, covering
    rows/cols from the offsets; computed on `weight`'s device."""
    rows, cols = weight.shape
    br, bc = block
    # `scale_inv` starts at the block holding (row_offset, col_offset).
    r0, c0 = row_offset % br, col_offset % bc
    scale = scale_inv.to(weight.device).float().repeat_interleave(br, 0).repeat_interleave(bc, 1)
    return (weight.float() * scale[r0 : r0 + rows, c0 : c0 + cols]).to(dtype)


def _open_safetensors(path: Path):
    """safe_open, with a truncated or corrupt file named in one sentence instead of a header-parse error."""
    try:
        return safe_open(path, framework="pt")
    except Exception as exc:  # SafetensorError is not exported under a stable name
        raise ValueError(
            f"{path} is not a readable safetensors file ({exc}); it is truncated or corrupt: copy it again."
        ) from None


def load_safetensors(path: str | Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """safetensors' load_file, with a truncated or corrupt file named in one sentence (as _open_safetensors)."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device=device)
    except Exception as exc:  # SafetensorError is not exported under a stable name
        raise ValueError(
            f"{path} is not a readable safetensors file ({exc}); it is truncated or corrupt: write or copy it again."
        ) from None


class SafetensorsCheckpoint:
    """A HF checkpoint directory; `read` returns a slice without loading whole files, on `device`, with FP8
    tensors dequantized there into `dequantized_dtype`."""

    def __init__(
        self,
        directory: str | Path,
        device: torch.device | str = "cpu",
        dequantized_dtype: torch.dtype = torch.float32,
    ):
        self.directory = Path(directory)
        self.device = torch.device(device)
        self.dequantized_dtype = dequantized_dtype
        if not self.directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory not found: {self.directory}")
        index = self.directory / INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.directory} holds no *.safetensors files (and no {INDEX_NAME}).")
            weight_map = {}
            for file in files:
                with _open_safetensors(file) as handle:
                    weight_map.update({key: file.name for key in handle.keys()})
        self.weight_map: dict[str, str] = weight_map
        self.fp8_block = fp8_block_size(self.directory)
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, object] = {}

    def __enter__(self) -> "SafetensorsCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, name: str):
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.directory}.")
        file = self.weight_map[name]
        if file not in self._handles:
            path = self.directory / file
            if not path.is_file():
                raise FileNotFoundError(f"{path} is listed in {INDEX_NAME} but missing.")
            self._handles[file] = self._stack.enter_context(_open_safetensors(path))
        return self._handles[file]

    def shape(self, name: str) -> list[int]:
        return list(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Read `name`, or only rows [a, b) / cols [a, b) of it, from disk onto `device` (FP8 dequantized)."""
        out = self._read_raw(name, rows, cols)
        if out.dtype not in FP8_DTYPES:
            return out.to(self.device)
        scale_name = name + SCALE_SUFFIX
        if not self.has(scale_name):
            raise ValueError(
                f"{self.directory}: {name} is {out.dtype} but has no {scale_name}; only block-scaled "
                f"FP8 checkpoints (weight + weight_scale_inv) can be loaded."
            )
        return self._dequantize(name, scale_name, out, rows, cols)

    def _read_raw(self, name: str, rows: tuple[int, int] | None, cols: tuple[int, int] | None) -> torch.Tensor:
        sliced = self._handle(name).get_slice(name)
        if rows is None and cols is None:
            return sliced[:]
        r = slice(*rows) if rows else slice(None)
        if cols is None:
            return sliced[r]
        return sliced[r, slice(*cols)]

    def _dequantize(self, name, scale_name, weight, rows, cols) -> torch.Tensor:
        if weight.dim() != 2:
            raise ValueError(f"{self.directory}: FP8 tensor {name} must be 2-D, got {tuple(weight.shape)}.")
        full = self.shape(name)
        br, bc = self.fp8_block
        expected = [-(-full[0] // br), -(-full[1] // bc)]
        if self.shape(scale_name) != expected:
            raise ValueError(
                f"{self.directory}: {scale_name} has shape {self.shape(scale_name)}, expected {expected} for "
                f"{name} {full} in {br}x{bc} blocks (quantization_config.weight_block_size)."
            )
        r0, r1 = rows if rows else (0, full[0])
        c0, c1 = cols if cols else (0, full[1])
        weight = weight.to(self.device)
        if r1 <= r0 or c1 <= c0:
            return weight.to(self.dequantized_dtype)
        scale = self._read_raw(scale_name, (r0 // br, -(-r1 // br)), (c0 // bc, -(-c1 // bc)))
        return dequantize_fp8_blocks(weight, scale, (br, bc), r0, c0, self.dequantized_dtype)


def write_safetensors_atomic(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    """Write a safetensors file atomically (temporary name, fsync, rename)."""
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata or {"format": "pt"})
