"""Regenerate every assistant turn of a conversations JSONL with the target model.

    python tools/regenerate.py --input prompts.jsonl --output regen.jsonl \\
        --backend server --server-url http://10.0.0.1:30000 --server-url http://10.0.0.2:30000 \\
        --temperature 0 --max-tokens 2048 --concurrency 64 --retries 3
    python tools/regenerate.py --input prompts.jsonl --output regen.jsonl --backend hf --model ./tiny_target

(python -m megatron_osprey.stages.regenerate takes the same flags)

Rerunning the same command resumes: ids already in the output are skipped. Failed rows
are listed in OUT.failures.jsonl. The API key comes from $OPENAI_API_KEY (or the variable
named by --api-key-env) and is never printed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from megatron_osprey.data.regenerate import (
    HFBackend,
    HFBackendConfig,
    RegenerateConfig,
    RegenerateSummary,
    SamplingParams,
    ServerBackend,
    ServerBackendConfig,
    regenerate_file,
)
from megatron_osprey.data.regenerate.backends import BackendRequestError, ChatBackend, redact_credentials
from megatron_osprey.stages.cli import exit_code


def run(config: RegenerateConfig, backend: ChatBackend) -> RegenerateSummary:
    """Regenerate config.input_path into config.output_path with `backend` (closed afterwards)."""
    try:
        return regenerate_file(config, backend)
    finally:
        backend.close()


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser."""
    p = argparse.ArgumentParser(description="Regenerate assistant turns with the target model (resumable).")
    p.add_argument("--input", required=True, type=Path, help="conversations JSONL (prompts)")
    p.add_argument("--output", required=True, type=Path, help="regenerated conversations JSONL (appended, resumable)")
    p.add_argument("--backend", choices=("server", "hf"), default="server")
    p.add_argument("--server-url", action="append", default=[], help="OpenAI-compatible server root; repeat for a pool")
    p.add_argument("--served-model-name", default=None, help="model name for requests (default: ask /v1/models)")
    p.add_argument("--api-key-env", default=None, help="env var holding the API key (default OPENAI_API_KEY if set)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--retries", type=int, default=3, help="extra attempts per request on transient errors")
    p.add_argument("--backoff", type=float, default=1.0, help="first retry delay in seconds (doubles each retry)")
    p.add_argument("--model", type=Path, default=None, help="local HF model directory (hf backend)")
    p.add_argument("--device", default="cpu", help="torch device (hf backend)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="hf backend, greedy: generate up to this many concurrent turns together (needs --concurrency >= it)",
    )
    p.add_argument("--trust-remote-code", action="store_true", help="allow model code from --model (hf backend)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=None, help="per-turn seeds derived from this (sampling only)")
    thinking = p.add_mutually_exclusive_group()
    thinking.add_argument("--enable-thinking", dest="enable_thinking", action="store_true", default=None)
    thinking.add_argument("--disable-thinking", dest="enable_thinking", action="store_false")
    p.add_argument("--concurrency", type=int, default=8, help="conversations in flight")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete an --output made from other input, another model or other sampling (default: refuse)",
    )
    return p


def build_backend(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ChatBackend:
    """The server pool or the local HF model the flags name (a bad flag: parser.error, exit 2)."""
    if args.backend == "server":
        if not args.server_url:
            parser.error("--backend server needs at least one --server-url.")
        for url in args.server_url:
            if not url.startswith(("http://", "https://")):
                parser.error(f"--server-url {redact_credentials(url)!r} must start with http:// or https://.")
        key_env = args.api_key_env or "OPENAI_API_KEY"
        api_key = os.environ.get(key_env) or None
        if args.api_key_env and api_key is None:
            parser.error(f"--api-key-env {args.api_key_env}: that environment variable is empty or unset.")
        return ServerBackend(
            ServerBackendConfig(
                urls=tuple(args.server_url),
                api_key=api_key,
                model=args.served_model_name,
                timeout_s=args.timeout,
                retries=args.retries,
                backoff_s=args.backoff,
                max_connections=max(64, args.concurrency),
            )
        )
    if args.model is None:
        parser.error("--backend hf needs --model DIR.")
    if not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model} is not a Hugging Face model directory (no config.json).")
    if args.batch_size < 1:
        parser.error("--batch-size must be >= 1.")
    return HFBackend(
        HFBackendConfig(
            model_dir=args.model,
            device=args.device,
            dtype=args.dtype,
            trust_remote_code=args.trust_remote_code,
            batch_size=args.batch_size,
        )
    )


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, regenerate; returns 0 when every row is done, 1 when some failed, 2 on bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.temperature < 0:
        parser.error("--temperature must be >= 0.")
    if args.max_tokens < 1:
        parser.error("--max-tokens must be >= 1.")
    if args.concurrency < 1:
        parser.error("--concurrency must be >= 1.")
    if args.retries < 0:
        parser.error("--retries must be >= 0.")
    if not args.input.is_file():
        parser.error(f"--input {args.input} does not exist.")

    backend = build_backend(parser, args)
    config = RegenerateConfig(
        input_path=args.input,
        output_path=args.output,
        sampling=SamplingParams(
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            seed=args.seed,
            enable_thinking=args.enable_thinking,
        ),
        concurrency=args.concurrency,
        progress=not args.no_progress,
        overwrite=args.overwrite,
    )

    def regenerate_and_report() -> int:
        summary = run(config, backend)
        print(
            f"regenerate: {summary.total} rows, {summary.already_done} already done, "
            f"{summary.succeeded} regenerated, {summary.failed} failed -> {summary.output_path}",
            flush=True,
        )
        if summary.failed:
            print(
                f"regenerate: failures listed in {summary.failures_path}; rerun the same command to retry them.",
                flush=True,
            )
            return 1
        return 0

    # ConversationFormatError is a ValueError; a server URL may carry credentials, which are never printed.
    return exit_code(regenerate_and_report, also=(BackendRequestError,), describe=redact_credentials)


if __name__ == "__main__":
    sys.exit(main())
