"""An inference server run as a child process of ours: spawn, wait for health, watch, stop.

Shared by `vllm serve` (`backends/serving/vllm.py`) and the embedded server run as ``trajflow serve``
(`backends/serving/embedded_process.py`); a subclass says only what to run (`argv`, `environment`) and what to call
it in messages (`label`, `missing_hint`). The rules:

- The port: the configured one, or (0) a free one found by binding port 0 and closing it just before the spawn.
- Output: stdout and stderr appended to `log_path` (a temporary file when none is given) after a line saying when
  it started, so a restarted server's lines follow its predecessor's.
- The API key travels in the child's environment, never on its command line (``ps`` shows that) and never in our
  logs; a log tail we quote has it masked.
- `start` waits for ``GET /health`` until a deadline; if the child exits first, or the deadline passes (the child is
  then stopped), it raises `ServerStartError` naming the server, the exit code or the deadline, and the log's tail.
- `failure` says, once the child has exited (OOM, crash, SIGKILL), its pid, exit code and log tail; the runtime
  starts a fresh one on the next use (``tasks/support/runtime.py``).
- `stop` sends SIGTERM to the child's process group (it runs in a session of its own, so whatever it spawned goes
  too), then SIGKILL after a grace period.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from backends.serving.inference_client import InferenceClient

log = logging.getLogger("trajflow")


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message ends with the tail of its log."""


def free_port(host: str) -> int:
    """A port nothing listens on now, on `host`'s family."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40, secret: str | None = None) -> str:
    """Last `lines` lines of a log file, with `secret` masked."""
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(no log at {path}: {e})"
    tail = "\n".join(text.splitlines()[-lines:])
    return tail.replace(secret, "***") if secret else tail


class ManagedServer:
    """A server process we launch (`start`/`stop`), or one started elsewhere (`url` given: `stop` leaves it)."""

    label = "the server"  # how messages name it ("vLLM", "the embedded server")
    start_error: type[ServerStartError] = ServerStartError
    log_prefix = "server-"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 log_path: str | Path | None = None, startup_timeout_s: float = 900, stop_grace_s: float = 30,
                 url: str | None = None):
        self.host = host
        self.port = port
        self.api_key = api_key
        self.log_path: Path | None = Path(log_path) if log_path else None
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.process: subprocess.Popen | None = None
        self._url = None if url is None else url.rstrip("/").removesuffix("/v1")

    # ---- what a subclass says ------------------------------------------------------------------
    def argv(self, port: int) -> list[str]:
        raise NotImplementedError

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        """The child's environment (the API key included): `base` unless a subclass adds to it."""
        return dict(base)

    def describe_start(self, argv: list[str]) -> str:
        """The log line that starts it (no secret in it)."""
        return f"starting {self.label}: {shlex.join(argv)} (log: {self.log_path})"

    def missing_hint(self, error: OSError) -> str:
        return f"cannot run {self.argv(self.port)[0]!r}: {error}"

    # ---- the rules of the module docstring ------------------------------------------------------
    @property
    def url(self) -> str:
        if self._url is not None:
            return self._url
        host = self.host if self.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self, timeout: float = 60) -> InferenceClient:
        return InferenceClient(self.base_url, api_key=self.api_key, timeout=timeout)

    def start(self, wait: bool = True):
        """Launch the child; with `wait`, return once /health answers (`start_error` with its log tail otherwise)."""
        if self.process is not None:
            raise RuntimeError(f"this {type(self).__name__} was already started")
        self.port = self.port or free_port(self.host)
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=self.log_prefix, suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = self.argv(self.port)
        env = self.environment(dict(os.environ))
        log.info("%s", self.describe_start(argv))
        with open(self.log_path, "ab") as out:
            out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting {self.label} ---\n".encode())
            out.flush()
            try:
                self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
            except OSError as e:
                raise self.start_error(self.missing_hint(e)) from e
        if wait:
            self.wait_healthy(self.startup_timeout_s)
            log.info("%s (pid %d) answers at %s", self.label, self.process.pid, self.base_url)
        return self

    def wait_healthy(self, deadline_s: float) -> None:
        """Poll /health; raise `start_error` (and stop the process) if it exits or the deadline passes."""
        client = self.client(timeout=5)
        end = time.monotonic() + deadline_s
        while True:
            if self.process is not None and self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                raise self.start_error(f"{self.label} exited with code {code} before becoming healthy; last log "
                                       f"lines ({self.log_path}):\n{self.tail()}")
            if client.health_sync():
                return
            if time.monotonic() >= end:
                self.stop()
                raise self.start_error(f"{self.label} did not answer {self.url}/health within {deadline_s} s; last "
                                       f"log lines ({self.log_path}):\n{self.tail()}")
            time.sleep(0.25)

    def failure(self) -> str | None:
        """None while the child runs (or for an attached server); once it has exited, a message naming it, its pid,
        exit code and log tail."""
        proc = self.process
        if proc is None or proc.poll() is None:
            return None
        return (f"{self.label} (pid {proc.pid}, {self.url}) exited with code {proc.returncode}; last log lines "
                f"({self.log_path}):\n{self.tail()}")

    def tail(self) -> str:
        return log_tail(self.log_path, secret=self.api_key) if self.log_path else "(no log)"

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM the child's process group, SIGKILL after `grace_s` (default: `stop_grace_s`); returns the exit
        code (None if attached or not running)."""
        grace_s = self.stop_grace_s if grace_s is None else grace_s
        proc, self.process = self.process, None
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(10)
        return proc.returncode

    def __enter__(self):
        return self if self.process is not None or self._url is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
