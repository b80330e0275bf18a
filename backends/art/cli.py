"""`trajflow backend serve`: run a LocalBackend as an HTTP service (see backends/art/server.py)."""

from __future__ import annotations

import argparse
import os


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from backends.art.local_backend import LocalBackend
    from backends.art.server import create_backend_app

    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    backend = LocalBackend(storage=args.storage, device=args.device, host=args.host, port=args.inference_port,
                           api_key=api_key)
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
    serve.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless told otherwise)")
    serve.add_argument("--port", type=int, default=7900, help="backend API port")
    serve.add_argument("--inference-port", type=int, default=0, help="port of the embedded inference server (0: any)")
    serve.add_argument("--device", default="auto", help="auto, cpu or cuda")
    serve.add_argument("--api-key-env", default="TRAJFLOW_BACKEND_API_KEY",
                       help="env var holding the API key required from clients (unset: no key)")
    serve.set_defaults(func=_serve)
