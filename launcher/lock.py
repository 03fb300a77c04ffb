"""The lock behind `make venv`: the exact version of every distribution the project and its test extra install.

pyproject.toml states what the package needs; a fresh `make venv` would otherwise take whatever the registry holds
that day for every transitive dependency (a new typer release once changed CI's environment overnight). The lock is
applied as a pip constraints file, so it fixes versions without adding packages, and `make venv` and CI install the
same set on every machine. `osprey lock --write` rewrites it from the current environment's installed closure;
`osprey lock --check` says whether the environment and the lock agree.

pyproject.toml states ranges for torch, megatron-core and transformers; cpu.txt holds their low end, and
cpu-newest.txt (`make test-newest`, Python 3.12) the newest release of each that the ranges allow, with the closure
those pull in, so both ends are installed exactly and tested.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

LOCK = Path(__file__).resolve().parent / "locks" / "cpu.txt"
NEWEST = LOCK.with_name("cpu-newest.txt")
ROOT_DISTRIBUTION = "megatron_osprey"
ROOT_EXTRAS = ("test",)
HEADER = (
    "# The exact versions `make venv` and CI install (a pip constraints file). Written by `osprey lock --write` from\n"
    "# the installed closure of megatron_osprey[test]; torch's local build label is left off so that the CPU and\n"
    "# CUDA builds of the same release both satisfy it.\n"
)
NEWEST_HEADER = (
    "# The high end of pyproject.toml's ranges (newest torch, megatron-core and transformers they allow) that\n"
    "# `make test-newest` installs into .venv-newest (Python 3.12; a pip constraints file). Written by\n"
    "# `osprey lock --write --lock launcher/locks/cpu-newest.txt` from that venv's closure of megatron_osprey[test].\n"
)


def installed_closure(root: str = ROOT_DISTRIBUTION, extras: tuple[str, ...] = ROOT_EXTRAS) -> dict[str, str]:
    """{canonical name: installed version} for `root[extras]` and everything it requires, markers evaluated here."""
    found: dict[str, str] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [(root, extras)]
    done: set[tuple[str, str]] = set()
    while todo:
        name, wanted = todo.pop()
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError as err:
            raise SystemExit(f"osprey lock: {name} is required but not installed; run `make venv` first") from err
        key = canonicalize_name(dist.metadata["Name"])
        found[key] = dist.version
        for extra in ("",) + tuple(wanted):
            if (key, extra) in done:
                continue
            done.add((key, extra))
            for text in dist.requires or []:
                req = Requirement(text)
                if req.marker is None or req.marker.evaluate({"extra": extra}):
                    todo.append((req.name, tuple(sorted(req.extras))))
    found.pop(canonicalize_name(root), None)
    return found


def _pin(version: str) -> str:
    return version.split("+", 1)[0]


def render(closure: dict[str, str], header: str = HEADER) -> str:
    return header + "".join(f"{name}=={_pin(version)}\n" for name, version in sorted(closure.items()))


def read_lock(path: Path = LOCK) -> dict[str, str]:
    pins = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==":
            raise SystemExit(f"{path}:{number}: a lock line pins one exact version (name==X), got {line!r}")
        pins[canonicalize_name(req.name)] = specs[0].version
    return pins


def differences(path: Path = LOCK) -> list[str]:
    """One line per distribution whose installed version and lock disagree (or that only one side has)."""
    locked = read_lock(path)
    installed = {name: _pin(version) for name, version in installed_closure().items()}
    lines = []
    for name in sorted(set(locked) | set(installed)):
        have, want = installed.get(name), locked.get(name)
        if have != want:
            lines.append(f"{name}: installed {have or '(not in the closure)'}, lock {want or '(missing)'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="osprey lock", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the lock from this environment")
    mode.add_argument("--check", action="store_true", help="exit 1, listing each difference, if they disagree")
    parser.add_argument("--lock", type=Path, default=LOCK, help=f"the lock file (default {LOCK})")
    args = parser.parse_args(argv)
    if args.write:
        args.lock.parent.mkdir(parents=True, exist_ok=True)
        closure = installed_closure()
        args.lock.write_text(render(closure, NEWEST_HEADER if args.lock.resolve() == NEWEST else HEADER))
        print(f"osprey lock: wrote {len(closure)} pins to {args.lock}")
        return 0
    if not args.lock.is_file():
        raise SystemExit(f"osprey lock: --lock {args.lock} does not exist")
    lines = differences(args.lock)
    for line in lines:
        print(line)
    print(f"osprey lock: {'agrees with' if not lines else f'{len(lines)} differences from'} {args.lock}")
    return 1 if lines else 0
