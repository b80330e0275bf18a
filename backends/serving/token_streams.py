"""The engine streams of one streamed answer (one per prompt of a text completion, one for chat), read as one.

Each stream (`Engine.stream`) is read by its own task into one queue, so the answer's writer waits on one thing and
takes what every prompt's steps handed over since it last looked, in one batch. `close()` cancels the readers, which
aborts their engine requests (their sequences, KV slots and LoRA slots are freed at the engine's next iteration);
`interrupt(error)` does the same and makes the writer's next `take` raise `error` (the client went away).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from backends.inference.engine import Accepted, Completion

Item = list[Accepted] | list[Completion]


class TokenStreams:
    """`await take()` -> [(prompt index, a step's tokens or that prompt's completions)], None once all are done."""

    def __init__(self, streams: list[AsyncIterator[Item]]):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(streams)
        self._readers = [asyncio.ensure_future(self._read(i, s)) for i, s in enumerate(streams)]

    async def _read(self, index: int, stream: AsyncIterator[Item]) -> None:
        try:
            async for item in stream:
                self._queue.put_nowait((index, item))
        except Exception as e:  # noqa: BLE001 - the writer raises it (cancellation is not caught: it ends the read)
            self._queue.put_nowait((index, e))

    async def take(self) -> list[tuple[int, Item]] | None:
        if not self._open:
            return None
        batch = [await self._queue.get()]
        while not self._queue.empty():
            batch.append(self._queue.get_nowait())
        for _, item in batch:
            if isinstance(item, BaseException):
                self.close()
                raise item
            if item and isinstance(item[0], Completion):
                self._open -= 1
        return batch

    def close(self) -> None:
        for reader in self._readers:
            reader.cancel()

    def interrupt(self, error: BaseException) -> None:
        self.close()
        self._queue.put_nowait((-1, error))
