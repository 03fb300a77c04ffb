#!/usr/bin/env python
"""Serve a local HF model directory as an OpenAI-compatible chat server on loopback (tests, the demo).

python tools/serve_local.py --model DIR [--port 8000] [--served-model-name local]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    from megatron_osprey.data.regenerate.backends import HFBackend, HFBackendConfig
    from megatron_osprey.data.regenerate.local_server import LOOPBACK, ChatCompletionServer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path, help="local Hugging Face model directory")
    parser.add_argument("--host", default=LOOPBACK, help="bind address (default loopback)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default="local")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--api-key-env", default=None, help="env var holding the API key clients must send")
    args = parser.parse_args(argv)
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            parser.error(f"--api-key-env {args.api_key_env}: that environment variable is empty or unset.")
    backend = HFBackend(HFBackendConfig(model_dir=args.model, device=args.device, dtype=args.dtype))
    server = ChatCompletionServer(backend, args.served_model_name, args.host, args.port, api_key)
    print(f"serving {args.model} as {args.served_model_name!r} on {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", flush=True)  # Ctrl-C is the normal way to stop this server
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
