"""Generation backends for regeneration: OpenAI-compatible servers and in-process HF models."""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from megatron_osprey.base.redact import redact_urls

# Where reasoning servers (SGLang/vLLM reasoning parsers) return thinking separately, it is
# put back inline in the target's own format so training data holds what the target wrote.
THINK_OPEN, THINK_CLOSE = "<think>\n", "\n</think>\n\n"

# Status codes worth another attempt: overload, rate limit and server-side faults.
RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; temperature 0 means greedy."""

    temperature: float = 0.0
    max_tokens: int = 2048
    seed: int | None = None
    enable_thinking: bool | None = None


class ChatBackend(Protocol):
    """Anything that answers one chat turn with the assistant's text."""

    def complete(self, messages: Sequence[dict[str, str]], params: SamplingParams) -> str:
        """Return the assistant reply to ``messages``."""
        ...

    def close(self) -> None:
        """Release connections or memory."""
        ...


class BackendRequestError(RuntimeError):
    """A generation request failed (after retries where they apply)."""


def merge_reasoning(content: str | None, reasoning: str | None) -> str:
    """Join separately returned reasoning and content back into ``<think>`` form."""
    content = content or ""
    if not reasoning:
        return content
    return THINK_OPEN + reasoning.strip("\n") + THINK_CLOSE + content.lstrip("\n")


def redact_credentials(text: str) -> str:
    """Every URL of `text` without its credentials, query values and fragment (for logs and failure records)."""
    return redact_urls(text)


# The per-job key a regenerate job generates, gives its SGLang servers (--api-key) and its client.
JOB_API_KEY_ENV = "OSPREY_SERVER_API_KEY"


def server_api_key(api_key_env: str | None, environ: Mapping[str, str]) -> str | None:
    """The key sent as `Authorization: Bearer KEY`: --api-key-env's variable, else the job's own key, else
    OPENAI_API_KEY (None: no key). The key is never printed; callers pass it only to ServerBackendConfig."""
    for name in [api_key_env] if api_key_env else [JOB_API_KEY_ENV, "OPENAI_API_KEY"]:
        if environ.get(name):
            return environ[name]
    return None


def split_credentials(url: str) -> tuple[str, tuple[str, str] | None]:
    """(url without `user:password@`, (user, password) or None): requests carry them as basic auth instead.

    A URL that holds no credentials cannot print them, whichever library logs it.
    """
    from urllib.parse import unquote, urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port is not None else "")
    clean = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return clean, (unquote(parts.username or ""), unquote(parts.password or ""))


