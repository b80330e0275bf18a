"""`trajflow backend serve`: run a LocalBackend as an HTTP service (see backends/art/server.py).

Whoever reaches the backend can train, log into and prune its runs, so it needs an API key unless it listens on
loopback only: on another address it refuses to start without one, and without one on loopback it warns.
"""

from __future__ import annotations

import argparse
import os
import sys

from backends.serving.exposure import is_loopback


def _api_key(args: argparse.Namespace) -> str | None:
    key = args.api_key if args.api_key is not None else os.environ.get(args.api_key_env or "", "")
    return key.strip() or None


def _serve(args: argparse.Namespace) -> int:
    api_key = _api_key(args)
    if api_key is None:
        if not is_loopback(args.host):
            print(f"trajflow backend serve: refusing to listen on {args.host} without an API key: anyone who reaches "
                  f"it could train, log into and prune runs. Set {args.api_key_env} (or pass --api-key), or bind "
                  "127.0.0.1", file=sys.stderr)
            return 2
        print(f"trajflow backend serve: WARNING: no API key ({args.api_key_env} is unset): every process on this "
              f"machine can train, log into and prune the runs under {args.storage}", file=sys.stderr, flush=True)

    import uvicorn

    from backends.art.local_backend import LocalBackend
    from backends.art.server import create_backend_app

    backend = LocalBackend(storage=args.storage, device=args.device, host=args.host, port=args.inference_port,
                           api_key=api_key, track=False)  # its RemoteBackend clients track, with their credentials
    try:
        uvicorn.run(create_backend_app(backend, api_key=api_key), host=args.host, port=args.port, log_level="warning")
    finally:
        backend.close()
    return 0


def register(subparsers) -> None:
    backend = subparsers.add_parser("backend", help="run a training backend for ART-style scripts")
    sub = backend.add_subparsers(dest="backend_command", required=True)
    serve = sub.add_parser("serve", help="serve LocalBackend over HTTP (RemoteBackend connects to it)")
    serve.add_argument("--storage", default=os.environ.get("TRAJFLOW_STORAGE", "runs"), help="storage root")
    serve.add_argument("--host", default="127.0.0.1",
                       help="bind address (loopback unless told otherwise; any other needs an API key)")
    serve.add_argument("--port", type=int, default=7900, help="backend API port")
    serve.add_argument("--inference-port", type=int, default=0, help="port of the embedded inference server (0: any)")
    serve.add_argument("--device", default="auto", help="auto, cpu or cuda")
    serve.add_argument("--api-key", default=None,
                       help="API key clients must send as 'Authorization: Bearer <key>' (prefer --api-key-env: a "
                            "command line is visible to other users)")
    serve.add_argument("--api-key-env", default="TRAJFLOW_BACKEND_API_KEY",
                       help="env var holding the API key (used when --api-key is not given)")
    serve.set_defaults(func=_serve)
