"""Request bodies of the embedded server: a size cap, JSON parsed off the event loop, and the JSON we refuse.

- **Size.** At most ``max_bytes`` (default `DEFAULT_MAX_BODY_BYTES`, 4 MiB: a chat request that fills a 32k-token
  context is well under 1 MiB). A ``Content-Length`` above it is refused before the body is read; a chunked body
  is counted as it arrives and refused the moment it passes the cap. Both answer 413 (`BodyTooLarge`).
- **Off the event loop.** Parsing runs on a worker thread, so a large body never delays another request (or
  ``/health``); the completion routes parse, validate and tokenize in one worker job (`read_body` then
  `parse_json` there). The parser is `orjson` when it accepts the body and the body has no run of 19 or more
  digits (orjson reads integers beyond 64 bits as floats), else the stdlib's ``json.loads``: orjson accepts a subset
  of what the stdlib accepts (no NaN, no lone surrogates, UTF-8 only) and gives the same values, so a body means
  what the stdlib makes of it, and its errors name the problem.
- **Refused with a 400** (`BadBody`): a body that is not JSON; nesting deeper than `MAX_DEPTH` levels (Python's
  parser fails with RecursionError near 1000 levels, and nested values later reach recursive code: validation, the
  chat template); a string holding a lone UTF-16 surrogate (``"\\ud800"``), which is not Unicode text and would
  fail only later, in the tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import Executor
from typing import Any

try:
    import orjson
except ImportError:  # a GPU image with only the serving wheels: the stdlib alone
    orjson = None

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
MAX_DEPTH = 64
_LONG_DIGITS = re.compile(rb"[0-9]{19}")


class BadBody(ValueError):
    """The body is not acceptable JSON (HTTP 400); the message says why."""


class BodyTooLarge(ValueError):
    """The body is larger than the server accepts (HTTP 413)."""

    def __init__(self, max_bytes: int):
        super().__init__(f"the request body is larger than this server's limit of {max_bytes} bytes")


async def read_body(request, max_bytes: int) -> bytes:
    """The request's body, read within `max_bytes` (BodyTooLarge past it)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:  # the HTTP server refuses a malformed one itself
        raise BodyTooLarge(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request, max_bytes: int, executor: Executor | None = None) -> Any:
    """The request's JSON body, read within `max_bytes` and parsed on `executor` (module docstring)."""
    raw = await read_body(request, max_bytes)
    return await asyncio.get_running_loop().run_in_executor(executor, parse_json, raw)


def parse_json(raw: bytes) -> Any:
    """`raw` as JSON, checked for depth and lone surrogates; BadBody naming the problem."""
    if orjson is not None and not _LONG_DIGITS.search(raw):
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # the stdlib decides (NaN, lone surrogates, other encodings) and names the problem
        else:
            check_json_value(value, strings=False)  # orjson refuses lone surrogates itself
            return value
    try:
        value = json.loads(raw)
    except RecursionError:
        raise BadBody(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError:  # UnicodeDecodeError included: the body is not UTF-8
        raise BadBody("the request body is not valid JSON") from None
    check_json_value(value)
    return value


def check_json_value(value: Any, strings: bool = True) -> None:
    """Walk `value` without recursion: BadBody for nesting beyond MAX_DEPTH or (with `strings`) a lone surrogate in
    a string. Scalars other than strings are never pushed: a prompt of token ids costs one pass over a list."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise BadBody(f"the request body nests deeper than {MAX_DEPTH} levels")
        children = item.values() if isinstance(item, dict) else item
        if strings and isinstance(item, dict):
            for key in item:
                _check_text(key)
        kinds = (str, dict, list) if strings else (dict, list)
        stack.extend((child, depth + 1) for child in children if isinstance(child, kinds))


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadBody(f"the request body holds a lone UTF-16 surrogate ({text[e.start]!r}), which is not "
                           "valid Unicode text") from None