def normalize_server_url(url: str) -> str:
    """Return the server root for ``url``: a trailing ``/v1`` of its path dropped, its query kept (a gateway's
    token), its fragment dropped (never sent)."""
    from urllib.parse import urlsplit, urlunsplit

    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--server-url {redact_urls(url)!r} must start with http:// or https://.")
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def endpoint_url(root: str, route: str) -> str:
    """``route`` (e.g. ``/v1/models``) under the server root's path, before its query: not after it."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(root)
    return urlunsplit((parts.scheme, parts.netloc, parts.path + route, parts.query, ""))


@dataclass(frozen=True)
class ServerBackendConfig:
    """A pool of OpenAI-compatible servers; the API key is kept out of repr and logs."""

    urls: tuple[str, ...]
    api_key: str | None = field(default=None, repr=False)
    model: str | None = None
    timeout_s: float = 600.0
    retries: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    max_connections: int = 64
    identity: dict | None = None  # what the pool serves, when the job started it; None: ask /v1/models


class ServerBackend:
    """Sends /v1/chat/completions requests round-robin over a server pool, with retries."""

    def __init__(self, config: ServerBackendConfig):
        import httpx

        if not config.urls:
            raise ValueError("--server-url is required for the server backend.")
        if config.retries < 0:
            raise ValueError(f"--retries must be >= 0, got {config.retries}.")
        self.config = config
        self._urls, self._auth = (), {}
        for url in config.urls:
            clean, credentials = split_credentials(normalize_server_url(url))
            self._urls += (clean,)
            self._auth[clean] = httpx.BasicAuth(*credentials) if credentials else None
        self._next = itertools.count()
        self._lock = threading.Lock()
        self._model_names: dict[str, str] = {}
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        limits = httpx.Limits(max_connections=config.max_connections, max_keepalive_connections=config.max_connections)
        self._client = httpx.Client(headers=headers, timeout=config.timeout_s, limits=limits)

    def close(self) -> None:
        """Close pooled connections."""
        self._client.close()

    def _model_name(self, base: str) -> str:
        if self.config.model:
            return self.config.model
        with self._lock:
            if base in self._model_names:
                return self._model_names[base]
        url = endpoint_url(base, "/v1/models")
        response = self._client.get(url, auth=self._auth[base])
        if response.status_code != 200:
            raise _HTTPFailure(response.status_code, redact_urls(f"GET {url} answered {response.status_code}"))
        data = response.json().get("data") or []
        if not data or "id" not in data[0]:
            raise BackendRequestError(redact_urls(f"{url} lists no model; pass --served-model-name."))
        with self._lock:
            self._model_names[base] = data[0]["id"]
        return data[0]["id"]

    def _request_once(self, base: str, messages: Sequence[dict[str, str]], params: SamplingParams) -> str:
        body: dict[str, Any] = {
            "model": self._model_name(base),
            "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
            "temperature": params.temperature,
            "max_tokens": params.max_tokens,
            "stream": False,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        if params.enable_thinking is not None:
            # SGLang and vLLM forward this to the chat template (Qwen3's thinking switch).
            body["chat_template_kwargs"] = {"enable_thinking": params.enable_thinking}
        url = endpoint_url(base, "/v1/chat/completions")
        response = self._client.post(url, json=body, auth=self._auth[base])
        if response.status_code != 200:
            raise _HTTPFailure(
                response.status_code,
                redact_urls(f"POST {url} answered {response.status_code}: {response.text[:300]}"),
            )
        try:
            message = response.json()["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise _HTTPFailure(
                502, redact_urls(f"{url} returned a malformed chat completion: {response.text[:300]}")
            ) from None
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        return merge_reasoning(message.get("content"), reasoning)

    def complete(self, messages: Sequence[dict[str, str]], params: SamplingParams) -> str:
        """Return the reply, trying the next server with exponential backoff on transient errors."""
        import httpx

        first = next(self._next)
        errors: list[str] = []
        for attempt in range(self.config.retries + 1):
            base = self._urls[(first + attempt) % len(self._urls)]
            try:
                return self._request_once(base, messages, params)
            except _HTTPFailure as exc:
                errors.append(str(exc))
                if exc.status not in RETRYABLE_STATUS:
                    break
            except (httpx.TransportError, json.JSONDecodeError) as exc:
                errors.append(redact_credentials(f"{base}: {type(exc).__name__}: {exc}"))
            if attempt < self.config.retries:
                time.sleep(min(self.config.max_backoff_s, self.config.backoff_s * 2**attempt))
        raise BackendRequestError(f"request failed after {len(errors)} attempt(s); last error: {errors[-1]}")

    def identity(self) -> dict:
        """What a regenerated row depends on here: the served model's name (asked of the first server that answers)."""
        if self.config.identity is not None:
            return dict(self.config.identity)
        if self.config.model:
            return {"backend": "server", "model": self.config.model}
        import httpx

        errors = []
        for base in self._urls:
            try:
                return {"backend": "server", "model": self._model_name(base)}
            except (_HTTPFailure, BackendRequestError, httpx.TransportError, ValueError) as exc:
                errors.append(redact_credentials(f"{base}: {exc}"))
        raise BackendRequestError(
            f"no --server-url answered GET /v1/models to name its model ({'; '.join(errors)}); "
            f"start the servers or pass --served-model-name."
        )


