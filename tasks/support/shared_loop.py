"""One event loop per process for the async work of the tasks (rollouts, evaluations), on a daemon thread.

Why: a task that ran its coroutines with ``asyncio.run`` got a new loop each time, and with it a new policy client,
new HTTP connections (one per concurrent call) and a new thread pool for its file writes; on the shared loop the
run's policy client (``Runtime.policy_client``) and its connections carry over from one step to the next.

Rule: :func:`run_on_shared_loop` runs a coroutine there in the caller's context (Prefect's task run and settings,
which its loggers and artifacts read, are context variables) and blocks the calling thread until it is done; its
result or exception is the caller's. Tasks running at once (the async pipeline's rollouts of later steps beside the current step's work)
are coroutines of the one loop. If the caller is interrupted while it waits (KeyboardInterrupt, a Prefect timeout),
the coroutine is cancelled before the exception goes on. Called from the loop's own thread it would wait for itself:
that is refused.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_pid = 0  # a forked child has the loop object but not its thread: it starts its own


def shared_loop() -> asyncio.AbstractEventLoop:
    """The process's shared loop, started on first use."""
    global _loop, _thread, _pid
    with _lock:
        if _loop is None or _pid != os.getpid() or not _thread.is_alive():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="trajflow-shared-loop", daemon=True)
            thread.start()
            _loop, _thread, _pid = loop, thread, os.getpid()
        return _loop


def on_shared_loop() -> bool:
    """True when the running code is on the shared loop's thread."""
    return _thread is not None and threading.current_thread() is _thread


def run_on_shared_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on the shared loop in a copy of the caller's context; wait for and return its result."""
    if on_shared_loop():
        coro.close()
        raise RuntimeError("run_on_shared_loop called on the shared loop itself: await the coroutine instead")
    loop = shared_loop()
    context = contextvars.copy_context()

    async def in_callers_context() -> T:
        return await loop.create_task(coro, context=context)

    future = asyncio.run_coroutine_threadsafe(in_callers_context(), loop)
    try:
        return future.result()
    except BaseException:
        future.cancel()  # an interrupted caller: the coroutine stops too (a no-op when it has finished)
        raise
