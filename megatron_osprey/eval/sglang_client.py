"""Measure AL and throughput of a running SGLang server from its per-request meta info.

Requests go to SGLang's native ``/generate`` with the prompt's token ids, so the prompt is exactly the
one ``python -m megatron_osprey evaluate`` decodes: one at a time (batch 1, the paper's setting) or
``batch_size`` in flight at once (the server batches them). A multi-turn row (MT-Bench) is sent as the release's
benchmarker sends it: its first turn, then the next user turn after the server's answer (``output_ids``, rendered
into the chat so far as the reference evaluator renders its own answer), conversations side by side and each one's
turns in sequence; every turn is a request (``ID``, ``ID#turn2``). AL per request =
``completion_tokens / spec_verify_ct`` from ``meta_info``; throughput = completion tokens / wall time.
"""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from megatron_osprey.eval.prompts import EvalPrompt, by_turn, converse


@dataclass(frozen=True)
class ServerConfig:
    """Where the server is and how to sample."""

    url: str = "http://127.0.0.1:30000"
    max_new_tokens: int = 256
    temperature: float = 0.0
    timeout_s: float = 600.0


def request_record(prompt_id: str, prompt_tokens: int, meta: dict, seconds: float, speculative: bool = True) -> dict:
    """One request's figures from SGLang's meta_info (raises when speculative decoding was off but expected).

    A target-only server (`speculative=False`) reports no spec_verify_ct: one forward per token, AL 1.
    """
    completion = int(meta["completion_tokens"])
    if not speculative:
        verifies = completion
    elif "spec_verify_ct" not in meta:
        raise ValueError("the server's meta_info has no spec_verify_ct: was it started with --speculative-algorithm?")
    else:
        verifies = int(meta["spec_verify_ct"])
    return {
        "id": prompt_id,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "verify_count": verifies,
        "seconds": seconds,
        "acceptance_length": completion / max(verifies, 1),
        "tokens_per_s": completion / seconds if seconds > 0 else None,
        "finish_reason": meta.get("finish_reason"),
    }


def generate(config: ServerConfig, input_ids: list[int]) -> tuple[dict, float]:
    """POST one request to /generate; returns (the server's reply: text, output_ids, meta_info; wall seconds)."""
    body = json.dumps(
        {
            "input_ids": input_ids,
            "sampling_params": {"temperature": config.temperature, "max_new_tokens": config.max_new_tokens},
        }
    ).encode()
    request = urllib.request.Request(
        config.url.rstrip("/") + "/generate", data=body, headers={"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=config.timeout_s) as response:
        payload = json.loads(response.read())
    return payload, time.perf_counter() - start


def bench_prompts(
    config: ServerConfig,
    prompts: list[EvalPrompt],
    progress=None,
    send=generate,
    batch_size: int = 1,
    speculative: bool = True,
    next_turn=None,
) -> list[dict]:
    """Send every conversation, `batch_size` in flight at once, each one's turns in sequence (`next_turn(prompt,
    output ids)` renders a multi-turn row's next turn); one record per request, every first turn, then every second.
    """
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}.")

    def ask(prompt: EvalPrompt) -> tuple[dict, list[int]]:
        reply, seconds = send(config, prompt.input_ids.tolist())
        record = request_record(prompt.id, int(prompt.input_ids.numel()), reply["meta_info"], seconds, speculative)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(al=f"{record['acceptance_length']:.2f}")
        if prompt.next_turns and "output_ids" not in reply:
            raise ValueError(f"--url {config.url}: the reply has no output_ids to send {prompt.id}'s next turn after.")
        return record, reply.get("output_ids", [])

    def one(prompt: EvalPrompt) -> list[dict]:
        return converse(prompt, ask, next_turn)

    if batch_size == 1:
        return by_turn([one(prompt) for prompt in prompts])
    with ThreadPoolExecutor(max_workers=batch_size) as pool:
        return by_turn(list(pool.map(one, prompts)))


def throughput(records: list[dict], wall_seconds: float) -> float | None:
    """Completion tokens per second of wall time over a whole (possibly batched) run."""
    return sum(r["completion_tokens"] for r in records) / wall_seconds if wall_seconds > 0 else None


def wait_for_server(url: str, timeout_s: float) -> None:
    """Poll /health until the server answers (a clear error after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=10):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"--url {url}: the SGLang server did not answer /health within {timeout_s:.0f}s."
                ) from None
            time.sleep(5)
