"""Progress of long work, shown in the terminal and as a Prefect progress artifact.

The terminal line is printed through the ``trajflow`` logger at once. The artifact calls (create, then updates) are
sent to the Prefect API by one background thread of the process (its own event loop), in the order they were made
and in the caller's context (its Prefect settings and task run), so the work never waits for the API: each call is
a round trip to the API server, 25-60 ms on the project's 2-core machine, and a rollouts task makes two. An update
sends the latest value when its turn comes, so updates queued behind a slow call collapse into one.
:func:`flush_progress` waits until every call made so far has been sent: the flows call it before they return
(their ephemeral API server stops with the process), and at exit it runs once more.

Outside a Prefect run (plain scripts, unit tests) the artifact part is skipped silently.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextvars
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable

from tasks.support.prefect_client import api_client

log = logging.getLogger("trajflow")

FLUSH_TIMEOUT_S = 30.0  # longest wait for the API at a flush; a dead API server must not hang the flow's end
EXIT_FLUSH_TIMEOUT_S = 5.0  # at interpreter exit the flows have flushed already: what is left is best effort


def _in_prefect_run() -> bool:
    try:
        from prefect.context import FlowRunContext, TaskRunContext

        return FlowRunContext.get() is not None or TaskRunContext.get() is not None
    except Exception:  # noqa: BLE001 - prefect missing or not initialised: no artifacts
        return False


class _Sender:
    """One daemon thread running an event loop that awaits the submitted calls one after another."""

    def __init__(self):
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue | None = None
        self._pid = 0  # a forked child has the loop but not its thread: it starts its own

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    self._queue = asyncio.Queue()
                    loop.create_task(self._drain())
                    ready.set()
                    loop.run_forever()

                threading.Thread(target=run, name="trajflow-progress", daemon=True).start()
                ready.wait()
                if self._loop is None:
                    atexit.register(flush_progress, EXIT_FLUSH_TIMEOUT_S)
                self._loop, self._pid = loop, os.getpid()
            return self._loop

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            call, context, done = await self._queue.get()
            try:
                await loop.create_task(call(), context=context)
            except Exception as exc:  # noqa: BLE001 - progress must never fail the work
                log.debug("progress artifact call failed: %s", exc)
            done.set_result(None)

    def submit(self, call: Callable[[], Awaitable[None]]) -> concurrent.futures.Future:
        """Queue `call()` to run after every call queued before it, in the caller's context; the future is done once it
        has run (failed or not)."""
        loop = self._start()
        done: concurrent.futures.Future = concurrent.futures.Future()
        loop.call_soon_threadsafe(self._queue.put_nowait, (call, contextvars.copy_context(), done))
        return done


_SENDER = _Sender()


async def _nothing() -> None:
    return None


def flush_progress(timeout_s: float = FLUSH_TIMEOUT_S) -> None:
    """Wait until every artifact call made so far in this process has been sent (at most `timeout_s`)."""
    if _SENDER._loop is None or _SENDER._pid != os.getpid():
        return
    try:
        _SENDER.submit(_nothing).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        log.debug("progress artifacts: the Prefect API did not answer within %.0f s", timeout_s)


class Progress:
    """Counts finished units of `total`, logging at most every `every_s` seconds and at the end."""

    def __init__(self, label: str, total: int, every_s: float = 2.0):
        self.label, self.total, self.every_s = label, max(total, 1), every_s
        self.done = 0
        self.extra = ""
        self._last = 0.0
        self._started = time.perf_counter()
        self._artifact_id = None
        self._sent: float | None = None  # the progress the artifact shows
        self._prefect = _in_prefect_run()

    def _percent(self) -> float:
        return 100.0 * self.done / self.total

    async def start(self) -> Progress:
        if self._prefect:
            _SENDER.submit(self._create)
        return self

    async def _create(self) -> None:
        from prefect.artifacts import ProgressArtifact

        value = self._percent()
        async with api_client() as client:
            artifact = await ProgressArtifact(progress=value, description=self.label).acreate(client=client)
        self._artifact_id, self._sent = artifact.id, value

    async def _update(self) -> None:
        value = self._percent()
        if self._artifact_id is None or value == self._sent:  # not created (the API failed), or sent already
            return
        from prefect.artifacts import aupdate_progress_artifact

        async with api_client() as client:
            await aupdate_progress_artifact(self._artifact_id, progress=value, client=client)
        self._sent = value

    async def flush(self) -> None:
        """Wait until this progress's artifact shows what was reported so far (every call made before is sent)."""
        if self._prefect:
            await asyncio.wrap_future(_SENDER.submit(_nothing))

    async def advance(self, n: int = 1, extra: str = "") -> None:
        self.done += n
        if extra:
            self.extra = extra
        now = time.perf_counter()
        if now - self._last < self.every_s and self.done < self.total:
            return
        self._last = now
        elapsed = now - self._started
        log.info("%s: %d/%d (%.0f%%) %s [%.1fs]", self.label, self.done, self.total,
                 100.0 * self.done / self.total, self.extra, elapsed)
        if self._prefect:
            _SENDER.submit(self._update)
