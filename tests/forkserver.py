"""A fork server for test subprocesses: heavy libraries imported once, one forked process per run.

A Python process of trajflow spends ~6 s of 2 CPU cores importing torch, transformers and peft
before doing anything. This server imports them once (nothing else: they read no per-run setting
at import); each run is then a fork that takes its own environment, working folder and output
files, starts a new session (its own process group) and runs a module (``-m``) or a script as
``__main__``, leaving through the interpreter's normal shutdown (atexit handlers run). Prefect,
trajflow and user code are imported in the child, after its environment is set: Prefect reads its
settings (PREFECT_HOME, PREFECT_API_URL) at import. A run is still a process of its own, with its
own PID, memory and exit status; SIGKILL and SIGTERM reach it as they would any process.

Protocol (JSON lines on stdin/stdout): the server prints {"ready": true}. A request {"argv", "env",
"cwd", "stdout", "stderr"} (argv as after ``python``: ["-m", "flows.train", ...] or ["script.py",
...]; stdout/stderr are file paths, stderr null for the stdout file) is answered at once with
{"pid"}; when that process ends the server prints {"pid", "returncode"} (as subprocess reports it:
-9 after SIGKILL). Runs may overlap. EOF on stdin ends the server once its runs have ended.
"""

from __future__ import annotations

import io
import json
import os
import runpy
import select
import sys

PRELOAD = ("torch", "transformers", "peft")


def _redirect(fd: int, path: str | None, flags: int) -> None:
    target = os.open(path or os.devnull, flags, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _child(req: dict) -> None:
    """Become the requested process; leaves only by an exception (normal interpreter shutdown)."""
    os.setsid()
    write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    _redirect(0, None, os.O_RDONLY)
    _redirect(1, req["stdout"], write)
    if req.get("stderr"):
        _redirect(2, req["stderr"], write)
    else:
        os.dup2(1, 2)
    sys.stdin = open(0, closefd=False)
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    if os.environ.get("PYTHONFAULTHANDLER"):  # as a fresh interpreter reads it at start-up
        import faulthandler

        faulthandler.enable(all_threads=True)
    argv = req["argv"]
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if argv[0] == "-m":  # as `python -m MODULE ARGS` run in cwd
        sys.path[:1] = [os.getcwd(), *pythonpath]
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:  # as `python SCRIPT ARGS`
        script = os.path.abspath(argv[0])
        sys.path[:1] = [os.path.dirname(script), *pythonpath]
        sys.argv = list(argv)
        runpy.run_path(script, run_name="__main__")
    raise SystemExit(0)


def serve(stdin_fd: int, replies) -> None:
    def reply(obj: dict) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    reply({"ready": True})
    running: set[int] = set()
    pending = b""
    open_input = True
    while open_input or running:
        readable, _, _ = select.select([stdin_fd] if open_input else [], [], [], 0.05)
        if readable:
            chunk = os.read(stdin_fd, 65536)
            open_input = bool(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                pid = os.fork()
                if pid == 0:
                    _child(json.loads(line))
                running.add(pid)
                reply({"pid": pid})
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                reply({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    for name in PRELOAD:
        __import__(name)
    serve(sys.stdin.fileno(), sys.stdout)
