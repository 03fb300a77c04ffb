"""Reading slices of sharded HF safetensors checkpoints, and writing them atomically."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"


class SafetensorsCheckpoint:
    """A HF checkpoint directory; `read` returns a slice without loading whole files."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory not found: {self.directory}")
        index = self.directory / INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"{self.directory} holds no *.safetensors files (and no {INDEX_NAME})."
                )
            weight_map = {}
            for file in files:
                with safe_open(file, framework="pt") as handle:
                    weight_map.update({key: file.name for key in handle.keys()})
        self.weight_map: dict[str, str] = weight_map
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
            self._handles[file] = self._stack.enter_context(safe_open(path, framework="pt"))
        return self._handles[file]

    def shape(self, name: str) -> list[int]:
        return list(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Read `name`, or only rows [a, b) / cols [a, b) of it, from disk."""
        sliced = self._handle(name).get_slice(name)
        if rows is None and cols is None:
            return sliced[:]
        r = slice(*rows) if rows else slice(None)
        if cols is None:
            return sliced[r]
        return sliced[r, slice(*cols)]


def write_safetensors_atomic(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    """Write a safetensors file under a temporary name, fsync, then rename into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata or {"format": "pt"})
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a text file under a temporary name, fsync, then rename into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
