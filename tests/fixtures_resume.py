"""Fixtures for kill-and-resume tests: a shared tiny inference server behind a request-counting proxy, and the
command line of one training run against it."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest


def train_invocation(root: str, proxy_url: str, tmp_path: Path, crash_at: str | None, env_extra: dict | None,
                     api_url: str | None, *, steps: int, groups: int, group_size: int,
                     sets: tuple[str, ...] = ()) -> tuple[list[str], dict, Path]:
    """(argv, env, log path) of one `python -m flows.train` run of configs/tiny.yaml with the echo agent against
    `proxy_url`, on a fresh PREFECT_HOME (a new machine); `api_url` None: Prefect's ephemeral API; `sets`: more
    `--set` overrides."""
    home = tmp_path / f"prefect-home-{os.urandom(4).hex()}"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90", **(env_extra or {})}
    for key in ("TRAJFLOW_CRASH_AT", "PREFECT_API_URL"):
        env.pop(key, None)
    if crash_at:
        env["TRAJFLOW_CRASH_AT"] = crash_at
    if api_url:
        env["PREFECT_API_URL"] = api_url
    args = ["configs/tiny.yaml", "--set", f"storage={root}", "--set", "agent=tests.flow_agents:EchoAgent",
            "--set", "inference.backend=url", "--set", f"inference.url={proxy_url}/v1",
            "--set", f"steps={steps}", "--set", f"groups_per_step={groups}", "--set", f"group_size={group_size}",
            "--set", f"rollouts.concurrency={group_size}"]  # groups finish one after another
    for item in sets:
        args += ["--set", item]
    return ["-m", "flows.train", *args], env, tmp_path / f"flow-{os.urandom(4).hex()}.log"


def _is_rollout(body: dict, model: str) -> bool:
    """A chat request for `model` that is a rollout (not a publish probe)."""
    from backends.policy.probe import PROBE_USER

    return body.get("model") == model and body.get("user") != PROBE_USER


class CountingProxy:
    """Forwards every request to `target` and records the JSON body of each chat completion.

    `hold_rollouts_after(model, n)` answers the first n rollout requests for `model` and leaves later
    ones unanswered until `release(model)` or `reset()`, so a kill after the first stored group finds the others
    in flight (without it, fast rollouts and slow storage writes let every group land before the kill). Holds of
    different models are independent: runs of several tests may share the proxy at once.
    """

    def __init__(self, target: str):
        self.target = target.rstrip("/")
        self.chat_bodies: list[dict] = []
        self._lock = threading.Lock()
        self._holds: dict[str, tuple[int, threading.Event]] = {}  # model -> (requests still answered, release)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self, method: str) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                if method == "POST" and self.path.rstrip("/").endswith("/chat/completions"):
                    release = proxy._record(json.loads(body))
                    if release is not None:
                        return self._held(release)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                resp = httpx.request(method, proxy.target + self.path, content=body, headers=headers, timeout=120)
                self.send_response(resp.status_code)
                for k, v in resp.headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                        self.send_header(k, v)
                self.send_header("content-length", str(len(resp.content)))
                self.end_headers()
                self.wfile.write(resp.content)

            def _held(self, release: threading.Event) -> None:
                release.wait(timeout=900)
                try:  # the client was usually killed meanwhile
                    self.send_error(503, "held by the test")
                except OSError:
                    pass

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _record(self, body: dict) -> threading.Event | None:
        """Record a chat request; the event to wait for when it must be held, else None."""
        with self._lock:
            self.chat_bodies.append(body)
            model = body.get("model")
            if model not in self._holds or not _is_rollout(body, model):
                return None
            left, release = self._holds[model]
            if left > 0:
                self._holds[model] = (left - 1, release)
                return None
            return release

    def hold_rollouts_after(self, model: str, count: int) -> None:
        with self._lock:
            self._holds[model] = (count, threading.Event())

    def release(self, model: str) -> None:
        """End the hold of `model`: its held requests get a 503, later ones go through."""
        with self._lock:
            hold = self._holds.pop(model, None)
        if hold is not None:
            hold[1].set()

    def reset(self) -> None:
        """Forget recorded requests and every hold; held requests get a 503."""
        with self._lock:
            self.chat_bodies.clear()
            holds, self._holds = self._holds, {}
        for _, release in holds.values():
            release.set()

    def rollout_requests(self, model: str) -> list[dict]:
        """Chat requests for `model` that are rollouts (not publish probes)."""
        with self._lock:
            return [b for b in self.chat_bodies if _is_rollout(b, model)]

    def close(self) -> None:
        self.reset()
        self.server.shutdown()


@pytest.fixture(scope="session")
def counting_server(tiny_model_path):
    from backends.serving.app import start_server

    handle = start_server(model="tiny-random", port=0)
    proxy = CountingProxy(handle.url)
    yield proxy
    proxy.close()
    handle.stop()

