"""The trainer process's side of ``training.mode: process`` (the protocol and the parent: ``trainer_process.py``).

    python -m tasks.support.trainer_worker CONFIG.json

Reads one JSON request per line from stdin, runs it as ``training.mode: local`` runs it in the flow's process
(tasks/training.py, tasks/sft.py, on the config with mode ``local``) and answers on the stdout it was started with;
everything else this process prints goes to stderr, and its ``trajflow`` log records go to the parent as protocol
lines. It exits when the process that started it is gone, or on ``{"op": "exit"}`` / the end of stdin.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

from tasks.run_config import RunConfig
from tasks.support.distributed_training import PARENT_ENV, exit_when_gone
from tasks.support.trainer_process import error_record


class _Forward(logging.Handler):
    """Log records as protocol lines, so they reach the flow's log (file, console, Prefect) as the parent's own."""

    def __init__(self, send):
        super().__init__(logging.INFO)
        self.send = send

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + logging.Formatter().formatException(record.exc_info)
        self.send({"log": record.levelno, "message": message})


def serve(config: RunConfig, op: str, step: int) -> tuple[dict[str, Any], dict[str, float]]:
    """One request, run as ``training.mode: local`` runs it in the flow's process."""
    from tasks import sft, training

    if op == "initialize":
        return training.initialize_policy_fn(config), {}
    if op == "sft":
        return sft.sft_policy_fn(config), {}
    if op == "load":
        from tasks.support.runtime import get_runtime

        get_runtime(config).trainer_at(step)
        return {"step": step}, {}
    result = training.train_policy_fn(config, step)
    return result, training.pop_body_seconds(config, step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.support.trainer_worker")
    parser.add_argument("config_file", type=Path)
    args = parser.parse_args(argv)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # prints and C libraries' output must not reach the protocol
    lock = threading.Lock()

    def send(message: dict[str, Any]) -> None:
        with lock:
            answers.write(json.dumps(message, default=str) + "\n")
            answers.flush()

    trajflow = logging.getLogger("trajflow")
    trajflow.addHandler(_Forward(send))
    trajflow.setLevel(logging.INFO)
    trajflow.propagate = False
    if os.environ.get(PARENT_ENV):
        exit_when_gone(int(os.environ[PARENT_ENV]))
    from tasks.training import trained_here  # torch, prefect: imported once stdout is the protocol's alone

    config = trained_here(RunConfig.model_validate_json(args.config_file.read_text()))
    for line in sys.stdin.buffer:
        request = json.loads(line)
        if request["op"] == "exit":
            break
        try:
            result, seconds = serve(config, request["op"], int(request["step"]))
        except Exception as exc:  # noqa: BLE001 - every error goes back to the parent, which raises it
            send({"error": error_record(exc)})
        else:
            send({"result": result, "seconds": seconds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
