"""`trajflow serve`: the embedded inference server in the foreground (SIGTERM / Ctrl-C shut it down cleanly).

Importing this module is light (argparse only); torch and transformers load inside the command. A bad argument
ends the command with one line on stderr naming it, and exit code 2 (argparse's code for usage errors): values
are checked before the model loads, the device once torch is imported.
"""

from __future__ import annotations

import argparse
import re

from backends.serving.request_bodies import DEFAULT_MAX_BODY_BYTES

# `--overlap-decode` and the run config's `inference.overlap_decode` -> EngineConfig.overlap_decode (None: its default)
OVERLAP_CHOICES = {"auto": None, "on": True, "off": False}


def register(subparsers) -> None:
    """Add the `serve` subcommand to `subparsers` (from `ArgumentParser.add_subparsers()`)."""
    p = subparsers.add_parser("serve", help="serve a model (and LoRA adapters) over an OpenAI-compatible HTTP API",
                              description="Serve MODEL with the embedded transformers engine in vLLM's dialect.")
    p.add_argument("--model", required=True, help="'smollm2-135m', 'tiny-random', or a local HF model folder")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (0 picks a free one; default 8000)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $TRAJFLOW_API_KEY, else no key)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--max-loras", type=int, default=4, help="adapters resident on the device at once (default 4)")
    p.add_argument("--max-batch-size", type=int, default=None, help="sequences decoded together (default 64)")
    p.add_argument("--max-seq-len", type=int, default=None, help="longest prompt + completion in tokens")
    p.add_argument("--overlap-decode", choices=OVERLAP_CHOICES, default="auto",
                   help="launch each decode step before accepting the previous one (auto: on with CUDA graphs)")
    p.add_argument("--engine", action="append", default=[], metavar="FIELD=VALUE",
                   help="any other engine setting (repeatable), e.g. --engine compile_decode=on --engine "
                        "admission_wait_steps=8; 'auto' leaves a setting to its device default. The fields and what "
                        "they do: EngineConfig in backends/inference/engine_config.py")
    p.add_argument("--served-name", default=None, help="name of the base model in requests (default: its id)")
    p.add_argument("--adapter-root", action="append", default=[], metavar="DIR|s3://BUCKET/PREFIX",
                   help="where /v1/load_lora_adapter may read adapters, besides the trajflow cache (repeatable); "
                        "other places and URL schemes (http, ...) are refused")
    p.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / 2**20,
                   help=f"largest request body in MiB; larger ones get 413 (default {DEFAULT_MAX_BODY_BYTES // 2**20})")
    p.add_argument("--quiet", action="store_true",
                   help="no line per request (uvicorn's access log) and only its warnings: for a server a run starts, "
                        "whose requests are counted elsewhere")
    p.add_argument("--parent-pid", type=int, default=None, metavar="PID",
                   help="stop once PID, the process that started this one, is gone (a run's own server: a killed "
                        "flow leaves none behind)")
    p.set_defaults(func=serve)


