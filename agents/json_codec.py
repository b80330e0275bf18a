"""JSON for the policy client's transport, which parses every chat request and answer and writes it back.

``decode(raw)`` gives the value and the encoder that writes that value back as the same JSON value:

- `orjson` (a dependency; several times faster than the stdlib on an answer of token ids and logprobs) when it
  accepts `raw` and `raw` has no run of 19 or more digits (orjson reads integers beyond 64 bits as floats). A value
  orjson parsed holds no NaN or infinity (JSON has no spelling for them, and orjson accepts none), so orjson writes
  it back exactly.
- Otherwise the stdlib both ways, as Python's ``json`` module reads and writes (``NaN`` and ``Infinity`` literals,
  big integers).

The two give the same JSON value; the bytes may differ (spacing, ``é`` vs ``\\u00e9``, ``1e-05`` vs ``1e-5``),
which no JSON reader sees.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import orjson

_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def _stdlib_dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


def decode(raw: bytes) -> tuple[Any, Callable[[Any], bytes]]:
    """`raw` as JSON, and the encoder to write it (or a value made from it) back; ValueError if it is not JSON."""
    if not _LONG_DIGITS.search(raw):
        try:
            return orjson.loads(raw), orjson.dumps
        except orjson.JSONDecodeError:
            pass  # the stdlib decides: NaN literals, other encodings, or an error that names the problem
    return json.loads(raw), _stdlib_dumps
