"""Regenerate every assistant turn of a conversations JSONL with the target model.

    python -m megatron_osprey regenerate --input prompts.jsonl --output regen.jsonl \\
        --backend server --server-url http://10.0.0.1:30000 --server-url http://10.0.0.2:30000 \\
        --temperature 0 --max-tokens 2048 --concurrency 64 --retries 3
    python -m megatron_osprey regenerate --input prompts.jsonl --output regen.jsonl --backend hf --model DIR
    python -m megatron_osprey regenerate --input prompts.jsonl --output regen.jsonl --serve vllm --model DIR

Rerunning the same command resumes: ids already in the output are skipped. Failed rows are listed in
OUT.failures.jsonl. The API key comes from $OPENAI_API_KEY (or the variable named by --api-key-env) and is
never printed. With --serve vllm the stage starts vLLM's OpenAI server on --model itself (loopback, a key of
its own passed through VLLM_API_KEY, its log beside --output) and regenerates through it; the engine's
interpreter is --vllm-python, else $VLLM_PYTHON, else the checkout's .venv-vllm. The runner is data/regenerate/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
from pathlib import Path
from typing import Iterator

from megatron_osprey.base.engines import CPU_KV_CACHE_BYTES, EngineUnavailable, free_loopback_port
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
SERVE_ENGINES = ("vllm",)
REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class ServeConfig:
    """A server the job starts itself on --model (vLLM's OpenAI server), instead of a --server-url pool."""

    engine: str | None = None  # "vllm"; None: no server of the job's own
    python: str | None = None  # the engine's interpreter; None: $VLLM_PYTHON (read by main), else .venv-vllm
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser (qwen3, deepseek_r1, ...)
    tensor_parallel_size: int = 1
    max_model_len: int | None = None  # None: the model's
    kv_cache_memory_bytes: int | None = None  # None: 1 GiB on CPU, vLLM's share of GPU memory on GPU
    enforce_eager: bool = False  # always on CPU, where torch.compile costs minutes of startup
    startup_timeout: float = 900.0


@dataclasses.dataclass(frozen=True)
class ServedPool:
    """The server(s) a job started: where they listen, the key they require, and what they serve."""

    urls: tuple[str, ...]
    api_key: str = dataclasses.field(repr=False)
    identity: dict
    log_path: Path


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
    serve: ServeConfig = dataclasses.field(default_factory=ServeConfig)

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
        if self.serve.engine is not None:
            self._validate_serve()
        elif self.backend == "server":
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

    def _validate_serve(self) -> None:
        serve = self.serve
        checks = [
            (serve.engine not in SERVE_ENGINES, f"--serve must be one of {SERVE_ENGINES}."),
            (self.backend != "server", "--serve starts a server for the server backend; drop --backend hf."),
            (bool(self.server_url), "--serve starts its own server; drop --server-url (or drop --serve)."),
            (bool(self.api_key_env), "--serve makes the job's own API key; drop --api-key-env."),
            (self.model is None, "--serve vllm needs --model DIR (the target's Hugging Face directory)."),
            (serve.tensor_parallel_size < 1, "--tensor-parallel-size must be >= 1."),
            (serve.max_model_len is not None and serve.max_model_len < 1, "--max-model-len must be >= 1."),
            (serve.kv_cache_memory_bytes is not None and serve.kv_cache_memory_bytes < 1,
             "--kv-cache-memory-bytes must be >= 1."),
        ]  # fmt: skip
        for failed, message in checks:
            if failed:
                raise ValueError(message)
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"--model {self.model} is not a Hugging Face model directory (no config.json).")


SERVE_FLAGS = under(
    "serve",
    [
        Flag(
            "--serve",
            "engine",
            {"choices": list(SERVE_ENGINES), "help": "start this engine's OpenAI server on --model (loopback)"},
        ),
        Flag("--vllm-python", "python", {"help": "the vLLM environment's interpreter (default $VLLM_PYTHON)"}),
        Flag("--reasoning-parser", "reasoning_parser", {"help": "the server's reasoning parser (--serve)"}),
        Flag("--tensor-parallel-size", "tensor_parallel_size", {"type": int, "help": "GPUs per server (--serve)"}),
        Flag("--max-model-len", "max_model_len", {"type": int, "help": "the server's context length (--serve)"}),
        Flag(
            "--kv-cache-memory-bytes",
            "kv_cache_memory_bytes",
            {"type": int, "help": "the server's KV cache size (--serve; default 1 GiB on CPU)"},
        ),
        Flag("--enforce-eager", "enforce_eager", {**STORE_TRUE, "help": "no CUDA graphs / compile (always on CPU)"}),
        Flag("--server-timeout", "startup_timeout", {"type": float, "help": "seconds until the server is healthy"}),
    ],
)


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
    "serve": SERVE_FLAGS,
}


def server_log_path(output: str | os.PathLike) -> Path:
    """Where a job's own server logs: beside --output (OUT.jsonl -> OUT.server.log)."""
    output = Path(output)
    stem = output.name[: -len(".jsonl")] if output.name.endswith(".jsonl") else output.name
    return output.with_name(stem + ".server.log")


