"""Results handed from the engine thread to the event loops awaiting them: one wake-up of a loop per batch.

An engine step finishes many requests at once (at 64 concurrent requests of equal length, all of them). Handing
each result over with its own ``call_soon_threadsafe`` wakes the loop once per request (a write to its wake-up pipe
each, and as many loop iterations); here the results for one loop go into that loop's inbox, and only the first
result of a batch schedules a drain, which settles every future in the inbox in one callback. The engine thread
holds the GIL while it finishes a step's requests, so a step's results land in one batch.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from typing import Any


class _Inbox:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # weak: this inbox is the value of a WeakKeyDictionary keyed by the loop
        self._items: list[tuple[asyncio.Future, Any]] = []
        self._lock = threading.Lock()

    def put(self, fut: asyncio.Future, result: Any) -> None:
        with self._lock:
            self._items.append((fut, result))
            if len(self._items) > 1:
                return  # the drain scheduled by the first one will take it
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the loop is gone")
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            with self._lock:
                self._items.clear()

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for fut, result in items:
            if fut.done():  # cancelled meanwhile
                continue
            if isinstance(result, BaseException):
                fut.set_exception(result)
            else:
                fut.set_result(result)


class LoopHandoff:
    """`future()` -> (a future of the running loop, the callback that settles it from any thread)."""

    def __init__(self):
        self._inboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def future(self) -> tuple[asyncio.Future, Callable[[Any], None]]:
        loop = asyncio.get_running_loop()
        with self._lock:
            inbox = self._inboxes.get(loop)
            if inbox is None:
                inbox = self._inboxes[loop] = _Inbox(loop)
        fut = loop.create_future()
        return fut, lambda result: inbox.put(fut, result)
