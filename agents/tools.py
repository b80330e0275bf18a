"""Tool-call helpers: parse and validate the tool calls of an assistant message, run a tool with a
timeout, and build the message that carries its result back to the model.

Where tool calls come from. A server with a tool-call parser (vLLM ``--tool-call-parser hermes``,
the embedded server) returns them in ``message["tool_calls"]`` with ``function.arguments`` as a JSON
string. When it could not parse them (bad JSON, a truncated call) the raw text stays in ``content``;
:func:`parse_tool_calls` then reads ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
from the content, so a malformed call is still seen, and scored, as a malformed call rather than as
prose. Structured ``tool_calls`` win when both are present.

Every problem with a call becomes a :class:`ToolCall` with ``error`` set and an ``error_kind``:
``bad_json`` (arguments are not a JSON object, or a ``<tool_call>`` block is not JSON), ``unknown_tool``,
``bad_arguments`` (missing required or wrongly typed arguments), ``timeout`` (the tool ran past its
limit), ``tool_error`` (the tool raised). None of them raises: agents score them.

A hanging *async* tool is cancelled at the timeout. A hanging *sync* tool runs in a worker thread
that Python cannot kill: the rollout moves on at the timeout and the thread ends when the function
returns. Write long-running tools as ``async`` functions.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

ErrorKind = Literal["bad_json", "unknown_tool", "bad_arguments", "timeout", "tool_error"]
ERROR_KINDS: tuple[str, ...] = ("bad_json", "unknown_tool", "bad_arguments", "timeout", "tool_error")
MODEL_ERROR_KINDS: tuple[str, ...] = ("bad_json", "unknown_tool", "bad_arguments")  # the model's fault

_TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass
class ToolCall:
    """One tool call as the model wrote it; ``error`` says why it cannot run (None when it can)."""

    name: str
    arguments: dict[str, Any] | None
    raw_arguments: str
    id: str | None = None
    source: Literal["tool_calls", "content"] = "tool_calls"
    error: str | None = None
    error_kind: ErrorKind | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class ToolResult:
    """What running a tool gave: the text for the model, and the error kind when it failed."""

    content: str
    error_kind: ErrorKind | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error_kind is None


def function_tool(name: str, description: str, properties: dict[str, dict[str, Any]],
                  required: list[str] | None = None) -> dict[str, Any]:
    """An OpenAI ``tools`` entry: ``{"type": "function", "function": {name, description, parameters}}``."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(required if required is not None else properties),
                "additionalProperties": False,
            },
        },
    }


def _decode_arguments(raw: Any) -> tuple[dict[str, Any] | None, str | None]:
    """Arguments as a dict, or (None, reason). Accepts a JSON string or an already-decoded dict."""
    if isinstance(raw, dict):
        return raw, None
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}, None
    if not isinstance(raw, str):
        return None, f"arguments must be a JSON object, got {type(raw).__name__}"
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        return None, f"arguments are not valid JSON ({exc.msg} at char {exc.pos}): {raw[:200]!r}"
    if not isinstance(value, dict):
        return None, f"arguments must be a JSON object, got {type(value).__name__}: {raw[:200]!r}"
    return value, None


def _from_structured(tc: dict[str, Any]) -> ToolCall:
    fn = tc.get("function") or {}
    name = str(fn.get("name") or "")
    raw = fn.get("arguments")
    raw_text = raw if isinstance(raw, str) else json.dumps(raw)
    args, err = _decode_arguments(raw)
    call = ToolCall(name=name, arguments=args, raw_arguments=raw_text, id=tc.get("id"), source="tool_calls")
    if not name:
        call.error, call.error_kind = "tool call without a function name", "bad_json"
    elif err:
        call.error, call.error_kind = f"{name}: {err}", "bad_json"
    return call


