"""Request bodies of the embedded server: a size cap, JSON parsed off the event loop, and the JSON we refuse.

- **Size.** At most ``max_bytes`` (default `DEFAULT_MAX_BODY_BYTES`, 4 MiB: a chat request that fills a 32k-token
  context is well under 1 MiB). A ``Content-Length`` above it is refused before the body is read; a chunked body
  is counted as it arrives and refused the moment it passes the cap. Both answer 413 (`BodyTooLarge`).
- **Off the event loop.** ``json.loads`` runs on a worker thread, so parsing a large body never delays another
  request (or ``/health``).
- **Refused with a 400** (`BadBody`): a body that is not JSON; nesting deeper than `MAX_DEPTH` levels (Python's
  parser fails with RecursionError near 1000 levels, and nested values later reach recursive code: validation, the
  chat template); a string holding a lone UTF-16 surrogate (``"\\ud800"``), which is not Unicode text and would
  fail only later, in the tokenizer.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import Executor
from typing import Any

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
MAX_DEPTH = 64


class BadBody(ValueError):
    """The body is not acceptable JSON (HTTP 400); the message says why."""


class BodyTooLarge(ValueError):
    """The body is larger than the server accepts (HTTP 413)."""

    def __init__(self, max_bytes: int):
        super().__init__(f"the request body is larger than this server's limit of {max_bytes} bytes")


async def read_json(request, max_bytes: int, executor: Executor | None = None) -> Any:
    """The request's JSON body, read within `max_bytes` and parsed on `executor` (module docstring)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:  # the HTTP server refuses a malformed one itself
        raise BodyTooLarge(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(max_bytes)
        chunks.append(chunk)
    return await asyncio.get_running_loop().run_in_executor(executor, parse_json, b"".join(chunks))


def parse_json(raw: bytes) -> Any:
    """`raw` as JSON, checked for depth and lone surrogates; BadBody naming the problem."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise BadBody(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError:  # UnicodeDecodeError included: the body is not UTF-8
        raise BadBody("the request body is not valid JSON") from None
    check_json_value(value)
    return value


def check_json_value(value: Any) -> None:
    """Walk `value` without recursion: BadBody for nesting beyond MAX_DEPTH or a lone surrogate in a string."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                raise BadBody(f"the request body nests deeper than {MAX_DEPTH} levels")
            if isinstance(item, dict):
                for key, child in item.items():
                    _check_text(key)
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in item)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadBody(f"the request body holds a lone UTF-16 surrogate ({text[e.start]!r}), which is not "
                           "valid Unicode text") from None
