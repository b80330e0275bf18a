"""`trajflow backend serve`'s app on a real HTTP server in this process: a LocalBackend on tiny-random, CPU."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx
import pytest

BACKEND_KEY = "backend-key-123"


@dataclass
class BackendServer:
    url: str
    backend: object  # the LocalBackend behind it
    storage: str
    api_key: str | None
    _server: object
    _thread: threading.Thread

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path: str, body=None, timeout: float = 300, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=kwargs.pop("headers", self.headers), timeout=timeout,
                          **kwargs)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self.backend.close()


def start_backend_server(storage: str, api_key: str | None = BACKEND_KEY) -> BackendServer:
    """create_backend_app(LocalBackend(storage, cpu)) served by uvicorn on 127.0.0.1:<free port>."""
    import uvicorn

    from backends.art.local_backend import LocalBackend
    from backends.art.server import create_backend_app
    from backends.serving.app import bind_socket

    backend = LocalBackend(storage=storage, device="cpu", api_key=api_key, track=False)
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_backend_app(backend, api_key), log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return BackendServer(url, backend, storage, api_key, server, thread)
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the backend server at {url} did not start")
        time.sleep(0.05)


@pytest.fixture
def backend_server(tiny_model_path, tmp_path):
    """A backend server with API key BACKEND_KEY over a fresh storage folder (tmp_path/store)."""
    handle = start_backend_server(str(tmp_path / "store"))
    yield handle
    handle.stop()
