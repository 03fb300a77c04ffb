"""The job door: every job, local run, demo step and tool runs a stage through here.

    python -m megatron_osprey STAGE [--recipe NAME[:DOMAIN]|FILE.yaml [--run-dir DIR]] [flags] [--set K=V ...]
    torchrun --nproc-per-node N -m megatron_osprey STAGE ...

It sits above the stages and the recipe registry: it imports the registry, which resolves `--recipe` and imports
the stage module once, under its own name, and calls its main(). STAGE is a module of megatron_osprey/stages/
(`python -m megatron_osprey --help` lists them); `python -m megatron_osprey STAGE --help` shows the stage's flags.
"""

from __future__ import annotations

import pkgutil
import sys

PROG = "python -m megatron_osprey"


def stages() -> list[str]:
    """Every stage this door runs: the modules of megatron_osprey/stages/ but the shared parser (cli)."""
    import megatron_osprey.stages

    return sorted(m.name for m in pkgutil.iter_modules(megatron_osprey.stages.__path__) if m.name != "cli")


def usage() -> str:
    return f"usage: {PROG} STAGE [--recipe NAME[:DOMAIN]|FILE.yaml [--run-dir DIR]] [flags] [--set KEY=VALUE ...]\n" + (
        f"stages: {', '.join(stages())} ({PROG} STAGE --help: its flags)"
    )


def main(argv: list[str] | None = None) -> int:
    """Run STAGE (argv[0]) on the rest of argv with --recipe resolved by the registry; the stage's exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in stages():
        print(f"{usage()}\n{PROG}: error: unknown stage {argv[0]!r}", file=sys.stderr)
        return 2
    from megatron_osprey.recipes import run_stage

    return run_stage(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
