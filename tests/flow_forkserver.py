"""A fork server for flow processes in tests: heavy libraries imported once, one forked process per run.

A `python -m flows.train` process spends ~6 s of 2 CPU cores importing torch, transformers and
peft before its first step. This server imports them once (nothing else: they read no per-run
setting at import); each run is then a fork that takes its own environment, working folder and log
file, starts a new session (its own process group) and runs the module as ``__main__``, exiting
through the interpreter's normal shutdown. Prefect, trajflow and the agent are imported in the
child, after its environment is set: Prefect reads its settings (PREFECT_HOME, PREFECT_API_URL) at
import. A run is still a process of its own, with its own PID, killed by a real SIGKILL.

Protocol (JSON lines): the server prints {"ready": true}; per request {"module", "args", "env", "cwd",
"log"} it prints {"pid"} at once and {"pid", "returncode"} when that process ends (returncode as
subprocess reports it: -9 after SIGKILL). Runs are served one after another; EOF on stdin ends it.
"""

from __future__ import annotations

import io
import json
import os
import runpy
import sys

PRELOAD = ("torch", "transformers", "peft")


def _child(req: dict) -> None:
    """Become the requested process; leaves only through SystemExit (normal interpreter shutdown)."""
    os.setsid()
    log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    sys.stdin = open(0, closefd=False)
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.path[0] = req["cwd"]  # as `python -m` run there
    sys.argv = [req["module"], *req["args"]]
    runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    raise SystemExit(0)


def serve(requests, replies) -> None:
    def reply(obj: dict) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    reply({"ready": True})
    for line in requests:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        reply({"pid": pid})
        _, status = os.waitpid(pid, 0)
        reply({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    for name in PRELOAD:
        __import__(name)
    serve(sys.stdin, sys.stdout)
