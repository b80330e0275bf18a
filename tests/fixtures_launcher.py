"""``fork_launcher`` (session): starts test subprocesses forked from tests/forkserver.py, so each skips
the ~6 s import of torch, transformers and peft; every run is still a process of its own."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


class ForkLauncher:
    """`start` / `wait` / `run` processes like ``subprocess`` does for ``[sys.executable, *argv]``."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver"], cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self._lock = threading.Lock()
        self._started: queue.Queue = queue.Queue()
        self._ended: dict[int, queue.Queue] = {}
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _ended_queue(self, pid: int) -> queue.Queue:
        with self._lock:
            return self._ended.setdefault(pid, queue.Queue())

    def _read(self) -> None:
        for line in self.proc.stdout:
            reply = json.loads(line)
            if "ready" in reply:
                self._ready.set()
            elif "returncode" in reply:
                self._ended_queue(reply["pid"]).put(reply["returncode"])
            else:
                self._started.put(reply["pid"])
        self._started.put(None)

    def start(self, argv: list[str], env: dict, cwd: str | Path, stdout: str | Path,
              stderr: str | Path | None = None) -> int:
        """Start `python *argv` (forked) in a new session; output to files (stderr None: into stdout). Its pid."""
        if not self._ready.wait(timeout=300):
            raise RuntimeError("the fork server did not start within 300 s")
        with self._lock:
            self.proc.stdin.write(json.dumps({"argv": list(argv), "env": dict(env), "cwd": str(cwd),
                                              "stdout": str(stdout), "stderr": stderr and str(stderr)}) + "\n")
            self.proc.stdin.flush()
            pid = self._started.get(timeout=60)
        if pid is None:
            raise RuntimeError(f"the fork server exited with code {self.proc.wait()}")
        return pid

    def wait(self, pid: int, timeout: float) -> int:
        """The return code (negative: killed by that signal); raises subprocess.TimeoutExpired."""
        try:
            return self._ended_queue(pid).get(timeout=timeout)
        except queue.Empty:
            raise subprocess.TimeoutExpired(f"pid {pid}", timeout) from None

    def run(self, argv: list[str], env: dict, cwd: str | Path, stdout: str | Path, stderr: str | Path | None = None,
            timeout: float = 300) -> int:
        """Start, wait (SIGKILL after `timeout`), then SIGKILL what is left of its process group
        (children such as an ephemeral Prefect API server, orphaned by a kill)."""
        pid = self.start(argv, env, cwd, stdout, stderr)
        try:
            try:
                return self.wait(pid, timeout)
            except subprocess.TimeoutExpired:
                os.killpg(pid, signal.SIGKILL)
                return self.wait(pid, 60)
        finally:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


@pytest.fixture(scope="session")
def fork_launcher(tiny_model_path):
    """Started after tiny_model_path, so forked runs see its TRAJFLOW_CACHE."""
    launcher = ForkLauncher()
    yield launcher
    launcher.close()
