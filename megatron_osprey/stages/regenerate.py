"""Regenerate every assistant turn of a conversations JSONL with the target model.

    python -m megatron_osprey regenerate --input prompts.jsonl --output regen.jsonl \\
        --backend server --server-url http://10.0.0.1:30000 --server-url http://10.0.0.2:30000 \\
        --temperature 0 --max-tokens 2048 --concurrency 64 --retries 3
    python -m megatron_osprey regenerate --input prompts.jsonl --output regen.jsonl --backend hf --model DIR

Rerunning the same command resumes: ids already in the output are skipped. Failed rows are listed in
OUT.failures.jsonl. The API key comes from $OPENAI_API_KEY (or the variable named by --api-key-env) and is
never printed. The runner is data/regenerate/.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from megatron_osprey.base.redact import configure_redacted_logging
from megatron_osprey.config.flags import STORE_TRUE, Flag, under
from megatron_osprey.data.regenerate.backends import (
    BackendRequestError,
    SamplingParams,
    redact_credentials,
    server_api_key,
)
from megatron_osprey.stages.cli import Invocation, check_inputs, exit_code, parse_config

BACKENDS = ("server", "hf")
BACKEND_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass
class RegenerateConfig:
    """The files, the backend (a server pool or an in-process HF model) and the sampling of one run."""

    input: str | None = None
    output: str | None = None
    backend: str = "server"
    server_url: list[str] = dataclasses.field(default_factory=list)  # server backend: the pool
    served_model_name: str | None = None  # None: ask /v1/models
    api_key_env: str | None = None  # the variable holding the API key (default OPENAI_API_KEY if set)
    timeout: float = 600.0
    retries: int = 3
    backoff: float = 1.0
    model: str | None = None  # hf backend: a local HF model directory
    device: str = "cpu"
    dtype: str = "float32"
    batch_size: int = 1
    trust_remote_code: bool = False
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    concurrency: int = 8
    progress: bool = True
    overwrite: bool = False

    def validate(self) -> None:
        """One clear sentence per bad setting, before any request."""
        checks = [
            (not self.input, "--input is required."),
            (not self.output, "--output is required."),
            (self.backend not in BACKENDS, f"--backend must be one of {BACKENDS}."),
            (self.sampling.temperature < 0, "--temperature must be >= 0."),
            (self.sampling.max_tokens < 1, "--max-tokens must be >= 1."),
            (self.concurrency < 1, "--concurrency must be >= 1."),
            (self.retries < 0, "--retries must be >= 0."),
            (self.batch_size < 1, "--batch-size must be >= 1."),
        ]
        for failed, message in checks:
            if failed:
                raise ValueError(message)
        if not Path(self.input).is_file():
            raise FileNotFoundError(f"--input {self.input} does not exist.")
        if self.backend == "server":
            if not self.server_url:
                raise ValueError("--backend server needs at least one --server-url.")
            for url in self.server_url:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"--server-url {redact_credentials(url)!r} must start with http:// or https://.")
            if self.api_key_env and not os.environ.get(self.api_key_env):
                raise ValueError(f"--api-key-env {self.api_key_env}: that environment variable is empty or unset.")
        elif self.model is None:
            raise ValueError("--backend hf needs --model DIR.")
        elif not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"--model {self.model} is not a Hugging Face model directory (no config.json).")


FLAGS = {
    "files": [
        Flag("--input", "input", {"help": "conversations JSONL (prompts)"}),
        Flag("--output", "output", {"help": "regenerated conversations JSONL (appended, resumable)"}),
        Flag(
            "--overwrite",
            "overwrite",
            {**STORE_TRUE, "help": "delete an --output made from other input, another model or other sampling"},
        ),
        Flag("--concurrency", "concurrency", {"type": int, "help": "conversations in flight"}),
        Flag("--no-progress", "progress", {"action": "store_false"}),
    ],
    "backend": [
        Flag("--backend", "backend", {"choices": list(BACKENDS)}),
        Flag("--server-url", "server_url", {"action": "append", "help": "OpenAI-compatible server; repeat for a pool"}),
        Flag("--served-model-name", "served_model_name", {"help": "model name for requests (default: /v1/models)"}),
        Flag("--api-key-env", "api_key_env", {"help": "env var holding the API key (default OPENAI_API_KEY if set)"}),
        Flag("--timeout", "timeout", {"type": float, "help": "seconds per request"}),
        Flag("--retries", "retries", {"type": int, "help": "extra attempts per request on transient errors"}),
        Flag("--backoff", "backoff", {"type": float, "help": "first retry delay in seconds (doubles each retry)"}),
        Flag("--model", "model", {"help": "local HF model directory (hf backend)"}),
        Flag("--device", "device", {"help": "torch device (hf backend)"}),
        Flag("--dtype", "dtype", {"choices": list(BACKEND_DTYPES)}),
        Flag(
            "--batch-size",
            "batch_size",
            {"type": int, "help": "hf backend, greedy: generate up to this many concurrent turns together"},
        ),
        Flag("--trust-remote-code", "trust_remote_code", {**STORE_TRUE, "help": "allow model code (hf backend)"}),
    ],
    "sampling": under(
        "sampling",
        [
            Flag("--temperature", "temperature", {"type": float}),
            Flag("--max-tokens", "max_tokens", {"type": int}),
            Flag("--seed", "seed", {"type": int, "help": "per-turn seeds derived from this (sampling only)"}),
            Flag("--enable-thinking", "enable_thinking", {"action": "store_true"}),
            Flag("--disable-thinking", "enable_thinking", {"action": "store_false"}),
        ],
    ),
}


def build_backend(config: RegenerateConfig):
    """The server pool or the local HF model the config names; the API key is read here, never stored."""
    from megatron_osprey.data.regenerate import HFBackend, HFBackendConfig, ServerBackend, ServerBackendConfig

    if config.backend == "server":
        api_key = server_api_key(config.api_key_env, os.environ)
        return ServerBackend(
            ServerBackendConfig(
                urls=tuple(config.server_url),
                api_key=api_key,
                model=config.served_model_name,
                timeout_s=config.timeout,
                retries=config.retries,
                backoff_s=config.backoff,
                max_connections=max(64, config.concurrency),
            )
        )
    return HFBackend(
        HFBackendConfig(
            model_dir=Path(config.model),
            device=config.device,
            dtype=config.dtype,
            trust_remote_code=config.trust_remote_code,
            batch_size=config.batch_size,
        )
    )


def run(config: RegenerateConfig, invocation: Invocation = Invocation("regenerate")):
    """Regenerate config.input into config.output; returns the RegenerateSummary."""
    from megatron_osprey.data.regenerate import RegenerationRun, regenerate_file

    config.validate()
    inputs = check_inputs({"prompts": config.input, "model_config": _model_config(config)})
    backend = build_backend(config)
    files = RegenerationRun(
        Path(config.input), Path(config.output), config.sampling, config.concurrency, config.progress, config.overwrite
    )
    try:
        summary = regenerate_file(files, backend)
    finally:
        backend.close()
    if not summary.failed:
        invocation.record_file(config.output, config, inputs, "conversations")
    return summary


def _model_config(config: RegenerateConfig) -> Path | None:
    return Path(config.model) / "config.json" if config.backend == "hf" else None


def main(argv: list[str] | None = None, recipes=None) -> int:
    """Parse the flags, regenerate; returns 0 when every row is done, 1 when some failed, 2 on bad input."""
    config, invocation = parse_config(argv, "regenerate", RegenerateConfig, FLAGS, __doc__, recipes)
    key = server_api_key(config.api_key_env, os.environ) if config.backend == "server" else None
    configure_redacted_logging(logging.INFO, secrets=(key,) if key else ())

    def regenerate_and_report() -> int:
        summary = run(config, invocation)
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
    # Deprecated for one release: hands over to the job door (`python -m megatron_osprey regenerate`) by exec,
    # so the job never imports this file twice; the recipe registry above the stages is the door's to import.
    from megatron_osprey.stages.cli import deprecated_module_door

    deprecated_module_door("regenerate")
