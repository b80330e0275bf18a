"""Fixtures for kill-and-resume tests: a shared tiny inference server behind a request-counting proxy."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest


class CountingProxy:
    """Forwards every request to `target` and records the JSON body of each chat completion."""

    def __init__(self, target: str):
        self.target = target.rstrip("/")
        self.chat_bodies: list[dict] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self, method: str) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                if method == "POST" and self.path.rstrip("/").endswith("/chat/completions"):
                    with proxy._lock:
                        proxy.chat_bodies.append(json.loads(body))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                resp = httpx.request(method, proxy.target + self.path, content=body, headers=headers, timeout=120)
                self.send_response(resp.status_code)
                for k, v in resp.headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                        self.send_header(k, v)
                self.send_header("content-length", str(len(resp.content)))
                self.end_headers()
                self.wfile.write(resp.content)

            def do_GET(self):  # noqa: N802
                self._forward("GET")

            def do_POST(self):  # noqa: N802
                self._forward("POST")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reset(self) -> None:
        with self._lock:
            self.chat_bodies.clear()

    def rollout_requests(self, model: str) -> list[dict]:
        """Chat requests for `model` that are rollouts (not publish probes)."""
        from backends.policy_store import PROBE_USER

        with self._lock:
            return [b for b in self.chat_bodies if b.get("model") == model and b.get("user") != PROBE_USER]

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture(scope="session")
def counting_server(tiny_model_path):
    from backends.server import start_server

    handle = start_server(model="tiny-random", port=0)
    proxy = CountingProxy(handle.url)
    yield proxy
    proxy.close()
    handle.stop()
