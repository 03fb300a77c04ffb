"""Regeneration: server backend (real loopback HTTP server) vs HF backend, resume, failures."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_osprey.data.conversations import ConversationFormatError, read_conversations
from megatron_osprey.data.fingerprint import write_settings
from megatron_osprey.data.regenerate import (
    HFBackend,
    HFBackendConfig,
    RegenerationRun,
    SamplingParams,
    ServerBackend,
    ServerBackendConfig,
    failures_path_for,
    regenerate_conversation,
    regenerate_file,
)
from megatron_osprey.data.regenerate.backends import endpoint_url, merge_reasoning, normalize_server_url
from megatron_osprey.data.regenerate.local_server import ChatCompletionServer
from megatron_osprey.data.regenerate.runner import recover_output, regenerate_settings, settings_path_for
from megatron_osprey.data.regenerate.tiny_target import write_tiny_target

REPO = Path(__file__).resolve().parents[2]
SAMPLING = SamplingParams(temperature=0.0, max_tokens=6)
ORIGINAL = "ORIGINAL-ASSISTANT-TEXT"


def _rows() -> list[dict]:
    u = lambda text: {"role": "user", "content": text}  # noqa: E731
    a = {"role": "assistant", "content": ORIGINAL}
    return [
        {"id": "r0", "conversations": [u("Question 0?"), a]},
        {
            "id": "r1",
            "conversations": [{"role": "system", "content": "Be brief."}, u("Question 1?"), a, u("And then?"), a],
        },
        {"id": "r2", "conversations": [u("Question 2?")]},
        {"id": "r3", "conversations": [u("Question 3?"), a, u("Why?")], "source": "kept"},
        {"id": "r4", "conversations": [u("Question 4, part one."), u("Part two."), a]},
        {"id": "r5", "conversations": [u("Question 5?"), a, u("Again?"), a, u("Last?"), a]},
    ]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("target") / "tiny", family="qwen3", seed=3)


@pytest.fixture(scope="module")
def hf_backend(target_dir) -> HFBackend:
    return HFBackend(HFBackendConfig(model_dir=target_dir))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prompts, hf_backend) -> bytes:
    """Uninterrupted HF-backend run: the file every other run must reproduce."""
    out = tmp_path_factory.mktemp("reference") / "out.jsonl"
    summary = regenerate_file(RegenerationRun(prompts, out, SAMPLING, concurrency=1, progress=False), hf_backend)
    assert (summary.succeeded, summary.failed) == (6, 0)
    return out.read_bytes()


class SlowBackend:
    """Delays each reply so a run can be killed midway."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    def complete(self, messages, params):
        time.sleep(self.delay_s)
        return self.inner.complete(messages, params)

    def close(self):
        pass


class FlakyBackend:
    """Fails the first ``fail_first`` requests and every request mentioning ``poison``."""

    def __init__(self, inner, fail_first: int = 0, poison: str | None = None):
        self.inner, self.fail_first, self.poison = inner, fail_first, poison
        self.calls = 0
        self.lock = threading.Lock()

    def complete(self, messages, params):
        with self.lock:
            self.calls += 1
            call = self.calls
        if call <= self.fail_first:
            raise RuntimeError(f"injected transient failure {call}")
        if self.poison and any(self.poison in m["content"] for m in messages):
            raise RuntimeError("injected permanent failure")
        return self.inner.complete(messages, params)

    def close(self):
        pass


class RecordingBackend:
    """Answers 'reply-<n>' and records every history it was sent."""

    def __init__(self):
        self.histories: list[list[dict]] = []

    def complete(self, messages, params):
        self.histories.append([dict(m) for m in messages])
        return f"reply-{len(self.histories) - 1}"

    def close(self):
        pass


