"""Tool calls in model text, the Hermes/Qwen way: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``.

`parse_tool_calls(text)` returns ``(content, calls)``: content is the text before the first ``<tool_call>`` (None
if blank), calls are OpenAI ``tool_calls`` entries with ``arguments`` as a JSON string. If the text has no complete
tool-call block, or any block is not a JSON object with a string ``name`` (``arguments`` may be an object, a JSON
string, or absent; ``parameters`` is accepted as a synonym), the result is ``(text, [])``: the caller returns it as
plain content, so a malformed call is never an error.
"""

from __future__ import annotations

import json
import re
import secrets

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


def _arguments(call: dict) -> str | None:
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Split `text` into (content before the calls, OpenAI tool_calls); ([text], []) when there is no valid call."""
    blocks = _BLOCK.findall(text)
    if not blocks:
        return text, []
    calls = []
    for block in blocks:
        try:
            call = json.loads(block.strip())
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            return text, []
        arguments = _arguments(call)
        if arguments is None:
            return text, []
        calls.append({"id": f"chatcmpl-tool-{secrets.token_hex(12)}", "type": "function",
                      "function": {"name": call["name"], "arguments": arguments}})
    content = text[: text.index(OPEN)].strip()
    return (content or None), calls
