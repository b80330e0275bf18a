"""The GRPO update in a child process that keeps its trainer between steps (``training.mode: process``).

Why: with ``pipeline.max_off_policy_steps`` >= 1 the flow's process runs the rollouts of later steps on its threads
while a step trains, and their client side (the agent, the openai client, parsing) holds the GIL that every kernel
launch of the update needs: on the H200 the update took 1.5-2x as long beside them (benchmarks/results/async-h200.md).
In a process of its own the update keeps its speed, and the trainer's memory (and a crash of it: out of memory)
stays out of the flow's process. The child lives as long as the run's runtime, so the cold start is paid once.

The parent (:class:`TrainerProcess`, one per run in the flow's ``Runtime``) starts the child
(``tasks/support/trainer_worker.py``)

    python -m tasks.support.trainer_worker CONFIG.json

and writes one JSON line per request to its stdin, ``{"op": "initialize" | "sft" | "train" | "load", "step": N}``,
served one at a time (``load``: the trainer at checkpoint N ahead of the update that needs it, which a resumed flow
asks for at its start). The child answers on its stdout (its own prints and C libraries' output go to stderr):
zero or more log records of its ``trajflow`` logger, ``{"log": LEVEL, "message": TEXT}``, which the parent logs as
its own, then one ``{"result": RESULT, "seconds": {...}}`` or ``{"error": {"type", "message", "transient"}}``. It
runs the functions ``training.mode: local`` runs (tasks/training.py, tasks/sft.py) on the config with mode
``local``, so it writes the same files in the same order, and a resumed run reads them whichever mode trained a
step (the weights agree within float32 rounding: tests/integration/test_resume.py).

Failures: the child's own error fails the step with its type and message (a transient one is retried, as in the
flow's process); a child that dies (a signal: out of memory, a kill) fails it with :class:`TrainerLostError`
(transient: the retry starts a new child, which loads the last committed checkpoint from storage). The child exits
when the flow's process is gone (the training ranks' watch), so a flow killed with SIGKILL leaves no trainer writing
a step that the resumed flow redoes; a crash point reached in the child (the resume tests') kills the flow first.
"""

from __future__ import annotations

import builtins
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from tasks.run_config import RunConfig
from tasks.support.crash_points import CRASH_PID_ENV
from tasks.support.distributed_training import PARENT_ENV
from tasks.support.retry_policy import TransientError, is_transient

log = logging.getLogger("trajflow")

OPS = ("initialize", "sft", "train", "load")
WORKER = "tasks.support.trainer_worker"
STOP_GRACE_S = 30.0


class TrainerLostError(TransientError):
    """The trainer process died without answering (a signal: out of memory, preemption, a kill)."""


class TrainerProcess:
    """The parent's handle: starts the child on the first request and again after it died."""

    def __init__(self, config: RunConfig):
        self.config = config
        self._proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def request(self, op: str, step: int) -> tuple[dict[str, Any], dict[str, float]]:
        """Run `op` of `step` in the child; its result and the seconds it measured (``load``, ``trained``)."""
        if op not in OPS:
            raise ValueError(f"unknown trainer request {op!r}; one of {', '.join(OPS)}")
        with self._lock:
            proc = self._started()
            try:
                proc.stdin.write(json.dumps({"op": op, "step": step}).encode() + b"\n")
                proc.stdin.flush()
            except OSError:
                raise self._lost(op, step) from None
            while True:
                line = proc.stdout.readline()
                if not line:
                    raise self._lost(op, step)
                message = protocol_line(line)
                if message is None:  # printed by an import before the child moved its stdout to stderr
                    log.info("trainer process: %s", line.decode(errors="replace").rstrip())
                elif "log" in message:
                    log.log(int(message["log"]), "%s", message["message"])
                elif "error" in message:
                    raise rebuilt_error(message["error"], f"{_what(op, step)} in the trainer process")
                else:
                    return message["result"], message.get("seconds", {})

    def preload(self, step: int) -> threading.Thread:
        """Start the child and put its trainer at checkpoint `step` on a thread, so that a resumed run's first update
        does not wait for the model load (it overlaps the first rollouts); a failure is only logged, since the update
        that needs the trainer raises it again with its own step."""

        def load() -> None:
            try:
                self.request("load", step)
            except Exception as exc:  # noqa: BLE001 - see the docstring
                log.warning("loading the trainer process at step %d ahead of the update failed: %s", step, exc)

        thread = threading.Thread(target=load, name="trajflow-trainer-preload", daemon=True)
        thread.start()
        return thread

    def _started(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="trajflow-trainer-")
        config_file = Path(self._dir.name) / "config.json"
        config_file.write_text(self.config.model_dump_json())
        env = {**os.environ, PARENT_ENV: str(os.getpid()), CRASH_PID_ENV: str(os.getpid())}
        self._proc = subprocess.Popen([sys.executable, "-m", WORKER, str(config_file)], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        log.info("trainer process started (pid %d)", self._proc.pid)
        return self._proc

    def _lost(self, op: str, step: int) -> TrainerLostError:
        proc, self._proc = self._proc, None
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return TrainerLostError(f"{_what(op, step)}: the trainer process (pid {proc.pid}) ended with {how} without "
                                "an answer (out of memory? killed?); nothing of the step was committed, a retry "
                                "starts a new one and redoes it from storage")

    def close(self) -> None:
        """Ask the child to exit; kill it after `STOP_GRACE_S`."""
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is not None:
                try:
                    proc.stdin.write(b'{"op": "exit"}\n')
                    proc.stdin.close()
                except OSError:
                    pass
                try:
                    proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                proc.stdout.close()
            if self._dir is not None:
                self._dir.cleanup()
                self._dir = None


def protocol_line(line: bytes) -> dict[str, Any] | None:
    """The child's answer or log record on this line; None for anything else (plain output)."""
    try:
        message = json.loads(line)
    except ValueError:
        return None
    return message if isinstance(message, dict) and message.keys() & {"log", "error", "result"} else None


def _what(op: str, step: int) -> str:
    named = {"initialize": "the initial adapter (step 0)", "sft": "the SFT stage (step 0)",
             "load": f"loading the trainer at step {step}"}
    return named.get(op, f"training step {step}")


def error_record(exc: BaseException) -> dict[str, Any]:
    """What the parent needs to raise the child's error again: its type's import path, message, transience."""
    cls = type(exc)
    return {"type": f"{cls.__module__}.{cls.__qualname__}", "message": str(exc), "transient": is_transient(exc)}


def rebuilt_error(record: dict[str, Any], where: str) -> Exception:
    """The child's error as the parent raises it: TransientError when it was transient (retried), else its own type
    when that imports and takes a message (a ValueError stays a ValueError), else a RuntimeError naming it."""
    text = f"{where}: {record['message']}"
    if record.get("transient"):
        return TransientError(f"{text} ({record['type']})")
    module, _, name = record["type"].rpartition(".")
    try:
        cls = getattr(builtins if module == "builtins" else importlib.import_module(module), name)
        if isinstance(cls, type) and issubclass(cls, Exception):
            return cls(text)
    except Exception:  # noqa: BLE001 - a type that will not import or construct: named in a RuntimeError instead
        pass
    return RuntimeError(f"{where}: {record['type']}: {record['message']}")
