"""A small OpenAI-compatible chat server on loopback, backed by any ChatBackend.

Serves ``GET /health`` (no key, like SGLang's), ``GET /v1/models`` and ``POST /v1/chat/completions``
(non-streaming). Meant for tests and the CPU demo; production regeneration talks to SGLang or vLLM instead.
A request body is read only after its key is checked and its declared length is within MAX_BODY_BYTES: an
unauthenticated or oversized request is answered 401 or 413 (and its connection closed) without being read.

To serve a local HF model directory: ``python tools/serve_local.py --model DIR --port 8000``.
"""

from __future__ import annotations

import hmac
import json
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from megatron_osprey.data.regenerate.backends import ChatBackend, SamplingParams

LOOPBACK = "127.0.0.1"
# A chat request of a few hundred thousand tokens of text is far below this.
MAX_BODY_BYTES = 16 << 20


class _BadRequest(Exception):
    pass


def _parse_request(body: dict[str, Any]) -> tuple[list[dict[str, str]], SamplingParams]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _BadRequest("'messages' must be a non-empty list")
    clean = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _BadRequest("each message needs string 'role' and 'content'")
        clean.append({"role": m["role"], "content": m["content"]})
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 256))
    temperature = body.get("temperature", 1.0)
    seed = body.get("seed")
    thinking = (body.get("chat_template_kwargs") or {}).get("enable_thinking")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise _BadRequest("'max_tokens' must be a positive integer")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise _BadRequest("'temperature' must be a non-negative number")
    if seed is not None and not isinstance(seed, int):
        raise _BadRequest("'seed' must be an integer")
    return clean, SamplingParams(
        temperature=float(temperature), max_tokens=max_tokens, seed=seed, enable_thinking=thinking
    )


class _Handler(BaseHTTPRequestHandler):
    server: "_HTTPServer"
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        # Per-request lines on stderr would drown test and demo output.
        return

    def _send(self, status: int, payload: dict[str, Any], close: bool = False) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:  # the request's body was not read: the connection cannot carry another request
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, close: bool = False) -> None:
        self._send(status, {"error": {"message": message, "code": status}}, close)

    def _route(self) -> str:
        # The path without its query, as real servers route (a gateway's token may ride in the query).
        return urlsplit(self.path).path.rstrip("/")

    def _authorized(self) -> bool:
        key = self.server.app.api_key
        given = self.headers.get("Authorization") or ""
        return key is None or hmac.compare_digest(given.encode("utf-8", "replace"), f"Bearer {key}".encode())

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        if self._route() == "/health":  # as SGLang's: liveness only, no key needed, nothing disclosed
            return self._send(HTTPStatus.OK, {})
        if not self._authorized():
            return self._error(HTTPStatus.UNAUTHORIZED, "invalid API key")
        if self._route() != "/v1/models":
            return self._error(HTTPStatus.NOT_FOUND, f"no route {self.path}")
        self._send(HTTPStatus.OK, {"object": "list", "data": [{"id": self.server.app.model_name, "object": "model"}]})

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        # Key, route and declared size first: nothing an unauthenticated or oversized client sends is read.
        if not self._authorized():
            return self._error(HTTPStatus.UNAUTHORIZED, "invalid API key", close=True)
        if self._route() != "/v1/chat/completions":
            return self._error(HTTPStatus.NOT_FOUND, f"no route {self.path}", close=True)
        declared = self.headers.get("Content-Length") or "0"
        if not declared.isdigit():
            return self._error(HTTPStatus.BAD_REQUEST, "bad request: Content-Length is not a length", close=True)
        if int(declared) > MAX_BODY_BYTES:
            return self._error(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"request body over {MAX_BODY_BYTES} bytes", close=True
            )
        raw = self.rfile.read(int(declared))
        try:
            messages, params = _parse_request(json.loads(raw))
        except (_BadRequest, ValueError, RecursionError, AttributeError) as exc:  # ValueError: JSON, UTF-8
            return self._error(HTTPStatus.BAD_REQUEST, f"bad request: {exc}")
        app = self.server.app
        try:
            text = app.backend.complete(messages, params)
        except Exception as exc:  # reported to the client as a 500, which it may retry
            return self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")
        self._send(
            HTTPStatus.OK,
            {
                "id": f"chatcmpl-{app.next_request_id()}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": app.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            },
        )


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    app: "ChatCompletionServer"


class ChatCompletionServer:
    """Threaded HTTP server answering chat completions with ``backend``; binds loopback by default."""

    def __init__(
        self,
        backend: ChatBackend,
        model_name: str = "local",
        host: str = LOOPBACK,
        port: int = 0,
        api_key: str | None = None,
    ):
        self.backend = backend
        self.model_name = model_name
        self.api_key = api_key
        self._counter = 0
        self._lock = threading.Lock()
        self._httpd = _HTTPServer((host, port), _Handler)
        self._httpd.app = self
        self._thread: threading.Thread | None = None

    def next_request_id(self) -> int:
        """Return a fresh request number."""
        with self._lock:
            self._counter += 1
            return self._counter

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:PORT."""
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "ChatCompletionServer":
        """Serve in a background thread and return self."""
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="chat-completion-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in the calling thread until interrupted."""
        self._httpd.serve_forever()

    def stop(self) -> None:
        """Stop a background server and close the socket."""
        self._httpd.shutdown()
        self.close()
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        """Close the listening socket."""
        self._httpd.server_close()

    def __enter__(self) -> "ChatCompletionServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
