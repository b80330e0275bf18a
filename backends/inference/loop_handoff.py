"""Results handed from the engine thread to the event loops awaiting them: one wake-up of a loop per engine step.

An engine step finishes many requests at once (at 64 concurrent requests of equal length, all of them). Handing
each result over with its own ``call_soon_threadsafe`` wakes the loop once per request: a write to its wake-up pipe
each (a system call that lets the loop take the GIL between two results), and as many loop iterations. Here a result
only goes into its loop's inbox; at the end of each iteration the engine thread calls `LoopHandoff.wake`, which
schedules one drain per loop with results waiting, and the drain settles them all in one callback.

A streamed request hands over more than one result: each engine step's tokens, then its completions. Its target is
a `Channel` rather than a future; the same inbox carries both, so a stream costs no extra wake-up of its loop, and
what one step accepted for every streamed row of a loop arrives in that step's one drain.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from typing import Any


class Channel:
    """Results for one reader on one event loop, in the order they were handed: `await take()` returns all that
    arrived since the last take (at least one)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._items: list[Any] = []
        self._waiter: asyncio.Future | None = None

    def feed(self, result: Any) -> None:
        """On the loop (the inbox's drain): queue `result` and wake the reader."""
        self._items.append(result)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[Any]:
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


class _Inbox:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # weak: this inbox is the value of a WeakKeyDictionary keyed by the loop
        self._items: list[tuple[asyncio.Future | Channel, Any]] = []
        self._scheduled = False
        self._lock = threading.Lock()

    def put(self, fut: asyncio.Future | Channel, result: Any) -> None:
        with self._lock:
            self._items.append((fut, result))

    def wake(self) -> None:
        with self._lock:
            if not self._items or self._scheduled:
                return
            self._scheduled = True
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the loop is gone")
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for fut, result in items:
            if isinstance(fut, Channel):
                fut.feed(result)
            elif fut.done():  # cancelled meanwhile
                continue
            elif isinstance(result, BaseException):
                fut.set_exception(result)
            else:
                fut.set_result(result)


class LoopHandoff:
    """`future()` -> (a future of the running loop, the callback that hands it its result from the engine thread),
    `channel()` the same for a stream of results; the engine thread calls `wake()` after each iteration to deliver
    what was handed."""

    def __init__(self):
        self._inboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def _inbox(self) -> tuple[asyncio.AbstractEventLoop, _Inbox]:
        loop = asyncio.get_running_loop()
        with self._lock:
            inbox = self._inboxes.get(loop)
            if inbox is None:
                inbox = self._inboxes[loop] = _Inbox(loop)
        return loop, inbox

    def future(self) -> tuple[asyncio.Future, Callable[[Any], None]]:
        loop, inbox = self._inbox()
        fut = loop.create_future()
        return fut, lambda result: inbox.put(fut, result)

    def channel(self) -> tuple[Channel, Callable[[Any], None]]:
        """(a `Channel` of the running loop, the callback that hands it a result from the engine thread)."""
        loop, inbox = self._inbox()
        channel = Channel(loop)
        return channel, lambda result: inbox.put(channel, result)

    def wake(self) -> None:
        with self._lock:
            inboxes = list(self._inboxes.values())
        for inbox in inboxes:
            inbox.wake()