def _run_server(backend_inner, prompts: Path, out: Path, urls_count: int = 1, retries: int = 2):
    servers = [ChatCompletionServer(backend_inner).start() for _ in range(urls_count)]
    try:
        config = ServerBackendConfig(urls=tuple(s.url for s in servers), retries=retries, backoff_s=0.01)
        backend = ServerBackend(config)
        try:
            summary = regenerate_file(RegenerationRun(prompts, out, SAMPLING, concurrency=3, progress=False), backend)
        finally:
            backend.close()
    finally:
        for s in servers:
            s.stop()
    return summary


def test_turns_use_the_targets_own_history():
    from megatron_osprey.data.conversations import Conversation

    backend = RecordingBackend()
    source = Conversation(
        id="x",
        messages=(
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U1"},
            {"role": "assistant", "content": ORIGINAL},
            {"role": "user", "content": "U2a"},
            {"role": "user", "content": "U2b"},
        ),
    )
    result = regenerate_conversation(source, backend, SAMPLING)
    assert [m["content"] for m in result.messages] == ["S", "U1", "reply-0", "U2a", "U2b", "reply-1"]
    assert backend.histories[0] == [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}]
    # Turn 2 sees the target's own first reply, never the original assistant text.
    assert backend.histories[1][2] == {"role": "assistant", "content": "reply-0"}
    assert len(backend.histories[1]) == 5


def test_reference_output_structure(reference):
    rows = [json.loads(line) for line in reference.decode().splitlines()]
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(6)]
    assert ORIGINAL not in reference.decode()
    roles = [[m["role"] for m in r["conversations"]] for r in rows]
    assert roles[1] == ["system", "user", "assistant", "user", "assistant"]
    assert roles[2] == ["user", "assistant"]
    assert roles[4] == ["user", "user", "assistant"]
    assert roles[5] == ["user", "assistant"] * 3
    assert rows[3]["source"] == "kept"


def test_server_pool_matches_hf_backend(tmp_path, prompts, hf_backend, reference):
    out = tmp_path / "out.jsonl"
    summary = _run_server(hf_backend, prompts, out, urls_count=2)
    assert (summary.succeeded, summary.failed) == (6, 0)
    assert out.read_bytes() == reference
    assert not failures_path_for(out).exists()


def test_transient_failures_are_retried(tmp_path, prompts, hf_backend, reference):
    flaky = FlakyBackend(hf_backend, fail_first=3)
    out = tmp_path / "out.jsonl"
    summary = _run_server(flaky, prompts, out, retries=3)
    assert (summary.succeeded, summary.failed) == (6, 0)
    assert out.read_bytes() == reference
    assert flaky.calls == 3 + 10  # 10 assistant turns in the prompts, plus the 3 failed attempts


def test_permanent_failure_recorded_then_fixed_by_rerun(tmp_path, prompts, hf_backend, reference):
    out = tmp_path / "out.jsonl"
    summary = _run_server(FlakyBackend(hf_backend, poison="Question 2?"), prompts, out, retries=1)
    assert (summary.succeeded, summary.failed) == (5, 1)
    failures = [json.loads(line) for line in failures_path_for(out).read_text().splitlines()]
    assert [f["id"] for f in failures] == ["r2"]
    assert "500" in failures[0]["error"] and "injected permanent failure" in failures[0]["error"]
    assert [c.id for c in read_conversations(out)] == ["r0", "r1", "r3", "r4", "r5"]

    summary = _run_server(hf_backend, prompts, out)
    assert (summary.already_done, summary.succeeded, summary.failed) == (5, 1, 0)
    assert out.read_bytes() == reference  # r2 lands in its input position
    assert not failures_path_for(out).exists()


