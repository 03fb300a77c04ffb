"""Regeneration through the real vLLM engine (one server for the module): the stage's own server on the target,
the release's sampling (temperature 1.0, per-turn seeds), a per-job key it requires and never prints.

Skipped where no vLLM environment is found (VLLM_PYTHON, or the checkout's .venv-vllm: `make engine-vllm`).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
from pathlib import Path

import httpx
import pytest

from megatron_osprey.base.engines import EngineUnavailable, engine_python, engine_version
from megatron_osprey.data.conversations import read_conversations
from megatron_osprey.data.regenerate import HFBackend, HFBackendConfig, SamplingParams, regenerate_conversation
from megatron_osprey.stages import regenerate

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [
    {"id": "a", "conversations": [{"role": "user", "content": "Name three colours."}]},
    {
        "id": "b",
        "conversations": [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "ORIGINAL"},
            {"role": "user", "content": "And of Italy?"},
        ],
    },
    {"id": "c", "conversations": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]},
]
# The release regenerates at temperature 1.0 with per-turn seeds; 12 tokens keep the CPU server quick.
RELEASE = SamplingParams(temperature=1.0, max_tokens=12, seed=0)


@pytest.fixture(scope="module")
def vllm_python() -> str:
    try:
        python = engine_python("vllm", None, os.environ, repo=REPO)
        engine_version("vllm", python)
    except EngineUnavailable as error:
        pytest.skip(str(error))
    return python


@pytest.fixture(scope="module")
def target() -> Path:
    from megatron_osprey.assets.models import get_model_dir

    return get_model_dir("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("regen_vllm")
    (path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    return path


def _config(workdir: Path, target: Path, python: str, output: str, sampling=RELEASE) -> regenerate.RegenerateConfig:
    return regenerate.RegenerateConfig(
        input=str(workdir / "prompts.jsonl"),
        output=str(workdir / output),
        model=str(target),
        sampling=sampling,
        concurrency=3,
        progress=False,
        serve=regenerate.ServeConfig(engine="vllm", python=python, max_model_len=1024, startup_timeout=600),
    )


@pytest.fixture(scope="module")
def served(workdir, target, vllm_python):
    """One vLLM server for the module, as `regenerate --serve vllm` starts it; the stage's log records captured."""
    records = io.StringIO()
    handler = logging.StreamHandler(records)
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    try:
        with regenerate.serve_target(_config(workdir, target, vllm_python, "first.jsonl")) as pool:
            yield pool, records
    finally:
        logging.getLogger().removeHandler(handler)


def test_the_server_is_loopback_and_refuses_requests_without_the_job_key(served):
    pool, _ = served
    (url,) = pool.urls
    assert url.startswith("http://127.0.0.1:")
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 401
    wrong = {"Authorization": "Bearer " + "0" * len(pool.api_key)}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, headers=wrong, timeout=60).status_code == 401
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {pool.api_key}"}, timeout=60)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "smollm2-135m-instruct-v1"
    assert pool.identity["backend"] == "vllm" and pool.identity["engine"] == "0.32.0"


def test_seeded_regeneration_is_reproducible_and_the_key_is_never_written(served, workdir, target, vllm_python):
    pool, records = served
    config = _config(workdir, target, vllm_python, "first.jsonl")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stdout):
        first = regenerate.run(config, served=pool)
        again = regenerate.run(_config(workdir, target, vllm_python, "again.jsonl"), served=pool)
    assert (first.total, first.succeeded, first.failed) == (3, 3, 0)
    rows = {row.id: row for row in read_conversations(workdir / "first.jsonl")}
    # Every user turn got the target's own reply; the original assistant text is gone.
    assert [m["role"] for m in rows["b"].messages] == ["user", "assistant", "user", "assistant"]
    replies = [m["content"] for row in rows.values() for m in row.messages if m["role"] == "assistant"]
    assert len(replies) == 4 and "ORIGINAL" not in replies and all(replies)
    # Per-turn seeds: a second run (other scheduling) writes the same file.
    assert (workdir / "again.jsonl").read_bytes() == (workdir / "first.jsonl").read_bytes()
    assert again.succeeded == 3
    settings = json.loads((workdir / "first.settings.json").read_text())
    assert settings["model"]["backend"] == "vllm" and settings["sampling"]["temperature"] == 1.0
    written = [stdout.getvalue(), records.getvalue(), pool.log_path.read_text(errors="replace")]
    written += [p.read_text(errors="replace") for p in workdir.iterdir() if p.is_file()]
    assert "POST /v1/chat/completions" in written[2]  # the server log is the real one
    assert all(pool.api_key not in text for text in written)


def test_greedy_replies_match_the_reference_backend(served, workdir, target, vllm_python, tmp_path):
    """vLLM's chat template and decoding agree with the project's HF backend on the target (float32, greedy)."""
    pool, _ = served
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    config = _config(workdir, target, vllm_python, "greedy.jsonl", sampling=greedy)
    assert regenerate.run(config, served=pool).succeeded == 3
    served_rows = list(read_conversations(workdir / "greedy.jsonl"))
    hf = HFBackend(HFBackendConfig(model_dir=target))
    try:
        reference = [regenerate_conversation(row, hf, greedy) for row in read_conversations(workdir / "prompts.jsonl")]
    finally:
        hf.close()
    assert [r.messages for r in served_rows] == [r.messages for r in reference]
