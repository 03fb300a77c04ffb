"""Build every input a recipe reads from the conversations you have: prompts, eval splits, token counts.

    python -m megatron_osprey data --input code=code.jsonl --input finance=finance.parquet \\
        --target TARGET_DIR --output DATA_DIR [--eval-size 512] [--seed 0] [--reasoning template|drop|inline]

An input is DOMAIN=PATH (a domain is any name; repeat --input for more domains or more files of one domain):
JSONL (plain or gzip), a JSON array, Parquet, or a `datasets` save_to_disk directory, with rows in OpenAI
`messages`, ShareGPT `conversations` (from/value or role/content) or `prompt`/`response` form. TARGET_DIR is
the target's HF directory (its tokenizer and chat template; no weights are read). Writes DATA_DIR/prompts/,
eval/, conversations/ (when the rows hold replies), token_counts.json, data_summary.json and provenance.json;
the library is data/user_data.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_osprey.config.flags import STORE_TRUE, Flag
from megatron_osprey.data.chat_template import REASONING_MODES, TOOL_MODES
from megatron_osprey.data.user_data import (
    PROMPT_TURNS,
    SPLIT_RULES,
    UserDataConfig,
    build_user_data,
    data_outputs,
    parse_inputs,
)
from megatron_osprey.stages.cli import Invocation, check_inputs, exit_code, parse_config

# The stage's config is the library's own (one schema, owned by the component).
DataConfig = UserDataConfig

FLAGS = {
    "data": [
        Flag(
            "--input",
            "inputs",
            {"action": "append", "metavar": "DOMAIN=PATH", "help": "a domain's file or save_to_disk directory"},
        ),
        Flag("--target", "target", {"help": "the target's HF directory (tokenizer + chat template; config.json)"}),
        Flag("--output", "output", {"help": "the data directory recipes read (paths.prompts, paths.eval_data, ...)"}),
        Flag(
            "--eval-size",
            "eval_size",
            {
                "type": int,
                "help": "held-out conversations per domain (default 512, the paper's; 64 was the earlier default)",
            },
        ),
        Flag("--max-train", "max_train", {"type": int, "help": "at most N training conversations per domain"}),
        Flag("--seed", "seed", {"type": int, "help": "the seed of the eval draw (same seed, same files)"}),
        Flag(
            "--split-rule",
            "split_rule",
            {
                "choices": list(SPLIT_RULES),
                "help": "seeded (default: duplicates removed, a seeded eval sample) or shuffle (the release's Llama "
                "split: shuffle with --seed, the first --max-train train, the next --eval-size eval)",
            },
        ),
        Flag(
            "--reasoning",
            "reasoning",
            {
                "choices": list(REASONING_MODES),
                "help": "reasoning_content: to the template, dropped, or inlined as <think> (default: what the "
                "target's chat template does with it)",
            },
        ),
        Flag(
            "--tools",
            "tools",
            {
                "choices": list(TOOL_MODES),
                "help": "tool turns: to the template, or conversations holding them left out (default: what the "
                "target's chat template does with them)",
            },
        ),
        Flag(
            "--prompt-turns",
            "prompt_turns",
            {"choices": list(PROMPT_TURNS), "help": "regenerate every user turn (all) or the first only"},
        ),
        Flag("--seq-length", "seq_length", {"type": int, "help": "tokens per conversation counted (default 4096)"}),
        Flag(
            "--overwrite",
            "overwrite",
            {**STORE_TRUE, "help": "replace an earlier osprey data output (one whose provenance.json names data)"},
        ),
    ],
}


def run(config: DataConfig, invocation: Invocation = Invocation("data")) -> dict:
    """Build the data directory and record its provenance; returns the summary."""
    config.validate()
    files = {
        f"{domain}[{i}]": path for domain, paths in parse_inputs(config.inputs).items() for i, path in enumerate(paths)
    }
    target = Path(config.target)
    tokenizer_files = {
        f"target_{name}": target / name for name in ("tokenizer.json", "tokenizer_config.json", "config.json")
    }
    inputs = check_inputs(
        {f"input {name}": path for name, path in files.items() if Path(path).exists()}
        | {name: path for name, path in tokenizer_files.items() if path.is_file()}
    )
    return build_user_data(
        config, record=lambda output: invocation.record(output, config, inputs, data_outputs(output))
    )


def main(argv: list[str] | None = None, recipes=None) -> int:
    """Parse the flags, build the data directory, print one line per domain; returns the exit code (2: bad input)."""
    config, invocation = parse_config(argv, "data", DataConfig, FLAGS, __doc__, recipes)

    def build_and_report() -> None:
        summary = run(config, invocation)
        print(json.dumps({k: summary[k] for k in ("reasoning", "tools", "assistant_tokens")}))
        for domain, counts in summary["domains"].items():
            print(
                f"{domain}: {counts['rows']} rows -> {counts['train']} train, {counts['eval']} eval "
                f"({counts['duplicates_removed']} duplicates, {counts['train_with_eval_prompt_removed']} repeating an "
                f"eval prompt, {counts['tool_conversations_dropped']} with tool turns left out)"
            )
            if counts["prompts_without_user_turn"]:
                print(
                    f"{domain}: {counts['prompts_without_user_turn']} training conversations call a tool before any "
                    f"user message, so prompts/{domain}.jsonl leaves them out (nothing for regenerate to answer)"
                )
        print(f"wrote {config.output}")

    return exit_code(build_and_report)


if __name__ == "__main__":
    # Deprecated for one release: hands over to the job door (`python -m megatron_osprey data`) by exec,
    # so the job never imports this file twice; the recipe registry above the stages is the door's to import.
    from megatron_osprey.stages.cli import deprecated_module_door

    deprecated_module_door("data")