def _server_class():
    import contextlib
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, but SIGTERM/SIGINT end `run` normally: uvicorn re-raises the signal after its graceful
        shutdown, which would kill the process before the engine is stopped."""

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


class UsageError(ValueError):
    """A command-line value that cannot work; its message is the one line printed."""


def _check_values(args: argparse.Namespace) -> None:
    """Checks that need no torch: port range, body cap, device spelling."""
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: a port is 0..65535 (0 picks a free one)")
    if not args.max_body_mb > 0:
        raise UsageError(f"--max-body-mb {args.max_body_mb}: must be positive")
    if not _DEVICE.fullmatch(args.device):
        raise UsageError(f"--device {args.device!r}: expected cpu, cuda or cuda:N")


def _check_device(device: str) -> None:
    """The CUDA device must exist in this process (torch raises deep inside the model load otherwise)."""
    import torch

    if device == "cpu":
        return
    if not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available here (torch {torch.__version__}, "
                         f"{torch.cuda.device_count()} GPUs visible)")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: this process sees {torch.cuda.device_count()} GPU(s)")


def engine_value(text: str) -> str | None:
    """An `--engine FIELD=VALUE` value as `EngineConfig` takes it: 'auto' (or 'none', or nothing) leaves the field to
    its device default (None); anything else goes to pydantic as written, which reads 'on'/'true', numbers..."""
    text = text.strip()
    return None if text.lower() in ("auto", "none", "") else text


def _engine_config(args: argparse.Namespace):
    from pydantic import ValidationError

    from backends.inference.engine_config import EngineConfig

    updates = {"max_loras": args.max_loras, "max_batch_size": args.max_batch_size, "max_seq_len": args.max_seq_len,
               "overlap_decode": OVERLAP_CHOICES[args.overlap_decode]}
    flags = {name: f"--{name.replace('_', '-')} {value}" for name, value in updates.items() if value is not None}
    for item in args.engine:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name:
            raise UsageError(f"--engine {item!r}: expected FIELD=VALUE, e.g. --engine compile_decode=on")
        if name not in EngineConfig.model_fields:
            raise UsageError(f"--engine {item!r}: no engine setting {name!r}; "
                             f"known: {', '.join(sorted(EngineConfig.model_fields))}")
        if name in flags:
            has_own = not flags[name].startswith("--engine")
            raise UsageError(f"--engine {item!r}: " + (f"{name} has its own flag, --{name.replace('_', '-')}"
                                                      if has_own else f"{name} is set twice ({flags[name]})"))
        updates[name] = engine_value(value)
        flags[name] = f"--engine {item}"
    try:
        return EngineConfig(**{k: v for k, v in updates.items() if v is not None})
    except ValidationError as e:
        raise UsageError("; ".join(f"{flags.get(str(err['loc'][0]), err['loc'][0])}: {err['msg'].lower()}"
                                   for err in e.errors())) from None


def serve(args: argparse.Namespace) -> int:
    """Load the model, serve until SIGTERM/SIGINT, then stop the engine. Returns the exit code."""
    import logging
    import os
    import sys

    from backends.serving.adapter_sources import AdapterSources
    from backends.serving.exposure import check_exposure

    watch = None
    if args.parent_pid is not None:
        from backends.serving.parent_watch import ParentWatch

        watch = ParentWatch(args.parent_pid)
    api_key = args.api_key or os.environ.get("TRAJFLOW_API_KEY") or None
    try:
        _check_values(args)
        check_exposure(args.host, api_key)
        sources = AdapterSources.default(args.adapter_root)
        config = _engine_config(args)
        _check_device(args.device)
    except ValueError as e:
        print(f"trajflow serve: {e}", file=sys.stderr)
        return 2

    from backends.inference.engine import Engine
    from backends.serving.app import bind_socket, create_app, freeze_heap, server_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = Engine.from_pretrained(args.model, device=args.device, served_name=args.served_name, config=config)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
        print(f"trajflow serve: {e}", file=sys.stderr)
        return 2
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"trajflow serve: cannot bind {args.host}:{args.port}: {e}", file=sys.stderr)
        engine.shutdown()
        return 2
    host, port = sock.getsockname()[:2]
    print(f"trajflow serve: {engine.name} at http://{host}:{port}/v1 (max_seq_len {engine.max_seq_len}, "
          f"device {engine.device}{', API key required' if api_key else ''})", file=sys.stderr, flush=True)
    app = create_app(engine, api_key, sources, int(args.max_body_mb * 2**20))
    freeze_heap()
    server = _server_class()(server_config(app, "warning", access_log=False) if args.quiet
                             else server_config(app, "info"))
    if watch is not None:
        watch.stop_with(lambda: setattr(server, "should_exit", True))
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        print("trajflow serve: stopped", file=sys.stderr, flush=True)
    return 0
