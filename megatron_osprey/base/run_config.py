"""The resolved run configuration saved beside every checkpoint as run_config.yaml."""

from __future__ import annotations

import dataclasses
import enum
import re
from pathlib import Path
from typing import Any

import yaml

from megatron_osprey.base.atomic_io import write_text_atomic

# Keys whose values must never land on disk (API keys for servers, wandb, hubs).
_SECRET_KEY = re.compile(r"(api[_-]?key|token|secret|password)", re.IGNORECASE)
# Token *ids* (eos_token_id, pad_token_id, eod_token_id) are model facts, not credentials.
_TOKEN_ID_KEY = re.compile(r"_token_ids?$", re.IGNORECASE)


def _is_secret_key(key: str) -> bool:
    return bool(_SECRET_KEY.search(key)) and not _TOKEN_ID_KEY.search(key)


def to_plain(value: Any) -> Any:
    """Dataclasses, enums, paths and dtypes -> YAML-safe builtins, secrets redacted."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): ("<redacted>" if _is_secret_key(str(k)) and v else to_plain(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def save_run_config(path: str | Path, config: dict[str, Any]) -> Path:
    """Write run_config.yaml atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, yaml.safe_dump(to_plain(config), sort_keys=False))
    return path


def load_run_config(path: str | Path) -> dict[str, Any]:
    """Read run_config.yaml (a file, or the directory that holds it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "run_config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"run_config.yaml not found at {path}.")
    return yaml.safe_load(path.read_text())
