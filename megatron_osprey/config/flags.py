"""Flag tables: Megatron-LM-named command-line flags mapped onto fields of a config dataclass.

A component owns the table of its own config (training/config.py has --micro-batch-size ... for
TrainingConfig); a stage composes the tables of its sections under their section names
(`under("training", TRAINING_FLAGS)`), builds one parser and applies what the user typed.
Only typed flags land in the namespace (argparse.SUPPRESS), so a recipe is never silently
overwritten by a flag's default.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Iterable

STORE_TRUE = {"action": "store_true"}


@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag: its name, the dotted config field it sets, and its argparse keywords."""

    flag: str
    dest: str
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


def skip_checksum_flag(what: str) -> Flag:
    """--skip-checksum for the stages that load a dist checkpoint: `what` names the flags whose checkpoint it covers."""
    return Flag(
        "--skip-checksum",
        "skip_checksum",
        {
            **STORE_TRUE,
            "help": f"load {what} without verifying its files against the sha256 recorded at save, or without that "
            "record (checksums.json): only a copy you trust",
        },
    )


def under(section: str, flags: Iterable[Flag]) -> list[Flag]:
    """The same flags, their fields inside `section` of a composed config."""
    return [dataclasses.replace(f, dest=f"{section}.{f.dest}") for f in flags]


def without(flags: Iterable[Flag], names: Iterable[str]) -> list[Flag]:
    """The flags minus those named (a stage that has no use for a shared flag refuses it by omission)."""
    drop = set(names)
    return [f for f in flags if f.flag not in drop]


FlagGroups = dict[str, list[Flag]]  # help-section title -> flags


def add_flag_groups(parser: argparse.ArgumentParser, groups: FlagGroups) -> None:
    """Add every group's flags to `parser`, each under its title."""
    for title, flags in groups.items():
        group = parser.add_argument_group(title)
        for f in flags:
            group.add_argument(f.flag, dest=f.dest, **f.kwargs)


def apply_flags(config: Any, typed: dict[str, Any]) -> Any:
    """Set each typed flag's value (dest "section.field" or "field") on `config`; returns it (a frozen section,
    such as the sampling parameters, is replaced rather than mutated)."""
    for dest, value in typed.items():
        config = _with_field(config, dest.split("."), value)
    return config


def _with_field(node: Any, path: list[str], value: Any) -> Any:
    """`node` with the field at `path` set to `value`: mutated in place, or replaced where it is frozen."""
    head, rest = path[0], path[1:]
    new = _with_field(getattr(node, head), rest, value) if rest else value
    params = getattr(type(node), "__dataclass_params__", None)
    if params is not None and params.frozen:
        return dataclasses.replace(node, **{head: new})
    setattr(node, head, new)
    return node


def boolean(text: str) -> bool:
    """A flag value `true` or `false` (argparse names the flag when it is neither)."""
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def flag_word(value) -> str:
    """A value as a command-line word; whole floats without the trailing .0."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