class _HTTPFailure(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class HFBackendConfig:
    """A local HF model directory served in-process."""

    model_dir: Path
    device: str = "cpu"
    dtype: str = "float32"
    trust_remote_code: bool = False
    # Greedy requests from concurrent conversations are generated together, up to this many at once
    # (left-padded); 1 generates each alone. Sampled requests are always generated alone.
    batch_size: int = 1
    batch_wait_s: float = 0.05


@dataclass
class _PendingRequest:
    input_ids: list[int]
    max_tokens: int
    done: threading.Event = field(default_factory=threading.Event)
    text: str | None = None
    error: BaseException | None = None


class HFBackend:
    """Generates with transformers' generate() on a local model; greedy at temperature 0."""

    def __init__(self, config: HFBackendConfig):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model_dir = Path(config.model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"--model {model_dir} is not a Hugging Face model directory (no config.json).")
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if config.dtype not in dtypes:
            raise ValueError(f"--dtype must be one of {sorted(dtypes)}, got {config.dtype!r}.")
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=config.trust_remote_code)
        self.model = (
            AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=dtypes[config.dtype], trust_remote_code=config.trust_remote_code
            )
            .to(config.device)
            .eval()
        )
        eos = self.model.generation_config.eos_token_id
        stop = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            stop.add(self.tokenizer.eos_token_id)
        self._stop_ids = sorted(stop)
        pad = self.tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else self._stop_ids[0]
        # generate() is not safe to share across threads, and seeding uses the global RNG.
        self._lock = threading.Lock()
        if config.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {config.batch_size}.")
        self._queue: list[_PendingRequest] = []
        self._queue_cv = threading.Condition()
        self._closed = False
        self._batcher: threading.Thread | None = None

    def close(self) -> None:
        """Stop the batching thread (if one runs); memory is freed by garbage collection."""
        with self._queue_cv:
            self._closed = True
            self._queue_cv.notify_all()
        if self._batcher is not None:
            self._batcher.join()

    def _generation_kwargs(self, max_tokens: int) -> dict[str, Any]:
        return dict(max_new_tokens=max_tokens, do_sample=False, eos_token_id=self._stop_ids, pad_token_id=self._pad_id)

    def _complete_batched(self, input_ids: list[int], max_tokens: int) -> str:
        request = _PendingRequest(input_ids, max_tokens)
        with self._queue_cv:
            if self._batcher is None:
                self._batcher = threading.Thread(target=self._batch_loop, name="hf-batcher", daemon=True)
                self._batcher.start()
            self._queue.append(request)
            self._queue_cv.notify_all()
        request.done.wait()
        if request.error is not None:
            raise request.error
        return request.text

    def _take_batch(self) -> list[_PendingRequest] | None:
        """Wait for requests; gather up to batch_size with the first one's max_tokens (None once closed)."""
        with self._queue_cv:
            while not self._queue and not self._closed:
                self._queue_cv.wait()
            if not self._queue:
                return None
            # A short wait lets the other conversations' next turns join this batch.
            deadline = time.monotonic() + self.config.batch_wait_s
            while len(self._queue) < self.config.batch_size and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._queue_cv.wait(left)
            first = self._queue[0].max_tokens
            batch = [r for r in self._queue if r.max_tokens == first][: self.config.batch_size]
            for r in batch:
                self._queue.remove(r)
            return batch

    def _batch_loop(self) -> None:
        import torch

        while (batch := self._take_batch()) is not None:
            try:
                width = max(len(r.input_ids) for r in batch)
                ids = torch.full((len(batch), width), self._pad_id, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for row, r in enumerate(batch):  # left padding: every row's next token is at the end
                    ids[row, width - len(r.input_ids) :] = torch.tensor(r.input_ids)
                    mask[row, width - len(r.input_ids) :] = 1
                with self._lock, torch.no_grad():
                    output = self.model.generate(
                        ids.to(self.config.device),
                        attention_mask=mask.to(self.config.device),
                        **self._generation_kwargs(batch[0].max_tokens),
                    )
                for row, r in enumerate(batch):
                    new = output[row, width:].tolist()
                    # Rows that stopped early are padded after their stop token; cut at the first stop.
                    cut = next((i for i, t in enumerate(new) if t in self._stop_ids), len(new))
                    r.text = self.tokenizer.decode(new[:cut], skip_special_tokens=True)
            except BaseException as error:  # noqa: BLE001 - handed to every waiting caller, which re-raises it
                for r in batch:
                    r.error = error
            finally:
                for r in batch:
                    r.done.set()

    def identity(self) -> dict:
        """What a regenerated row depends on here: the model directory's files."""
        from megatron_osprey.data.fingerprint import model_fingerprint

        return {"backend": "hf", "model": model_fingerprint(self.config.model_dir), "dtype": self.config.dtype}

    def complete(self, messages: Sequence[dict[str, str]], params: SamplingParams) -> str:
        """Return the model's reply to ``messages`` rendered with its chat template."""
        import torch

        from megatron_osprey.data.chat_template import render_generation_prompt

        prompt = render_generation_prompt(self.tokenizer, messages, params.enable_thinking)
        input_ids = self.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(
            self.config.device
        )
        sample = params.temperature > 0
        if not sample and self.config.batch_size > 1:
            return self._complete_batched(input_ids[0].tolist(), params.max_tokens)
        kwargs = self._generation_kwargs(params.max_tokens)
        if sample:
            # Plain temperature sampling, as the servers' defaults: no top-k / top-p cut.
            kwargs.update(do_sample=True, temperature=params.temperature, top_k=0, top_p=1.0)
        with self._lock, torch.no_grad():
            if params.seed is not None:
                torch.manual_seed(params.seed)
            output = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        return self.tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