def _from_block(text: str) -> ToolCall:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return ToolCall(name="", arguments=None, raw_arguments=text, source="content", error_kind="bad_json",
                        error=f"<tool_call> is not valid JSON ({exc.msg} at char {exc.pos}): {text[:200]!r}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj.get("name"):
        return ToolCall(name="", arguments=None, raw_arguments=text, source="content", error_kind="bad_json",
                        error=f'<tool_call> must be {{"name": ..., "arguments": {{...}}}}: {text[:200]!r}')
    raw = obj.get("arguments", obj.get("parameters"))
    args, err = _decode_arguments(raw)
    call = ToolCall(name=obj["name"], arguments=args, raw_arguments=raw if isinstance(raw, str) else json.dumps(raw),
                    source="content")
    if err:
        call.error, call.error_kind = f"{call.name}: {err}", "bad_json"
    return call


def parse_tool_calls(message: dict[str, Any]) -> list[ToolCall]:
    """The tool calls of an assistant message: structured ``tool_calls`` first, else ``<tool_call>`` blocks."""
    structured = message.get("tool_calls") or []
    if structured:
        return [_from_structured(tc if isinstance(tc, dict) else tc.model_dump()) for tc in structured]
    content = message.get("content") or ""
    if not isinstance(content, str) or "<tool_call>" not in content:
        return []
    return [_from_block(m.group(1)) for m in _TOOL_CALL_BLOCK.finditer(content)]


def _schema_of(tools: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    for tool in tools:
        fn = tool.get("function", tool)
        if fn.get("name") == name:
            return fn.get("parameters") or {"type": "object", "properties": {}}
    return None


def _type_ok(value: Any, expected: str | list[str] | None) -> bool:
    if expected is None:
        return True
    names = expected if isinstance(expected, list) else [expected]
    for n in names:
        types = _JSON_TYPES.get(n)
        if types is None:
            return True  # a type we do not check
        if isinstance(value, bool) and n in ("integer", "number"):
            continue
        if isinstance(value, types):
            return True
    return False


def validate_tool_call(call: ToolCall, tools: list[dict[str, Any]]) -> ToolCall:
    """Set ``call.error`` when the tool is unknown or the arguments break its JSON schema (top level only)."""
    if not call.ok:
        return call
    schema = _schema_of(tools, call.name)
    if schema is None:
        known = ", ".join(sorted(t.get("function", t).get("name", "?") for t in tools))
        call.error, call.error_kind = f"unknown tool {call.name!r}; available tools: {known}", "unknown_tool"
        return call
    args = call.arguments or {}
    props = schema.get("properties") or {}
    missing = [k for k in schema.get("required") or [] if k not in args]
    extra = [k for k in args if k not in props] if schema.get("additionalProperties") is False else []
    wrong = [f"{k} should be {props[k].get('type')}" for k, v in args.items()
             if k in props and not _type_ok(v, props[k].get("type"))]
    problems = ([f"missing {', '.join(missing)}"] if missing else []) + (
        [f"unexpected {', '.join(extra)}"] if extra else []) + wrong
    if problems:
        call.error = f"{call.name}: bad arguments ({'; '.join(problems)}); got {call.raw_arguments[:200]!r}"
        call.error_kind = "bad_arguments"
    return call


async def run_tool(fn: Callable[..., Any], arguments: dict[str, Any], timeout_s: float) -> ToolResult:
    """Call ``fn(**arguments)`` (sync in a worker thread, or async) within ``timeout_s`` seconds.

    The result is converted to text (``str`` as is, anything else as JSON). A timeout or an exception
    becomes a :class:`ToolResult` with an error kind; nothing raises except cancellation.
    """
    start = time.perf_counter()
    try:
        if inspect.iscoroutinefunction(fn):
            value = await asyncio.wait_for(fn(**arguments), timeout_s)
        else:
            value = await asyncio.wait_for(asyncio.to_thread(fn, **arguments), timeout_s)
    except (asyncio.TimeoutError, TimeoutError):
        return ToolResult(f"Error: tool timed out after {timeout_s:g} s", "timeout", time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - a failing tool is an outcome for the model to see
        return ToolResult(f"Error: {type(exc).__name__}: {exc}"[:500], "tool_error", time.perf_counter() - start)
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return ToolResult(text, None, time.perf_counter() - start)


def tool_result_message(call: ToolCall, content: str) -> dict[str, Any]:
    """The message answering ``call``: ``role: tool`` with its id, or (a call parsed from text, which has
    no id) a user turn holding ``<tool_response>`` the way Hermes/Qwen templates render tool results."""
    if call.id:
        return {"role": "tool", "tool_call_id": call.id, "content": content}
    return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}


class ToolBox:
    """Named tools with their schemas and one timeout: parse, validate and run an assistant's calls."""

    def __init__(self, functions: dict[str, Callable[..., Any]], schemas: list[dict[str, Any]],
                 timeout_s: float = 5.0):
        names = {s["function"]["name"] for s in schemas}
        if names != set(functions):
            raise ValueError(f"tool functions {sorted(functions)} and schemas {sorted(names)} must name the same tools")
        if timeout_s <= 0:
            raise ValueError(f"tool timeout must be positive, got {timeout_s}")
        self.functions = dict(functions)
        self.schemas = list(schemas)
        self.timeout_s = timeout_s

    def calls(self, message: dict[str, Any]) -> list[ToolCall]:
        """Parsed and validated calls of an assistant message."""
        return [validate_tool_call(c, self.schemas) for c in parse_tool_calls(message)]

    async def run(self, call: ToolCall) -> ToolResult:
        """Run a valid call, or turn an invalid one into its error result without running anything."""
        if not call.ok:
            return ToolResult(f"Error: {call.error}", call.error_kind)
        return await run_tool(self.functions[call.name], call.arguments or {}, self.timeout_s)
