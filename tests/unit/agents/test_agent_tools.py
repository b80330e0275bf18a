"""Tool-call helpers: parsing structured and textual calls, schema checks, timeouts, result messages."""

from __future__ import annotations

import asyncio
import threading

import pytest

from agents.tools import (
    ToolBox,
    ToolCall,
    function_tool,
    parse_tool_calls,
    run_tool,
    tool_result_message,
    validate_tool_call,
)

TOOLS = [
    function_tool("search", "find", {"query": {"type": "string"}}),
    function_tool("read", "read", {"doc_id": {"type": "string"}, "lines": {"type": "integer"}}, required=["doc_id"]),
]


def _structured(name, arguments, id_="call_1"):
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}]}


@pytest.mark.parametrize("message, expected", [
    (_structured("search", '{"query": "x"}'), [("search", {"query": "x"}, None)]),
    (_structured("search", {"query": "x"}), [("search", {"query": "x"}, None)]),          # already decoded
    (_structured("search", ""), [("search", {}, None)]),                                   # no arguments
    (_structured("search", '{"query": '), [("search", None, "bad_json")]),
    (_structured("search", '["x"]'), [("search", None, "bad_json")]),
    (_structured("", "{}"), [("", {}, "bad_json")]),
    ({"role": "assistant", "content": 'ok <tool_call>{"name": "read", "arguments": {"doc_id": "d1"}}</tool_call>'},
     [("read", {"doc_id": "d1"}, None)]),
    ({"role": "assistant", "content": '<tool_call>{"name": "read", "parameters": "{\\"doc_id\\": \\"d\\"}"}</tool_call>'},
     [("read", {"doc_id": "d"}, None)]),
    ({"role": "assistant", "content": '<tool_call>{"name": "read", "arguments": {"doc_id": </tool_call>'},
     [("", None, "bad_json")]),
    ({"role": "assistant", "content": '<tool_call>{"name": "read", "arguments": {"doc_id": "d1"}'},  # truncated
     [("", None, "bad_json")]),
    ({"role": "assistant", "content": '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "search"}</tool_call>'},
     [("", None, "bad_json"), ("search", {}, None)]),
    ({"role": "assistant", "content": "I would search for it."}, []),
    ({"role": "assistant", "content": None}, []),
])
def test_parse_tool_calls(message, expected):
    calls = parse_tool_calls(message)
    got = [(c.name, c.arguments, c.error_kind) for c in calls]
    assert got == expected
    for c in calls:
        assert (c.error is None) == (c.error_kind is None)


def test_structured_calls_win_over_text_and_keep_ids():
    msg = _structured("search", '{"query": "x"}', id_="abc")
    msg["content"] = '<tool_call>{"name": "read", "arguments": {}}</tool_call>'
    (call,) = parse_tool_calls(msg)
    assert (call.name, call.id, call.source) == ("search", "abc", "tool_calls")


@pytest.mark.parametrize("name, args, kind, fragment", [
    ("search", {"query": "a"}, None, None),
    ("read", {"doc_id": "d", "lines": 3}, None, None),
    ("browse", {}, "unknown_tool", "unknown tool 'browse'; available tools: read, search"),
    ("read", {}, "bad_arguments", "missing doc_id"),
    ("read", {"doc_id": 7}, "bad_arguments", "doc_id should be string"),
    ("read", {"doc_id": "d", "lines": True}, "bad_arguments", "lines should be integer"),
    ("read", {"doc_id": "d", "page": 2}, "bad_arguments", "unexpected page"),
])
def test_validate_tool_call(name, args, kind, fragment):
    call = validate_tool_call(ToolCall(name=name, arguments=args, raw_arguments=str(args)), TOOLS)
    assert call.error_kind == kind
    if fragment:
        assert fragment in call.error


async def test_run_tool_results_errors_and_timeouts():
    def add(a, b):
        return {"sum": a + b}

    async def echo(text):
        return text

    def boom():
        raise KeyError("no such row")

    async def hang():
        await asyncio.sleep(30)

    release = threading.Event()

    def hang_sync():
        release.wait(5)
        return "late"

    assert (await run_tool(add, {"a": 1, "b": 2}, 1)).content == '{"sum": 3}'
    assert (await run_tool(echo, {"text": "hi"}, 1)).content == "hi"
    r = await run_tool(boom, {}, 1)
    assert r.error_kind == "tool_error" and r.content == "Error: KeyError: 'no such row'"
    r = await run_tool(hang, {}, 0.05)
    assert r.error_kind == "timeout" and "timed out after 0.05 s" in r.content
    r = await run_tool(hang_sync, {}, 0.05)
    release.set()
    assert r.error_kind == "timeout"
    r = await run_tool(add, {"a": 1}, 1)  # a wrong signature is the tool's error, not a crash
    assert r.error_kind == "tool_error" and "TypeError" in r.content


def test_tool_result_messages():
    structured = ToolCall(name="search", arguments={}, raw_arguments="{}", id="call_9")
    assert tool_result_message(structured, "3 hits") == {"role": "tool", "tool_call_id": "call_9", "content": "3 hits"}
    textual = ToolCall(name="search", arguments={}, raw_arguments="{}", source="content")
    assert tool_result_message(textual, "3 hits") == {"role": "user",
                                                      "content": "<tool_response>\n3 hits\n</tool_response>"}


async def test_toolbox_runs_valid_calls_and_reports_invalid_ones():
    box = ToolBox({"search": lambda query: f"results for {query}", "read": lambda doc_id, lines=0: doc_id}, TOOLS,
                  timeout_s=1)
    ok, unknown = box.calls(_structured("search", '{"query": "q"}')) + box.calls(_structured("nope", "{}"))
    assert (await box.run(ok)).content == "results for q"
    r = await box.run(unknown)
    assert r.error_kind == "unknown_tool" and r.content.startswith("Error: unknown tool 'nope'")
    with pytest.raises(ValueError, match="must name the same tools"):
        ToolBox({"search": print}, TOOLS)
    with pytest.raises(ValueError, match="timeout must be positive"):
        ToolBox({"search": print, "read": print}, TOOLS, timeout_s=0)
