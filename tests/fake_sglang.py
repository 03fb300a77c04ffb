"""A stand-in for SGLang's HTTP server on loopback, for the client tests (tools/sglang_bench.py, eval speedup).

`answer(body)` gets each POSTed JSON body (SGLang's /generate request: input_ids, sampling_params) and returns the
reply's JSON (text, optionally output_ids, and meta_info as SGLang 0.5.23 writes it); GET (the readiness probe)
answers 200. Requests are served on threads, so a client's concurrent requests are in flight together.
"""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def meta_reply(meta: dict, text: str = "x") -> dict:
    """A /generate reply with no output ids: the text and SGLang's meta_info."""
    return {"text": text, "meta_info": meta}


@contextmanager
def fake_sglang_server(answer):
    """Serve `answer` at http://127.0.0.1:PORT (yielded) until the block ends."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            data = json.dumps(answer(body)).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
