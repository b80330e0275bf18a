"""Tokenizer work of the embedded server (validating a request, rendering its chat template, encoding a prompt,
building the response) on a few worker threads, each with its own copy of the tokenizer.

Why: on the event loop, one large request's template rendering and encoding would delay every other request,
``/health`` included. Why copies: a Hugging Face fast tokenizer is not re-entrant ("Already borrowed" when two
threads use one), which is also why the engine thread keeps its own.
"""

from __future__ import annotations

import asyncio
import copy
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class TokenizerPool:
    """`await pool.run(fn, *args)` calls ``fn(tokenizer, *args)`` on a worker thread with that thread's tokenizer."""

    def __init__(self, tokenizer, workers: int | None = None):
        self._tokenizer = tokenizer
        self._local = threading.local()
        self.executor = ThreadPoolExecutor(max_workers=workers or min(4, os.cpu_count() or 1),
                                           thread_name_prefix="tokenize")

    def _call(self, fn: Callable[..., Any], args: tuple) -> Any:
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self._tokenizer)
        return fn(tokenizer, *args)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, self._call, fn, args)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
