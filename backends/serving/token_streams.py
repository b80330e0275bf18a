"""The engine stream of one streamed answer (`Engine.stream_all`: every prompt of a text completion, the one of a
chat), read in batches.

A task reads the stream into a queue, so the answer's writer takes what every prompt's steps handed over since it
last looked, in one batch. `close()` cancels the reader, which aborts the engine requests not finished (their
sequences, KV slots and LoRA slots are freed at the engine's next iteration); `interrupt(error)` does the same and
makes the writer's next `take` raise `error` (the client went away).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from backends.inference.engine import Accepted, Completion

Item = list[Accepted] | list[Completion]
_END = (-1, None)  # the stream is exhausted: every prompt's completions came


class TokenStreams:
    """`await take()` -> [(prompt index, a step's tokens or that prompt's completions)], None once all are done."""

    def __init__(self, stream: AsyncIterator[tuple[int, Item]]):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = True
        self._reader = asyncio.ensure_future(self._read(stream))

    async def _read(self, stream: AsyncIterator[tuple[int, Item]]) -> None:
        try:
            async for entry in stream:
                self._queue.put_nowait(entry)
        except Exception as e:  # noqa: BLE001 - the writer raises it (cancellation is not caught: it ends the read)
            self._queue.put_nowait((-1, e))
        else:
            self._queue.put_nowait(_END)

    async def take(self) -> list[tuple[int, Item]] | None:
        batch = []
        while self._open and not batch:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            for _, item in batch:
                if isinstance(item, BaseException):
                    self.close()
                    raise item
            if batch[-1] is _END:  # nothing comes after it
                self._open = False
                batch.pop()
        return batch or None

    def close(self) -> None:
        self._reader.cancel()

    def interrupt(self, error: BaseException) -> None:
        self.close()
        self._queue.put_nowait((-1, error))
