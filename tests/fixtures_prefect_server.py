"""A real `prefect server start` (SQLite, its own home) and process workers, for end-to-end deployment tests.

Unlike the session's test harness (tests/fixtures_prefect.py) it runs the server's services (event triggers,
automations), as a production server does, and nothing else in the suite talks to it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.paths import REPO

PREFECT = [sys.executable, "-m", "prefect"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prefect_env(api_url: str, home: Path, **extra: str) -> dict[str, str]:
    """The environment of a Prefect process of this deployment: its API, its own home, analytics off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "TRAJFLOW_CRASH_AT"))}
    env.update(PREFECT_API_URL=api_url, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               DO_NOT_TRACK="1", PYTHONPATH=str(REPO), **extra)
    return env


class PrefectServer:
    def __init__(self, root: Path):
        self.root = root
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.log = root / "server.log"
        # SQLite's busy wait (Prefect's statement timeout, 10 s by default): on a loaded 2-core machine the workers,
        # automations and runs of a test hold its write lock long enough that a request times out and is answered
        # 503, and the client's five retries (2 + 4 + ... + 32 s) were seen to run out
        env = prefect_env(self.url, root / "server-home", PREFECT_SERVER_DATABASE_TIMEOUT="60")
        env.pop("PREFECT_API_URL")
        self.process = subprocess.Popen([*PREFECT, "server", "start", "--host", "127.0.0.1", "--port",
                                         str(self.port)], env=env, stdout=self.log.open("w"),
                                        stderr=subprocess.STDOUT, start_new_session=True, cwd=root)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prefect server exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"prefect server did not answer within 120 s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        _kill_group(self.process, signal.SIGTERM)


class Worker:
    """`prefect worker start` on `pool` (and `queue`), in its own process group, as a machine's worker would be."""

    def __init__(self, server: PrefectServer, name: str, pool: str, queue: str | None = None, **env: str):
        self.log = server.root / f"worker-{name}.log"
        home = server.root / f"worker-home-{name}"
        command = [*PREFECT, "worker", "start", "--pool", pool, "--name", name]
        if queue:
            command += ["--work-queue", queue]
        self.process = subprocess.Popen(command, env=prefect_env(server.url, home, **env), cwd=REPO,
                                        stdout=self.log.open("a"), stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def kill(self) -> None:
        """SIGKILL the worker (its machine is gone); its flow runs are processes of their own sessions."""
        _kill_group(self.process, signal.SIGKILL)


def _kill_group(process: subprocess.Popen, sig: int) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    server = PrefectServer(tmp_path_factory.mktemp("prefect-server"))
    yield server
    server.stop()
