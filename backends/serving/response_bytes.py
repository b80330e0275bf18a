"""Response bodies of the embedded server as bytes, encoded on a worker thread rather than by the event loop.

- **JSON.** `orjson` (a dependency; 5-10x faster than the stdlib on a response of logprobs) when it can encode the
  value, else the stdlib with what Starlette's ``JSONResponse`` uses: compact separators, UTF-8 text unescaped, no
  NaN or infinity. The two give the same JSON value; only number spellings may differ (``1e-05`` / ``1e-5``).
  Where orjson refuses a value (an integer beyond 64 bits), the stdlib decides.
- **Finite numbers.** JSON has no NaN or infinity: the stdlib refuses them, orjson would write ``null``. The only
  floats of a response that come from the model are logprobs; `check_finite` refuses a non-finite one (HTTP 500,
  as Starlette's encoder did) before it could reach the body.
- **Server-sent events.** A stream's chunks as ``data: <json>\\n\\n`` events, written as the engine's steps hand
  over tokens (`backends.serving.stream_chunks`), the last followed by ``data: [DONE]\\n\\n``.
"""

from __future__ import annotations

import json
import math
from typing import Any

try:
    import orjson
except ImportError:  # a GPU image with only the serving wheels: the stdlib, slower, same JSON
    orjson = None


def json_bytes(value: Any) -> bytes:
    """`value` as compact UTF-8 JSON (module docstring)."""
    if orjson is not None:
        try:
            return orjson.dumps(value)
        except TypeError:  # beyond 64-bit integers, non-str keys, ...: the stdlib's rules apply
            pass
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def check_finite(values: list[float], what: str) -> None:
    """ValueError unless every value is finite (one C-level sum: NaN and infinities survive it)."""
    try:
        ok = math.isfinite(math.fsum(values))
    except (ValueError, OverflowError):  # fsum refuses inf + -inf, and overflows only past 1e308
        ok = False
    if not ok:
        raise ValueError(f"the model produced a non-finite {what}; JSON cannot carry it")


def sse_events(chunks: list[dict], done: bool = False) -> bytes:
    """`chunks` as server-sent events, then the ``[DONE]`` event if `done`."""
    body = b"".join(b"data: " + json_bytes(chunk) + b"\n\n" for chunk in chunks)
    return body + b"data: [DONE]\n\n" if done else body