def test_truncated_last_line_is_dropped_on_resume(tmp_path, prompts, hf_backend, reference):
    lines = reference.splitlines(keepends=True)
    out = tmp_path / "out.jsonl"
    out.write_bytes(lines[0] + lines[1] + lines[2][: len(lines[2]) // 2])
    assert recover_output(out, {f"r{i}" for i in range(6)}) == ["r0", "r1"]
    assert out.read_bytes() == lines[0] + lines[1]
    config = RegenerationRun(prompts, out, SAMPLING, concurrency=2, progress=False)
    # What the killed run recorded before its first row.
    write_settings(settings_path_for(out), regenerate_settings(config, hf_backend))
    summary = regenerate_file(config, hf_backend)
    assert (summary.already_done, summary.succeeded) == (2, 4)
    assert out.read_bytes() == reference


def test_corrupt_or_foreign_output_rows_raise(tmp_path, reference):
    lines = reference.splitlines(keepends=True)
    out = tmp_path / "out.jsonl"
    out.write_bytes(lines[0] + b"{not json}\n" + lines[1])
    with pytest.raises(ConversationFormatError, match=r"out\.jsonl:2 is corrupt"):
        recover_output(out, {f"r{i}" for i in range(6)})
    out.write_bytes(lines[0])
    with pytest.raises(ConversationFormatError, match="not in --input"):
        recover_output(out, {"r1"})
    out.write_bytes(lines[0] + lines[0])
    with pytest.raises(ConversationFormatError, match="repeats id 'r0'"):
        recover_output(out, {"r0"})


def _cli(args: list[str]) -> list[str]:
    return [sys.executable, str(REPO / "tools" / "regenerate.py"), *args]


def test_cli_killed_midway_then_rerun_equals_uninterrupted(tmp_path, prompts, hf_backend, reference):
    out = tmp_path / "out.jsonl"
    args = ["--input", str(prompts), "--output", str(out), "--max-tokens", "6", "--temperature", "0",
            "--concurrency", "2", "--retries", "1", "--backoff", "0.01", "--no-progress"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    with ChatCompletionServer(SlowBackend(hf_backend, 0.25)) as server:
        proc = subprocess.Popen(
            _cli(args + ["--server-url", server.url]), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        deadline = time.time() + 60
        while time.time() < deadline and (not out.exists() or out.read_bytes().count(b"\n") < 2):
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    killed_lines = out.read_bytes().count(b"\n")
    assert 2 <= killed_lines < 6, "the kill must land midway"
    with out.open("ab") as handle:  # what an interrupted append leaves behind
        handle.write(b'{"id":"r5","conversations":[{"role":"us')

    with ChatCompletionServer(hf_backend) as server:
        done = subprocess.run(
            _cli(args + ["--server-url", server.url]), env=env, capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{killed_lines} already done" in done.stdout
    assert out.read_bytes() == reference


def test_api_key_sent_but_never_printed(tmp_path, prompts, hf_backend, reference):
    secret = "sk-test-very-secret-4711"
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "MY_REGEN_KEY": secret}
    with ChatCompletionServer(hf_backend, api_key=secret) as server:
        args = ["--input", str(prompts), "--output", str(out), "--server-url", server.url,
                "--api-key-env", "MY_REGEN_KEY", "--max-tokens", "6", "--concurrency", "3"]  # fmt: skip
        done = subprocess.run(_cli(args), env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert out.read_bytes() == reference
        assert secret not in done.stdout + done.stderr

        wrong = tmp_path / "wrong.jsonl"
        # --served-model-name: no /v1/models query up front, so every row meets the 401 and is recorded.
        backend = ServerBackend(
            ServerBackendConfig(
                urls=(server.url,), api_key="sk-wrong-key-0000", retries=3, backoff_s=0.01, model="local"
            )
        )
        assert "sk-wrong" not in repr(backend.config)
        summary = regenerate_file(RegenerationRun(prompts, wrong, SAMPLING, concurrency=2, progress=False), backend)
        backend.close()
    assert summary.failed == 6
    errors = failures_path_for(wrong).read_text()
    assert "401" in errors and "after 1 attempt" in errors  # auth errors are not retried
    assert "sk-wrong" not in errors


def test_a_token_in_the_server_url_reaches_the_server_and_no_log(tmp_path, prompts, hf_backend, reference):
    """The issue's case: `--server-url http://127.0.0.1:PORT/v1?token=SECRET#FRAG` under regenerate's INFO logging."""
    secret, key = "SECRET-q-8231", "sk-test-key-5522"
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "MY_REGEN_KEY": key}
    with ChatCompletionServer(hf_backend, api_key=key) as server:
        url = f"{server.url}/v1?token={secret}#FRAG-9913"
        args = ["--input", str(prompts), "--output", str(out), "--server-url", url, "--api-key-env", "MY_REGEN_KEY",
                "--max-tokens", "6", "--concurrency", "3", "--no-progress"]  # fmt: skip
        done = subprocess.run(_cli(args), env=env, capture_output=True, text=True, timeout=120)
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed  # /v1/models and /v1/chat/completions reached with the query kept
    assert out.read_bytes() == reference
    assert secret not in printed and "FRAG-9913" not in printed and key not in printed
    assert endpoint_url(normalize_server_url(url), "/v1/models") == f"{server.url}/v1/models?token={secret}"


def test_endpoints_go_before_the_query_and_the_fragment_is_never_sent():
    root = normalize_server_url("https://gw.example:8443/llm/v1/?sig=a&token=b#frag")
    assert root == "https://gw.example:8443/llm?sig=a&token=b"
    assert endpoint_url(root, "/v1/chat/completions") == "https://gw.example:8443/llm/v1/chat/completions?sig=a&token=b"
    assert endpoint_url(normalize_server_url("http://h:1"), "/v1/models") == "http://h:1/v1/models"


def test_cli_rejects_bad_flags(tmp_path, prompts):
    missing = subprocess.run(
        _cli(["--input", str(prompts), "--output", str(tmp_path / "o.jsonl")]), capture_output=True, text=True
    )
    assert missing.returncode == 2 and "--server-url" in missing.stderr
    no_model = subprocess.run(
        _cli(
            [
                "--input",
                str(prompts),
                "--output",
                str(tmp_path / "o.jsonl"),
                "--backend",
                "hf",
                "--model",
                str(tmp_path),
            ]
        ),
        capture_output=True,
        text=True,
    )
    assert no_model.returncode == 2 and "--model" in no_model.stderr and "config.json" in no_model.stderr


def test_seeded_sampling_is_reproducible(hf_backend):
    messages = [{"role": "user", "content": "Question 0?"}]
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=123)
    first = hf_backend.complete(messages, params)
    assert hf_backend.complete(messages, params) == first
    others = {hf_backend.complete(messages, SamplingParams(temperature=1.0, max_tokens=12, seed=s)) for s in range(5)}
    assert len(others) > 1


def test_merge_reasoning_and_url_normalization():
    assert merge_reasoning("Four.", "add 2 and 2\n") == "<think>\nadd 2 and 2\n</think>\n\nFour."
    assert merge_reasoning("Four.", None) == "Four."
    assert merge_reasoning(None, "") == ""
    assert normalize_server_url("http://h:1/v1/") == "http://h:1"
    with pytest.raises(ValueError, match="--server-url"):
        normalize_server_url("h:1")


def test_serve_local_tool_serves_a_model_dir(target_dir, hf_backend):
    import httpx

    cmd = [sys.executable, str(REPO / "tools" / "serve_local.py"), "--model", str(target_dir), "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = proc.stdout.readline()
        assert "on http://127.0.0.1:" in banner, banner + proc.stderr.read()
        url = banner.rsplit(" ", 1)[-1].strip()
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "local"
        messages = [{"role": "user", "content": "Question 0?"}]
        body = {"model": "local", "messages": messages, "temperature": 0, "max_tokens": 6}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        assert reply["choices"][0]["message"]["content"] == hf_backend.complete(messages, SAMPLING)
        assert httpx.post(f"{url}/v1/chat/completions", json={"messages": []}).status_code == 400
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_rerun_with_other_input_model_or_sampling_is_refused_or_starts_fresh(
    tmp_path, prompts, hf_backend, reference
):
    out = tmp_path / "out.jsonl"
    regenerate_file(RegenerationRun(prompts, out, SAMPLING, concurrency=1, progress=False), hf_backend)
    assert out.read_bytes() == reference
    hotter = SamplingParams(temperature=0.7, max_tokens=6, seed=1)
    with pytest.raises(
        ValueError,
        match=r"--output .*out.jsonl holds rows regenerated from other inputs or settings "
        r"\(sampling: .*\"temperature\": 0.0.* -> .*\"temperature\": 0.7.*Pass --overwrite",
    ):
        regenerate_file(RegenerationRun(prompts, out, hotter, concurrency=1, progress=False), hf_backend)
    with ChatCompletionServer(hf_backend, model_name="another-model") as server:
        backend = ServerBackend(ServerBackendConfig(urls=(server.url,), retries=0))
        with pytest.raises(ValueError, match=r"model: .*-> .*another-model"):
            regenerate_file(RegenerationRun(prompts, out, SAMPLING, concurrency=1, progress=False), backend)
        backend.close()
    edited = tmp_path / "edited.jsonl"
    edited.write_text(prompts.read_text().replace("Question 0?", "Question zero?"))
    with pytest.raises(ValueError, match=r"input_sha256"):
        regenerate_file(RegenerationRun(edited, out, SAMPLING, concurrency=1, progress=False), hf_backend)
    assert out.read_bytes() == reference  # the refusals left it alone
    summary = regenerate_file(
        RegenerationRun(edited, out, SAMPLING, concurrency=1, progress=False, overwrite=True), hf_backend
    )
    assert (summary.already_done, summary.succeeded) == (0, 6)
    first = json.loads(out.read_text().splitlines()[0])
    assert first["conversations"][0]["content"] == "Question zero?"


def test_credentials_in_server_urls_never_reach_logs_or_the_failures_file(tmp_path, prompts, hf_backend):
    from megatron_osprey.data.regenerate.backends import redact_credentials, split_credentials

    assert split_credentials("http://al:p@ss@h:30000/v1") == ("http://h:30000/v1", ("al", "p@ss"))
    assert redact_credentials("POST http://al:p@ss@h:1/v1 failed") == "POST http://***@h:1/v1 failed"
    out = tmp_path / "out.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    # Nothing listens on port 1: every request fails with a connection error naming the server.
    args = [
        "--input",
        str(prompts),
        "--output",
        str(out),
        "--server-url",
        "http://alice:s3cret-pw@127.0.0.1:1",
        "--served-model-name",
        "local",
        "--retries",
        "0",
        "--max-tokens",
        "6",
        "--no-progress",
    ]
    done = subprocess.run(_cli(args), env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    failures = failures_path_for(out).read_text()
    assert "127.0.0.1:1" in failures and "ConnectError" in failures
    assert "s3cret" not in failures and "s3cret" not in done.stdout + done.stderr
    # The credentials still authenticate: they travel as basic auth, not in the URL.
    seen = []
    with ChatCompletionServer(hf_backend) as server:
        url = server.url.replace("http://", "http://alice:s3cret-pw@")
        backend = ServerBackend(ServerBackendConfig(urls=(url,), retries=0))
        import httpx

        transport = backend._client._transport
        original = transport.handle_request

        def spy(request):  # the request as it goes on the wire, after httpx applied the auth
            seen.append((str(request.url), request.headers.get("authorization")))
            return original(request)

        transport.handle_request = spy
        assert backend.complete([{"role": "user", "content": "Question 0?"}], SAMPLING)
        backend.close()
    expected = httpx.BasicAuth("alice", "s3cret-pw")._auth_header
    assert seen and all("s3cret" not in u and auth == expected for u, auth in seen)


def test_a_non_utf8_input_names_the_file_and_line(tmp_path):
    bad = tmp_path / "latin1.jsonl"
    good = json.dumps({"id": "a", "conversations": [{"role": "user", "content": "hi"}]}) + "\n"
    latin = json.dumps({"id": "b", "conversations": [{"role": "user", "content": "café"}]}, ensure_ascii=False) + "\n"
    bad.write_bytes(good.encode() + latin.encode("latin-1"))
    with pytest.raises(ConversationFormatError, match=r"latin1\.jsonl:2 is not UTF-8 text \(byte 0xe9 at column \d+\)"):
        list(read_conversations(bad))
    done = subprocess.run(
        _cli(
            [
                "--input",
                str(bad),
                "--output",
                str(tmp_path / "o.jsonl"),
                "--backend",
                "server",
                "--server-url",
                "http://127.0.0.1:1",
                "--served-model-name",
                "m",
            ]
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "latin1.jsonl:2 is not UTF-8" in done.stderr and "Traceback" not in done.stderr


def test_the_server_request_and_the_recipes_sample_as_the_release_regenerates():
    """The release's regenerate_train_data.py (run by regenerate_data.sh) sends temperature 1.0 and max_tokens
    4,096 and no top_p / top_k / presence_penalty (its defaults, None, are left out of the request); it keeps
    the system prompt; its servers run a reasoning parser (qwen3; minimax-append-think for MiniMax-M2.5) with a
    context of 2 x max tokens + 2,048, and the reasoning comes back beside the content."""
    import httpx

    from megatron_osprey.data.conversations import Conversation
    from megatron_osprey.data.regenerate.backends import ServerBackend, ServerBackendConfig
    from megatron_osprey.recipes import get_recipe

    bodies = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"data": [{"id": "served"}]})
        bodies.append(json.loads(request.content))
        message = {"role": "assistant", "content": "\n\nAnswer.", "reasoning_content": "Think."}
        return httpx.Response(200, json={"choices": [{"message": message}]})

    backend = ServerBackend(ServerBackendConfig(urls=("http://pool:30000",), retries=0))
    backend._client = httpx.Client(transport=httpx.MockTransport(answer))
    for name, parser in (
        ("qwen3_8b_osprey_distill_2gpu_h100_bf16:chat", "qwen3"),
        ("minimax_m25_osprey_distill_8gpu_h100_bf16", "minimax-append-think"),
    ):
        recipe = get_recipe(name)
        sampling = recipe.regenerate.sampling
        assert (sampling.temperature, sampling.max_tokens) == (1.0, 4096)
        assert recipe.servers.reasoning_parser == parser and recipe.servers.context_length == 2 * 4096 + 2048
    system = {"role": "system", "content": "Be brief."}
    source = Conversation(id="x", messages=(system, {"role": "user", "content": "Q?"}))
    result = regenerate_conversation(source, backend, sampling)
    assert bodies == [
        {
            "model": "served",
            "messages": [system, {"role": "user", "content": "Q?"}],
            "temperature": 1.0,
            "max_tokens": 4096,
            "stream": False,
        }
    ]
    assert result.messages[-1]["content"] == merge_reasoning("\n\nAnswer.", "Think.")


# --- --serve vllm: the stage's own vLLM server (the real engine's run is tests/unit/test_regenerate_vllm.py) ---


def test_the_serve_flags_fill_the_serve_config(prompts, target_dir, tmp_path):
    from megatron_osprey.stages import regenerate
    from megatron_osprey.stages.cli import parse_config

    argv = ["--input", str(prompts), "--output", str(tmp_path / "o.jsonl"), "--model", str(target_dir)]
    argv += ["--serve", "vllm", "--vllm-python", "/opt/v/bin/python", "--reasoning-parser", "qwen3"]
    argv += ["--tensor-parallel-size", "2", "--max-model-len", "4096", "--kv-cache-memory-bytes", "2048"]
    argv += ["--enforce-eager", "--server-timeout", "60"]
    config, _ = parse_config(argv, "regenerate", regenerate.RegenerateConfig, regenerate.FLAGS, "")
    assert config.serve == regenerate.ServeConfig(
        engine="vllm",
        python="/opt/v/bin/python",
        reasoning_parser="qwen3",
        tensor_parallel_size=2,
        max_model_len=4096,
        kv_cache_memory_bytes=2048,
        enforce_eager=True,
        startup_timeout=60.0,
    )
    config.validate()
    assert regenerate.server_log_path(config.output) == tmp_path / "o.server.log"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--server-url", "http://127.0.0.1:1"], "--serve starts its own server; drop --server-url"),
        (["--backend", "hf"], "--serve starts a server for the server backend; drop --backend hf."),
        (["--api-key-env", "HOME"], "--serve makes the job's own API key; drop --api-key-env."),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1."),
        (["--no-model"], "--serve vllm needs --model DIR"),
    ],
)
def test_serve_refuses_what_it_cannot_honour_in_one_sentence(extra, message, prompts, target_dir, tmp_path, capsys):
    from megatron_osprey.stages import regenerate

    argv = ["--input", str(prompts), "--output", str(tmp_path / "o.jsonl"), "--serve", "vllm"]
    argv += [] if extra == ["--no-model"] else ["--model", str(target_dir), *extra]
    assert regenerate.main(argv) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {message}")


def test_serve_finds_the_engine_through_the_flag_then_vllm_python(prompts, target_dir, tmp_path, capsys, monkeypatch):
    from megatron_osprey.stages import regenerate

    argv = [
        "--input",
        str(prompts),
        "--output",
        str(tmp_path / "o.jsonl"),
        "--serve",
        "vllm",
        "--model",
        str(target_dir),
    ]
    monkeypatch.setenv("VLLM_PYTHON", "/nowhere/from-env/python")
    assert regenerate.main(argv) == 2
    err = capsys.readouterr().err
    assert "VLLM_PYTHON=/nowhere/from-env/python does not exist; install it with `make engine-vllm`" in err
    assert regenerate.main(argv + ["--vllm-python", "/nowhere/flag/python"]) == 2
    assert "/nowhere/flag/python does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


class _EchoBackend:
    def complete(self, messages, params):
        return "ok"

    def close(self):
        pass


def _raw_post(url: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    """Send a POST's head (and `body`, possibly much shorter than it declares); the first answer the server gives."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + body)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(4096)  # a server still reading the declared body answers nothing: socket.timeout
            if not chunk:
                break
            answer += chunk
        return answer


def test_the_local_server_checks_the_key_and_the_size_before_reading_a_body():
    # The case: a 1 GB Content-Length without a key made the server read (and wait for) the whole body first.
    with ChatCompletionServer(_EchoBackend(), api_key="sk-right") as server:
        answer = _raw_post(server.url, {"Content-Length": str(1 << 30), "Authorization": "Bearer sk-wrong"})
        assert answer.startswith(b"HTTP/1.1 401") and b"Connection: close" in answer
        answer = _raw_post(server.url, {"Content-Length": str(1 << 30)})
        assert answer.startswith(b"HTTP/1.1 401")
        from megatron_osprey.data.regenerate.local_server import MAX_BODY_BYTES

        big = {"Content-Length": str(MAX_BODY_BYTES + 1), "Authorization": "Bearer sk-right"}
        assert _raw_post(server.url, big, b"{").startswith(b"HTTP/1.1 413")
        assert _raw_post(server.url, {**big, "Content-Length": "-5"}).startswith(b"HTTP/1.1 400")
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
        ok = _raw_post(server.url, {"Content-Length": str(len(body)), "Authorization": "Bearer sk-right"}, body)
        assert ok.startswith(b"HTTP/1.1 200")
        deep = b"[" * 100_000 + b"]" * 100_000
        bad = _raw_post(server.url, {"Content-Length": str(len(deep)), "Authorization": "Bearer sk-right"}, deep)
        assert bad.startswith(b"HTTP/1.1 400")