@contextlib.contextmanager
def serve_target(config: RegenerateConfig, api_key: str | None = None) -> Iterator[ServedPool]:
    """vLLM's OpenAI server on config.model for the length of the block: loopback, requiring `api_key` (None: a
    fresh one)."""
    from megatron_osprey.base.engines import (
        EngineServer,
        VllmServeArgs,
        engine_python,
        engine_version,
        vllm_environment,
    )
    from megatron_osprey.data.fingerprint import model_fingerprint

    serve = config.serve
    python = engine_python("vllm", serve.python, os.environ, repo=REPO)
    version = engine_version("vllm", python)
    on_cpu = config.device == "cpu"
    port = free_loopback_port()
    name = config.served_model_name or Path(config.model).name
    args = VllmServeArgs(
        model=str(config.model),
        port=port,
        served_model_name=name,
        dtype=config.dtype,
        max_model_len=serve.max_model_len,
        seed=config.sampling.seed or 0,
        tensor_parallel_size=serve.tensor_parallel_size,
        kv_cache_memory_bytes=serve.kv_cache_memory_bytes or (CPU_KV_CACHE_BYTES if on_cpu else None),
        enforce_eager=serve.enforce_eager or on_cpu,
        reasoning_parser=serve.reasoning_parser,
        trust_remote_code=config.trust_remote_code,
    )
    api_key = api_key or secrets.token_hex(24)
    environ = vllm_environment(python, api_key, os.environ, on_cpu=on_cpu, repo=REPO)
    url = f"http://127.0.0.1:{port}"
    log_path = server_log_path(config.output)
    logging.getLogger(__name__).info("starting vLLM %s on %s at %s (log %s)", version, config.model, url, log_path)
    with EngineServer(args.argv(python), url, log_path, env=environ, startup_timeout=serve.startup_timeout):
        identity = {
            "backend": "vllm",
            "engine": version,
            "model": model_fingerprint(Path(config.model)),
            "dtype": config.dtype,
        }
        yield ServedPool(urls=(url,), api_key=api_key, identity=identity, log_path=log_path)


def build_backend(config: RegenerateConfig, served: ServedPool | None = None):
    """The server pool (the job's own when `served`), or the local HF model the config names; the API key is read
    here, never stored."""
    from megatron_osprey.data.regenerate import HFBackend, HFBackendConfig, ServerBackend, ServerBackendConfig

    if served is not None:
        return ServerBackend(
            ServerBackendConfig(
                urls=served.urls,
                api_key=served.api_key,
                model=config.served_model_name or Path(config.model).name,
                timeout_s=config.timeout,
                retries=config.retries,
                backoff_s=config.backoff,
                max_connections=max(64, config.concurrency),
                identity=served.identity,
            )
        )
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


def run(
    config: RegenerateConfig,
    invocation: Invocation = Invocation("regenerate"),
    served: ServedPool | None = None,
    api_key: str | None = None,
):
    """Regenerate config.input into config.output (through `served`, or the server --serve starts, requiring
    `api_key`, when given); returns the RegenerateSummary."""
    from megatron_osprey.data.regenerate import RegenerationRun, regenerate_file

    config.validate()
    inputs = check_inputs({"prompts": config.input, "model_config": _model_config(config)})
    files = RegenerationRun(
        Path(config.input), Path(config.output), config.sampling, config.concurrency, config.progress, config.overwrite
    )
    with contextlib.ExitStack() as stack:
        if served is None and config.serve.engine is not None:
            served = stack.enter_context(serve_target(config, api_key))
        backend = build_backend(config, served)
        try:
            summary = regenerate_file(files, backend)
        finally:
            backend.close()
    if not summary.failed:
        invocation.record_file(config.output, config, inputs, "conversations")
    return summary


def _model_config(config: RegenerateConfig) -> Path | None:
    served_here = config.backend == "hf" or config.serve.engine is not None
    return Path(config.model) / "config.json" if served_here else None


def main(argv: list[str] | None = None, recipes=None) -> int:
    """Parse the flags, regenerate; returns 0 when every row is done, 1 when some failed, 2 on bad input."""
    config, invocation = parse_config(argv, "regenerate", RegenerateConfig, FLAGS, __doc__, recipes)
    if config.serve.engine == "vllm" and config.serve.python is None:
        config.serve.python = os.environ.get("VLLM_PYTHON") or None
    # With --serve the job's own key, made here so that the redacting log handler knows it too.
    job_key = secrets.token_hex(24) if config.serve.engine is not None else None
    key = job_key or (server_api_key(config.api_key_env, os.environ) if config.backend == "server" else None)
    configure_redacted_logging(logging.INFO, secrets=(key,) if key else ())

    def regenerate_and_report() -> int:
        summary = run(config, invocation, api_key=job_key)
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
    return exit_code(regenerate_and_report, also=(BackendRequestError, EngineUnavailable), describe=redact_credentials)


if __name__ == "__main__":
    # Deprecated for one release: hands over to the job door (`python -m megatron_osprey regenerate`) by exec,
    # so the job never imports this file twice; the recipe registry above the stages is the door's to import.
    from megatron_osprey.stages.cli import deprecated_module_door

    deprecated_module_door("regenerate")
