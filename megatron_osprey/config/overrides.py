"""`--set section.key=value` overrides applied to a nested config dataclass."""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml


def parse_override(text: str) -> tuple[list[str], Any]:
    """'optimizer.lr=1e-4' -> (['optimizer', 'lr'], 0.0001); the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set {text!r}: expected section.key=value.")
    value = yaml.safe_load(raw) if raw.strip() else None
    # YAML reads 1e-4 as a string (no dot): numbers written that way are still numbers.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            pass
    return key.strip().split("."), value


def set_path(config: Any, path: list[str], value: Any, original: str) -> None:
    """Set one dotted field of a dataclass tree; unknown keys raise naming the valid ones."""
    target = config
    for i, name in enumerate(path):
        if not dataclasses.is_dataclass(target):
            raise ValueError(f"--set {original}: {'.'.join(path[:i])} is not a section.")
        names = [f.name for f in dataclasses.fields(target)]
        if name not in names:
            where = ".".join(path[:i]) or "the top level"
            raise ValueError(f"--set {original}: no key {name!r} in {where}; valid keys: {', '.join(names)}.")
        if i == len(path) - 1:
            current = getattr(target, name)
            if dataclasses.is_dataclass(current):
                raise ValueError(f"--set {original}: {'.'.join(path)} is a section; set one of its keys.")
            if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            setattr(target, name, value)
        else:
            target = getattr(target, name)


def apply_overrides(config: Any, overrides: list[str]) -> Any:
    """Apply `section.key=value` strings in order (later ones win); returns the config."""
    for text in overrides or []:
        path, value = parse_override(text)
        set_path(config, path, value, text)
    return config
