"""`trajflow backend serve` and its key: refused beyond loopback without one, loud without one on loopback, and
with one only `Authorization: Bearer <key>` opens it (the request-level table is test_bad_inputs_backend_server.py).
Each case is the real command in a process of its own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Self

import httpx
import pytest

from backends.serving.exposure import is_loopback
from tests.paths import REPO

KEY_ENV = "TRAJFLOW_BACKEND_API_KEY"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(tmp_path, *args: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", "backend", "serve", "--storage", str(tmp_path / "store"),
            "--device", "cpu", *args]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    return {**env, "PYTHONPATH": str(REPO), **extra}


class Serving:
    """The command running on 127.0.0.1:<port> until the block ends; `stderr()` is what it printed so far."""

    def __init__(self, tmp_path, env: dict, *args: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.err_path = tmp_path / f"serve-{self.port}.err"
        self.args, self.env, self.tmp_path = args, env, tmp_path

    def __enter__(self) -> Self:
        self.err = open(self.err_path, "w")
        self.proc = subprocess.Popen(_command(self.tmp_path, "--port", str(self.port), *self.args), env=self.env,
                                     cwd=REPO, stdout=subprocess.DEVNULL, stderr=self.err, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                httpx.get(self.url + "/health", timeout=1)
                return self
            except httpx.HTTPError:
                time.sleep(0.2)
        self.__exit__()
        pytest.fail(f"backend serve did not start: {self.stderr()[-2000:]}")

    def stderr(self) -> str:
        return self.err_path.read_text()

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=20)
        self.err.close()


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("0.0.0.0", False), ("::", False), ("192.168.1.20", False), ("gpu-box", False), ("", False),
])
def test_which_hosts_are_loopback(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1"])
def test_beyond_loopback_without_a_key_it_refuses_to_start(tmp_path, host):
    try:
        done = subprocess.run(_command(tmp_path, "--host", host, "--port", str(_free_port())), env=_env(), cwd=REPO,
                              capture_output=True, text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"backend serve started on {host} without an API key")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [(
        f"trajflow backend serve: refusing to listen on {host} without an API key: anyone who reaches it could "
        f"train, log into and prune runs. Set {KEY_ENV} (or pass --api-key), or bind 127.0.0.1")]
    assert not (tmp_path / "store").exists()


def test_on_loopback_without_a_key_it_warns_loudly(tmp_path):
    with Serving(tmp_path, _env()) as serving:
        assert "WARNING: no API key" in serving.stderr() and KEY_ENV in serving.stderr()
        assert httpx.post(serving.url + "/backend/step", json={"project": "p", "name": "n"}).status_code == 404


@pytest.mark.parametrize("how", ["flag", "env"])
def test_with_a_key_only_bearer_opens_it(tmp_path, how):
    args, env = (("--api-key", "k-123"), _env()) if how == "flag" else ((), _env(**{KEY_ENV: "k-123"}))
    with Serving(tmp_path, env, *args) as serving:
        assert "WARNING" not in serving.stderr()
        ref = {"project": "p", "name": "n"}
        for headers in ({}, {"Authorization": "k-123"}, {"Authorization": "Bearer k-12"}):
            assert httpx.post(serving.url + "/backend/step", json=ref, headers=headers).status_code == 401, headers
        assert httpx.get(serving.url + "/openapi.json").status_code == 401
        assert httpx.get(serving.url + "/openapi.json", headers={"Authorization": "Bearer k-123"}).status_code == 200
        assert httpx.get(serving.url + "/health").status_code == 200
        resp = httpx.post(serving.url + "/backend/step", json=ref, headers={"Authorization": "bearer k-123"})
        assert resp.status_code == 404  # in: the model is just not registered
